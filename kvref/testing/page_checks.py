"""The device-page invariant of a `KVManager`, executable: every check that
drives a manager (lockstep, the scheduled tests, the unit fixtures) runs
this one, so the invariant is stated once.

I1 (with shared pages): each page other than the sink is held by exactly
the streams whose page table names it (its reference count is their
number), or free, and the pool's own structures agree (`PagePool.
sanity_check`: held / free-cached / free-blank, one each). I2: the sink is
never in a table. a stream's spare pages (past its last token's page)
are private to it (R52), so no write past a stream's length lands in a page
another stream reads or the prefix cache names.
"""

from __future__ import annotations

from collections import defaultdict

from kvref.manager import KVManager
from kvref.stepping.plan import SINK_PAGE


def check_device_pages(kv: KVManager) -> None:
    """Raise AssertionError naming the first broken part. Call with no other
    thread inside the manager."""
    pool = kv._pages
    pool.sanity_check()
    named: dict[int, set[tuple[str, str]]] = defaultdict(set)
    ps = kv.config.page_size
    for rid, labels in kv._streams.items():
        for label, s in labels.items():
            pages = s.page_indices
            assert SINK_PAGE not in pages, f"I2: sink page in {rid}/{label}"
            assert len(set(pages)) == len(pages), f"I1: {rid}/{label} names a page twice"
            for p in pages:
                named[p].add((rid, label))
            # an offload's claim keeps the pages until its commit empties the table
            # (slots from released // ps on: a windowed stream's released
            # slots hold no page and are not in the list)
            assert s.released % ps == 0, f"W2: {rid}/{label} released part of a page"
            spare = pages[-(-s.stored_len // ps) - s.released // ps:] if pages else []
            if spare:
                private = pool.private_pages((rid, label), spare)
                bad = [p for p, mine in zip(spare, private, strict=True) if not mine]
                assert not bad, (f"R52: {rid}/{label} keeps shared or cached pages {bad} "
                                 "past its last token")
    for p in range(pool.first, pool.num_pages):
        holders = pool.holders(p)
        assert holders == named.get(p, set()), (
            f"I1: page {p} is held by {sorted(map(str, holders))} but named by the tables "
            f"of {sorted(map(str, named.get(p, set())))}")
    held = len(named)
    assert kv.num_free_pages + held + 1 == kv.config.max_num_pages, (
        f"I1: {kv.num_free_pages} free + {held} held + the sink != "
        f"{kv.config.max_num_pages} pages: a page is lost")
