"""``python -m benchmarks [--quick] [--only control|data] [--threads N] [--json PATH]``:
Markdown tables; ``--json`` also writes the raw rows (for `scripts/docs_figures.py`)."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

from benchmarks import control_plane, data_plane, machine, md_table, write_json

# --quick: a smoke run in well under 20 s, the sizes that exercise every path
QUICK_BATCHES = (1, 16, 256)
QUICK_PAGES = (64, 256)


def control_report(quick: bool, batches: tuple[int, ...] = control_plane.BATCHES,
                   mixed_batches: tuple[int, ...] = control_plane.MIXED_BATCHES,
                   keep: dict[str, Any] | None = None) -> str:
    """Run the control-plane benchmark; its rows also go into ``keep`` if given."""
    rows, mixed, pre, profiles = control_plane.run(quick, batches, mixed_batches)
    if keep is not None:
        keep["control"] = {"decode": rows, "mixed": mixed, "prefill": pre, "profiles": profiles}
    return control_tables(rows, mixed, pre, profiles)


def control_tables(rows: list[control_plane.DecodeRow], mixed: list[control_plane.MixedRow],
                   pre: control_plane.PrefillRow,
                   profiles: dict[int, list[control_plane.ProfileEntry]]) -> str:
    """The control plane's Markdown, from its rows (a run's, or read back from JSON)."""
    chunk = control_plane.CHUNK
    out = [
        "### Control plane: one decode step (admit + plan + commit)",
        "",
        "Prefilled streams of 100–500 tokens, page_size 16, CPU float32. µs, median "
        "[p10, p90] over the steps; *reference* is the reference manager's step "
        "written straightforwardly (`benchmarks/reference_manager.py`), timed "
        "interleaved in the same run; ratio = kvref / reference (lower is better).",
        "",
        md_table(
            ["batch", "steps", "µs/step", "[p10, p90]", "µs/request",
             "reference µs/request", "ratio"],
            [
                [r.batch, r.steps, r.step_us.median,
                 f"[{r.step_us.p10:.1f}, {r.step_us.p90:.1f}]", r.req_us.median,
                 r.ref_req_us.median, r.ratio]
                for r in rows
            ],
        ),
        "",
        f"Mixed steps: the same decode batch plus one {chunk}-token prefill chunk "
        f"(a 512-token prompt, {chunk} tokens a step). Each iteration times a decode "
        "step and a mixed step (alternating which goes first) on kvref, then on the "
        "reference, the reference's order flipping every two iterations. *extra* = "
        "mixed - decode, averaged over two consecutive iterations (one each way "
        "round, so the first step's cold penalty cancels), median [p10, p90]; the "
        "target is extra ≤ 15 µs "
        "+ a cost linear in the chunk's tokens.",
        "",
        md_table(
            ["batch", "steps", "decode µs", "mixed µs", "extra µs", "[p10, p90]",
             "reference decode µs", "reference mixed µs", "reference extra µs",
             "mixed ratio"],
            [
                [r.batch, r.steps, r.decode_us.median, r.mixed_us.median,
                 r.extra_us.median, f"[{r.extra_us.p10:.1f}, {r.extra_us.p90:.1f}]",
                 r.ref_decode_us.median, r.ref_mixed_us.median, r.ref_extra_us.median,
                 r.ratio]
                for r in mixed
            ],
        ),
        "",
        f"Prefill, {pre.requests} requests × {pre.tokens} tokens (packed path), fresh "
        f"requests each step: {pre.step_us.median:.0f} µs/step "
        f"[{pre.step_us.p10:.0f}, {pre.step_us.p90:.0f}], "
        f"{pre.token_us.median * 1000:.1f} ns/token, over {pre.step_us.n} steps.",
    ]
    for batch, entries in profiles.items():
        out += [
            "",
            f"Profile, decode at batch {batch} (cProfile, by self time; cProfile "
            "inflates small Python calls, read it for shares, not totals):",
            "",
            md_table(
                ["function", "calls/step", "self µs/step", "cumulative µs/step"],
                [[f"`{e.function}`", e.calls_per_step, e.self_us_per_step,
                  e.cum_us_per_step] for e in entries],
            ),
        ]
    return "\n".join(out)


def data_report(quick: bool, page_counts: tuple[int, ...] = data_plane.PAGE_COUNTS,
                keep: dict[str, Any] | None = None) -> str:
    """Run the data-plane benchmark; its rows also go into ``keep`` if given."""
    rows = data_plane.run(quick, page_counts)
    if keep is not None:
        keep["data"] = rows
    return data_tables(rows)


def data_tables(rows: list[data_plane.CopyRow]) -> str:
    """The data plane's Markdown, from its rows (a run's, or read back from JSON)."""
    page_kib = data_plane.LAYERS * 2 * data_plane.PAGE_SIZE * data_plane.KV_HEADS \
        * data_plane.HEAD_DIM * 4 / 1024
    out = [
        "### Data plane: bytes moved vs a plain copy of the same bytes",
        "",
        f"A page is {page_kib:.0f} KiB ({data_plane.LAYERS} layers, {data_plane.KV_HEADS} kv "
        f"heads, head_dim {data_plane.HEAD_DIM}, page_size {data_plane.PAGE_SIZE}, float32, "
        "NHD). GB/s median [p10, p90]; plain = `dst.copy_(src)` on contiguous tensors "
        "of the same bytes, back to back; ratio = path / plain, median of per-repetition "
        "ratios. **bold**: under half of plain.",
        "",
        md_table(
            ["path", "pages", "MiB", "GB/s", "[p10, p90]", "plain GB/s", "ratio"],
            [
                [r.path, r.pages, r.bytes / 2**20, r.gbps.median,
                 f"[{r.gbps.p10:.2f}, {r.gbps.p90:.2f}]", r.plain_gbps.median,
                 f"**{r.ratio.median:.2f}**" if r.below_half else f"{r.ratio.median:.2f}"]
                for r in rows
            ],
        ),
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smoke run: few repetitions")
    parser.add_argument("--only", choices=("control", "data"), default=None)
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads (default 1: on a shared 2-core box two threads "
             "stall on each other and on neighbours; 0 keeps torch's default)",
    )
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the raw rows and the run's conditions to PATH")
    args = parser.parse_args(argv)
    keep: dict[str, Any] | None = {} if args.json else None
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    print("## kvref benchmarks" + (" (--quick)" if args.quick else ""))
    print()
    print(f"Machine: {machine()}")
    print()
    # a shared box: the load says how far the absolute figures are from idle
    load_start = os.getloadavg()[0]
    print(f"Load average at the start: {load_start:.1f}")
    if args.only in (None, "control"):
        print()
        batches = QUICK_BATCHES if args.quick else control_plane.BATCHES
        print(control_report(args.quick, batches, keep=keep), flush=True)
    if args.only in (None, "data"):
        print()
        pages = QUICK_PAGES if args.quick else data_plane.PAGE_COUNTS
        print(data_report(args.quick, pages, keep=keep), flush=True)
    seconds = time.perf_counter() - t0
    load_end = os.getloadavg()[0]
    print()
    print(f"_Measured in {seconds:.0f} s with "
          f"`python -m benchmarks{' --quick' if args.quick else ''}`; load average "
          f"{load_end:.1f} at the end._")
    if args.json:
        assert keep is not None
        write_json(args.json, {
            "benchmark": "benchmarks", "quick": args.quick, "machine": machine(),
            "cpus": os.cpu_count(), "load_start": load_start, "load_end": load_end,
            "seconds": seconds, **keep})


if __name__ == "__main__":
    main()
