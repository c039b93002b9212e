"""One decode step timed alone: ``python -m benchmarks.decode_alone``.

The control-plane table interleaves kvref with the reference baseline so that
drift on a shared machine hits both alike; this times kvref's admit + plan +
commit back to back with nothing between steps, the figure the library
issue's targets (2 µs per request at batch 256, 15 µs at batch 1) speak of.
Median of the steps after a warmup; streams of 100 tokens, page size 16.
"""

from __future__ import annotations

import time

import torch

from benchmarks import no_gc
from kvref import KVConfig, KVManager, KVStep, Segment, StepContext


def decode_alone(batch: int, steps: int = 200) -> float:
    """Median µs of one decode step over ``batch`` requests."""
    cfg = KVConfig(num_layers=1, num_kv_heads=1, head_dim=8, max_seq_len=4096,
                   max_num_pages=batch * 40 + 10, page_size=16, num_qo_heads=1)
    kv = KVManager(cfg, "kv", None, None, "cpu", dtype=torch.float32)
    rids = [f"r{i}" for i in range(batch)]
    for rid in rids:
        kv.ingest_request(rid)
    ctx = StepContext(rids)
    prefill = KVStep([Segment(rid, "main", 100) for rid in rids])
    kv.admit(prefill, ctx)
    kv.plan(prefill, ctx)
    kv.commit(prefill, ctx)
    step = KVStep([Segment(rid, "main", 1) for rid in rids])
    times = []
    with no_gc():
        for _ in range(steps):
            t = time.perf_counter()
            kv.admit(step, ctx)
            kv.plan(step, ctx)
            kv.commit(step, ctx)
            times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1e6


def main() -> None:
    torch.set_num_threads(1)
    print("| batch | µs/step | µs/request |\n|---|---|---|")
    for batch in (1, 16, 64, 256, 1024):
        us = decode_alone(batch)
        print(f"| {batch} | {us:.1f} | {us / batch:.2f} |")


if __name__ == "__main__":
    main()
