"""One decode step timed alone: ``python -m benchmarks.decode_alone``.

The control-plane table interleaves kvref with the reference baseline so that
drift on a shared machine hits both alike; this times each manager's admit +
plan + commit back to back with nothing between steps, the figure issue 11's
batch-1 target (under 8 µs) speaks of. kvref and the reference
(`benchmarks.reference_manager`) run one after the other in the same process,
each on its own streams of 100 tokens (page size 16); the median of the
steps after a warmup, and the load average before and after (a shared box:
read the ratio).
"""

from __future__ import annotations

import os
import time

import torch

from benchmarks import no_gc
from benchmarks.reference_manager import ReferenceManager
from kvref import KVConfig, KVManager, KVStep, Segment, StepContext

PROMPT = 100  # tokens each stream holds before the timed steps


def _steps(mgr: KVManager | ReferenceManager, rids: list[str], steps: int) -> float:
    """Median µs of ``steps`` decode steps of one token for each of ``rids``."""
    for rid in rids:
        mgr.ingest_request(rid)
    ctx = StepContext(rids)
    prefill = KVStep([Segment(rid, "main", PROMPT) for rid in rids])
    step = KVStep([Segment(rid, "main", 1) for rid in rids])
    for run in (prefill, step, step):  # the prefill, then a warmup
        mgr.admit(run, ctx)
        mgr.plan(run, ctx)
        mgr.commit(run, ctx)
    times = []
    with no_gc():
        for _ in range(steps):
            t = time.perf_counter()
            mgr.admit(step, ctx)
            mgr.plan(step, ctx)
            mgr.commit(step, ctx)
            times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2] * 1e6


def decode_alone(batch: int, steps: int = 200, caching: bool = True) -> tuple[float, float]:
    """Median µs of one decode step over ``batch`` requests: kvref (prefix
    caching and shared pages on or off), the reference (which has neither)."""
    pages = batch * (-(-(PROMPT + steps + 2) // 16)) + 10
    cfg = KVConfig(num_layers=1, num_kv_heads=1, head_dim=8, max_seq_len=4096,
                   max_num_pages=pages + 1, page_size=16, num_qo_heads=1,
                   enable_prefix_caching=caching)
    rids = [f"r{i}" for i in range(batch)]
    ours = _steps(KVManager(cfg, "kv", None, None, "cpu", dtype=torch.float32), rids, steps)
    theirs = _steps(ReferenceManager(pages, 16), rids, steps)
    return ours, theirs


def main() -> None:
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    print("| batch | caching | kvref µs/step | kvref µs/request | reference µs/step | "
          "ratio | reference / kvref |\n|---|---|---|---|---|---|---|")
    for batch in (1, 16, 64, 256, 1024):
        for caching in (True, False):
            ours, theirs = decode_alone(batch, caching=caching)
            print(f"| {batch} | {'on' if caching else 'off'} | {ours:.1f} | "
                  f"{ours / batch:.2f} | {theirs:.1f} | {ours / theirs:.2f} | "
                  f"{theirs / ours:.2f} |")
    print(f"\nload average {load:.1f} before, {os.getloadavg()[0]:.1f} after "
          f"({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
