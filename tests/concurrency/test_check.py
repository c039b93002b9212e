"""kvref's threads against the model: Hypothesis-drawn programs under
Hypothesis-drawn schedules, PCT, and exhaustive search of small programs.

A failure prints the programs, the linearization and ``schedule=[...]``;
`tests.support.sched_harness.replay(programs, schedule)` reruns it exactly.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvref_model import core as m
from tests.concurrency.programs import choices, programs
from tests.support.sched_harness import SCOPES, Op, Program, StepOp, replay, run_once
from tests.support.sched_planted import STEP0, dfs_count
from tests.support.scheduler import PCT, Replay

# sized for CI (about a minute of CPU for these four; 300 and 150 once, half
# that since CI outgrew its 15 minutes); the nightly test below draws 5,000
CI = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# kvref's default configuration, at half the plain budget; not shrunk (a
# failure prints its programs and schedule)
SHIPPED = settings(CI, max_examples=75, phases=[Phase.explicit, Phase.generate])


def drawn(scope: str, data: st.DataObject) -> None:
    # the lockset check off in the CI's bulk runs (its cost); on in the DFS
    # suites, the known races and the nightly draws
    progs = data.draw(programs(sharing=SCOPES[scope].sharing), label="programs")
    schedule = data.draw(choices(), label="schedule")
    run_once(progs, Replay(schedule), lockset=False, scope=SCOPES[scope])


def pct_run(scope: str, data: st.DataObject, seed: int, depth: int) -> None:
    progs = data.draw(programs(sharing=SCOPES[scope].sharing), label="programs")
    run_once(progs, PCT(seed, depth, steps=80), lockset=False, scope=SCOPES[scope])


@CI
@given(data=st.data())
def test_drawn_schedules(data: st.DataObject) -> None:
    drawn("plain", data)


@SHIPPED
@given(data=st.data())
def test_drawn_schedules_as_shipped(data: st.DataObject) -> None:
    drawn("shipped", data)


@CI
@given(data=st.data(), seed=st.integers(0, 2**32 - 1), depth=st.integers(2, 3))
def test_pct(data: st.DataObject, seed: int, depth: int) -> None:
    pct_run("plain", data, seed, depth)


@SHIPPED
@given(data=st.data(), seed=st.integers(0, 2**32 - 1), depth=st.integers(2, 3))
def test_pct_as_shipped(data: st.DataObject, seed: int, depth: int) -> None:
    pct_run("shipped", data, seed, depth)


SMALL = {
    "offload against admit and commit": [
        Program("engine", [STEP0]), Program("worker", [Op("offload", 0)])],
    "reload against remove": [
        Program("worker", [Op("reload", 1)]), Program("life", [Op("remove", 1)])],
    "preplan against offload": [
        Program("engine", [StepOp(m.Step((m.Seg(0, 0, 1),), padded=(0,)), "preplan")]),
        Program("worker", [Op("offload", 0)])],
    "retrieve completes against an offload": [
        Program("engine", [Op("retrieve", 2, 0, 4)]), Program("worker", [Op("offload", 2)])],
}


@pytest.mark.parametrize("scope", sorted(SCOPES))
@pytest.mark.parametrize("name", sorted(SMALL))
def test_dfs_every_schedule_up_to_two_preemptions(name: str, scope: str) -> None:
    n = dfs_count(SMALL[name], bound=2, budget=5000, scope=SCOPES[scope])
    assert 1 < n < 5000, f"{name}: {n} schedules"


@pytest.mark.nightly
@settings(max_examples=5000, deadline=None, suppress_health_check=list(HealthCheck))
@given(programs(), choices(200))
def test_drawn_schedules_nightly(progs: list[Program], schedule: list[int]) -> None:
    run_once(progs, Replay(schedule))


def test_a_failure_prints_a_schedule_that_replays_it() -> None:
    from tests.support.sched_planted import RACES, detect, pct

    race = RACES[0]
    found = detect(race, pct(0, 3), budget=500)
    assert found.schedule is not None and "schedule=" in found.message
    with race.patch(), pytest.raises(AssertionError) as again:
        replay(race.programs, found.schedule)
    assert str(again.value).splitlines()[0] == found.message.splitlines()[0]
