"""The device-page invariant of a `KVManager`, executable, on what
`KVManager.observe` shows: every check that
drives a manager (lockstep, the scheduled tests, the unit fixtures) runs
this one, so the invariant is stated once.

I1 (with shared pages): each page other than the sink is held by exactly
the streams whose page table names it (its reference count is their
number), or free, and the pool's own structures agree (`check_pool`:
held / free-cached / free-blank, one each, as `PagePool.sanity_check`). I2: the sink is
never in a table. a stream's spare pages (past its last token's page)
are private to it (R52), so no write past a stream's length lands in a page
another stream reads or the prefix cache names.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Protocol

from kvref import SINK_PAGE, KVObservation


class Observed(Protocol):
    """A manager the check can read: `KVManager.observe`, its free count, and
    `KVManager.check`, the pool's own structures observe does not show."""

    @property
    def num_free_pages(self) -> int: ...
    def observe(self) -> KVObservation: ...
    def check(self) -> list[str]: ...


def check_pool(seen: KVObservation) -> None:
    """The pool's own invariant, on what `observe` shows of it: each page is
    exactly one of held / free-cached / free-blank, a cached page is keyed
    and unheld, a blank one unkeyed, a key names one page."""
    where = Counter([*seen.free_cached, *seen.free_blank])
    assert SINK_PAGE not in where, "I2: the sink page is free"
    bad = []
    for page in seen.pages:
        p, held = page.page, bool(page.holders)
        if where[p] + held != 1:
            bad.append(f"page {p}: {'held, ' if held else ''}{where[p]} time(s) free: it "
                       "must be exactly one of held/cached/blank")
        if p in seen.free_cached and page.key is None:
            bad.append(f"free-cached page {p} has no key")
        if p in seen.free_blank and page.key is not None:
            bad.append(f"free-blank page {p} is registered")
    keys = Counter(page.key for page in seen.pages if page.key is not None)
    bad += [f"{n} pages hold one key" for n in keys.values() if n > 1]
    assert seen.free_pages == len(seen.free_cached) + len(seen.free_blank), (
        f"{seen.free_pages} free pages, but {len(seen.free_cached)} cached + "
        f"{len(seen.free_blank)} blank")
    assert not bad, "page pool: " + "; ".join(bad)


def check_device_pages(kv: Observed, seen: KVObservation | None = None) -> None:
    """Raise AssertionError naming the first broken part. Call with no other
    thread inside the manager; ``seen``: its observation, if already taken."""
    seen = seen if seen is not None else kv.observe()
    check_pool(seen)
    # the key index, the LRU list's count, holder sets: the manager's own check
    broken = kv.check()
    assert not broken, "page pool (KVManager.check): " + "; ".join(broken)
    named: dict[int, set[tuple[str, str]]] = defaultdict(set)
    ps = seen.page_size
    for s in seen.streams():
        rid, label, pages = s.request_id, s.label, s.pages
        assert SINK_PAGE not in pages, f"I2: sink page in {rid}/{label}"
        assert len(set(pages)) == len(pages), f"I1: {rid}/{label} names a page twice"
        for p in pages:
            named[p].add((rid, label))
        # an offload's claim keeps the pages until its commit empties the table
        # (slots from released // ps on: a windowed stream's released
        # slots hold no page and are not in the list)
        assert s.released % ps == 0, f"W2: {rid}/{label} released part of a page"
        spare = pages[-(-s.stored_len // ps) - s.released // ps:] if pages else ()
        # private: this stream alone holds it, and the prefix cache names it not
        bad = [p for p in spare if seen.page(p).holders != {(rid, label)}
               or seen.page(p).key is not None]
        assert not bad, (f"R52: {rid}/{label} keeps shared or cached pages {bad} "
                         "past its last token")
    for page in seen.pages:
        holders = page.holders
        assert holders == named.get(page.page, set()), (
            f"I1: page {page.page} is held by {sorted(map(str, holders))} but named by the "
            f"tables of {sorted(map(str, named.get(page.page, set())))}")
    held = len(named)
    assert kv.num_free_pages + held + 1 == seen.num_pages, (
        f"I1: {kv.num_free_pages} free + {held} held + the sink != "
        f"{seen.num_pages} pages: a page is lost")
