"""`PagePool.allocate_each`: one call giving each owner the pages
`allocate` called for each in turn gives (issue 42: a decode step's admit
gives a page to each stream crossing into a new one)."""

from __future__ import annotations

import pytest

from kvref.core.errors import InvalidArgumentError
from kvref.core.page_pool import PagePool
from kvref.stepping.step import AllocationFailed

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
