"""The trace files kept under tests/traces/, and the plants that make them fail.

Each kept trace is a planted bug's failure, one per layer that writes
traces: CI replays it (tests/unit/test_kept_traces.py) with its plant, where
it must fail with the disagreement it recorded, and on the clean tree,
where it must pass. A change that makes a kept trace pass under its plant
(the calls no longer reach the bug) or fail on the clean tree shows here.

    python -m tests.support.kept_traces    # write them again (a new format)
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvref import KVManager
from kvref.testing import trace as tr

HERE = Path(__file__).resolve().parents[1] / "traces"


@contextmanager
def mutant(name: str) -> Iterator[None]:
    """A plant of tests/conformance/test_mutations.py's MUTANTS."""
    from tests.conformance.test_mutations import MUTANTS

    with ExitStack() as stack:
        MUTANTS[name](stack)
        yield


@contextmanager
def seam(name: str) -> Iterator[None]:
    """A plant of tests/support/seam_plants.py."""
    from tests.support import seam_plants

    mp = pytest.MonkeyPatch()
    try:
        getattr(seam_plants, name)(mp)
        yield
    finally:
        mp.undo()


def race(name: str) -> AbstractContextManager[None]:
    """A planted race of tests/support/sched_planted.py."""
    from tests.support.sched_planted import RACES

    return next(r for r in RACES if r.name == name).patch()


def make_lockstep() -> None:
    from kvref.testing.lockstep import PLAIN_SCOPE, Lockstep

    saved = Lockstep.scope
    Lockstep.scope = PLAIN_SCOPE  # the mutants' scope (test_mutations.py)
    run = settings(max_examples=100, stateful_step_count=50, derandomize=True,
                   database=None, deadline=None, phases=[Phase.generate, Phase.shrink],
                   suppress_health_check=list(HealthCheck), print_blob=False)
    try:
        run_state_machine_as_test(Lockstep, settings=run)
    finally:
        Lockstep.scope = saved


def make_exhaustive() -> None:
    from kvref.testing.exhaustive import CI_SCOPE, check_scope

    check_scope(CI_SCOPE, max_failures=1)


def make_sched() -> None:
    from tests.support.sched_planted import RACES, run_race
    from tests.support.scheduler import Prefix, next_dfs_prefix

    r = next(r for r in RACES if r.name == "claim ignores in-flight marks")
    prefix: list[int] | None = []
    while prefix is not None:  # DFS, at most two preemptions, to the first failure
        prefix = next_dfs_prefix(run_race(r, Prefix(prefix)).trace, 2)


@dataclass(frozen=True)
class Kept:
    plant: Callable[[], AbstractContextManager[None]]
    make: Callable[[], None]  # run the layer under the plant until it fails


KEPT: dict[str, Kept] = {
    "lockstep-second-step-admitted": Kept(
        lambda: mutant("a: a second step is admitted"), make_lockstep),
    "exhaustive-reset-stops-following": Kept(
        lambda: seam("reset_stops_following"), make_exhaustive),
    "sched-claim-ignores-marks": Kept(
        lambda: race("claim ignores in-flight marks"), make_sched),
}


def write_again(name: str) -> Path:
    """Run ``name``'s layer under its plant and keep the trace it writes."""
    kept = KEPT[name]
    with tempfile.TemporaryDirectory() as where:
        saved = os.environ.get("KVREF_TRACE_DIR")
        os.environ["KVREF_TRACE_DIR"] = where
        try:
            # the failure is expected: its trace is what is kept
            with kept.plant(), suppress(Exception):
                kept.make()
        finally:
            if saved is None:
                del os.environ["KVREF_TRACE_DIR"]
            else:
                os.environ["KVREF_TRACE_DIR"] = saved
        written = sorted(Path(where).glob("*.json"))
        if len(written) != 1:
            raise AssertionError(f"{name}: expected one trace, got {written}")
        trace: dict[str, Any] = json.loads(written[0].read_text())
    trace["planted"] = name
    HERE.mkdir(exist_ok=True)
    out = HERE / f"{name}.json"
    out.write_text(json.dumps(trace, indent=1) + "\n")
    return out


class MiscountsFree(KVManager):
    """A manager under test that reports one free page too many: what
    ``python -m kvref.testing.replay --factory`` is checked against."""

    @property
    def num_free_pages(self) -> int:
        return super().num_free_pages + 1


def miscounts_free(**kwargs: Any) -> KVManager:
    return MiscountsFree(**kwargs)


def kept_files() -> list[Path]:
    return sorted(HERE.glob("*.json"))


def plant_of(trace: dict[str, Any]) -> AbstractContextManager[None] | None:
    name = trace.get("planted")
    return None if name is None else KEPT[name].plant()


if __name__ == "__main__":
    for key in KEPT:
        path = write_again(key)
        print(path, tr.load(path)["disagreement"]["message"].splitlines()[0][:120])
