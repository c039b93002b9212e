"""Hybrid models in the one model (`Scope.groups`, H1-H5 of specs/retention.md).

The checker explores a hybrid scope (one full group, one window group) with
every invariant on; each H rule switched off is shown to be found, by the
checker where a CI-sized scope reaches it, else by the short trace that
shows the defect it prevents (stated on the model's state; kvref's hybrid
config is run against the model by the lockstep layers, and its planted
hybrid bugs by tests/conformance/test_hybrid_plants.py)."""

from __future__ import annotations

from dataclasses import replace

from kvref_model import invariants as inv
from kvref_model.check import Report, explore
from kvref_model.core import (
    OFFLOADED,
    RESIDENT,
    Admit,
    CachePrefix,
    Commit,
    Count,
    Flag,
    FollowTokens,
    Freed,
    Ingest,
    MatchPrefix,
    Misuse,
    Model,
    OffloadClaim,
    OffloadCommit,
    OffloadCopy,
    Ok,
    Plan,
    Remove,
    Scope,
    Seg,
    State,
    Step,
    Write,
)

# one full group and one window group (W = 1), pages of one token: the
# smallest scope where a window releases, keys and hits
HYBRID = Scope(requests=2, labels=1, device_pages=3, host_pages=1, page_size=1, max_span=2,
               depth=6, sharing=True, groups=(None, 1), window_cache=True)
# room for a prompt of three tokens in both groups and a second request
ROOMY = Scope(requests=2, labels=1, device_pages=8, host_pages=0, page_size=1, max_span=3,
              depth=0, sharing=True, groups=(None, 1), window_cache=True)


def _without(rule: str) -> type[Model]:
    return type(f"Model_no_{rule}", (Model,), {rule: False})


def _run(m: Model, *actions: object) -> tuple[list[object], State]:
    s, out = m.init(), []
    for a in actions:
        r, s = m.step(s, a)  # type: ignore[arg-type]
        out.append(r)
    return out, s


def _prompt(rid: int, n: int) -> tuple[object, ...]:
    return (Admit(Step((Seg(rid, 0, n),), padded=(rid,))), Plan(), Write(), Commit())


def _violations(m: Model, s: State) -> list[tuple[str, str]]:
    return inv.violations(m, s)


def _check(model: Model) -> Report:
    rep = Report()
    list(explore(model, report=rep, traces=False, states=False))
    return rep


def test_the_checker_passes_a_hybrid_scope() -> None:
    rep = _check(Model(HYBRID))
    assert not rep.violations, rep.violations
    assert rep.states > 1000  # it went somewhere: depth 6 of the protocol


def test_a_hit_is_served_by_every_group() -> None:
    """H2: the window group serves the hit from the page its window reads at
    the hit point; the slots before it name no page; both attach 3 tokens."""
    m = Model(ROOMY)
    out, s = _run(m, Ingest(0), *_prompt(0, 3), CachePrefix(0, 0), Ingest(1),
                  MatchPrefix(1, 0, 4))
    assert out[-1] == Count(3)
    st = s.stream_map()
    assert st[(1, 0)].table == st[(0, 0)].table  # the full group shares all three pages
    assert st[(1, 1)].table[:2] == (0, 0) and st[(1, 1)].table[2] == st[(0, 1)].table[2]
    assert _violations(m, s) == []


def test_no_hit_where_the_window_group_cannot_serve() -> None:
    """H2: ids whose cap stops before the window's kept page: the full group
    could serve two tokens, the window group's pages there went back blank
    (H3), so no group attaches anything."""
    out, _ = _run(Model(ROOMY), Ingest(0), *_prompt(0, 3), CachePrefix(0, 0), Ingest(1),
                  MatchPrefix(1, 0, 3))
    assert out[-1] == Count(0)


def test_h2_off_attaches_what_one_group_cannot_serve() -> None:
    """Each group's own longest hit (vllm-ascend 12394, vLLM PR 50457): the
    window group is given a length whose window it holds no page for (I3's
    capacity, I26's window)."""
    m = _without("H2_hit_every_group")(ROOMY)
    out, s = _run(m, Ingest(0), *_prompt(0, 3), CachePrefix(0, 0), Ingest(1),
                  MatchPrefix(1, 0, 3))
    assert out[-1] == Count(2)
    assert {"I3", "I26"} & set(dict(_violations(m, s)))


def test_h1_off_is_found_by_the_checker() -> None:
    """A call that moves one group only: the checker finds I30 broken."""
    rep = _check(_without("H1_groups_move_together")(HYBRID))
    assert "I30" in rep.violations


def test_h4_off_is_found_by_i31() -> None:
    """A window that lets go tail first (vLLM 48435): its kept tail is
    evicted before the page before it, which I31 reports."""
    sc = Scope(requests=2, labels=1, device_pages=8, host_pages=0, page_size=1, max_span=3,
               depth=0, sharing=True, groups=(None, 2), window_cache=True)
    calls = (Ingest(0), *_prompt(0, 3), CachePrefix(0, 0))
    for m, found in ((Model(sc), False), (_without("H4_window_frees_head_first")(sc), True)):
        _, before = _run(m, *calls)
        r, s = m.step(before, Remove(0))
        assert r == Ok()
        # I31 is a transition invariant: the pages one stream let go of in the call
        assert ("I31" in dict(inv.violations(m, s, Remove(0), r, before))) == found


def test_h3_keeps_other_prefixes_cached() -> None:
    """What a window passes goes back blank, so a later allocation takes it
    before another request's cached prefix; with H3 off the passed window
    pages are cached and the prefix is evicted first (vLLM 42948)."""
    sc = Scope(requests=2, labels=1, device_pages=9, host_pages=0, page_size=1, max_span=3,
               depth=0, sharing=True, groups=(None, 1), window_cache=True)
    calls = (Ingest(1), *_prompt(1, 2), CachePrefix(1, 0), Remove(1),  # r1's prefix, cached
             Ingest(0), *_prompt(0, 3), CachePrefix(0, 0),  # r0 fills the pool, keyed
             *_prompt(0, 1))  # its window passes a keyed page
    for model, kept in ((Model(sc), True), (_without("H3_window_release_blank")(sc), False)):
        _, s = _run(model, *calls, *_prompt(0, 1))  # one more token: two pages to find
        assert s.pool is not None
        full_keys = [pg.key for pg in s.pool.pages if pg.key is not None
                     and pg.key.tokens == (0,) and not pg.holders]
        assert bool(full_keys) is kept, (model, s.pool)


# one full group and one chunked group (C = 2, H7), pages of one token, room
# for a stream of two tokens in both groups
CHUNKED = Scope(requests=2, labels=1, device_pages=4, host_pages=1, page_size=1, max_span=2,
                depth=6, sharing=True, groups=(None, 2), window_cache=True, chunked=(1,))


def test_the_checker_passes_a_hybrid_scope_with_a_chunked_group() -> None:
    rep = _check(Model(CHUNKED))
    assert not rep.violations, rep.violations
    assert rep.states > 1000


def test_a_chunk_releases_at_its_boundary_and_a_hit_reads_its_chunk() -> None:
    """H7: at 2 tokens the chunk of C = 2 starts at 2, so slots 0 and 1 hold
    no page (a window of 2 would keep both). At 3 tokens the chunk still
    starts at 2: a hit of 3 tokens needs only the chunk's page, slot 2."""
    sc = Scope(requests=2, labels=1, device_pages=8, host_pages=0, page_size=1, max_span=3,
               depth=0, sharing=True, groups=(None, 2), window_cache=True, chunked=(1,))
    m = Model(sc)
    out, s = _run(m, Ingest(0), *_prompt(0, 2))
    assert s.stream_map()[(0, 1)].table[:2] == (0, 0)  # the chunk at 2 reads none of them
    out, s = _run(m, Ingest(0), *_prompt(0, 3), CachePrefix(0, 0), Ingest(1),
                  MatchPrefix(1, 0, 4))
    assert out[-1] == Count(3)
    chunk = s.stream_map()[(1, 1)].table
    assert chunk[:2] == (0, 0) and chunk[2] == s.stream_map()[(0, 1)].table[2]
    assert _violations(m, s) == []


def test_h7_off_is_found_by_i26() -> None:
    """A chunk kept as a window of C: at 2 tokens it still holds slot 0 and
    1, which its chunk (from 2) no longer reads; I26 reports it."""
    sc = Scope(requests=2, labels=1, device_pages=8, host_pages=0, page_size=1, max_span=3,
               depth=0, sharing=True, groups=(None, 2), window_cache=True, chunked=(1,))
    m = _without("H7_chunk_moves_by_chunks")(sc)
    _, s = _run(m, Ingest(0), *_prompt(0, 2))
    assert "I26" in dict(_violations(m, s))
    assert "I26" in _check(_without("H7_chunk_moves_by_chunks")(CHUNKED)).violations


def test_a_chunked_group_names_a_group_with_a_number() -> None:
    import pytest

    with pytest.raises(ValueError):
        Scope(groups=(None, 2), chunked=(0,))


# one full and one window group (W = 3), pages of two tokens, room on the
# host for two group copies: the scheduler's hybrid offload programs' scope
OFFLOADS = Scope(requests=2, labels=1, device_pages=6, host_pages=2, page_size=2, max_span=6,
                 sharing=True, groups=(None, 3), window_cache=True)


def test_a_label_copy_is_its_groups_copies_in_turn() -> None:
    """H1: kvref copies each group's stream in its own critical sections,
    so a concurrent run is checked one group's copy at a time
    (`OffloadCopy.group`); the label's copy is exactly those, in order."""
    m = Model(OFFLOADS)
    base = (Ingest(0), *_prompt(0, 2), OffloadClaim(0))
    whole, s1 = _run(m, *base, OffloadCopy(0, 0))
    each, s2 = _run(m, *base, OffloadCopy(0, 0, group=0), OffloadCopy(0, 0, group=1))
    assert whole[-1] == each[-2] == each[-1] == Flag(True)
    assert s1 == s2
    # a group the scope does not have, or one copied already: the handle's misuse
    out, _ = _run(m, *base, OffloadCopy(0, 0, group=2), OffloadCopy(0, 0, group=0),
                   OffloadCopy(0, 0, group=0))
    assert out[-3] == out[-1] == Misuse("OffloadStateError") and out[-2] == Flag(True)
    # without groups there is no group to name
    plain = Model(Scope(requests=1, labels=1, device_pages=2, host_pages=2, page_size=2))
    out, _ = _run(plain, Ingest(0), *_prompt(0, 2), OffloadClaim(0), OffloadCopy(0, 0, group=0))
    assert out[-1] == Misuse("OffloadStateError")


def test_two_offloads_can_each_move_one_group() -> None:
    """Two offloads whose group copies interleave take the host's two pages
    one group each: each label's groups end apart (H1 allows it; a label's
    copy taken whole could not), and every invariant holds on the way."""
    m = Model(OFFLOADS)
    _, s = _run(m, Ingest(0), *_prompt(0, 2), Ingest(1), *_prompt(1, 2))
    for a, want in ((OffloadClaim(0), None), (OffloadClaim(1), None),
                    (OffloadCopy(0, 0, group=0), Flag(True)),
                    (OffloadCopy(1, 0, group=0), Flag(True)),
                    (OffloadCopy(0, 0, group=1), Flag(False)),
                    (OffloadCopy(1, 0, group=1), Flag(False)),
                    (OffloadCommit(0), Freed(1)), (OffloadCommit(1), Freed(1))):
        r, s = m.step(s, a)
        assert want is None or r == want, (a, r)
        assert not _violations(m, s), (a, _violations(m, s))
    st = s.stream_map()
    assert [st[(rid, g)].offload for rid in (0, 1) for g in (0, 1)] == [
        OFFLOADED, RESIDENT, OFFLOADED, RESIDENT]


# W9 (window_cache off): the window group keys nothing, so it follows no ids
UNCACHED_WINDOW = replace(HYBRID, window_cache=False, depth=4)


def test_a_window_group_that_never_caches_follows_no_ids() -> None:
    """I30 compared `followed` across groups, so ``--groups None,1`` without
    window_cache failed at its second call: the full group follows the ids,
    W9's window group does not, and H1 asks no more (issue 41)."""
    m = Model(UNCACHED_WINDOW)
    _, s = _run(m, Ingest(0), FollowTokens(0, 0))
    streams = s.stream_map()
    assert streams[(0, 0)].followed and not streams[(0, 1)].followed
    assert inv.i30(m, s) is None
    rep = _check(m)
    assert not rep.violations, rep.violations
    # planted: the window group follows too
    bad = dict(streams)
    bad[(0, 1)] = replace(bad[(0, 1)], followed=True)
    assert inv.i30(m, replace(s, streams=tuple(sorted(bad.items())))) is not None
