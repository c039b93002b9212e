"""PageAllocator: FIFO from page 0, and a bad free changes nothing."""

from __future__ import annotations

import pytest
from _manager_fixtures import Driver, fill, make_manager

from kvref.core.allocator import PageAllocator
from kvref.stepping.plan import SINK_PAGE


def test_fifo_from_page_zero() -> None:
    a = PageAllocator(8)
    assert a.try_allocate(1) == [0]
    assert a.try_allocate(3) == [1, 2, 3]
    assert a.num_free == 4
    a.free([2, 1])
    # FIFO: what was free first goes first; freed pages queue behind
    assert a.try_allocate(5) == [4, 5, 6, 7, 2]
    assert a.try_allocate(1) == [1]
    assert a.num_free == 0


def test_short_allocation_takes_nothing() -> None:
    a = PageAllocator(4)
    assert a.try_allocate(5) is None
    assert a.num_free == 4
    assert a.try_allocate(0) == []
    with pytest.raises(ValueError):
        a.try_allocate(-1)
    assert a.num_free == 4


@pytest.mark.parametrize("bad", [[3, 3], [1, 2, 1], [4, 99], [4, -1], [5]])
def test_bad_free_raises_and_changes_nothing(bad: list[int]) -> None:
    a = PageAllocator(8)
    assert a.try_allocate(5) == [0, 1, 2, 3, 4]
    # 5 is still free: freeing it again is a double free
    with pytest.raises(ValueError):
        a.free(bad)
    assert a.num_free == 3
    for p in range(5):
        assert not a.is_free(p)
    for p in (5, 6, 7):
        assert a.is_free(p)
    # the free list is exactly as before: the next allocation sees 5, 6, 7
    assert a.try_allocate(3) == [5, 6, 7]
    assert a.try_allocate(1) is None


def test_double_free_of_already_freed_page() -> None:
    a = PageAllocator(4)
    pages = a.try_allocate(2)
    assert pages == [0, 1]
    a.free([1])
    with pytest.raises(ValueError, match="already free"):
        a.free([0, 1])
    assert not a.is_free(0)
    assert a.num_free == 3


def test_manager_never_hands_out_the_sink() -> None:
    mgr = make_manager(pages=6, page_size=2)
    assert mgr.num_free_pages == 5
    drv = Driver(mgr)
    drv.ingest("a", "b")
    seen: set[int] = set()
    for _ in range(3):
        fill(drv, "a", 6)
        fill(drv, "b", 4)
        pages = [p for s in mgr._streams.values() for st in s.values() for p in st.page_indices]
        assert SINK_PAGE not in pages
        seen.update(pages)
        mgr.reset_request("a", free=True)
        mgr.reset_request("b", free=True)
        drv.model = {k: [] for k in drv.model}
        assert mgr.num_free_pages == 5
    assert seen == {1, 2, 3, 4, 5}


def test_concurrent_callers_neither_raise_nor_lose_pages() -> None:
    # issue 9: try_allocate compared the free count and popped without a lock;
    # two callers both passed the check and one popped an empty deque
    # (IndexError), or a page left circulation. The reference's allocator is
    # thread safe and so is this one (R30). Real threads switching as often
    # as the interpreter allows: unlocked, about 5 runs in 6 of one round
    # fail here, so two rounds miss it rarely; locked, none can.
    import sys
    import threading

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(2):
            a = PageAllocator(6)
            errors: list[BaseException] = []

            def user(a: PageAllocator = a, errors: list[BaseException] = errors) -> None:
                try:
                    for _ in range(50_000):
                        pages = a.try_allocate(3)  # two callers fit, a third does not
                        if pages is not None:
                            a.free(pages)
                        if errors:
                            return
                except BaseException as err:  # reported below, with the pages' state
                    errors.append(err)

            threads = [threading.Thread(target=user) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors, errors
            assert a.num_free == 6, "pages left circulation"
            assert all(a.is_free(p) for p in range(6))
    finally:
        sys.setswitchinterval(old)
