"""Child-process side of the cross-process lease test (R50): a publisher on
shared memory that tries to overwrite its published stream while a peer in
another process copies it. A module of its own: a spawned child imports
whatever module its target lives in, and this one pulls in no pytest."""

from __future__ import annotations

import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvref import KVConfig, KVManager, KVStep, Segment, StepContext
from kvref.transfer.engine import TransferEngineInfo

WAIT_S = 60.0
TOKENS = 6


def config() -> KVConfig:
    return KVConfig(num_layers=1, num_kv_heads=1, head_dim=4, max_seq_len=32,
                    max_num_pages=8, page_size=2, num_qo_heads=1)


def rows(tokens: int, seed: float) -> torch.Tensor:
    """Token ``p`` of a stream written with ``seed``: every element ``seed + p``."""
    return (torch.arange(tokens, dtype=torch.float32) + seed).view(-1, 1, 1).expand(
        tokens, 1, 4).contiguous()


def write(kv: KVManager, rid: str, label: str, tokens: int, seed: float) -> None:
    step, ctx = KVStep([Segment(rid, label, tokens)]), StepContext([rid])
    assert kv.admit(step, ctx).ok
    kv.plan(step, ctx)
    kv.write_kv(rows(tokens, seed), rows(tokens, seed), layer_idx=0, label=label)
    kv.commit(step, ctx)


def fork_onto_main(kv: KVManager, rid: str) -> Any:
    """A step whose pre-fork overwrites ``main`` with ``draft``: the answer of its admit."""
    step = KVStep([], pre_forks=[("draft", "main")])
    ctx = StepContext([rid])
    out = kv.admit(step, ctx)
    if out.ok:
        kv.plan(step, ctx)
        kv.commit(step, ctx)
    return out


def _recv(conn: Connection) -> Any:
    if not conn.poll(WAIT_S):
        raise TimeoutError("parent went quiet")
    return conn.recv()


def publisher(conn: Connection, prefix: str) -> None:
    """Publish ``main`` (seed 10) over shm; while the parent copies, fork
    ``draft`` (seed 90) onto it: refused under the lease; after the release
    the same fork runs. Reports each answer's reason, then the bytes of main."""
    try:
        kv = KVManager(config(), "publisher", None,
                       TransferEngineInfo(kind="shm", shm_prefix=prefix), "cpu",
                       dtype=torch.float32)
        kv.ingest_request("r")
        write(kv, "r", "main", TOKENS, 10.0)
        write(kv, "r", "draft", TOKENS, 90.0)
        conn.send(kv.publish("r"))
        assert _recv(conn) == "copying"
        leased = fork_onto_main(kv, "r")
        conn.send((leased.ok, type(leased.reason).__name__))
        assert _recv(conn) == "released"
        kv.release_published("r")
        after = fork_onto_main(kv, "r")
        conn.send((after.ok, kv.read_stream("r", "main")[0, :, 0, 0, 0].tolist()))
        assert _recv(conn) == "cleanup"
        kv.remove_request("r")
        kv._transfer.cleanup()
        conn.send("done")
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise
