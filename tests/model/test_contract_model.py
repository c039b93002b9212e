"""The model's side of issue 29's loose ends (kvref's: tests/unit/
test_contract_loose_ends.py): R45's priority of a request whose every page
another holds, R58's stream left by a match that finds nothing, and S23's
count of pages newly keyed."""

from __future__ import annotations

from kvref_model import core
from tests.model.test_one_model import PS2, WIN, run, step


def test_priority_is_zero_for_a_claim_that_frees_nothing_and_the_claim_is_accepted() -> None:
    m = core.Model(core.Scope(**PS2, sharing=True))
    _, s = run(m, core.Ingest(0), *step(0, 0, 4), core.CachePrefix(0, 0), core.Ingest(1),
               core.MatchPrefix(1, 0, 5))
    assert m.offload_priority(s, 0) == m.offload_priority(s, 1) == 0  # all shared
    rs, s = run(m, core.Ingest(0), *step(0, 0, 4), core.CachePrefix(0, 0), core.Ingest(1),
                core.MatchPrefix(1, 0, 5), core.OffloadClaim(1), core.OffloadCopy(1, 0),
                core.OffloadCommit(1))
    assert rs[-3] == core.Claimed((0,)) and rs[-1] == core.Freed(0)
    assert m.offload_priority(s, 0) == 2  # now the last holder of both pages
    r, _ = m.step(s, core.OffloadClaim(0))
    assert r == core.Claimed((0,))
    assert m.offload_priority(s, 1) == 0  # offloaded: a claim is refused


def test_priority_is_zero_exactly_where_a_claim_is_refused_without_sharing() -> None:
    m = core.Model(core.Scope(**PS2))
    _, s = run(m, core.Ingest(0), *step(0, 0, 3))
    assert m.offload_priority(s, 0) == 2 and m.offload_priority(s, 1) == 0
    _, s2 = m.step(s, core.Admit(core.Step((core.Seg(0, 0, 1),), padded=(0,))))
    assert m.offload_priority(s2, 0) == 0  # a step in flight (R4)


def test_match_prefix_leaves_the_stream_there_whether_or_not_it_hits() -> None:
    m = core.Model(core.Scope(**PS2, sharing=True))
    rs, s = run(m, core.Ingest(0), core.MatchPrefix(0, 1, 5))
    assert rs[-1] == core.Count(0) and s.stream_map()[(0, 1)] == core.Stream()
    w = core.Model(core.Scope(**WIN, sharing=True))
    rs, s = run(w, core.Ingest(0), core.MatchPrefix(0, 1, 5))  # W10: a windowed label
    assert rs[-1] == core.Count(0) and (0, 1) in s.stream_map()


def test_cache_prefix_counts_pages_newly_keyed_only() -> None:
    m = core.Model(core.Scope(**PS2, sharing=True))
    rs, _ = run(m, core.Ingest(0), *step(0, 0, 4), core.Ingest(1), *step(1, 0, 4),
                core.CachePrefix(0, 0), core.CachePrefix(1, 0))
    # r1 computed r0's tokens itself: its pages pass under r0's keys (S11)
    assert rs[-2:] == [core.Count(2), core.Count(0)]


def test_match_prefix_while_leased_is_refused_and_makes_no_stream() -> None:
    m = core.Model(core.Scope(**PS2, sharing=True))
    rs, s = run(m, core.Ingest(0), *step(0, 0, 2), core.Publish(0), core.MatchPrefix(0, 1, 3))
    assert rs[-1] == core.Misuse("PublishLeasedError") and (0, 1) not in s.stream_map()
