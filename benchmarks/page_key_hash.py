"""What caching costs a decode step under each page-key hash (issue 42):
``python -m benchmarks.page_key_hash [--batch B] [--steps N] [--runs R]``

Four managers hold the same B streams (100–500 tokens, page size 16, as
`benchmarks.shared_pages`' decode rows) and decode one token a request a
step: caching off, and caching on with each request's ids handed over once
(``follow_tokens``) keyed with SHA-256 (the default) and with XXH3-128
(``KVConfig(page_key_hash="xxh3_128")``; needs ``pip install
'kvref[fast-hash]'``, else that side is left out), and caching on with no
ids handed over (what sharing costs before any keying). Each step runs them
back to back, the order rotating step by step so no side always runs first
or after the same one; a run's ratio is the median of its per-step ratios
(on / off), and the line printed is the median of the R runs' ratios, with
each run's: on a shared, noisy box one run moves by several percent.
Nothing here asserts a time. `benchmarks.shared_pages` has the same rows
beside its other decode rows.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from benchmarks import control_plane as cp
from benchmarks import no_gc
from benchmarks import shared_pages as sp
from kvref import KVStep, Segment, StepContext


def ratios(batch: int, steps: int, warmup: int = 5) -> dict[str, float]:
    """One run: per side (``"on"``: caching on, no ids handed over;
    ``"sha256"`` and the fast hash's name: ids followed), the median of its
    per-step time over caching off's; ``"off_us"``: caching off's median."""
    rng = random.Random(batch)
    lengths = {f"r{i}": rng.randint(cp.MIN_LEN, cp.MAX_LEN) for i in range(batch)}
    total = steps + warmup
    tokens = {rid: sp.token_ids(rng, n + total) for rid, n in lengths.items()}
    pages = sum(sp.pages_for(n + total) for n in lengths.values()) + 1
    fast = sp.fast_hash()
    # "on": caching on, no ids handed over (nothing keyed as pages fill):
    # what sharing costs a step before any keying
    sides = {"off": sp.manager(False, pages), "on": sp.manager(True, pages),
             "sha256": sp.manager(True, pages)}
    if fast is not None:
        sides[fast] = sp.manager(True, pages, key_hash=fast)
    for name, mgr in sides.items():
        cp.prefill(mgr, lengths)
        if name not in ("off", "on"):
            for rid in lengths:
                mgr.follow_tokens(rid, tokens[rid])  # ids past the committed are never read
    step = KVStep([Segment(rid, "main", 1) for rid in lengths])
    ctx = StepContext()
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    with no_gc():
        for i in range(total):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                t0 = time.perf_counter()
                sp.run_step(sides[name], step, ctx)
                if i >= warmup:
                    times[name].append(time.perf_counter() - t0)
    for name, mgr in sides.items():  # every page that filled was keyed
        if name not in ("off", "on"):
            assert all(mgr.cached_tokens(rid) == (n + total) // sp.PAGE_SIZE * sp.PAGE_SIZE
                       for rid, n in lengths.items())
    off = times["off"]
    out = {name: statistics.median(a / b for a, b in zip(times[name], off, strict=True))
           for name in names if name != "off"}
    out["off_us"] = statistics.median(off) * 1e6
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)
    if sp.fast_hash() is None:
        print(f"{sp.FAST_HASH}: its package is not installed (pip install 'kvref[fast-hash]');"
              " SHA-256 only")
    load = os.getloadavg()[0]
    runs = [ratios(args.batch, args.steps) for _ in range(args.runs)]
    off = statistics.median(r.pop("off_us") for r in runs)
    print(f"decode B={args.batch}, {args.steps} steps x {args.runs} runs; caching off "
          f"{off:.0f} µs/step (median of runs); load average {load:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end ({os.cpu_count()} CPUs)")
    for name in runs[0]:
        got = [r[name] for r in runs]
        how = "no ids handed over" if name == "on" else f"follow_tokens, {name} keys"
        print(f"caching on ({how}) / off: median "
              f"{statistics.median(got):.3f}; runs " + " ".join(f"{x:.3f}" for x in got))


if __name__ == "__main__":
    main()
