"""`PagePool.allocate_each`: one call giving each owner the pages
`allocate` called for each in turn gives (issue 42: a decode step's admit
gives a page to each stream crossing into a new one, in one call)."""

from __future__ import annotations

import pytest

from kvref.core.errors import InvalidArgumentError
from kvref.core.page_pool import PagePool
from kvref.stepping import admit_plan_commit
from kvref.stepping.step import AllocationFailed, KVStep, Segment, StepContext
from tests.unit._manager_fixtures import Snapshot, assert_same, make_manager, snapshot

PS = 2


def _pool_with_cached_pages() -> PagePool:
    """Pages 1..8: 1..4 free-cached (a released prompt), 5..8 blank."""
    pool = PagePool(9, PS)
    pages = pool.allocate("p", 4)
    assert isinstance(pages, list)
    parent = None
    for i, p in enumerate(pages):
        parent = pool.register(p, parent, [i, i]).key
    pool.release("p", pages[::-1])
    return pool


@pytest.mark.parametrize("counts", [[1, 1, 1], [2, 0, 3], [4, 4], [1, 6, 1], [0]])
def test_each_owner_gets_what_allocate_in_turn_gives(counts: list[int]) -> None:
    owners = [("r", str(i)) for i in range(len(counts))]
    each, one_by_one = _pool_with_cached_pages(), _pool_with_cached_pages()
    got = each.allocate_each(owners, counts)
    assert got == [one_by_one.allocate(o, n) for o, n in zip(owners, counts, strict=True)]
    assert each.snapshot() == one_by_one.snapshot()  # holders, keys, LRU, blank alike
    each.sanity_check()


def test_short_is_a_value_and_takes_nothing() -> None:
    pool = _pool_with_cached_pages()
    before = pool.snapshot()
    got = pool.allocate_each([("a", "m"), ("b", "m")], [5, 4])
    assert isinstance(got, AllocationFailed) and got.pages_short == 1
    assert pool.snapshot() == before


@pytest.mark.parametrize("owners, counts", [
    ([("a", "m")], [1, 1]),  # lengths disagree
    ([None], [1]),  # no owner
    ([["a"]], [1]),  # unhashable
    ([("a", "m")], [-1]),
    ([("a", "m")], [True]),
])
def test_misuse_raises_and_takes_nothing(owners: list, counts: list) -> None:
    pool = _pool_with_cached_pages()
    before = pool.snapshot()
    with pytest.raises(InvalidArgumentError):
        pool.allocate_each(owners, counts)
    assert pool.snapshot() == before


def _decode_across_pages(monkeypatch: pytest.MonkeyPatch, batched_from: int) -> Snapshot:
    """Six streams at a page's end, a cached prompt's pages free in the
    LRU, then one decode step: every stream takes a page in the admit."""
    monkeypatch.setattr(admit_plan_commit, "_BATCHED_TAKE", batched_from)
    kv = make_manager(pages=40, page_size=4)
    ctx = StepContext()
    rids = [f"r{i}" for i in range(6)]
    for rid in ["gone", *rids]:
        kv.ingest_request(rid)
    for step in (KVStep([Segment("gone", "main", 8)]),
                 KVStep([Segment(rid, "main", 4 * (i + 1)) for i, rid in enumerate(rids)]),
                 KVStep([Segment(rid, "main", 1) for rid in rids])):
        assert kv.admit(step, ctx).ok
        kv.plan(step, ctx)
        kv.commit(step, ctx)
        if step.segments[0].request_id == "gone":
            kv.remove_request("gone")
    return snapshot(kv)


def test_a_decode_step_takes_the_pages_stream_by_stream_or_in_one_call_alike(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain admit's one pool call for many streams (issue 42) leaves
    every stream the pages it takes stream by stream."""
    batched = _decode_across_pages(monkeypatch, 2)
    one_by_one = _decode_across_pages(monkeypatch, 1 << 20)
    assert_same(batched, one_by_one)


@pytest.mark.parametrize("n", [0, 1, 3, 4, 6, 8])
def test_take_counted_gives_what_allocate_gives(n: int) -> None:
    # the admission's trusted take (no argument checks): the same pages,
    # holders, keys dropped and LRU as `allocate`, blank first then cached
    counted, checked = _pool_with_cached_pages(), _pool_with_cached_pages()
    assert counted.take_counted(("r", "m"), n) == checked.allocate(("r", "m"), n)
    assert counted.snapshot() == checked.snapshot()
    counted.sanity_check()


def test_take_counted_past_the_free_pages_is_a_broken_count() -> None:
    # a count the caller did not make under the lock is its bug, not a
    # refusal: it stops before any page moves
    pool = _pool_with_cached_pages()
    before = pool.snapshot()
    with pytest.raises(AssertionError, match="9 pages counted free, 8 are"):
        pool.take_counted(("r", "m"), 9)
    assert pool.snapshot() == before
