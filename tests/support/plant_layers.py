"""Run one composed layer with a plant applied and say where it failed.

Each layer runs at a fixed budget, deterministically, so the clean tree
passing that budget and a plant found within it are statements about the
same runs: the lockstep derandomized (the same examples for every plant),
the exhaustive replay in its state order, the scheduler's DFS in its
schedule order. `Found.at` is the 1-based example (lockstep machine), transition
(exhaustive), schedule (scheduler) or call (traces, counted over the
traces run) at which the layer first failed (None: it never did).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, Phase, settings

from kvref.testing import lockstep as lockstep_module
from kvref.testing.driver import DriverConfig
from kvref.testing.exhaustive import check_scope, run_trace
from kvref_model import core as m
from tests.support.admission_check import check_plain_admission

Plant = Callable[[pytest.MonkeyPatch], None]


@dataclass(frozen=True)
class Found:
    at: int | None  # the example / transition / schedule that failed first
    ran: int  # how many ran
    message: str = ""


@contextmanager
def planted(plant: Plant | None) -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    try:
        if plant is not None:
            plant(mp)
        yield
    finally:
        mp.undo()


def lockstep_settings(examples: int) -> settings:
    """Derandomized, no database, no shrinking: the same examples in the same
    order on every run, and a failure reported as first met."""
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None,
                    stateful_step_count=50, phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=list(HealthCheck), print_blob=False)


def lockstep(plant: Plant | None, scope: m.Scope, examples: int) -> Found:
    """`kvref.testing.lockstep.run_lockstep` over ``scope`` for ``examples``
    derandomized examples; counts the examples (machines) it built."""
    count = [0]
    machine = lockstep_module.Lockstep
    init = machine.__init__

    def counting(self: lockstep_module.Lockstep) -> None:
        count[0] += 1
        init(self)

    with planted(plant):
        machine.__init__ = counting  # type: ignore[method-assign]
        try:
            lockstep_module.run_lockstep(DriverConfig(before_admit=check_plain_admission),
                                         scope, lockstep_settings(examples))
        except Exception as err:  # the disagreement, or kvref raising
            text = f"{type(err).__name__}: {err}"
            if any(c in text for c in COVERAGE):
                # every example passed; the run's own coverage check failed
                return Found(None, count[0], text[:2000])
            return Found(count[0], count[0], text[:2000])
        finally:
            machine.__init__ = init  # type: ignore[method-assign]
    return Found(None, count[0])


# `run_lockstep`'s checks after the examples, not disagreements
COVERAGE = ("never exercised", "too few kinds of misuse")


def exhaustive(plant: Plant | None, scope: m.Scope) -> Found:
    """`kvref.testing.exhaustive.check_scope`, stopping at the first mismatch."""
    with planted(plant):
        out = check_scope(scope, DriverConfig(), max_failures=1)
    if out.failures:
        return Found(out.transitions, out.transitions, out.failures[0][:2000])
    return Found(None, out.transitions)


def traces(plant: Plant | None, scope: m.Scope, cases: Sequence[Sequence[m.Action]]) -> Found:
    """Fixed traces replayed on the model and kvref together
    (`kvref.testing.exhaustive.run_trace`: every check after every call)."""
    model = m.Model(scope)
    done = 0
    with planted(plant):
        for trace in cases:
            try:
                run_trace(model, list(trace), DriverConfig())
            except Exception as err:
                at = first_failing_call(model, trace)
                return Found(done + at, done + at, f"{type(err).__name__}: {err}"[:2000])
            done += len(trace)
    return Found(None, done)


def first_failing_call(model: m.Model, trace: Sequence[m.Action]) -> int:
    """The 1-based call of ``trace`` after which the checks first fail (the
    checks after a call are not all named by `run_trace`'s message)."""
    for k in range(1, len(trace) + 1):
        try:
            run_trace(model, list(trace[:k]), DriverConfig())
        except Exception:
            return k
    raise AssertionError("the trace failed once, then passed every prefix")


def schedules(plant: Plant | None, program: str) -> Found:
    """The controlled scheduler: every schedule of one program of
    `tests.support.shared_programs` with up to two preemptions, DFS order."""
    from tests.support.shared_programs import CASES, Failed, explore

    with planted(plant):
        try:
            n = explore(CASES[program])
        except Failed as err:
            return Found(err.at, err.at, str(err)[:2000])
    return Found(None, n)
