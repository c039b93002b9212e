"""What caching costs a decode step under each page-key hash (issue 42):
``python -m benchmarks.page_key_hash [--batch B] [--steps N] [--runs R]``

Runs `benchmarks.shared_pages.bench_decode` R times: a decode step of B
requests (default 256) with caching off, against caching on with each
request's ids handed over once (``follow_tokens``), keyed with SHA-256 (the
default) and with XXH3-128 (``KVConfig(page_key_hash="xxh3_128")``; needs
``pip install 'kvref[fast-hash]'``). The managers step interleaved, each
ratio is the median of per-step ratios of one run, and the line printed is
the median of the R runs' ratios, with each run's: on a shared, noisy box
one run moves by several percent. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import os
import statistics

from benchmarks import shared_pages as sp


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args(argv)
    fast = sp.fast_hash()
    if fast is None:
        print(f"{sp.FAST_HASH}: its package is not installed (pip install 'kvref[fast-hash]');"
              " SHA-256 only")
    load = os.getloadavg()[0]
    rows = [sp.bench_decode(args.batch, args.steps) for _ in range(args.runs)]
    off = statistics.median(r.off_us.median for r in rows)
    print(f"decode B={args.batch}, {args.steps} steps x {args.runs} runs; caching off "
          f"{off:.0f} µs/step (median of runs); load average {load:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end ({os.cpu_count()} CPUs)")
    sides = [("sha256", [r.followed_ratio.median for r in rows])]
    if fast is not None:
        sides.append((fast, [r.fast_ratio.median for r in rows if r.fast_ratio is not None]))
    for name, ratios in sides:
        print(f"caching on (follow_tokens, {name} keys) / off: median "
              f"{statistics.median(ratios):.3f}; runs " + " ".join(f"{x:.3f}" for x in ratios))


if __name__ == "__main__":
    main()
