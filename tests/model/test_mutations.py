"""The checker must catch broken models, each with a trace of minimal length.

Each mutant is a realistic bug in one action.  The minimum lengths are
argued in the comments; BFS must find exactly that, never longer.
"""

from dataclasses import replace

from kvref_model.check import Report, explore
from kvref_model.core import (
    ClearPreplan,
    Model,
    OffloadAbandon,
    OffloadClaim,
    Result,
    Scope,
    State,
)
from kvref_model.reference import without

SCOPE = Scope(requests=2, labels=2, device_pages=3, host_pages=2, page_size=2, max_span=1,
              depth=7)


class ClaimIgnoresMarks(Model):
    """claim forgets R4: it does not look at the in-flight marks"""

    def do_OffloadClaim(self, s: State, a: OffloadClaim) -> tuple[Result, State]:
        unmarked = replace(s, streams=tuple((k, replace(v, in_flight=False)) for k, v in s.streams))
        r, n = super().do_OffloadClaim(unmarked, a)
        flags = {k: v.in_flight for k, v in s.streams}
        return r, replace(n, streams=tuple((k, replace(v, in_flight=flags[k]))
                                           for k, v in n.streams))


class AbandonKeepsHostCopy(Model):
    def do_OffloadAbandon(self, s: State, a: OffloadAbandon) -> tuple[Result, State]:
        r, n = super().do_OffloadAbandon(s, a)
        return r, replace(n, host=s.host)


# under R11 a preplan applies no fork, so there is no fork undo to forget:
# the mutant is planted in the model without R11 (forks applied at preplan)
class ClearForgetsForkUndo(without("R11")):  # type: ignore[misc]
    def do_ClearPreplan(self, s: State, a: ClearPreplan) -> tuple[Result, State]:
        if s.staged is not None:
            kept = tuple(u for u in s.staged.undo if u[1] is None)  # only invented labels
            s = replace(s, staged=replace(s.staged, undo=kept))
        return super().do_ClearPreplan(s, a)


def first_violation(model: Model) -> tuple[str, int, str]:
    rep = Report()
    for _ in explore(model, report=rep, traces=False):
        pass
    assert rep.violations, f"{type(model).__name__}: no violation found"
    (i, (_msg, trace)), *_ = sorted(rep.violations.items(), key=lambda x: len(x[1][1]))
    from kvref_model.check import render
    return i, len(trace), render(trace)


def test_kvref_model_passes_the_mutation_scope() -> None:
    rep = Report()
    for _ in explore(Model(replace(SCOPE, depth=4)), report=rep, traces=False):
        pass
    assert not rep.violations


def test_claim_ignoring_marks_is_caught_in_3() -> None:
    # ingest; admit (reserves a page, marks main); claim: nothing shorter
    # has a page to claim and a step in flight at once
    i, n, trace = first_violation(ClaimIgnoresMarks(SCOPE))
    assert (i, n) == ("I4", 3), trace


def test_abandon_keeping_host_copy_is_caught_in_5() -> None:
    # a claimable stream needs pages and no mark: ingest, retrieve; then
    # claim, copy (which waits for the retrieve to land), abandon
    i, n, trace = first_violation(AbandonKeepsHostCopy(SCOPE))
    assert (i, n) == ("I6", 5), trace


def test_clear_forgetting_fork_undo_is_caught_in_6() -> None:
    # the fork target must exist with tokens other than the source's before
    # the preplan: ingest, retrieve cfg, completion; preplan admit with the
    # pre-fork main->cfg, its plan (the fork), clear_preplan
    i, n, trace = first_violation(ClearForgetsForkUndo(SCOPE))
    assert (i, n) == ("I9", 6), trace
