"""The shared-pages model: the bounded checker finds no violation, every action
and interesting case arises, the symmetry reduction is sound, and every
call has a result in every state."""

from __future__ import annotations

from dataclasses import replace

from kvref_model.pages import (
    ACTIONS,
    AllocationFailed,
    Misuse,
    Page,
    PagesModel,
    ResetRefused,
    Scope,
    State,
)
from kvref_model.pages_check import SCOPE, Canon, calls, check, make_spec
from kvref_model.pages_invariants import INTERESTING
from kvref_model.search import Search, loads


def test_bounded_check_finds_no_violation_and_covers_everything() -> None:
    rep = check(PagesModel(SCOPE))
    assert rep.complete and not rep.violations
    assert rep.states > 1000
    assert all(rep.fired[cls.__name__] for cls in ACTIONS), rep.fired
    assert all(rep.interesting[name] for name in INTERESTING), rep.interesting


def test_symmetry_reduction_keeps_every_verdict_and_saves_states() -> None:
    small = replace(SCOPE, depth=5)
    reduced, full = check(PagesModel(small)), check(PagesModel(small), reduce=False)
    assert not reduced.violations and not full.violations
    assert reduced.states < full.states
    assert set(reduced.interesting) == set(full.interesting)


def test_canonical_key_is_equal_exactly_up_to_renaming() -> None:
    canon = Canon(Scope(pages=3, holders=2))
    s = State(pages=(Page(frozenset({0})), Page(), Page(frozenset({0, 1}))),
              blank=(2,), tables=((1, 3), (3,)))
    # pages 1 and 3 swapped, holders 0 and 1 swapped
    t = State(pages=(Page(frozenset({0, 1})), Page(), Page(frozenset({1}))),
              blank=(2,), tables=((1,), (3, 1)))
    assert canon(s) == canon(t)
    u = replace(s, tables=((3, 1), (3,)))  # another stream order: another state
    assert canon(s) != canon(u)


def test_every_call_has_a_result_and_a_refusal_changes_nothing() -> None:
    m = PagesModel(replace(SCOPE, depth=4))
    for _, data in Search(make_spec(m)).run():
        s = loads(data)
        for a in calls(m, s):
            r, n = m.step(s, a)
            if isinstance(r, Misuse | AllocationFailed | ResetRefused):
                assert n == s, (a, r)
