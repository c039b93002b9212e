"""Interaction plants (issue 27, build 5): defects planted at the seams of two
mechanisms (tests/support/seam_plants.py), each found by a composed layer
in kvref's default configuration, the prefix cache on and windows with a
rollback margin, while the clean tree passes the very same runs.

The CI layers here are cheap and deterministic:
- the seam traces (tests/support/seam_traces.py), replayed on the model and
  kvref together with every check after every call, as the composed
  regressions are (`kvref.testing.exhaustive.run_trace`);
- the controlled scheduler's programs (tests/support/shared_programs.py),
  every schedule up to two preemptions, depth first.
`FOUND_AT` records where each plant is found (the call of the trace, or the
schedule in DFS order); a change that finds it later, or not at all, fails.
The Hypothesis lockstep over `SHIPPED_SCOPE` finds most of them too, at a
cost that belongs in the nightly run (`test_the_lockstep_finds_the_plant`;
the examples at which it found each are in docs/verification/planted-bugs.md).
"""

from __future__ import annotations

import pytest

from kvref.testing.exhaustive import CI_SCOPE
from kvref.testing.lockstep import SHIPPED_SCOPE
from tests.support import seam_plants
from tests.support.plant_layers import Found, exhaustive, lockstep, schedules, traces
from tests.support.seam_traces import TRACES

# plant -> (layer, trace or program, the call / schedule at which it is found)
FOUND_AT: dict[str, tuple[str, str, int]] = {
    "offload_commit_frees_shared_pages": ("trace", "offload and reload under a sharer", 11),
    "reload_reattaches_without_a_reference": ("trace", "offload and reload under a sharer", 12),
    "reset_clears_the_sharers_chain": ("trace", "reset of one sharer", 9),
    "reset_keeps_shared_pages": ("trace", "reset of one sharer", 9),
    "reset_cache_while_offloaded": ("trace", "prefix reset while offloaded", 10),
    "fork_reserves_released_slots": ("trace", "fork beside a window's writer", 15),
    "failed_fork_keeps_shared_pages": ("trace", "failed copy-on-write fork", 11),
    "received_kv_cached": ("trace", "received KV keyed", 4),
    "retrieve_ignores_released": ("trace", "retrieve into a window", 6),
    "fork_drops_the_margin": ("trace", "fork of a window", 11),
    "truncate_keeps_the_chain": ("trace", "truncate of a keyed stream", 7),
    "fork_keeps_the_targets_key_chain": ("trace", "fork onto a keyed stream", 20),
    # at schedule 60 from a wrong result before the lock discipline and the
    # watched request configs (issue 44): its lookup outside the lock is reported at once
    "match_attaches_after_the_lock": ("scheduler", "eviction against match", 1),
    "offload_commit_frees_shared_pages@scheduler": ("scheduler", "hit against offload", 1),
    "offload_copy_forgets_the_window": ("scheduler", "window release against an offload copy",
                                        1),
    "offload_copy_forgets_the_window@trace": ("trace", "offload of a window", 11),
    # found once the model made the copy-on-write at admit, as kvref does
    # (S18, R52; issue 27's first open disagreement)
    "preplan_skips_copy_on_write": ("trace", "preplanned write after a truncate into a shared page",
                                    10),
    "truncate_forgets_the_shared_tail": ("trace", "write after a truncate into a shared page", 10),
    # pages keyed as they fill (S33)
    "page_filled_at_its_end_missed": ("trace", "decode of a followed stream", 10),
    "truncate_hides_the_fill": ("trace", "decode of a followed stream", 23),
    "reset_stops_following": ("trace", "decode of a followed stream", 28),
    "commit_keys_in_reverse": ("trace", "one step fills a key twice", 8),
    # a retrieve or a step under the request's own lease (R71, issue 44)
    "retrieve_ignores_the_lease": ("trace", "retrieve into a leased window", 7),
    "retrieve_ignores_the_lease@keyed": ("trace",
                                         "write after a truncate into a keyed page, leased", 9),
    "copy_on_write_ignores_the_lease": ("trace",
                                        "write after a truncate into a keyed page, leased", 10),
    # issue 44: classes no layer reached, each through the reach it lacked:
    # a `start` for cache_prefix (S34) and ids that differ along a stream
    "cache_prefix_compares_from_token_0": ("trace", "cache_prefix from a keyed page", 11),
    # forks between two full labels with the prefix cache (the CI lockstep's
    # scope has one full label; the nightly one draws them, `fork_the_prompt`)
    "preplan_privatises_by_refcount": ("trace", "preplanned fork onto a keyed stream", 11),
    "fork_drops_received": ("trace", "fork of received KV keyed", 8),
    "follow_ignores_the_forks_label": ("trace", "fork into a followed stream", 19),
    "cow_ignores_released": ("trace", "write after a truncate into a window's shared page", 15),
    # the free queues' order (`Driver.check_free_order`)
    "release_shared_head_first": ("trace", "reset keeping keyed pages", 7),
    "failed_reload_gives_back_reversed": ("trace", "failed reload of two pages", 9),
    # each page's key itself (`Driver.kv_key`), tenants told apart by extra
    # keys alone, and request ids used again (`DriverConfig.reuse_ids`)
    "one_pass_ignores_extra_keys": ("trace", "a page keyed under extra keys", 6),
    "remove_keeps_the_config": ("trace", "a request id used again", 8),
}

def run(layer: str, target: str, plant: seam_plants.Plant | None) -> Found:
    if layer == "scheduler":
        return schedules(plant, target)
    scope, trace = TRACES[target]
    return traces(plant, scope, [trace])


@pytest.mark.parametrize("target", sorted(
    {t for layer, t, _ in FOUND_AT.values() if layer == "trace"}))
def test_the_clean_tree_passes_the_trace(target: str) -> None:
    found = run("trace", target, None)
    assert found.at is None, found.message


def test_the_clean_tree_passes_every_schedule_of_the_programs() -> None:
    # run clean, every schedule, by tests/concurrency/test_shared_programs.py
    # (not again here: the same DFS, its cost paid once)
    from tests.support.shared_programs import CASES

    programs = {t for layer, t, _ in FOUND_AT.values() if layer == "scheduler"}
    assert programs <= set(CASES)


@pytest.mark.parametrize("name", sorted(FOUND_AT))
def test_the_plant_is_found(name: str) -> None:
    layer, target, at = FOUND_AT[name]
    plant = getattr(seam_plants, name.split("@")[0])
    found = run(layer, target, plant)
    assert found.at is not None, f"{name} survived the {layer} ({target}, {found.ran} run)"
    # where it was found when recorded: later means the layer got weaker
    assert found.at <= at, f"{name} found at {found.at}, recorded {at}: {found.message}"


def test_twelve_interaction_plants_are_found_in_ci() -> None:
    assert len({n.split("@")[0] for n in FOUND_AT}) >= 12


# the Hypothesis lockstep in the shipped configuration, at the budget whose
# rates over seeds 0-9 are measured (`scripts/plant_rates.py`, issue 41):
# at 100 examples the clean run missed a prefix hit or a followed commit
# under some seeds (its coverage check), and each plant that needs one was
# found under 8 or 9 seeds of 10; at 200 the clean run passed all ten and
# these were found under 9 or 10 (docs/verification/coverage.md). A plant
# found under fewer is not listed: it was found by a lucky draw
LOCKSTEP_EXAMPLES = 200
LOCKSTEP_FINDS = (
    # offload_commit_frees_shared_pages survives the lockstep since issue
    # 44's draws: its trace and program find it in CI. Nor is
    # release_shared_head_first listed: 8 of 10 at 200 examples (seeds 5 and
    # 8 missed) once decode steps key their pages, 9 of 10 at 100 before;
    # its trace finds it in CI
    "reset_cache_while_offloaded",
    "page_filled_at_its_end_missed",  # S33
    # issue 44: the reach added to the lockstep (docs/verification/planted-bugs.md)
    "cache_prefix_compares_from_token_0",  # S34's start drawn
    "one_pass_ignores_extra_keys",  # a tenant told apart by extra keys, keys compared
    "remove_keeps_the_config",  # request ids used again
)


@pytest.mark.nightly
def test_the_clean_tree_passes_the_lockstep_budget() -> None:
    found = lockstep(None, SHIPPED_SCOPE, LOCKSTEP_EXAMPLES)
    assert found.at is None, found.message


@pytest.mark.nightly
@pytest.mark.parametrize("name", LOCKSTEP_FINDS)
def test_the_lockstep_finds_the_plant(name: str) -> None:
    found = lockstep(getattr(seam_plants, name), SHIPPED_SCOPE, LOCKSTEP_EXAMPLES)
    assert found.at is not None, f"{name} survived {found.ran} lockstep examples"


# the exhaustive replay over CI_SCOPE (whose clean run, 17,066 transitions,
# is tests/conformance/test_exhaustive.py's): depth 3 reaches the seams that
# take three calls; found at these transitions, about 30 s each here (the
# first two at 11,850 and 11,666 before follow_tokens' transitions, S33)
EXHAUSTIVE_FINDS = {"received_kv_cached": 13_603, "reset_cache_while_offloaded": 13_419,
                    "reset_stops_following": 2_437}


@pytest.mark.nightly
@pytest.mark.parametrize("name", sorted(EXHAUSTIVE_FINDS))
def test_the_exhaustive_replay_finds_the_plant(name: str) -> None:
    found = exhaustive(getattr(seam_plants, name), CI_SCOPE)
    assert found.at is not None and found.at <= EXHAUSTIVE_FINDS[name], (found.at, found.ran)
