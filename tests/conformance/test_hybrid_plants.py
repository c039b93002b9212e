"""Hybrid plants (issue 40): the hybrid classes of KV-cache bugs other
engines shipped, planted in kvref (tests/support/hybrid_plants.py), each
found by a model layer run on a hybrid scope while the clean tree passes
the very same runs.

CI runs the hybrid traces (tests/support/hybrid_traces.py, replayed on the
model and kvref together with every check after every call, as the seam
traces are). `FOUND_AT` records the call at which each plant is found; a
change that finds it later, or not at all, fails. The nightly run measures
the hybrid lockstep's and exhaustive replay's CI budgets against each plant
(docs/verification/planted-bugs.md records where each was found).
"""

from __future__ import annotations

import pytest

from kvref.testing.exhaustive import HYBRID_CI_SCOPE
from kvref.testing.lockstep import HYBRID_SCOPE
from tests.conformance.test_lockstep import HYBRID_EXAMPLES
from tests.support.hybrid_plants import PLANTS
from tests.support.hybrid_traces import TRACES
from tests.support.plant_layers import Found, exhaustive, lockstep, traces

# plant -> (trace, the call at which it is found)
FOUND_AT: dict[str, tuple[str, int]] = {
    "window_frees_tail_first": ("a keyed window removed", 7),  # vLLM 48435
    "window_hit_only_at_the_longest_point": ("a prompt past a cached one", 8),  # vLLM 57610
    "window_passes_keyed_pages_to_the_lru": ("a window passes a keyed page", 14),  # vLLM 42948
    # vLLM PR 50457, vllm-ascend PR 12394
    "hit_decided_by_the_first_group": ("a hit the window group cannot serve", 8),
    "refused_admit_keeps_the_first_group": ("an admit one group cannot take", 7),
    "late_start_fault_keeps_the_started_group": (
        "a retrieve whose window group cannot start", 2),
}


def run(trace: str, plant: object) -> Found:
    scope, actions = TRACES[trace]
    return traces(plant, scope, [actions])  # type: ignore[arg-type]


@pytest.mark.parametrize("trace", sorted(TRACES))
def test_the_clean_tree_passes_the_trace(trace: str) -> None:
    found = run(trace, None)
    assert found.at is None, found.message


@pytest.mark.parametrize("name", sorted(FOUND_AT))
def test_the_plant_is_found(name: str) -> None:
    trace, at = FOUND_AT[name]
    found = run(trace, PLANTS[name])
    assert found.at is not None, f"{name} survived the trace {trace!r} ({found.ran} calls)"
    assert found.at <= at, f"{name} found at call {found.at}, recorded {at}: {found.message}"


def test_every_hybrid_plant_has_a_trace() -> None:
    assert set(FOUND_AT) == set(PLANTS)


# the CI budgets of the hybrid lockstep and exhaustive replay, against each
# plant: which of them find it (measured, recorded in planted-bugs.md)
# (the first two at the 4th lockstep example, the late start fault at the
# 12th; at the 49th and 75th transitions of the replay; the other plants
# survive those budgets: their traces find them)
LOCKSTEP_FINDS = ("window_frees_tail_first", "refused_admit_keeps_the_first_group",
                  "late_start_fault_keeps_the_started_group")
EXHAUSTIVE_FINDS = ("refused_admit_keeps_the_first_group",
                    "late_start_fault_keeps_the_started_group")


@pytest.mark.nightly
def test_the_clean_tree_passes_the_hybrid_budgets() -> None:
    assert lockstep(None, HYBRID_SCOPE, HYBRID_EXAMPLES).at is None
    assert exhaustive(None, HYBRID_CI_SCOPE).at is None


@pytest.mark.nightly
@pytest.mark.parametrize("name", LOCKSTEP_FINDS)
def test_the_hybrid_lockstep_finds_the_plant(name: str) -> None:
    found = lockstep(PLANTS[name], HYBRID_SCOPE, HYBRID_EXAMPLES)
    assert found.at is not None, f"{name} survived {found.ran} hybrid lockstep examples"


@pytest.mark.nightly
@pytest.mark.parametrize("name", EXHAUSTIVE_FINDS)
def test_the_hybrid_exhaustive_replay_finds_the_plant(name: str) -> None:
    found = exhaustive(PLANTS[name], HYBRID_CI_SCOPE)
    assert found.at is not None, f"{name} survived {found.ran} transitions"
