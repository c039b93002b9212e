"""R50 across processes: a consumer in another process cannot ask the
publisher's generation (R35's sequence lock has nothing to read), so the lease
alone keeps the published tokens; a fork onto the leased stream is refused."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from kvref import KVManager, PublishedKVInfo
from kvref.transfer.engine import KVTransferManager, TransferEngineInfo
from tests.unit import _lease_workers as workers


@pytest.fixture
def shm_prefix() -> Iterator[str]:
    prefix = f"kvref_l{uuid.uuid4().hex[:8]}_"
    yield prefix
    gc.collect()
    assert [n for n in os.listdir("/dev/shm") if n.startswith(prefix)] == []


def test_a_fork_onto_a_stream_a_peer_copies_is_refused_across_processes(
        shm_prefix: str) -> None:
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=workers.publisher, args=(child_conn, shm_prefix))
    child.start()
    try:
        assert conn.poll(120), "the publisher did not publish"
        info = conn.recv()
        assert isinstance(info, PublishedKVInfo), info
        seq = info.get(0)["main"]
        # another process: the registry cannot tell whether it moved
        assert KVTransferManager.source_current(
            seq.latest_kv_transfer_info, "r", "main", seq.generation) is None

        kv = KVManager(workers.config(), "consumer", None, TransferEngineInfo(), "cpu",
                       dtype=torch.float32)
        kv.ingest_request("r")
        out = kv.admit_retrieve("r", None, None, info)
        assert out.ok
        conn.send("copying")
        # the publisher tries to overwrite main while the copy may still run
        assert conn.poll(60)
        assert conn.recv() == (False, "PublishLeased")
        deadline = time.monotonic() + 60
        while not kv.admit_retrieve("r").ready:
            assert time.monotonic() < deadline, "the copy did not land"
            time.sleep(0.01)
        got = kv.read_stream("r", "main")[0, :, 0, 0, 0]
        assert torch.equal(got, torch.arange(workers.TOKENS, dtype=torch.float32) + 10.0)

        conn.send("released")
        assert conn.poll(60)
        ok, main_after = conn.recv()
        # once released, the same fork runs: main now holds draft's tokens
        assert ok and main_after == [90.0 + p for p in range(workers.TOKENS)]
        conn.send("cleanup")
        assert conn.poll(60) and conn.recv() == "done"
        child.join(30)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
        child.join(5)
