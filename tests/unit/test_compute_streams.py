"""Side-stream copies wait for every stream known to compute on the cache.

The CUDA behaviour is checked on a GPU (tests/gpu/test_cuda_ordering.py,
scripts/gpu_check.py); here, with stand-in streams, the bookkeeping: which
streams a side stream is made to wait on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvref.core.cache import KVCache
from kvref.core.config import KVConfig
from kvref.transfer.engine import KVTransferManager, TransferEngineInfo


@dataclass
class FakeStream:
    cuda_stream: int
    device_index: int = 0
    waited: list[FakeStream] = field(default_factory=list)

    def wait_stream(self, other: FakeStream) -> None:
        self.waited.append(other)


def _cache() -> KVCache:
    cfg = KVConfig(num_layers=1, num_kv_heads=1, head_dim=4, max_seq_len=16,
                   max_num_pages=4, page_size=2, num_qo_heads=1)
    return KVCache(cfg, torch.device("cpu"), torch.float32)


def test_side_stream_waits_on_every_declared_compute_stream() -> None:
    cache = _cache()
    engine, other = FakeStream(0x10), FakeStream(0x20)
    cache.add_compute_stream(engine)
    cache.add_compute_stream(other)
    cache.add_compute_stream(FakeStream(0x10))  # the same stream, another handle
    side = FakeStream(0x30)
    cache.order_after_compute(side)
    assert [s.cuda_stream for s in side.waited] == [0x10, 0x20]


def test_no_declared_streams_no_waits_on_cpu() -> None:
    side = FakeStream(0x30)
    _cache().order_after_compute(side)
    assert side.waited == []


def test_descriptor_stays_equal_across_publishes() -> None:
    # mark_published runs on every get_kv_transfer_info; the descriptor must
    # not change, or a manager could not spot a retrieve from itself
    cache = _cache()
    mgr = KVTransferManager(TransferEngineInfo(), cache)
    first = mgr.get_kv_transfer_info()
    assert mgr.get_kv_transfer_info() == first and first.cuda_ipc_event is None
    mgr.cleanup()
