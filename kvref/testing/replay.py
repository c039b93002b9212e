"""Replay a verification failure from its trace file, without Hypothesis's draws.

    python -m kvref.testing.replay FILE [FILE ...] [--device cuda] [--factory mod:fn]

Each file (written by the lockstep, the exhaustive replay or the scheduler
harness, `kvref.testing.trace`) is run again on the model and a fresh
kvref: the lockstep's calls through the lockstep machine's own checks, in
the order they ran, its state checks where they ran; the exhaustive
replay's through `kvref.testing.exhaustive.run_trace`; the scheduler's
programs under the recorded schedule (that harness lives in kvref's
tests/, so those replay from a source tree only). The verdict per file is
REPRODUCED (kvref and the model still disagree; the same disagreement or
another) or PASSED; the exit status is 1 if any file reproduced.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvref.stepping import decode_table
from kvref.testing import trace as tr
from kvref.testing.driver import DriverConfig, ManagerFactory
from kvref_model import core as m


@dataclass(frozen=True)
class Replayed:
    failed: bool
    error_type: str = ""
    message: str = ""
    same: bool = False  # the recorded disagreement: same type, same first line

    def verdict(self) -> str:
        if not self.failed:
            return "PASSED: kvref and the model agree on every call of the trace"
        how = "the same disagreement" if self.same else "a different disagreement"
        return f"REPRODUCED ({how}): {self.error_type}: {self.message.splitlines()[0]}"


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def driver_config(trace: Mapping[str, Any], device: str | None = None,
                  factory: ManagerFactory | None = None) -> DriverConfig:
    """The recorded settings on ``device`` (default: the recorded one where
    it runs here, else the CPU), with ``factory`` if given (else kvref's)."""
    rec = trace.get("config") or {}
    want = device or rec.get("device", "cpu")
    if want.startswith("cuda") and not torch.cuda.is_available() and device is None:
        want = "cpu"  # recorded on a GPU, replayed on a machine without one
    cfg = DriverConfig(device=want, dtype=getattr(torch, rec.get("dtype", "float32")),
                       page_key_hash=rec.get("page_key_hash", "sha256"),
                       reuse_ids=rec.get("reuse_ids", True))
    if factory is not None:
        cfg.factory = factory
    check = rec.get("before_admit")
    if check:
        try:
            cfg.before_admit = load_factory(check)
        except (ImportError, AttributeError) as err:  # kvref's tests' check, not here
            print(f"note: the trace ran {check} before each admit; not found here "
                  f"({err}), replayed without it", file=sys.stderr)
    return cfg


@contextmanager
def knobs(trace: Mapping[str, Any]) -> Iterator[None]:
    """kvref's module settings as they were when the trace was written."""
    saved = decode_table.SMALL_BATCH
    small = (trace.get("knobs") or {}).get("decode_table.SMALL_BATCH")
    try:
        if small is not None:
            decode_table.SMALL_BATCH = int(small)
        yield
    finally:
        decode_table.SMALL_BATCH = saved


def run_lockstep_trace(trace: Mapping[str, Any], config: DriverConfig) -> None:
    from kvref.testing.lockstep import Lockstep  # imports Hypothesis: only here

    machine_type = type("ReplayedLockstep", (Lockstep,),
                        {"scope": tr.decode(trace["scope"]), "config": config})
    machine = machine_type()
    machine.recording = False
    drained = False
    for event in tr.decode(trace["calls"]):
        if event[0] == "call":
            machine.driver.combine = bool(event[2])
            machine.run(event[1])
        elif event[0] == "check":
            machine.agrees_with_model()
        elif event[0] == "drained":
            machine.check_drained()
            drained = True
        else:
            raise ValueError(f"unknown lockstep event {event[0]!r}")
    if not drained:  # the run ends as the machine's does: drained and checked
        machine.teardown()


def run_exhaustive_trace(trace: Mapping[str, Any], config: DriverConfig) -> None:
    from kvref.testing.exhaustive import run_trace

    scope = tr.decode(trace["scope"])
    run_trace(m.Model(scope), list(tr.decode(trace["calls"])), config)


def run_sched_trace(trace: Mapping[str, Any], config: DriverConfig) -> None:
    try:
        harness = importlib.import_module("tests.support.sched_harness")
        scheduler = importlib.import_module("tests.support.scheduler")
    except ImportError as err:
        raise SystemExit("a scheduler trace replays from kvref's source tree (its harness "
                         f"is tests/support/sched_harness.py): {err}") from err
    if trace.get("model") not in (None, "ConcurrentModel"):
        print(f"note: recorded under model {trace['model']}; replayed under "
              "ConcurrentModel", file=sys.stderr)
    h = harness.Harness(scheduler.Replay(tr.decode(trace["schedule"])),
                        tr.decode(trace["scope"]), config, **dict(trace.get("options") or {}))
    h.recording = False
    h.run(tr.decode(trace["programs"]), tr.decode(trace["setup"]), bool(trace.get("drain")))


RUNNERS = {"lockstep": run_lockstep_trace, "exhaustive": run_exhaustive_trace,
           "sched": run_sched_trace}


def replay(trace: Mapping[str, Any], config: DriverConfig | None = None) -> Replayed:
    """Run ``trace`` once on the model and a fresh kvref; never raises for a
    disagreement (it is the result), only for a trace it cannot read."""
    cfg = config or driver_config(trace)
    want = trace.get("disagreement") or {}
    with knobs(trace):
        try:
            RUNNERS[trace["kind"]](trace, cfg)
        except Exception as err:  # a crash on kvref's side is a disagreement too
            text = str(err)
            same = (type(err).__name__ == want.get("type")
                    and first_line(text) == first_line(str(want.get("message", ""))))
            return Replayed(True, type(err).__name__, text, same)
    return Replayed(False)


def load_factory(path: str) -> Any:
    """The object ``module:qualname`` names."""
    module, _, name = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvref.testing.replay",
                                 description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path, help="trace files (JSON)")
    ap.add_argument("--device", help="torch device (default: the recorded one if "
                    "available here, else cpu)")
    ap.add_argument("--factory", help="module:callable building the manager under "
                    "test (default: kvref's KVManager)")
    o = ap.parse_args(argv)
    factory = load_factory(o.factory) if o.factory else None
    failed = 0
    for path in o.files:
        trace = tr.load(path)
        cfg = driver_config(trace, o.device, factory)
        print(f"{path}: {trace['kind']} trace from kvref {trace.get('kvref')}, "
              f"{len(trace['calls'])} calls, on {cfg.device}")
        print(f"  recorded: {trace['disagreement']['type']}: "
              f"{first_line(trace['disagreement']['message'])}")
        result = replay(trace, cfg)
        print(f"  {result.verdict()}")
        failed += result.failed
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
