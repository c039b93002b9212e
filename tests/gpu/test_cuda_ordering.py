"""On CUDA: copies on kvref's side streams are ordered after the engine's work.

Each test delays the engine's writes with ``torch.cuda._sleep`` on a stream
of the engine's own, then starts the copy from another stream: a copy that
did not wait would read (or overwrite) the pages too early. Skipped without
CUDA.
"""

from __future__ import annotations

import pytest
import torch

from kvref import KVConfig, KVManager, KVStep, Segment, StepContext, TransferEngineInfo
from kvref.stepping.plan import host_to_device

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SLEEP_CYCLES = 200_000_000  # ~0.1 s on a current GPU: far longer than the copy


def _manager() -> KVManager:
    cfg = KVConfig(num_layers=2, num_kv_heads=2, head_dim=64, max_seq_len=256,
                   max_num_pages=16, page_size=16, num_qo_heads=8, cpu_offload_pages=8)
    return KVManager(cfg, "kv", None, TransferEngineInfo(), "cuda", dtype=torch.bfloat16)


def test_offload_waits_for_writes_on_the_engines_own_stream() -> None:
    kv = _manager()
    kv.ingest_request("r")
    step, ctx = KVStep([Segment("r", "main", 40)]), StepContext(["r"])
    assert kv.admit(step, ctx).ok
    kv.plan(step, ctx)
    engine = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    x = torch.full((40, 2, 64), 5.0, dtype=torch.bfloat16, device="cuda")
    engine.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(engine):
        torch.cuda._sleep(SLEEP_CYCLES)  # type: ignore[no-untyped-call]
        for layer in range(2):
            kv.write_kv(x, -x, layer_idx=layer)
    kv.commit(step, ctx)
    # the offload runs from the default stream, which never saw the writes
    assert kv.offload("r") == 3
    kv.kv_cache.tensor.zero_()
    torch.cuda.synchronize()
    assert kv.reload("r")
    got = kv.read_stream("r")
    assert bool((got[:, :, 0] == 5.0).all()) and bool((got[:, :, 1] == -5.0).all())


def test_plan_tables_reach_the_device_intact() -> None:
    host = torch.arange(1000, dtype=torch.int32)
    dev = host_to_device(host, torch.device("cuda"))
    host.zero_()  # the staging copy is pinned and separate: the source is free at once
    assert torch.equal(dev.cpu(), torch.arange(1000, dtype=torch.int32))
