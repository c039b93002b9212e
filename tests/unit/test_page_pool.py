"""PagePool and prefix_hash: each rule of specs/shared-pages.md on its own."""

from __future__ import annotations

import hashlib
import struct
import threading

import numpy as np
import pytest

from kvref.core.errors import InvalidArgumentError
from kvref.core.page_pool import (
    PageNotWritableError,
    PagePool,
    PagePoolCorruptedError,
    PageRefError,
    PageRegisterError,
    ResetRefused,
)
from kvref.core.runtime import ThreadingRuntime
from kvref.prefix.keys import encode_extras, page_key, page_keys
from kvref.stepping.step import AllocationFailed

PS = 2


def cached(pool: PagePool, owner: str, tokens: list[int], extras: tuple = ()) -> list[int]:
    """Prefill `tokens` (whole pages) for `owner`: allocate, register each page."""
    pages = pool.allocate(owner, len(tokens) // PS)
    assert isinstance(pages, list)
    parent = None
    for i, p in enumerate(pages):
        pool.check_writable(owner, p)
        r = pool.register(p, parent, tokens[i * PS:(i + 1) * PS], extras)
        parent = r.key
    return pages


def test_allocation_takes_blank_first_then_the_least_recently_used() -> None:
    pool = PagePool(5, PS)  # pages 1..4; page 0 is the sink
    a = cached(pool, "a", [1, 2, 3, 4])
    assert a == [1, 2]
    assert pool.release("a", a[::-1]) == 2  # tail first: page 2 is evicted first
    assert pool.num_free == 4 and pool.num_cached == 2
    assert pool.allocate("b", 2) == [3, 4]  # blank before cached
    assert pool.allocate("b", 1) == [2]  # the tail page goes first...
    assert pool.key_of(2) is None  # ...its key dropped before it is handed out
    hit = pool.lookup([1, 2, 3, 4, 5])
    assert hit.pages == (1,) and hit.num_tokens == 2  # the chain stops at the evicted page
    pool.sanity_check()


def test_short_allocation_is_a_value_and_takes_nothing() -> None:
    pool = PagePool(4, PS)
    assert pool.allocate("a", 2) == [1, 2]
    got = pool.allocate("b", 3)
    assert isinstance(got, AllocationFailed) and got.pages_short == 2
    assert pool.num_free == 1
    with pytest.raises(InvalidArgumentError):
        pool.allocate("b", -1)
    with pytest.raises(InvalidArgumentError):
        pool.allocate(["unhashable"], 1)
    pool.sanity_check()


def test_a_hit_keeps_the_last_token_to_compute() -> None:
    pool = PagePool(5, PS)
    cached(pool, "a", [1, 2, 3, 4])
    assert pool.match("b", [1, 2, 3, 4]).num_tokens == 2  # all cached: one page less
    assert pool.match("c", [1, 2, 3, 4, 5]).pages == (1, 2)
    assert pool.match("d", [1]).pages == ()
    assert pool.match("e", [1, 9, 3, 4, 5]).pages == ()  # diverges in the first page
    assert pool.refcount(1) == 3 and pool.refcount(2) == 2  # a, b, c; a, c


def test_a_hit_on_a_free_cached_page_takes_it_out_of_the_lru() -> None:
    pool = PagePool(5, PS)
    pool.release("a", cached(pool, "a", [1, 2, 3, 4])[::-1])
    assert pool.snapshot().lru == (2, 1)
    assert pool.match("b", [1, 2, 3]).pages == (1,)
    assert pool.snapshot().lru == (2,) and pool.num_free == 3
    with pytest.raises(PageRefError, match="already holds"):
        pool.match("b", [1, 2, 3])  # a hit for a stream that holds its prefix
    pool.sanity_check()


def test_a_hit_refused_part_way_changes_nothing() -> None:
    # match takes each reference as it checks the page: a page the owner
    # holds already, found after a free-cached, a bare and a shared one, must
    # leave holders and the LRU's order as they were
    pool = PagePool(8, PS)
    z = cached(pool, "z", [9, 9])
    p1, p2, p3, p4 = cached(pool, "a", [1, 2, 3, 4, 5, 6, 7, 8])
    pool.share("x", [p2, p3])
    pool.share("y", [p3])
    pool.share("b", [p4])
    pool.release("a", [p4, p3, p2, p1])
    pool.release("z", z)
    before = pool.snapshot()
    assert before.lru == (p1, *z)  # p1 free-cached, then z's page
    with pytest.raises(PageRefError, match=f"already holds cached page {p4}"):
        pool.match("b", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert pool.snapshot() == before
    assert pool._holders[p2] == "x" and pool._holders[p3] == {"x", "y"}
    assert pool.match("c", [1, 2, 3, 4, 5, 6, 7, 8, 0]).pages == (p1, p2, p3, p4)
    assert pool.snapshot().lru == tuple(z)
    pool.sanity_check()


def test_extra_keys_keep_tenants_apart() -> None:
    pool = PagePool(5, PS)
    cached(pool, "a", [1, 2, 3, 4], (("salt", "ab"),))
    assert pool.lookup([1, 2, 3], (("salt", "ab"),)).pages == (1,)
    assert pool.lookup([1, 2, 3]).pages == ()
    assert pool.lookup([1, 2, 3], (("lora", "a"), ("salt", "b"))).pages == ()
    assert pool.lookup([1, 2, 3], (("salt", "a"), ("salt", "b"))).pages == ()


def test_register_rules() -> None:
    pool = PagePool(5, PS)
    [p, q] = pool.allocate("a", 2)
    with pytest.raises(PageRegisterError, match="full"):
        pool.register(p, None, [1])  # a part page
    with pytest.raises(PageRegisterError, match="free"):
        pool.register(3, None, [1, 2])  # a free page
    with pytest.raises(PageRegisterError, match="no page"):
        pool.register(0, None, [1, 2])  # the sink
    r = pool.register(p, None, [1, 2])
    assert (r.page, r.deduplicated) == (p, False)
    assert pool.register(p, None, [1, 2]) == r  # again: the same answer
    with pytest.raises(PageRegisterError, match="immutable"):
        pool.register(p, None, [1, 3])  # tokens that disagree
    with pytest.raises(PageNotWritableError, match="registered"):
        pool.check_writable("a", p)
    d = pool.register(q, None, [1, 2])  # the key is p's: p wins
    assert (d.page, d.deduplicated) == (p, True)
    assert pool.key_of(q) is None and pool.holders(q) == {"a"}  # q is not freed
    pool.check_writable("a", q)
    pool.sanity_check()


def test_release_rules() -> None:
    pool = PagePool(5, PS)
    pages = pool.allocate("a", 3)
    assert isinstance(pages, list)
    pool.share("b", pages[:2])  # a fork of the first two
    before = pool.snapshot()
    for bad in ([3, 3], [1, 4], [0], [99]):  # twice, not held, the sink, no such page
        with pytest.raises(PageRefError):
            pool.release("a", bad)
        assert pool.snapshot() == before  # refused whole
    assert pool.reclaimable({"a": pages}) == 1  # only the page b does not share
    assert pool.reclaimable({"a": pages, "b": pages[:2]}) == 3  # shared pages once
    assert pool.release("a", pages[::-1]) == 1
    with pytest.raises(PageRefError, match="second release"):
        pool.release("a", pages[:1])  # a second release path
    with pytest.raises(PageRefError, match="free"):
        pool.share("c", [3])
    assert pool.release("b", pages[1::-1]) == 2
    assert pool.num_free == 4
    pool.sanity_check()


def test_a_share_refused_part_way_gives_back_what_it_took() -> None:
    # share takes each reference as it checks the page: a page that fails
    # after others passed must leave every holder as it was, a page held by
    # one owner bare again and a page held by two its own set
    pool = PagePool(8, PS)
    pages = pool.allocate("a", 4)
    assert isinstance(pages, list)
    pool.share("b", pages[:2])  # pages 0, 1 held by {a, b}; 2, 3 by a alone
    free = next(p for p in range(1, 8) if p not in pages)
    before = pool.snapshot()
    for bad, match in (([*pages, free], "free"), ([pages[2], pages[0], pages[3]], None)):
        owner = "c" if match else "b"  # b holds pages[0] already
        with pytest.raises(PageRefError, match=match or "holds it already"):
            pool.share(owner, bad)
        assert pool.snapshot() == before
        assert type(pool._holders[pages[2]]) is str  # bare again, not a set of one
        assert pool._holders[pages[0]] == {"a", "b"}
    for bad in ([pages[0], pages[0]], [pages[1], 0], [pages[1], True]):  # twice, sink, a bool
        with pytest.raises(PageRefError):
            pool.share("c", bad)
        assert pool.snapshot() == before
    pool.share("c", pages)
    assert all(pool.holders(p) >= {"a", "c"} for p in pages)
    pool.sanity_check()


def test_writes_need_a_private_unregistered_page() -> None:
    pool = PagePool(4, PS)
    [p] = pool.allocate("a", 1)
    pool.check_writable("a", p)
    pool.share("b", [p])
    with pytest.raises(PageNotWritableError, match="shared by 2"):
        pool.check_writable("a", p)
    with pytest.raises(PageNotWritableError, match="does not hold"):
        pool.check_writable("c", p)
    pool.release("b", [p])
    pool.check_writable("a", p)


def test_reset_is_refused_while_pages_are_held() -> None:
    pool = PagePool(5, PS)
    pages = cached(pool, "a", [1, 2, 3, 4])
    before = pool.snapshot()
    got = pool.reset_prefix_cache()
    assert isinstance(got, ResetRefused) and got.pages_held == 2
    assert pool.snapshot() == before
    pool.release("a", pages[::-1])
    assert pool.reset_prefix_cache() == 2
    snap = pool.snapshot()
    assert snap.lru == () and snap.blank == (3, 4, 2, 1) and not any(snap.keys)
    assert pool.lookup([1, 2, 3]).pages == ()
    pool.sanity_check()


def test_sanity_check_names_a_corruption() -> None:
    pool = PagePool(4, PS)
    pool.allocate("a", 1)
    pool._blank.append(1)  # a held page queued as free
    with pytest.raises(PagePoolCorruptedError, match="page 1"):
        pool.sanity_check()


def test_threads_keep_the_invariant() -> None:
    rt = ThreadingRuntime()
    pool = PagePool(17, PS, runtime=rt)

    def worker(i: int) -> None:
        for _ in range(200):
            hit = pool.match(i, [1, 2, 3, 4, 5])
            got = pool.allocate(i, 2 - len(hit.pages))
            if isinstance(got, list):
                parent = hit.keys[-1] if hit.keys else None
                for j, p in enumerate(got, len(hit.pages)):
                    parent = pool.register(p, parent, [1, 2, 3, 4][j * 2:j * 2 + 2]).key
            pool.release(i, [*hit.pages, *(got if isinstance(got, list) else [])][::-1])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pool.sanity_check()
    assert pool.num_free == 16


# ---------------------------------------------------------------- prefix_hash


def test_page_key_is_the_documented_sha256() -> None:
    extras = (("salt", "x"), ("n", 7))
    want_extras = (struct.pack("<Q", 2) + struct.pack("<Q", 4) + b"salt" + b"s"
                   + struct.pack("<Q", 1) + b"x" + struct.pack("<Q", 1) + b"n" + b"i"
                   + struct.pack("<Q", 1) + b"7")
    assert encode_extras(extras) == want_extras
    first = hashlib.sha256(b"\x00" + struct.pack("<Q2q", 2, 5, -1) + want_extras).digest()
    assert page_key(None, [5, -1], extras) == first
    second = hashlib.sha256(b"\x01" + first + struct.pack("<Q2q", 2, 1 << 40, 0)
                            + want_extras).digest()
    assert page_keys([5, -1, 1 << 40, 0, 9], 2, extras) == [first, second]


def test_tagged_extras_never_collide() -> None:
    pairs = [((("lora", "a"), ("salt", "bc")), (("lora", "ab"), ("salt", "c"))),
             ((("a", "bc"),), (("ab", "c"),)), ((("n", 1),), (("n", "1"),)),
             ((("n", b"1"),), (("n", "1"),)), ((), (("", ""),))]
    for x, y in pairs:
        assert encode_extras(x) != encode_extras(y)
        assert page_key(None, [1, 2], x) != page_key(None, [1, 2], y)


def test_numpy_and_lists_hash_alike_and_bad_input_is_a_misuse() -> None:
    toks = [3, 1, 4, 1, 5, 9, 2]
    for arr in (np.array(toks, dtype=np.int32), np.array(toks, dtype=np.uint16)):
        assert page_keys(arr, 2) == page_keys(toks, 2)
    assert len(page_keys(toks, 2)) == 3 and page_keys(toks, 2, pages=1) == page_keys(toks[:2], 2)
    for bad in ([1.5, 2.0], [1 << 63], np.array([1.0, 2.0]), ["a", "b"]):
        with pytest.raises(InvalidArgumentError):
            page_key(None, bad)
    with pytest.raises(InvalidArgumentError):
        page_key(b"short", [1, 2])
    with pytest.raises(InvalidArgumentError):
        page_key(None, [1, 2], (("salt", 1.5),))


def test_sixteen_requests_share_one_copy_of_their_prompt() -> None:
    from benchmarks.prefix_cache import memory

    m = memory(requests=16, shared_tokens=1024, own_tokens=100)
    assert (m.shared_pages, m.own_pages) == (64, 7)
    assert m.held == 64 + 16 * 7 and m.private_copies == 16 * 71
    assert m.shared_refcount == 16 and m.reclaimable_one == 7


def test_release_table_refuses_as_release_does_and_keeps_lru_order() -> None:
    """`release_table` (a stream table's own list, one pass that links freed
    cached pages as it goes) refuses a page the owner does not hold, listed
    twice, or out of range, changing nothing; otherwise it frees like
    `release`, cached pages at the LRU's tail in the order given."""
    pool = PagePool(12, 4)
    a, b = ("r", "main"), ("r", "s1")
    pages = pool.allocate(a, 6)
    assert isinstance(pages, list)
    keys = page_keys(list(range(24)), 4)
    assert pool.register_chain(pages[:4], keys[:4]) == (4, 4, None)
    pool.share(b, pages[:1])  # page 0 of the table stays held by b
    other = pool.allocate(b, 1)
    assert isinstance(other, list)
    # a free-cached page before them: a refusal's undo ends the chain at it
    c = ("q", "main")
    [cp] = pool.allocate(c, 1)
    assert pool.register_chain([cp], page_keys(list(range(100, 104)), 4)) == (1, 1, None)
    pool.release_table(c, [cp])
    before = pool.snapshot()
    for bad in ([*pages[::-1], other[0]], [pages[0], pages[1], pages[1]], [pages[0], 99],
                [pages[3], pages[4], pages[2], pages[3]]):
        with pytest.raises(PageRefError):
            pool.release_table(a, bad)
        assert pool.snapshot() == before
    assert pool.release_table(a, pages[::-1]) == 5
    snap = pool.snapshot()
    assert snap.lru == (cp, *pages[3:0:-1])  # pages[1:4] cached, tail first as given
    assert set(snap.blank) >= set(pages[4:])
    pool.sanity_check()


def test_holders_kept_bare_or_as_a_set_read_the_same() -> None:
    """A page's holders are kept as one bare owner or a set of two or more
    (a release need not hash into a set per page): sharing and releasing move
    between the forms and every query reads them alike; an owner that is a
    frozenset equal to a page's set of holders does not hold it; a set of one
    left in place is found by `sanity_check`."""
    pool = PagePool(8, 4)
    a, b = ("r", "main"), ("r", "s1")
    pages = pool.allocate(a, 2)
    assert isinstance(pages, list)
    pool.share(b, pages[:1])
    assert pool.holders(pages[0]) == {a, b} and pool.refcount(pages[0]) == 2
    assert pool.private_pages(a, pages) == [False, True]
    imposter = frozenset({a, b})
    before = pool.snapshot()
    with pytest.raises(PageRefError):
        pool.release_table(imposter, pages[:1])
    with pytest.raises(PageRefError):
        pool.release_table(a, [pages[1], 0])  # the reserved page: no holder
    assert pool.snapshot() == before
    assert pool.release_table(b, pages[:1]) == 0
    assert pool.holders(pages[0]) == {a} and pool.writable(a, pages[0])
    pool.sanity_check()
    assert pool.release_table(a, pages[::-1]) == 2
    assert pool.num_free == 7
    pool._holders[pages[0]] = {a}  # planted: a set of one
    with pytest.raises(PagePoolCorruptedError, match="a holder set of 1"):
        pool.sanity_check()


def test_register_filled_answers_as_register_chain_entry_by_entry() -> None:
    """`register_filled` (a decode step's pages, one per stream) takes each
    free key, counts 0 for a page keyed so before or a key another page
    holds (S11), and stops at the first free, out-of-range or differently
    keyed page with that page's error, keeping what it did before it."""
    pool = PagePool(12, 4)
    pages = pool.allocate(("r", "main"), 6)
    assert isinstance(pages, list)
    keys = page_keys(list(range(24)), 4)
    assert pool.register_filled(pages[:2], keys[:2]) == ([1, 1], None)
    # keyed so before: 0; a key page 0 holds, on another page: 0, not taken
    assert pool.register_filled([pages[1], pages[2]], [keys[1], keys[0]]) == ([0, 0], None)
    assert pool.key_of(pages[2]) is None and pool.cached_page(keys[0]) == pages[0]
    took, err = pool.register_filled([pages[2], pages[0]], [keys[2], keys[3]])
    assert took == [1] and isinstance(err, PageRegisterError) and "immutable" in str(err)
    assert pool.key_of(pages[0]) == keys[0] and pool.key_of(pages[2]) == keys[2]
    pool.release(("r", "main"), pages[5:])
    took, err = pool.register_filled([pages[3], pages[5]], [keys[3], keys[5]])
    assert took == [1] and isinstance(err, PageRegisterError) and "free" in str(err)
    took, err = pool.register_filled([99], [keys[4]])
    assert took == [] and isinstance(err, PageRegisterError) and "no page 99" in str(err)
    assert pool.key_of(pages[4]) is None
    # a batch's pages (checked by C-level passes): the pages before one that
    # is no page are done, in order, and its error said; a bool is no page
    more = PagePool(12, 4)
    got = more.allocate(("r", "main"), 6)
    assert isinstance(got, list)
    for bad in (99, True):
        took, err = more.register_filled([*got[:5], bad], keys[:6])
        assert isinstance(err, PageRegisterError) and f"no page {bad!r}" in str(err)
        assert took == ([1] * 5 if bad == 99 else [0] * 5)  # keyed by the first pass
    assert [more.key_of(p) for p in got] == [*keys[:5], None]
    with pytest.raises(ValueError, match="6 pages, 5 keys"):
        more.register_filled(got, keys[:5])
    pool.sanity_check()
    more.sanity_check()


@pytest.mark.parametrize("n, pages, parent", [
    (0, None, False), (3, None, False), (16, None, True), (37, None, False), (37, 2, True),
    (37, 0, False),
])
def test_page_keys_loop_lazy_walk_and_cached_head_agree(n: int, pages: int | None,
                                                        parent: bool) -> None:
    """`page_keys` (one loop), `iter_page_keys` (lazy) and a chain of
    `page_key` calls give the same keys; `cached_head` stops where an index
    first misses, as a walk of `iter_page_keys` would."""
    from kvref.core.page_keys import cached_head, iter_page_keys

    ids = list(range(1000, 1000 + n))
    extras = (("salt", "s"), ("label", "main"))
    first = page_key(None, [7, 8, 9, 10], extras) if parent else None
    got = page_keys(ids, 4, extras, parent=first, pages=pages)
    assert got == list(iter_page_keys(ids, 4, extras, parent=first, pages=pages))
    chain, prev = [], first
    for i in range(min(n // 4, n if pages is None else pages)):
        prev = page_key(prev, ids[4 * i:4 * i + 4], extras)
        chain.append(prev)
    assert got == chain
    full = page_keys(ids, 4, extras)
    for known in (len(full), len(full) // 2, 0):
        index = {k: 100 + i for i, k in enumerate(full[:known])}
        assert cached_head(index, ids, 4, extras) == (
            [100 + i for i in range(known)], full[:known])
