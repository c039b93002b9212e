#!/usr/bin/env python
"""The GPU check, in one run: every row PASS, FAIL or SKIP, with seconds.

    python scripts/gpu_check.py                 # from a checkout, no install needed
    python scripts/gpu_check.py --dry-run       # CPU: the parts that run without CUDA
    python scripts/gpu_check.py --only graph    # rows whose name contains "graph"

Each check runs in its own try/except; a check that cannot run here (no
CUDA, no flashinfer) is SKIP with the reason, never PASS. Exits 1 if any
row FAILed, else 0. Budget: 8 minutes cold on an H200, FlashInfer's JIT
compile included; rows over a minute are named as slow at the end.

Without flashinfer (a GPU machine with no network) every row but the
FlashInfer ones runs: attention inside graphs is then the SDPA path on a
static table (`kvref.attention.sdpa`).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a checkout without an install: the repository and this folder on the path
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import gpu_check_attention
import gpu_check_graphs as graphs
import gpu_check_transfer
import torch
from gpu_check_graphs import Skip, need_cuda

BUDGET_S = 8 * 60
SLOW_S = 60.0
LOCKSTEP_TIMEOUT_S = 150


@dataclass
class Row:
    name: str
    status: str  # PASS | FAIL | SKIP
    seconds: float
    detail: str


def environment() -> str:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    driver = "n/a"
    if torch.cuda.is_available():
        try:
            driver = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20, check=True,
            ).stdout.strip().splitlines()[0]
        except Exception as e:  # the row still prints: the driver is informative only
            driver = f"unknown ({type(e).__name__})"
    try:
        import flashinfer

        fi = getattr(flashinfer, "__version__", "present")
    except Exception as e:
        fi = f"absent ({type(e).__name__})"
    return (
        f"environment: GPU {gpu}; driver {driver}; torch {torch.__version__}; "
        f"CUDA {torch.version.cuda or 'none'}; flashinfer {fi}; "
        f"Python {platform.python_version()}"
    )


# -- the checks that are not in the helper modules ----------------------------


def check_lockstep() -> str:
    """The lockstep conformance suite with every manager on CUDA (ci profile, time-boxed)."""
    need_cuda()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "tests/conformance/test_lockstep.py", "--kvref-device", "cuda",
           "--hypothesis-profile=ci", "-k", "not nightly"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=LOCKSTEP_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-400:] if isinstance(e.stdout, bytes) else (e.stdout or "")[-400:]
        raise AssertionError(
            f"did not finish in {LOCKSTEP_TIMEOUT_S} s (a run cut short is not a pass): {tail!s}"
        ) from None
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n")
    assert proc.returncode == 0, f"pytest exit {proc.returncode}: {last}"
    if "skipped" in last and "passed" not in last:
        raise Skip(f"pytest skipped it: {last}")
    return last


def check_engine_stream_ordering() -> str:
    need_cuda()
    from tests.gpu.test_cuda_ordering import (
        test_offload_waits_for_writes_on_the_engines_own_stream,
        test_plan_tables_reach_the_device_intact,
    )

    test_offload_waits_for_writes_on_the_engines_own_stream()
    test_plan_tables_reach_the_device_intact()
    return "offload after writes queued behind a sleep on the engine's stream; pinned plans"


def check_cuda_ipc() -> str:
    need_cuda()
    results = gpu_check_transfer.run_checks("cuda_ipc")
    assert results is not None
    bad = [f"{name}: {detail.strip().splitlines()[-1] if detail else ''}"
           for name, ok, detail in results if not ok]
    assert not bad, "; ".join(bad)
    return f"{len(results)}/{len(results)}: one process, cpu->cuda, two processes both ways"


def check_attention_dry_run() -> str:
    return "CPU: " + gpu_check_attention.check_attention(dry_run=True)


CUDA_ROWS: list[tuple[str, Callable[[], str]]] = [
    ("attention: FlashInfer vs reference (+graph decode/prefill, D1-D3)",
     gpu_check_attention.check_attention),
    ("graph: write_kv + attention, decode bucket (sdpa)",
     lambda: graphs.graph_step("sdpa", prefill=False)),
    ("graph: write_kv + attention, prefill bucket (sdpa)",
     lambda: graphs.graph_step("sdpa", prefill=True)),
    ("graph: write_kv + attention, decode bucket (flashinfer)",
     lambda: graphs.graph_step("flashinfer", prefill=False)),
    ("graph: write_kv + attention, prefill bucket (flashinfer)",
     lambda: graphs.graph_step("flashinfer", prefill=True)),
    ("ordering: engine's own stream, pinned plan staging", check_engine_stream_ordering),
    ("offload/reload byte-exact, bandwidth vs plain pinned copy", graphs.bandwidth),
    ("cuda_ipc retrieve across processes (publish event)", check_cuda_ipc),
    ("lockstep conformance on CUDA (ci profile)", check_lockstep),
]

# the rows that run without CUDA (also the whole of --dry-run)
CPU_ROWS: list[tuple[str, Callable[[], str]]] = [
    ("attention reference vs dense (CPU, runs everywhere)", check_attention_dry_run),
    ("graph steps, decode bucket (sdpa, CPU, no capture)",
     lambda: graphs.graph_step("sdpa", prefill=False, device="cpu")),
    ("graph steps, prefill bucket (sdpa, CPU, no capture)",
     lambda: graphs.graph_step("sdpa", prefill=True, device="cpu")),
]


def run(name: str, fn: Callable[[], str]) -> Row:
    print(f"--- {name}", flush=True)
    t0 = time.perf_counter()
    try:
        detail, status = fn(), "PASS"
    except Skip as e:
        detail, status = str(e), "SKIP"
    except Exception as e:  # AssertionError and crashes alike: this row failed, go on
        traceback.print_exc()
        detail, status = f"{type(e).__name__}: {e}", "FAIL"
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    row = Row(name, status, time.perf_counter() - t0, detail)
    print(f"{row.status} {name} ({row.seconds:.1f}s): {row.detail}", flush=True)
    return row


def table(rows: list[Row]) -> str:
    width = max(len(r.name) for r in rows)
    lines = [f"{'check':<{width}}  result  seconds  detail", "-" * (width + 40)]
    for r in rows:
        detail = r.detail if len(r.detail) <= 160 else r.detail[:157] + "..."
        lines.append(f"{r.name:<{width}}  {r.status:<6}  {r.seconds:7.1f}  {detail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dry-run", action="store_true",
                        help="run the CPU halves only (no CUDA needed)")
    parser.add_argument("--only", default="", help="run the rows whose name contains this")
    args = parser.parse_args(argv)
    os.chdir(ROOT)
    print(environment(), flush=True)
    checks = CPU_ROWS if args.dry_run else CPU_ROWS + CUDA_ROWS
    rows = [run(name, fn) for name, fn in checks if args.only in name]
    total = sum(r.seconds for r in rows)
    print("\n" + table(rows))
    counts = {s: sum(r.status == s for r in rows) for s in ("PASS", "FAIL", "SKIP")}
    print(f"\n{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
          f"in {total:.0f} s (budget {BUDGET_S} s)")
    slow = [f"{r.name} ({r.seconds:.0f} s)" for r in rows if r.seconds > SLOW_S]
    if slow:
        print("slow sections: " + "; ".join(slow))
    if total > BUDGET_S:
        print(f"over budget: {total:.0f} s > {BUDGET_S} s")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
