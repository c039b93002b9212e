"""Mutation adequacy: realistic bugs planted in kvref, each of which the lockstep suite must find.

Each mutant is one line of thinking an implementer could get wrong; the
suite, run with a fixed budget and no shrinking, has to report it. A mutant
that survives means a check is missing, not that the mutant is harmless.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import kvref.plan as plan_module
import kvref.stepping as stepping_module
from kvref.forks import Forks
from kvref.manager import KVManager
from kvref.plan import KVPlanState, PagedIndptrs
from tests.conformance.test_lockstep import Lockstep
from tests.support.sched_planted import claim_ignores_marks


def _decode_offset_off_by_one(mp: pytest.MonkeyPatch) -> None:
    orig = plan_module.decode_tables

    def bad(*args: Any) -> tuple[PagedIndptrs, KVPlanState]:
        indptrs, state = orig(*args)
        state.token_to_cache.sub_(1).clamp_(min=0)  # writes one slot early
        return indptrs, state

    mp.setattr(stepping_module, "decode_tables", bad)


def _fork_moves_length_not_pages(mp: pytest.MonkeyPatch) -> None:
    def bad(self: Forks, rid: str, src: str, dst: str, created: set[tuple[str, str]]) -> None:
        streams = self._table.streams.get(rid, {})
        if src in streams and dst in streams:
            streams[dst].stored_len = streams[src].stored_len
            streams[dst].generation += 1

    mp.setattr(Forks, "apply", bad)


def _commit_skips_generation(mp: pytest.MonkeyPatch) -> None:
    orig = KVManager.commit

    def bad(self: KVManager, step: Any, ctx: Any) -> None:
        gens = {id(s): s.generation for r in self._streams.values() for s in r.values()}
        orig(self, step, ctx)
        for streams in self._streams.values():
            for s in streams.values():
                s.generation = gens.get(id(s), s.generation)

    mp.setattr(KVManager, "commit", bad)


def _reload_forgets_length(mp: pytest.MonkeyPatch) -> None:
    orig = KVManager.reload

    def bad(self: KVManager, rid: str) -> bool:
        ok = orig(self, rid)
        if ok:
            for s in self._streams[rid].values():
                s.stored_len = max(0, s.stored_len - 1)
        return ok

    mp.setattr(KVManager, "reload", bad)


def _clear_preplan_keeps_new_labels(mp: pytest.MonkeyPatch) -> None:
    orig = KVManager.clear_preplan

    def bad(self: KVManager) -> None:
        if self._preplan is not None:
            self._preplan.new_labels = []
        orig(self)

    mp.setattr(KVManager, "clear_preplan", bad)


def _claim_ignores_in_flight(stack: ExitStack) -> None:
    # the race the concurrency suite plants, reused as it is
    stack.enter_context(claim_ignores_marks())


def _patched(mutant: Callable[[pytest.MonkeyPatch], None]) -> Callable[[ExitStack], None]:
    return lambda stack: mutant(stack.enter_context(pytest.MonkeyPatch.context()))


MUTANTS: dict[str, Callable[[ExitStack], None]] = {
    "decode slot off by one": _patched(_decode_offset_off_by_one),
    "fork moves the length, not the pages": _patched(_fork_moves_length_not_pages),
    "claim ignores in-flight marks": _claim_ignores_in_flight,
    "commit does not bump generations": _patched(_commit_skips_generation),
    "reload loses a token": _patched(_reload_forgets_length),
    "clear_preplan keeps invented labels": _patched(_clear_preplan_keeps_new_labels),
}


BUDGET = settings(
    max_examples=300, stateful_step_count=50, derandomize=True, database=None,
    deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck),
)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_lockstep_finds_mutant(name: str) -> None:
    with ExitStack() as stack:
        MUTANTS[name](stack)
        with pytest.raises(BaseException) as found:  # any failure of the suite counts
            run_state_machine_as_test(Lockstep, settings=BUDGET)
    assert not isinstance(found.value, KeyboardInterrupt)


@pytest.mark.slow
def test_unmutated_kvref_passes_the_same_budget() -> None:
    """The control: with no mutant the same run passes, so each detection above
    is the mutant's doing, not a harness failure that any run would hit."""
    run_state_machine_as_test(Lockstep, settings=BUDGET)
