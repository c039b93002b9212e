"""Mutation adequacy: realistic bugs planted in kvref, each of which the lockstep suite must find.

Each mutant is one line of thinking an implementer could get wrong; the
suite, run with a fixed budget and no shrinking, has to report it. A mutant
that survives means a check is missing, not that the mutant is harmless.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import kvref.stepping.admission as admission_module
import kvref.stepping.admit_plan_commit as stepping_module
import kvref.stepping.decode_table as decode_table_module
import kvref.stepping.plan as plan_module
import kvref.stepping.truncation as truncation_module
import kvref.validate as validate_module
from kvref import Offload, ReloadCopyError
from kvref.manager import KVManager
from kvref.stepping.forks import ForkFailed, Forks
from kvref.stepping.plan import KVPlanState
from kvref.testing.lockstep import PLAIN_SCOPE, Lockstep
from kvref.transfer.engine import KVTransferManager
from tests.support.sched_planted import claim_ignores_marks


def _decode_offset_off_by_one(mp: pytest.MonkeyPatch) -> None:
    orig = plan_module.decode_slots

    def bad(*args: Any) -> KVPlanState:
        state = orig(*args)
        state.token_to_cache.sub_(1).clamp_(min=0)  # writes one slot early
        return state

    # every decode step's slots: `decode_tables` (plan.py) and the kept and
    # fresh decode tables (decode_table.py)
    mp.setattr(plan_module, "decode_slots", bad)
    mp.setattr(decode_table_module, "decode_slots", bad)


def _fork_moves_length_not_pages(mp: pytest.MonkeyPatch) -> None:
    def bad(self: Forks, rid: str, src: str, dst: str, created: set[Any],
            *args: Any, **kwargs: Any) -> None:  # span, copy: no pages move anyway
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
            self._preplan.created = []
        orig(self)

    mp.setattr(KVManager, "clear_preplan", bad)


# -- one per blind spot of issue 8 (a: total protocol, b: wider scope,
# c: faults at every copy, d: retrieves still writing, e: plan views)


def _write_after_commit_uses_last_plan(mp: pytest.MonkeyPatch) -> None:  # a
    orig = KVManager.commit

    def bad(self: KVManager, step: Any, ctx: Any) -> None:
        states = self._current_plan_states
        try:
            orig(self, step, ctx)
        finally:
            self._current_plan_states = states  # addressing outlives the step

    mp.setattr(KVManager, "commit", bad)


def _second_step_admitted(mp: pytest.MonkeyPatch) -> None:  # a
    orig = KVManager.admit

    def bad(self: KVManager, step: Any, ctx: Any) -> Any:
        if not ctx.is_preplan and self._preplan is None:
            self._running = None  # forgets the step already admitted
        return orig(self, step, ctx)

    mp.setattr(KVManager, "admit", bad)


def _fork_from_absent_source_wipes_target(mp: pytest.MonkeyPatch) -> None:  # b
    orig = Forks.apply

    def bad(self: Forks, rid: str, src: str, dst: str, created: set[Any],
            *args: Any, **kwargs: Any) -> None:
        # every source treated as pre-existing; the rest of the call as given
        # (a mutant that dropped `copy` crashed with a TypeError instead)
        orig(self, rid, src, dst, set(), *args, **kwargs)

    mp.setattr(Forks, "apply", bad)


def _failed_reload_keeps_a_page(mp: pytest.MonkeyPatch) -> None:  # c
    orig = KVManager.reload

    def bad(self: KVManager, rid: str) -> bool:
        try:
            return orig(self, rid)
        except ReloadCopyError:
            self._pages.allocate(("leaked",), 1)  # one page taken, never given back
            raise

    mp.setattr(KVManager, "reload", bad)


def _failed_fork_leaves_target_torn(mp: pytest.MonkeyPatch) -> None:  # c
    orig = Forks.apply

    def bad(self: Forks, rid: str, src: str, dst: str, created: set[Any],
            *args: Any, **kwargs: Any) -> None:
        target = self._table.streams[rid][dst]
        old = target.stored_len
        try:
            orig(self, rid, src, dst, created, *args, **kwargs)
        except ForkFailed:
            target.stored_len = old  # reports its old tokens over half-copied pages
            raise

    mp.setattr(Forks, "apply", bad)


def _admit_ignores_running_retrieve(mp: pytest.MonkeyPatch) -> None:  # d
    orig = admission_module.retrieve_state

    def bad(stream: Any) -> str:
        state = orig(stream)
        return admission_module.IDLE if state == admission_module.PENDING else state

    mp.setattr(admission_module, "retrieve_state", bad)


def _offload_copy_does_not_wait_for_read(mp: pytest.MonkeyPatch) -> None:  # d
    orig = Offload.copy

    def bad(self: Offload, label: str) -> bool:
        self._read_futures.clear()
        return orig(self, label)

    mp.setattr(Offload, "copy", bad)


def _promoted_preplan_keeps_stale_generations(mp: pytest.MonkeyPatch) -> None:  # e
    orig = KVManager.plan

    def bad(self: KVManager, step: Any, ctx: Any) -> Any:
        staged = self._preplan
        before = None
        if staged is not None and staged.outputs is not None and not ctx.is_preplan:
            before = [(v, v.generation) for o in staged.outputs.values() for v in o.views]
        out = orig(self, step, ctx)
        for view, gen in before or ():
            view.generation = gen
        return out

    mp.setattr(KVManager, "plan", bad)


# -- issue 10 item 4 (t: truncate) and item 7a


def _truncate_keeps_the_generation(mp: pytest.MonkeyPatch) -> None:  # t
    orig = truncation_module.truncate

    def bad(table: Any, rid: str, label: str, new_len: int) -> int:
        stream = table.stream(rid, label)
        gen = stream.generation
        freed = orig(table, rid, label, new_len)
        stream.generation = gen  # a plan, a host copy or a peer sees no change
        return freed

    mp.setattr(truncation_module, "truncate", bad)


def _truncate_frees_one_page_off(extra: int) -> Callable[[pytest.MonkeyPatch], None]:  # t
    def plant(mp: pytest.MonkeyPatch) -> None:
        # the kept page count off by one: ceil taken as floor, or the
        # partial last page counted twice
        def pages_for(tokens: int, page_size: int) -> int:
            return max(0, -(-tokens // page_size) + extra)

        mp.setattr(truncation_module, "pages_for", pages_for)
    return plant


def _fork_with_no_padded_request_passes(mp: pytest.MonkeyPatch) -> None:  # 7a
    # both checks dropped: the forks are stripped before validation looks
    orig_step, orig_streams = validate_module.step, validate_module.step_streams

    def bare(step: Any) -> Any:
        return dataclasses.replace(step, pre_forks=(), post_forks=())

    def bad_step(step: Any, ctx: Any) -> None:
        orig_step(step if ctx.padded_request_ids else bare(step), ctx)

    def bad_streams(table: Any, step: Any, padded: tuple[str, ...]) -> None:
        orig_streams(table, step if padded else bare(step), padded)

    mp.setattr(validate_module, "step", bad_step)
    mp.setattr(validate_module, "step_streams", bad_streams)
# -- issue 10 item 5, overlap scheduling (R41, R42)


def _promotion_skips_the_basis_check(mp: pytest.MonkeyPatch) -> None:
    # the running step committed otherwise (a fork copy failed), and the
    # staged plan is promoted all the same
    mp.setattr(stepping_module, "stale", lambda streams, staged: None)


def _preplan_built_from_pre_commit_lengths(mp: pytest.MonkeyPatch) -> None:
    # the basis is recorded, but the reservation and the views of a preplan
    # over the running step start from the lengths before it commits
    reserve = admission_module.reserve
    after_forks = Forks.lengths_after_pre_forks

    def bad_reserve(*args: Any, **kwargs: Any) -> Any:
        return reserve(*args[:6], None)

    def bad_after_forks(self: Forks, step: Any, padded: Any, created: Any,
                        base: Any = None) -> Any:
        return after_forks(self, step, padded, created, None)

    mp.setattr(admission_module, "reserve", bad_reserve)
    mp.setattr(Forks, "lengths_after_pre_forks", bad_after_forks)


def _claim_ignores_in_flight(stack: ExitStack) -> None:
    # the race the concurrency suite plants, reused as it is
    stack.enter_context(claim_ignores_marks())


def _remove_ignores_the_lease(mp: pytest.MonkeyPatch) -> None:  # issue 10
    orig = KVManager.remove_request

    def bad(self: KVManager, rid: str) -> None:
        self._table.leases.release(rid)  # as if remove never heard of the peer
        orig(self, rid)

    mp.setattr(KVManager, "remove_request", bad)


def _retrieve_skips_the_generation_check(mp: pytest.MonkeyPatch) -> None:  # issue 10
    # the registry lookup "cannot tell", before the copy and in it: the stale
    # publication is copied as if it were current
    mp.setattr(KVTransferManager, "source_current",
               staticmethod(lambda remote, rid, label, generation: None))


def _retrieve_checks_only_before_the_copy(mp: pytest.MonkeyPatch) -> None:  # issue 17
    # half a sequence lock: the generation read before the copy, never after
    # it, so a publisher that moves while the copy reads lands silently
    check = KVTransferManager._check_source

    def before_only(self: KVTransferManager, remote: Any, source: Any, when: str) -> None:
        if when == "before":
            check(self, remote, source, when)

    mp.setattr(KVTransferManager, "_check_source", before_only)


def _fork_overwrites_a_leased_stream(mp: pytest.MonkeyPatch) -> None:  # issue 17, R50
    mp.setattr(admission_module, "leased_fork_target", lambda *args: None)


def _patched(mutant: Callable[[pytest.MonkeyPatch], None]) -> Callable[[ExitStack], None]:
    return lambda stack: mutant(stack.enter_context(pytest.MonkeyPatch.context()))


MUTANTS: dict[str, Callable[[ExitStack], None]] = {
    "decode slot off by one": _patched(_decode_offset_off_by_one),
    "fork moves the length, not the pages": _patched(_fork_moves_length_not_pages),
    "claim ignores in-flight marks": _claim_ignores_in_flight,
    "commit does not bump generations": _patched(_commit_skips_generation),
    "reload loses a token": _patched(_reload_forgets_length),
    "clear_preplan keeps invented labels": _patched(_clear_preplan_keeps_new_labels),
    "a: write_kv after commit uses the last plan": _patched(_write_after_commit_uses_last_plan),
    "a: a second step is admitted": _patched(_second_step_admitted),
    "b: a fork from an absent source wipes the target": _patched(
        _fork_from_absent_source_wipes_target),
    "c: a failed reload keeps a page": _patched(_failed_reload_keeps_a_page),
    "c: a failed fork copy leaves its target torn": _patched(_failed_fork_leaves_target_torn),
    "d: admit ignores a running retrieve": _patched(_admit_ignores_running_retrieve),
    "d: an offload copy does not wait for the read": _patched(
        _offload_copy_does_not_wait_for_read),
    "e: a promoted preplan keeps stale view generations": _patched(
        _promoted_preplan_keeps_stale_generations),
    "t: truncate keeps the generation": _patched(_truncate_keeps_the_generation),
    "t: truncate frees one page too many": _patched(_truncate_frees_one_page_off(-1)),
    "t: truncate frees one page too few": _patched(_truncate_frees_one_page_off(+1)),
    "7a: a fork with no padded request passes": _patched(_fork_with_no_padded_request_passes),
    "lease: remove ignores the lease": _patched(_remove_ignores_the_lease),
    "lease: a retrieve skips the generation check": _patched(
        _retrieve_skips_the_generation_check),
    "lease: a retrieve checks the publisher only before its copy": _patched(
        _retrieve_checks_only_before_the_copy),
    "lease: a fork overwrites a leased stream": _patched(_fork_overwrites_a_leased_stream),
    "overlap: promotion skips the committed-as-admitted check": _patched(
        _promotion_skips_the_basis_check),
    "overlap: the staged plan is built from pre-commit lengths": _patched(
        _preplan_built_from_pre_commit_lengths),
}


BUDGET = settings(
    max_examples=100, stateful_step_count=50, derandomize=True, database=None,
    deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck),
)
# each plant must be found within half the budget the clean tree passes: a
# margin, so that a change to the rules' mix does not silently lose one
# (issue 17). Derandomized, and the draws depend on nothing but the library's
# source (tests/support/preload.py), so in any order and any selection.
HALF = settings(BUDGET, max_examples=BUDGET.max_examples // 2)
# the nightly-only plants (below): found there, with the time nightly has
NIGHTLY_BUDGET = settings(BUDGET, max_examples=4 * BUDGET.max_examples)


# the first round's six run nightly (CI's 15 minutes); each blind spot's in CI
FIRST_ROUND = {name for name in MUTANTS if ":" not in name}
# found by lockstep only past the CI budget (a fork fault of the running step
# under a staged preplan is rare among ~30 rules); in CI the unit test
# test_overlap_preplan.py::test_promotion_refuses_a_preplan_the_running_step_did_not_leave
# fails on it
NIGHTLY_ONLY = FIRST_ROUND | {"overlap: promotion skips the committed-as-admitted check"}
# found within the full budget the control passes, not within half: the draws
# follow the library's source, and the one model's (issue 27) moved d's
# finding past the half-way mark, follow_tokens' (S33, issue 28) e's, t's
# and c's; the margin is lost for them, the check is not
FULL_BUDGET_ONLY = {"d: an offload copy does not wait for the read",
                    "t: truncate frees one page too many", "c: a failed reload keeps a page",
                    "e: a promoted preplan keeps stale view generations",
                    "b: a fork from an absent source wipes the target",
                    "lease: a fork overwrites a leased stream",
                    "t: truncate frees one page too few", "t: truncate keeps the generation"}


@pytest.fixture(autouse=True)
def lifecycle_scope(monkeypatch: pytest.MonkeyPatch) -> None:
    # these mutants are of the step pipeline and offload phases, their budgets
    # measured with the prefix cache off; the shipped scope's seams have their
    # own plants (tests/conformance/test_interaction_plants.py). In the
    # shipped scope the lockstep's draws move (two of them went unfound)
    monkeypatch.setattr(Lockstep, "scope", PLAIN_SCOPE)


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.nightly) if name in NIGHTLY_ONLY else name
    for name in sorted(MUTANTS)])
def test_lockstep_finds_mutant(name: str) -> None:
    with ExitStack() as stack:
        MUTANTS[name](stack)
        with pytest.raises(BaseException) as found:  # any failure of the suite counts
            run_state_machine_as_test(
                Lockstep, settings=NIGHTLY_BUDGET if name in NIGHTLY_ONLY
                else BUDGET if name in FULL_BUDGET_ONLY else HALF)
    assert not isinstance(found.value, KeyboardInterrupt)


@pytest.mark.slow
def test_unmutated_kvref_passes_the_same_budget() -> None:
    """The control: with no mutant the same run passes, so each detection above
    is the mutant's doing, not a harness failure that any run would hit."""
    run_state_machine_as_test(Lockstep, settings=BUDGET)
