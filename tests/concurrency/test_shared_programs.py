"""The controlled scheduler over shared pages and windows (issue 27, build 3):
each program of `tests.support.shared_programs`, every schedule up to two
preemptions, in kvref's default configuration and (one program) the plain
one. What each run checks: that module's docstring."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.support.hybrid_plants import SCHEDULED_PLANTS
from tests.support.sched_harness import SHIPPED_SCOPE
from tests.support.shared_programs import CASES, HYBRID_CASES, Failed, explore


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_schedule_up_to_two_preemptions(name: str) -> None:
    n = explore(CASES[name])
    assert n > 1, f"{name}: one schedule only, nothing raced"


def test_the_programs_race_in_the_plain_configuration_too() -> None:
    # the second scope: the prefix cache off, no window (no match there: the
    # eviction program's hit is a miss, its admit always fits)
    case = CASES["window release against a retrieve's copy"]
    plain = replace(case, scope=replace(SHIPPED_SCOPE, sharing=False, windows=(),
                                        margins=()), post=lambda got: None)
    assert explore(plain) > 1


@pytest.mark.parametrize("name", sorted(HYBRID_CASES))
def test_a_hybrid_program_up_to_one_preemption(name: str) -> None:
    """Issue 40: one full group and one window group over one pool, the
    window group keying and hitting; every schedule with one preemption
    (16 to 60 a program), checked against the model as every program is.
    A hybrid offload copies each group's stream in its own critical
    sections, each checked as the model's copy of that group."""
    assert explore(HYBRID_CASES[name], bound=1) > 1


@pytest.mark.parametrize("name", sorted(SCHEDULED_PLANTS))
def test_a_hybrid_plant_is_found_by_its_program(name: str) -> None:
    """A hybrid defect planted in kvref that only an interleaving shows is
    found within the budget the clean tree passes above (one preemption,
    every schedule of the same program)."""
    plant, case, at = SCHEDULED_PLANTS[name]
    with pytest.MonkeyPatch.context() as mp:
        plant(mp)
        with pytest.raises(Failed) as found:
            explore(HYBRID_CASES[case], bound=1)
    assert found.value.at <= at, f"{name} found at schedule {found.value.at}, recorded {at}"


@pytest.mark.nightly
@pytest.mark.parametrize("name", sorted(HYBRID_CASES))
def test_a_hybrid_program_up_to_two_preemptions(name: str) -> None:
    assert explore(HYBRID_CASES[name]) > 16
