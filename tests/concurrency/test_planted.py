"""Proof that the check bites: each known race, patched back into kvref, is
found by every strategy within a small budget (figures: measure.py)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, find, settings

from tests.concurrency.programs import choices
from tests.support.sched_harness import run_once
from tests.support.sched_planted import RACES, Race, detect, dfs, dfs_count, pct, random_walk
from tests.support.scheduler import Replay, ScheduleFailure

BY_NAME = {r.name: r for r in RACES}


@pytest.mark.parametrize("name", sorted(BY_NAME))
@pytest.mark.parametrize("strategy", ["dfs", "pct", "random"])
def test_planted_race_is_found(name: str, strategy: str) -> None:
    race = BY_NAME[name]
    if strategy == "dfs":
        found = dfs(race, bound=2, budget=300)
    elif strategy == "pct":
        found = detect(race, pct(1, 3), budget=300)
    else:
        found = detect(race, random_walk(1), budget=300)
    assert found.schedules is not None, f"{name} not found by {strategy}"


def _fails(race: Race, schedule: list[int]) -> bool:
    with race.patch():
        try:
            run_once(race.programs, Replay(schedule))
        except ScheduleFailure:
            return True
    return False


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_hypothesis_finds_and_shrinks_a_planted_race(name: str) -> None:
    race = BY_NAME[name]
    minimal = find(choices(), lambda s: _fails(race, s),
                   settings=settings(max_examples=300, database=None, deadline=None,
                                     suppress_health_check=list(HealthCheck)))
    # shrunk: a handful of non-zero choices is the whole interleaving
    assert sum(1 for c in minimal if c) <= 3, minimal


@pytest.mark.parametrize("name", [RACES[0].name])
def test_unpatched_program_passes_every_schedule(name: str) -> None:
    # the failures above are the patch's, not the program's. (The other two
    # programs also hit a known race unpatched: test_known_races.py)
    assert dfs_count(BY_NAME[name].programs, bound=2, budget=3000) < 3000
