"""The sliding-window retention model (kvref_model.retention): each action's result,
refusal and misuse in hand-made states, the bounded checker at its default
scope, and the symmetry reduction."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvref_model.retention import (
    ACTIONS,
    ARG,
    RELEASED,
    STEP,
    UNAVAILABLE,
    UNKNOWN,
    Action,
    AllocationFailed,
    Append,
    CachePrefix,
    Count,
    Fork,
    MatchPrefix,
    Misuse,
    Offload,
    Ok,
    Refused,
    Reload,
    Remove,
    Result,
    RetentionModel,
    Scope,
    State,
    Truncate,
    variant,
)
from kvref_model.retention_check import SCOPE, TWO, check
from kvref_model.retention_invariants import INTERESTING, violations

# labels: 0 and 1 windowed (W = 3, forks between them), 2 full attention
M = RetentionModel(Scope(pages=6, page_size=2, windows=(3, 3, None), max_len=9))


def run(m: RetentionModel, *actions: Action, s: State | None = None
        ) -> tuple[list[Result], State]:
    """Step through `actions`, checking every invariant on the way."""
    s = m.init() if s is None else s
    out = []
    for a in actions:
        r, n = m.step(s, a)
        bad = violations(m, n, a, r, s)
        assert not bad, (a, r, bad)
        out.append(r)
        s = n
    return out, s


def last(m: RetentionModel, *actions: Action, s: State | None = None) -> tuple[Result, State]:
    rs, n = run(m, *actions, s=s)
    return rs[-1], n


def unchanged(m: RetentionModel, s: State, a: Action, want: Result) -> None:
    r, n = m.step(s, a)
    assert r == want
    assert n is s


def grow(label: int, n: int, rid: int = 0) -> list[Action]:
    """Appends of one token each: `n` tokens on (rid, label)."""
    return [Append(rid, label, (0,))] * n


def reads(m: RetentionModel, s: State, h: int) -> list[object]:
    st, ps = s.streams[h], m.scope.page_size
    assert st is not None
    return [None if (p := st.table[i // ps]) is None else s.slots[p - 1][i % ps]
            for i in range(st.n)]


def free(s: State) -> int:
    return len(s.pool.blank) + len(s.pool.lru)


# ------------------------------------------------------------- append


def test_window_start_and_bound() -> None:
    assert [M.window_start(0, n) for n in range(7)] == [0, 0, 0, 0, 1, 2, 3]
    assert M.window_start(2, 9) == 0  # full attention
    assert M.bound(0) == 3 and M.bound(2) is None


def test_a_commit_releases_the_pages_wholly_before_the_window() -> None:
    r, s = last(M, *grow(0, 4))  # window [1, 4): page 0 holds token 1, stays
    st = s.streams[0]
    assert r == Ok() and st is not None and st.released == 0 and None not in st.table
    r, s = last(M, Append(0, 0, (0,)), s=s)  # window [2, 5): page 0 goes
    st = s.streams[0]
    assert r == Ok() and st is not None
    assert (st.released, st.position, st.table[0]) == (2, 5, None)
    assert free(s) == 6 - 2  # counted as free at once
    assert reads(M, s, 0) == [None, None, (2, 0), (3, 0), (4, 0)]


def test_one_commit_may_release_several_pages_and_a_full_stream_none() -> None:
    _, s = run(M, Append(0, 0, (0,)), Append(0, 0, (0, 0)), Append(0, 0, (0, 0)),
               Append(0, 0, (0, 0)))  # n = 7: window [4, 7)
    st = s.streams[0]
    assert st is not None and st.released == 4 and st.table[:2] == (None, None)
    _, s = run(M, *grow(2, 7), s=s)
    full = s.streams[2]
    assert full is not None and full.released == 0 and None not in full.table


def test_append_short_of_pages_is_refused_and_changes_nothing() -> None:
    _, s = run(M, *grow(2, 9), *grow(0, 3))  # 5 + 2 pages: 6 usable, so one short
    assert free(s) == 0
    r, n = M.step(s, Append(0, 1, (0,)))
    assert r == AllocationFailed(1) and n is s


def test_append_misuses_change_nothing() -> None:
    s = M.init()
    unchanged(M, s, Append(0, 3, (0,)), Misuse(UNKNOWN))
    unchanged(M, s, Append(1, 0, (0,)), Misuse(UNKNOWN))
    unchanged(M, s, Append(0, 0, (1,)), Misuse(ARG))  # not a token id of the scope
    unchanged(M, s, Append(0, 0, ()), Ok())  # a zero-span segment


def test_a_window_release_of_a_shared_page_drops_only_its_reference() -> None:
    _, s = run(M, *grow(0, 4), Fork(0, 0, 1))  # page 0 and 1 full: shared
    src = s.streams[0]
    assert src is not None and (shared := src.table[0]) is not None
    assert s.pool.page(shared).holders == {0, 1}
    _, s = run(M, Append(0, 1, (0,)), s=s)  # label 1's window passes page 0
    assert s.pool.page(shared).holders == {0}  # label 0 still reads it
    assert reads(M, s, 0) == [(i, 0) for i in range(4)]


def test_append_copies_a_shared_last_page_first() -> None:
    _, s = run(M, *grow(0, 4), Fork(0, 0, 1), Truncate(0, 1, 3))
    st = s.streams[1]
    assert st is not None and st.table[1] == s.streams[0].table[1]  # type: ignore[union-attr]
    _, s = run(M, Append(0, 1, (0,)), s=s)
    st, src = s.streams[1], s.streams[0]
    assert st is not None and src is not None and st.table[1] != src.table[1]
    assert reads(M, s, 1) == [(i, 0) for i in range(4)]


# ------------------------------------------------------------- fork


def test_fork_inherits_the_released_prefix_shares_full_pages_and_copies_the_part() -> None:
    _, s = run(M, *grow(0, 5))  # released 2; slots: None, [2, 3], [4]
    r, s = last(M, Fork(0, 0, 1), s=s)
    src, dst = s.streams[0], s.streams[1]
    assert r == Ok() and src is not None and dst is not None
    assert (dst.released, dst.position, dst.tokens) == (2, 5, src.tokens)
    assert dst.table[0] is None and dst.table[1] == src.table[1]
    assert dst.table[2] != src.table[2] and dst.table[2] is not None
    assert reads(M, s, 1)[2:] == [(2, 0), (3, 0), (4, 0)]


def test_fork_misuses_and_refusal() -> None:
    _, s = run(M, *grow(0, 3))
    unchanged(M, s, Fork(0, 0, 0), Misuse(STEP))
    unchanged(M, s, Fork(0, 1, 0), Misuse(UNKNOWN))  # no source stream
    unchanged(M, s, Fork(0, 0, 2), Misuse(ARG))  # another window
    unchanged(M, s, Fork(0, 0, 3), Misuse(UNKNOWN))
    _, s = run(M, *grow(2, 8), s=s)  # 2 + 4 pages: nothing free for the part page
    unchanged(M, s, Fork(0, 0, 1), AllocationFailed(1))


def test_fork_onto_an_existing_target_releases_what_it_held() -> None:
    _, s = run(M, *grow(0, 2), *grow(1, 3))
    r, s = last(M, Fork(0, 0, 1), s=s)
    assert r == Ok() and s.streams[1] is not None and s.streams[1].n == 2
    assert free(s) == 6 - 1  # the shared full page only


UNSHARED = RetentionModel(replace(M.scope, sharing=False))


def test_a_fork_without_sharing_copies_only_the_retained_slots() -> None:
    """Issue 27, defect 1 in the model: the copy needs a page per retained
    slot, none for the released ones."""
    m = UNSHARED
    _, s = run(m, *grow(0, 7))  # released 4: slots None, None, [4, 5], [6]
    before = free(s)
    r, s = last(m, Fork(0, 0, 1), s=s)
    src, dst = s.streams[0], s.streams[1]
    assert r == Ok() and src is not None and dst is not None
    assert (dst.released, dst.position, dst.tokens) == (4, 7, src.tokens)
    assert dst.table[:2] == (None, None) and before - free(s) == 2
    assert not set(dst.table[2:]) & set(src.table[2:])  # copies: nothing shared
    assert reads(m, s, 1)[4:] == [(4, 0), (5, 0), (6, 0)]
    _, s2 = run(m, *grow(0, 7), *grow(2, 8))  # 2 + 4 pages held: none free
    unchanged(m, s2, Fork(0, 0, 1), AllocationFailed(2))


def test_a_fork_without_sharing_reuses_the_targets_pages() -> None:
    """Defect 2's shape: a target that released more than its source holds
    keeps its pages for the copy and takes only the ones it lacks."""
    m = UNSHARED
    _, s = run(m, *grow(1, 9), *grow(0, 3))  # target: slots 3, 4; source: 0, 1
    held = [p for p in s.streams[1].table if p is not None]  # type: ignore[union-attr]
    before = free(s)
    r, s = last(m, Fork(0, 0, 1), s=s)
    dst = s.streams[1]
    assert r == Ok() and dst is not None and dst.released == 0
    assert list(dst.table) == held and free(s) == before  # its own two pages, reused
    assert reads(m, s, 1) == [(0, 0), (1, 0), (2, 0)]


def test_without_sharing_nothing_is_cached_or_hit() -> None:
    m = UNSHARED
    _, s = run(m, *grow(2, 4))
    unchanged(m, s, CachePrefix(0, 2), Count(0))
    unchanged(m, s, MatchPrefix(0, 1, (0, 0, 0)), Count(0))


# ------------------------------------------------------------- truncate


def test_truncate_results_and_misuses() -> None:
    _, s = run(M, *grow(2, 5))
    unchanged(M, s, Truncate(0, 2, -1), Misuse(ARG))
    unchanged(M, s, Truncate(0, 2, 6), Misuse(ARG))
    unchanged(M, s, Truncate(0, 1, 0), Misuse(UNKNOWN))
    unchanged(M, s, Truncate(0, 2, 5), Count(0))
    r, s = last(M, Truncate(0, 2, 2), s=s)
    assert r == Count(2) and s.streams[2] is not None and s.streams[2].position == 2


def test_truncate_cannot_reach_into_the_released_prefix() -> None:
    _, s = run(M, *grow(0, 6))  # released 2: the window of n' must start at >= 2
    unchanged(M, s, Truncate(0, 0, 4), Misuse(RELEASED))
    unchanged(M, s, Truncate(0, 0, 1), Misuse(RELEASED))  # below the released tokens
    r, s = last(M, Truncate(0, 0, 5), s=s)
    assert r == Count(0) and s.streams[0] is not None and s.streams[0].n == 5


# ------------------------------------------------------------- remove


def test_remove_releases_everything_and_is_idempotent() -> None:
    _, s = run(M, *grow(0, 5), Fork(0, 0, 1), *grow(2, 3))
    r, s = last(M, Remove(0), s=s)
    assert r == Ok() and free(s) == 6 and all(st is None for st in s.streams)
    unchanged(M, s, Remove(0), Ok())
    unchanged(M, s, Remove(7), Ok())


# ------------------------------------------------------------- offload / reload


def test_offload_moves_only_retained_pages_and_reload_brings_them_back() -> None:
    _, s = run(M, *grow(0, 7), *grow(2, 2))  # label 0: 2 retained pages; label 2: 1
    before = free(s)
    r, s = last(M, Offload(0), s=s)
    assert r == Count(3) and free(s) == before + 3
    st = s.streams[0]
    assert st is not None and st.offloaded and st.released == 4 and set(st.table) == {None}
    unchanged(M, s, Offload(0), Refused("NOTHING_ON_DEVICE"))
    for a in (Append(0, 0, (0,)), Fork(0, 0, 1), Truncate(0, 0, 7), CachePrefix(0, 2),
              MatchPrefix(0, 0, (0, 0, 0))):
        unchanged(M, s, a, Misuse(UNAVAILABLE))
    # label 1 held no page, so it was not offloaded: usable (W10: no hit)
    unchanged(M, s, MatchPrefix(0, 1, (0, 0, 0)), Count(0))
    r, s = last(M, Reload(0), s=s)
    assert r == Count(3)
    st = s.streams[0]
    assert st is not None and not st.offloaded and st.table[:2] == (None, None)
    assert reads(M, s, 0)[4:] == [(4, 0), (5, 0), (6, 0)]
    unchanged(M, s, Reload(0), Refused("NOTHING_ON_HOST"))


def test_offload_and_reload_refusals() -> None:
    s = M.init()
    unchanged(M, s, Offload(0), Refused("UNKNOWN_REQUEST"))
    unchanged(M, s, Reload(0), Refused("UNKNOWN_REQUEST"))
    _, s = run(M, Append(0, 2, ()), MatchPrefix(0, 2, (0,)))
    assert s == M.init()
    two = RetentionModel(Scope(pages=6, page_size=2, windows=(3, None), requests=2,
                               max_len=9))
    _, s = run(two, *grow(0, 3), Offload(0), *grow(1, 9, rid=1))  # 5 pages held
    unchanged(two, s, Reload(0), AllocationFailed(1))
    unchanged(two, s, Append(0, 0, (0,)), Misuse(UNAVAILABLE))  # the stream is away
    # its sibling held no page at the offload: it stays, and takes appends
    r, _ = two.step(s, Append(0, 1, (0,)))
    assert r == Ok()


# ------------------------------------------------------------- prefix cache


def test_a_full_label_registers_and_hits_a_windowed_one_never() -> None:
    _, s = run(M, *grow(0, 5), *grow(2, 5))
    unchanged(M, s, CachePrefix(0, 0), Count(0))  # W9: a windowed label registers nothing
    r, s = last(M, CachePrefix(0, 2), s=s)
    assert r == Count(2)
    unchanged(M, s, CachePrefix(0, 2), Count(0))  # once
    unchanged(M, s, CachePrefix(0, 1), Misuse(UNKNOWN))
    _, s = run(M, Remove(0), s=s)
    assert len(s.pool.lru) == 2  # the full label's pages, cached
    unchanged(M, s, MatchPrefix(0, 0, (0,) * 5), Count(0))  # W10
    r, s = last(M, MatchPrefix(0, 2, (0,) * 5), s=s)
    assert r == Count(4) and not s.pool.lru
    unchanged(M, s, MatchPrefix(0, 2, (0,) * 5), Misuse(ARG))  # not empty


def test_window_pages_never_reach_the_lru() -> None:
    _, s = run(M, *grow(2, 4), CachePrefix(0, 2), *grow(0, 7))
    assert set(s.pool.lru) == set()  # the full label still holds its pages
    _, s = run(M, Remove(0), s=s)
    assert len(s.pool.lru) == 2  # only the full label's cached prefix


# ------------------------------------------------------------- the checker


def test_bounded_check_finds_no_violation_and_covers_everything() -> None:
    rep = check(RetentionModel(SCOPE))
    assert not rep.violations, rep.violations
    assert rep.complete
    assert all(rep.fired[c.__name__] for c in ACTIONS)
    assert all(rep.interesting[name] for name in INTERESTING), rep.interesting


def test_two_requests_check_bounded() -> None:
    rep = check(RetentionModel(replace(TWO, depth=7)))
    assert not rep.violations, rep.violations


def test_symmetry_reduction_keeps_every_verdict_and_saves_states() -> None:
    scope = replace(SCOPE, depth=5)
    reduced, full = check(RetentionModel(scope)), check(RetentionModel(scope), reduce=False)
    assert not reduced.violations and not full.violations
    assert reduced.states < full.states
    for rule in ("RETIRE_WHOLE_PAGES_ONLY", "RELEASE_FROM_LIVE_SLOTS"):
        a = check(variant(rule)(scope))
        b = check(variant(rule)(scope), reduce=False)
        assert set(a.violations) == set(b.violations)


def test_scope_and_variant_validation() -> None:
    with pytest.raises(ValueError):
        Scope(windows=(0, None))
    with pytest.raises(ValueError):
        variant("NO_SUCH_RULE")
