"""Child-process side of the cross-process transfer tests.

A module of its own, not the test file: a spawned child imports whatever
module its target lives in, and this one pulls in neither pytest nor the
tests' fixtures.
"""

from __future__ import annotations

import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvref.core.cache import KVCache
from kvref.core.config import KVConfig, KVLayout
from kvref.transfer.engine import KVTransferManager, TransferEngineInfo, allocate_cache_tensor

WAIT_S = 30.0


def config(layout: str = "NHD", page_size: int = 4) -> KVConfig:
    return KVConfig(
        num_layers=2,
        num_kv_heads=2,
        head_dim=8,
        max_seq_len=64,
        max_num_pages=12,
        page_size=page_size,
        num_qo_heads=2,
        layout=KVLayout(layout),
    )


def pattern(shape: tuple[int, ...], seed: float) -> torch.Tensor:
    """Distinct, exactly representable float32 values both processes can recompute."""
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float32) * 0.25 + seed).view(shape)


def shm_cache(prefix: str, layout: str = "NHD") -> tuple[KVCache, KVTransferManager]:
    info = TransferEngineInfo(kind="shm", shm_prefix=prefix)
    cfg = config(layout)
    tensor = allocate_cache_tensor(
        info, KVCache.shape_for(cfg, cfg.max_num_pages), torch.float32, "cpu"
    )
    cache = KVCache(cfg, torch.device("cpu"), torch.float32, tensor=tensor)
    return cache, KVTransferManager(info, cache)


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


def _recv(conn: Connection) -> Any:
    if not conn.poll(WAIT_S):
        raise TimeoutError("parent went quiet")
    return conn.recv()


def shm_peer(conn: Connection, prefix: str, pages: list[int], seed: float) -> None:
    """Publish a pattern-filled shm cache, then pull the parent's pages into it."""
    try:
        cache, manager = shm_cache(prefix)
        cache.tensor.copy_(pattern(tuple(cache.tensor.shape), seed))
        conn.send((manager.get_kv_transfer_info(), pages))
        # the reverse direction: the parent's descriptor, its pages, our pages, a range
        remote, remote_pages, local_pages, start, end = _recv(conn)
        before = cache.tensor.clone()
        future = manager.start_async_retrieve(start, end, local_pages, remote_pages, remote)
        assert future is not None
        future.result(timeout=WAIT_S)
        # raw bytes: a pickled tensor would travel as shared memory of its own
        conn.send(("retrieved", _raw(before), _raw(cache.tensor)))
        assert _recv(conn) == "cleanup"
        manager.cleanup()
        conn.send(("done", None, None))
    except BaseException:
        conn.send(("error", traceback.format_exc(), None))
        raise
