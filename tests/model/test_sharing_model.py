"""The stream-level shared-pages model (kvref_model.sharing): each action's result,
refusal and misuse in hand-made states, the bounded checker at its default
scope, and the symmetry reduction."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvref_model.pages import Key
from kvref_model.search import Search, loads
from kvref_model.sharing import (
    ACTIONS,
    ARG,
    STEP,
    TOKENS,
    UNKNOWN,
    Action,
    AllocationFailed,
    Append,
    CachePrefix,
    Count,
    Fork,
    MatchPrefix,
    Misuse,
    NumFree,
    Offload,
    Ok,
    Reclaimable,
    Refused,
    Reload,
    Remove,
    Reset,
    ResetPrefixCache,
    ResetRefused,
    Result,
    Scope,
    SharingModel,
    State,
    Stream,
    Truncate,
    variant,
)
from kvref_model.sharing_check import SALTED, SCOPE, Canon, calls, check, make_spec
from kvref_model.sharing_invariants import INTERESTING, NEEDS_TWO_SALTS, violations

SMALL = Scope(pages=4, page_size=2, alphabet=2, labels=2, salts=("a", "a"), max_len=8)


def run(m: SharingModel, *actions: Action, s: State | None = None
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


def last(m: SharingModel, *actions: Action, s: State | None = None) -> tuple[Result, State]:
    rs, n = run(m, *actions, s=s)
    return rs[-1], n


def reads(m: SharingModel, s: State, rid: int, label: int) -> tuple[int | None, ...]:
    h, ps = m.holder(rid, label), m.scope.page_size
    st = s.streams[h]
    assert st is not None
    return tuple(s.slots[s.table(h)[i // ps] - 1][i % ps] for i in range(st.n))


def unchanged(m: SharingModel, s: State, a: Action, want: Result) -> None:
    r, n = m.step(s, a)
    assert r == want
    assert n == s


M = SharingModel(SMALL)


# ----------------------------------------------------------------- append


def test_append_writes_and_reads_back() -> None:
    r, s = last(M, Append(0, 0, (1, 0, 1)))
    assert r == Ok()
    assert reads(M, s, 0, 0) == (1, 0, 1)
    assert s.table(0) == (1, 2)  # blank pages first, in order
    assert M.num_free(s) == 2


def test_append_short_of_pages_is_refused_and_changes_nothing() -> None:
    _, s = run(M, Append(0, 0, (0,) * 6))  # 3 of 4 pages
    unchanged(M, s, Append(0, 1, (0,) * 4), AllocationFailed(1))
    # the copy-on-write page counts too: a shared part page, no page free
    _, s = run(M, Append(0, 0, (0, 1)), Fork(0, 0, 1), Truncate(0, 1, 1),
               Append(1, 0, (0,) * 6))
    assert M.num_free(s) == 0
    unchanged(M, s, Append(0, 1, (0,)), AllocationFailed(1))
    unchanged(M, s, Append(0, 1, (0, 0, 0)), AllocationFailed(2))


def test_append_copies_a_shared_page_first() -> None:
    _, s = run(M, Append(0, 0, (0, 1)), Fork(0, 0, 1), Truncate(0, 1, 1))
    p = s.table(0)[0]
    assert s.table(1) == (p,) and s.pool.page(p).holders == {0, 1}
    r, s = last(M, Append(0, 1, (0,)), s=s)
    assert r == Ok()
    assert s.table(0) == (p,) and s.table(1) != (p,)  # a private copy
    assert reads(M, s, 0, 0) == (0, 1) and reads(M, s, 0, 1) == (0, 0)
    assert s.pool.page(p).holders == {0}


def test_append_copies_a_registered_page_it_holds_alone() -> None:
    _, s = run(M, Append(0, 0, (0, 1)), CachePrefix(0, 0, (0, 1)), Truncate(0, 0, 1))
    p = s.table(0)[0]
    r, s = last(M, Append(0, 0, (0,)), s=s)
    assert r == Ok() and s.table(0)[0] != p
    assert s.pool.lru == (p,)  # the cached page went free-cached, untouched
    assert s.slots[p - 1] == (0, 1)


def test_append_reuses_spare_pages_and_evicts_least_recent_cached() -> None:
    _, s = run(M, Append(0, 0, (0, 0, 1, 1)), Reset(0, False))
    assert s.table(0) == (1, 2) and M.num_free(s) == 2  # spare, private
    _, s = last(M, Append(0, 0, (1, 1, 0, 0)), s=s)
    assert s.table(0) == (1, 2) and M.num_free(s) == 2  # no allocation
    # two cached pages (tail first: page 2 then 1 queue), the blank ones go first
    _, s = run(M, CachePrefix(0, 0, (1, 1, 0, 0)), Remove(0), s=s)
    assert s.pool.lru == (2, 1) and s.pool.blank == (3, 4)
    _, s = run(M, Append(1, 0, (0,) * 6), s=s)
    assert s.table(2) == (3, 4, 2)  # blank, blank, then the suffix page evicted
    assert s.pool.page(2).key is None and s.pool.lru == (1,)


def test_append_to_an_unknown_label_is_a_misuse() -> None:
    unchanged(M, M.init(), Append(0, 5, (0,)), Misuse(UNKNOWN))
    unchanged(M, M.init(), Append(0, 0, (7,)), Misuse(ARG))


# ------------------------------------------------------------------- fork


def test_fork_shares_full_pages_and_copies_the_part_page() -> None:
    _, s = run(M, Append(0, 0, (0, 1, 1)))
    r, s = last(M, Fork(0, 0, 1), s=s)
    assert r == Ok()
    full, part = s.table(0)
    assert s.table(1)[0] == full and s.table(1)[1] != part
    assert s.pool.page(full).holders == {0, 1} and s.pool.page(part).holders == {0}
    assert reads(M, s, 0, 1) == (0, 1, 1)


def test_fork_of_whole_pages_holds_no_new_page() -> None:
    _, s = run(M, Append(0, 0, (0, 1, 1, 0)))
    r, n = last(M, Fork(0, 0, 1), s=s)
    assert r == Ok() and n.table(1) == n.table(0) and M.num_free(n) == M.num_free(s)


class Reserving(SharingModel):
    """A fork that first holds private pages for the source's whole length,
    as a copying fork's admission reserves, then frees the surplus."""

    FORK_RESERVES_TARGET_LENGTH = True


def test_fork_reserves_the_targets_length_first_or_only_the_copy() -> None:
    # every page held: the source's three full pages, another request's one
    acts = (Append(0, 0, (0,) * 6), Append(1, 0, (1,)), Fork(0, 0, 1))
    reserving = Reserving(SMALL)
    _, s = run(reserving, *acts[:2])
    unchanged(reserving, s, acts[2], AllocationFailed(3))  # as a copying fork's admission
    rs, n = run(M, *acts)
    assert rs[-1] == Ok() and n.table(1) == n.table(0)
    # the same table either way, where both succeed; the reserved pages come back
    # blank, and a cached page among them lost its key
    acts = (Append(0, 0, (0, 1)), CachePrefix(0, 0, (0, 1)), Remove(0),
            Append(0, 0, (1, 1, 0)), Fork(0, 0, 1))
    (*_, r1), a = run(reserving, *acts)
    (*_, r2), b = run(M, *acts)
    assert r1 == r2 == Ok() and a.table(1) == b.table(1)
    assert not a.pool.lru and len(b.pool.lru) == 1


def test_the_checker_passes_with_forks_that_reserve_the_whole_length() -> None:
    rep = check(Reserving(replace(SCOPE, depth=4)))
    assert rep.complete and not rep.violations, rep.violations


def test_fork_short_of_pages_is_refused() -> None:
    _, s = run(M, Append(0, 0, (0,) * 7))  # every page held, a part page last
    unchanged(Reserving(SMALL), s, Fork(0, 0, 1), AllocationFailed(4))  # whole length
    unchanged(M, s, Fork(0, 0, 1), AllocationFailed(1))  # only the copy's page


def test_fork_reuses_the_targets_private_pages_and_drops_its_shared_ones() -> None:
    # the target holds a page it shares (a hit) and two private ones; no page free
    _, s = run(M, Append(1, 1, (1, 1)), CachePrefix(1, 1, (1, 1)),
               MatchPrefix(0, 1, (1, 1, 0)), Append(0, 1, (0, 0, 0)),
               Append(0, 0, (0,)))
    cached, own = s.table(3)[0], s.table(1)[1:]
    assert s.table(1)[0] == cached and M.num_free(s) == 0
    r, n = last(M, Fork(0, 0, 1), s=s)
    assert r == Ok()
    assert n.pool.page(cached).holders == {3}  # dropped
    assert n.table(1) == own  # the copy lands in its first own page, the other spare
    assert reads(M, n, 0, 1) == (0,)


def test_fork_keeps_the_targets_high_water_mark_and_frees_the_surplus() -> None:
    _, s = run(M, Append(0, 1, (1, 1, 1)), Append(0, 0, (0, 1)))
    a, b = s.table(1)
    r, n = last(M, Fork(0, 0, 1), s=s)
    assert r == Ok()
    # the source's full page, then one of its own pages kept spare; the other freed
    assert n.table(1) == (s.table(0)[0], a) and n.pool.blank[-1] == b
    assert M.num_free(n) == M.num_free(s) + 1


def test_fork_misuses() -> None:
    # no source (R20): nothing copied; the step named both ends, so both exist
    r, n = last(M, Fork(0, 0, 1), s=M.init())
    assert r == Ok() and n.streams[0] == n.streams[1] == Stream() and not n.table(1)
    _, s = run(M, Append(0, 0, (0,)))
    unchanged(M, s, Fork(0, 0, 0), Misuse(STEP))
    unchanged(M, s, Fork(0, 0, 9), Misuse(UNKNOWN))


def test_fork_of_an_empty_source_empties_the_target() -> None:
    _, s = run(M, Append(0, 0, (0,)), Append(0, 1, (1, 1, 1)), Truncate(0, 0, 0))
    r, n = last(M, Fork(0, 0, 1), s=s)
    assert r == Ok() and n.streams[1] is not None and n.streams[1].n == 0
    assert len(n.table(1)) == 2  # spare, private


# --------------------------------------------------------------- truncate


def test_truncate_results_and_misuses() -> None:
    _, s = run(M, Append(0, 0, (0, 1, 1)))
    unchanged(M, s, Truncate(0, 0, 4), Misuse(ARG))
    unchanged(M, s, Truncate(0, 0, -1), Misuse(ARG))
    unchanged(M, s, Truncate(0, 0, 3), Count(0))
    unchanged(M, s, Truncate(0, 1, 0), Misuse(UNKNOWN))
    r, n = last(M, Truncate(0, 0, 1), s=s)
    assert r == Count(1) and len(n.table(0)) == 1


def test_truncate_counts_pages_freed_not_released_and_cuts_the_chain() -> None:
    _, s = run(M, Append(0, 0, (0, 1, 1, 0)), CachePrefix(0, 0, (0, 1, 1, 0)),
               Fork(0, 0, 1))
    r, n = last(M, Truncate(0, 0, 1), s=s)
    assert r == Count(0)  # the released page is the fork's too
    st = n.streams[0]
    assert st is not None and st.chain == ()
    r, n = last(M, Truncate(0, 1, 0), s=n)
    assert r == Count(1)  # its last reference: free-cached (registered)
    assert len(n.pool.lru) == 1


# ------------------------------------------------------------ reset, remove


def test_reset_keeps_only_private_pages_as_spare() -> None:
    _, s = run(M, Append(0, 0, (0, 1, 1)), CachePrefix(0, 0, (0, 1)))
    full, part = s.table(0)
    r, n = last(M, Reset(0, False), s=s)
    assert r == Ok() and n.table(0) == (part,) and n.pool.lru == (full,)
    r, n = last(M, Reset(0, True), s=s)
    assert r == Ok() and n.table(0) == () and M.num_free(n) == 4
    unchanged(M, M.init(), Reset(1, False), Misuse(UNKNOWN))


def test_remove_releases_tail_first_and_is_idempotent() -> None:
    _, s = run(M, Append(0, 0, (0, 1, 1, 0)), CachePrefix(0, 0, (0, 1, 1, 0)))
    r, n = last(M, Remove(0), s=s)
    assert r == Ok() and n.streams[0] is None
    assert n.pool.lru == s.table(0)[::-1]  # the prefix is evicted last
    unchanged(M, n, Remove(0), Ok())


# ----------------------------------------------------------- the prefix cache


def test_cache_prefix_registers_full_pages_once() -> None:
    _, s = run(M, Append(0, 0, (0, 1, 1)))
    r, n = last(M, CachePrefix(0, 0, (0, 1, 1)), s=s)
    assert r == Count(1)  # the part page is not registered
    assert n.pool.page(n.table(0)[0]).key is not None
    assert n.pool.page(n.table(0)[1]).key is None
    unchanged(M, n, CachePrefix(0, 0, (0, 1)), Count(0))


def test_cache_prefix_misuses() -> None:
    _, s = run(M, Append(0, 0, (0, 1)), CachePrefix(0, 0, (0, 1)))
    unchanged(M, s, CachePrefix(0, 0, (0, 1, 0)), Misuse(ARG))  # uncommitted
    unchanged(M, s, CachePrefix(0, 0, (1, 1)), Misuse(TOKENS))  # disagrees with the chain
    unchanged(M, s, CachePrefix(0, 1, ()), Misuse(UNKNOWN))


def test_cache_prefix_deduplicates_and_keeps_the_page() -> None:
    _, s = run(M, Append(0, 0, (0, 1)), CachePrefix(0, 0, (0, 1)), Append(1, 0, (0, 1)))
    r, n = last(M, CachePrefix(1, 0, (0, 1)), s=s)
    assert r == Count(0)  # S23: the chain goes on, but nothing new is findable
    mine = n.table(2)[0]
    assert n.pool.page(mine).key is None and n.pool.page(mine).holders == {2}
    st = n.streams[2]
    assert st is not None and st.chain == n.streams[0].chain  # type: ignore[union-attr]


def test_match_prefix_attaches_whole_pages_capped_before_the_last_token() -> None:
    _, s = run(M, Append(0, 0, (0, 1, 1, 0)), CachePrefix(0, 0, (0, 1, 1, 0)))
    r, n = last(M, MatchPrefix(1, 0, (0, 1, 1, 0)), s=s)
    assert r == Count(2) and n.table(2) == s.table(0)[:1]
    r, n = last(M, MatchPrefix(1, 0, (0, 1, 1, 0, 1)), s=s)
    assert r == Count(4) and n.table(2) == s.table(0)
    assert reads(M, n, 1, 0) == (0, 1, 1, 0)
    r, n = last(M, MatchPrefix(1, 0, (1, 1, 1)), s=s)
    assert r == Count(0) and n.streams[2] is not None  # a miss still creates the stream


def test_match_prefix_keeps_spare_pages_after_the_hit() -> None:
    _, s = run(M, Append(0, 0, (0, 1)), CachePrefix(0, 0, (0, 1)), Remove(0),
               Append(1, 0, (1, 1)), Reset(1, False))
    spare = s.table(2)
    r, n = last(M, MatchPrefix(1, 0, (0, 1, 0)), s=s)
    assert r == Count(2) and n.table(2)[1:] == spare
    assert n.pool.lru == ()  # the hit took the page out of the LRU


def test_match_prefix_on_a_stream_that_is_not_empty_is_a_misuse() -> None:
    _, s = run(M, Append(0, 0, (0, 1)), CachePrefix(0, 0, (0, 1)), Append(0, 1, (1,)))
    unchanged(M, s, MatchPrefix(0, 1, (0, 1, 0)), Misuse(ARG))
    unchanged(M, s, MatchPrefix(0, 9, (0, 1, 0)), Misuse(UNKNOWN))


def test_another_salt_never_hits() -> None:
    m = SharingModel(replace(SMALL, salts=("a", "b")))
    _, s = run(m, Append(0, 0, (0, 1)), CachePrefix(0, 0, (0, 1)))
    r, _ = last(m, MatchPrefix(1, 0, (0, 1, 0)), s=s)
    assert r == Count(0)
    r, _ = last(m, MatchPrefix(0, 1, (0, 1, 0)), s=s)
    assert r == Count(0)  # nor does another label (S25)
    r, _ = last(m, Remove(0), MatchPrefix(0, 0, (0, 1, 0)), s=s)
    assert r == Count(2)  # the same salt and label: a hit, after the request is gone


def test_reset_prefix_cache_refused_while_a_stream_is_on_the_host() -> None:
    """S30 (issue 27, defect 3): no page is held, but the host copy holds KV
    from before the reset, which a reload and a cache_prefix would key."""
    _, s = run(M, Append(0, 0, (0, 1, 0)), Offload(0))
    assert not any(pg.holders for pg in s.pool.pages)
    unchanged(M, s, ResetPrefixCache(), ResetRefused(0, 1))
    r, n = last(M, Reload(0), Remove(0), ResetPrefixCache(), s=s)
    assert r == Count(0) and not n.pool.lru
    # the rule off: the reset is accepted, and Q12 flags the host copy it leaves
    bad = variant("RESET_REFUSED_WHILE_OFFLOADED")(M.scope)
    r, n = bad.step(s, ResetPrefixCache())
    assert r == Count(0) and "Q12" in {i for i, _ in violations(bad, n, ResetPrefixCache(),
                                                                  r, s)}


def test_reset_prefix_cache_refused_while_held() -> None:
    _, s = run(M, Append(0, 0, (0, 1)), CachePrefix(0, 0, (0, 1)))
    unchanged(M, s, ResetPrefixCache(), ResetRefused(1))
    r, n = last(M, Remove(0), ResetPrefixCache(), s=s)
    assert r == Count(1) and n.pool.blank and not n.pool.lru
    assert all(sl == (None, None) for sl in n.slots)


# ------------------------------------------------------------------ queries


def test_num_free_and_reclaimable() -> None:
    _, s = run(M, Append(0, 0, (0, 1, 1)), CachePrefix(0, 0, (0, 1)), Fork(0, 0, 1),
               MatchPrefix(1, 0, (0, 1, 0)))
    unchanged(M, s, NumFree(), Count(1))
    # request 0 holds three pages; the shared full page is request 1's too
    unchanged(M, s, Reclaimable(0), Count(2))
    unchanged(M, s, Reclaimable(1), Count(0))
    _, n = run(M, Remove(1), s=s)
    unchanged(M, n, Reclaimable(0), Count(3))
    unchanged(M, M.init(), Reclaimable(0), Misuse(UNKNOWN))


# -------------------------------------------------------------- the checker


def test_bounded_check_finds_no_violation_and_covers_everything() -> None:
    # depth 5 here (16,800 states, 7 s); the CLI's default, depth 6, is 77,001
    rep = check(SharingModel(replace(SCOPE, depth=5)))
    assert rep.complete and not rep.violations, rep.violations
    assert rep.states > 10_000
    assert all(rep.fired[cls.__name__] for cls in ACTIONS), rep.fired
    missing = {name for name in INTERESTING if not rep.interesting[name]}
    assert missing == set(NEEDS_TWO_SALTS), missing


def test_two_salts_share_nothing_across_requests() -> None:
    rep = check(SharingModel(replace(SALTED, depth=4)))
    assert rep.complete and not rep.violations, rep.violations
    assert all(rep.interesting[name] for name in NEEDS_TWO_SALTS)
    assert not rep.interesting["hit on a page another request holds"]


def test_symmetry_reduction_keeps_every_verdict_and_saves_states() -> None:
    small = replace(SCOPE, depth=3)
    reduced, full = check(SharingModel(small)), check(SharingModel(small), reduce=False)
    assert not reduced.violations and not full.violations
    assert reduced.states < full.states
    assert {k for k, v in reduced.interesting.items() if v} == {
        k for k, v in full.interesting.items() if v}


def test_canonical_key_is_equal_exactly_up_to_renaming() -> None:
    canon = Canon(SMALL)
    _, s = run(M, Append(0, 0, (0, 1, 1)), Fork(0, 0, 1))
    # the same in another request of the salt, tokens renamed, other page ids
    # (labels are not interchangeable: each keys its pages, S25)
    _, t = run(M, Append(0, 0, (0,)), Remove(0), Append(1, 0, (1, 0, 0)), Fork(1, 0, 1))
    assert s.table(0) != t.table(2)
    assert canon(s) == canon(t)
    _, u = run(M, Append(0, 0, (0, 1, 1)), Fork(0, 0, 1), Truncate(0, 1, 2))
    assert canon(s) != canon(u)


def test_every_call_has_a_result_and_a_refusal_changes_nothing() -> None:
    m = SharingModel(replace(SCOPE, depth=3))
    for _, data in Search(make_spec(m)).run():
        s = loads(data)
        for a in calls(m, s):
            r, n = m.step(s, a)
            assert isinstance(r, Ok | Count | AllocationFailed | ResetRefused | Misuse | Refused)
            if isinstance(r, Misuse | AllocationFailed | ResetRefused):
                assert n == s, (a, r)


@pytest.mark.parametrize("a", [
    Append(2, 0, (0,)), Fork(2, 0, 1), Truncate(2, 0, 0), Reset(2, True), Remove(2),
    CachePrefix(2, 0, ()), MatchPrefix(2, 0, ()), Reclaimable(2), Truncate(0, 3, 0),
])
def test_out_of_scope_names_are_unknown_or_ignored(a: Action) -> None:
    r, n = M.step(M.init(), a)
    assert r in (Misuse(UNKNOWN), Ok()) and n == M.init()


def test_keys_are_chained_under_the_requests_salt_and_the_label() -> None:
    k = M.keys(1, 0, (0, 1, 1))
    assert k == (Key(None, (0, 1), (("salt", "a"), ("label", "0"))),)
    assert M.keys(1, 1, (0, 1)) != k  # another label: another key (S25)
