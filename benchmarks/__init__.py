"""kvref benchmarks: the control plane (admit + plan + commit) and the data plane
(page copies, offload, reload).

Every figure is either a median of repeated runs with its p10/p90 spread, or a
ratio against a baseline measured in the same run; nothing here asserts a time.
``python -m benchmarks`` prints the tables in Markdown.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import torch


@dataclass(frozen=True)
class Spread:
    """Median of samples, with the 10th and 90th percentiles."""

    median: float
    p10: float
    p90: float
    n: int

    def scaled(self, factor: float) -> Spread:
        return Spread(self.median * factor, self.p10 * factor, self.p90 * factor, self.n)


def percentile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100]."""
    if not samples:
        raise ValueError("percentile of no samples")
    xs = sorted(samples)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread(samples: Sequence[float]) -> Spread:
    return Spread(
        percentile(samples, 50), percentile(samples, 10), percentile(samples, 90), len(samples)
    )


@contextmanager
def no_gc() -> Iterator[None]:
    """Collect once, then keep the cyclic collector out of the timed region (as timeit does)."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def time_call(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def machine() -> str:
    """One line naming what the numbers were measured on."""
    return (
        f"{platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} intra-op threads)"
    )


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(x: object) -> str:
        if isinstance(x, float):
            if x == 0:
                return "0"
            if abs(x) >= 100:
                return f"{x:.0f}"
            if abs(x) >= 10:
                return f"{x:.1f}"
            return f"{x:.2f}"
        return str(x)

    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
    ]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def jsonable(obj: Any) -> Any:
    """Dataclasses (rows, spreads) as plain dicts, tuples as lists, recursively."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    return obj


def measured_commit() -> str:
    """The commit the code under measurement is at (short hash), ``+dirty``
    when kvref/ or benchmarks/ differ from it; "unknown" outside a checkout.
    Every figure says which code it measured (issue 28)."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                              text=True, check=True).stdout.strip()

    try:
        rev = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--", "kvref", "kvref_model", "benchmarks")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write a run's raw results (``--json PATH``): `scripts/docs_figures.py`
    renders them. The run records when, and at which commit, it measured."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    when = datetime.now(UTC).isoformat(timespec="seconds")
    out.write_text(json.dumps(jsonable({"recorded": when, "commit": measured_commit(),
                                        **payload}), indent=1, ensure_ascii=False) + "\n")


R = TypeVar("R")


def run_cli(name: str, doc: str | None, argv: list[str] | None,
            run: Callable[[bool], R], report: Callable[[R, float, tuple[float, float]], str]
            ) -> None:
    """``python -m benchmarks.<name> [--quick] [--json PATH]``: run on one torch
    thread, print the report with the run's time and load, and with ``--json``
    write the results and the run's conditions for scripts/docs_figures.py."""
    import argparse

    ap = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=doc)
    ap.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    ap.add_argument("--json", metavar="PATH", default=None,
                    help="also write the figures and the run's conditions to PATH")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # a shared box: two threads stall on each other
    load_start = os.getloadavg()[0]
    t0 = time.perf_counter()
    results = run(args.quick)
    seconds = time.perf_counter() - t0
    load_end = os.getloadavg()[0]
    print(report(results, seconds, (load_start, load_end)))
    if args.json:
        write_json(args.json, {
            "benchmark": name, "machine": machine(), "cpus": os.cpu_count(),
            "load_start": load_start, "load_end": load_end, "seconds": seconds,
            "results": results})
