"""The anchors' shared-page defects, planted, and the layer that finds each.

Each plant is one defect class that vLLM, SGLang or mini-sglang shipped and
fixed (issue 18), adapted to kvref.core.page_pool and planted by monkeypatch.
Two layers must find it:

- the lockstep machine (tests/conformance/test_page_pool_lockstep.py),
  with a fixed budget: derandomized, no database, no shrinking, 200
  examples of at most 50 steps; the clean pool passes the same budget;
- the model checker (kvref_model.pages_check, at its default scope), on the
  model with the rule that prevents the defect switched off (the model with
  every rule passes that scope: tests/model/test_pages_model.py).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvref.core import page_keys as prefix_hash
from kvref.core.page_pool import PageNotWritableError, PagePool, PageRefError, Registered
from kvref_model.pages import variant
from kvref_model.pages_check import SCOPE, check
from tests.conformance.test_page_pool_lockstep import PagePoolLockstep

BUDGET = settings(max_examples=200, stateful_step_count=50, derandomize=True,
                  database=None, deadline=None, phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=[HealthCheck.too_slow], print_blob=False)

Plant = Callable[[pytest.MonkeyPatch], None]


def evicted_page_stays_indexed(mp: pytest.MonkeyPatch) -> None:
    """vLLM PR 4761: eviction forgets the page's key but not the index entry,
    so the key is hit (or deduplicated onto) after the page is reused."""
    def bad(self: PagePool) -> int:
        p = self._lru.pop_front()
        self._key[p] = None
        return p

    mp.setattr(PagePool, "_evict", bad)


def hit_leaves_page_queued(mp: pytest.MonkeyPatch) -> None:
    """vLLM 16825: the LRU queue and the free table out of sync: a hit on a
    free-cached page takes a reference but leaves it queued for eviction."""
    mp.setattr(PagePool, "_touch", lambda self, p: None)


def untagged_extra_keys(mp: pytest.MonkeyPatch) -> None:
    """vLLM 44701: extra keys joined untagged: ("lora" "a", "salt" "b") hashes
    like ("salt" "ab"), so one tenant's pages hit under another's key."""
    mp.setattr(prefix_hash, "encode_extras",
               lambda extras: "".join(str(v) for _, v in extras).encode())


def cached_length_not_capped(mp: pytest.MonkeyPatch) -> None:
    """vLLM PR 11186: a fully cached prompt attaches every page, leaving no
    token to compute (the cap is len(tokens) - 1)."""
    mp.setattr(PagePool, "_cacheable_pages", lambda self, n: n // self.page_size)


def same_page_twice_in_release(mp: pytest.MonkeyPatch) -> None:
    """vLLM 42571: a page listed twice in one release passes the check, is
    decremented twice and queued twice."""
    orig = PagePool._check_release

    def bad(self: PagePool, owner: Hashable, pages: list[int]) -> None:
        orig(self, owner, list(dict.fromkeys(pages)))  # each page checked once

    mp.setattr(PagePool, "_check_release", bad)


def dedup_frees_referenced_page(mp: pytest.MonkeyPatch) -> None:
    """mini-sglang PR 142: de-duplication on register frees the caller's page
    while the caller's page table still references it."""
    orig = PagePool.register

    def bad(self: PagePool, page: int, parent: bytes | None, tokens: Sequence[int],
            extras: Sequence[tuple[str, str]] = ()) -> Registered:
        r = orig(self, page, parent, tokens, extras)
        if r.deduplicated:
            with self._lock:
                self._holders[page] = None
                self._blank.append(page)
        return r

    mp.setattr(PagePool, "register", bad)


def evictable_counts_shared_twice(mp: pytest.MonkeyPatch) -> None:
    """SGLang 35270: the evictable count counts a page once per reference
    released, so a page two released streams share is counted twice."""
    def bad(self: PagePool, released: Mapping[Hashable, Sequence[int]]) -> int:
        going = set(released)
        return sum(1 for pages in released.values() for p in pages
                   if self._owners(p) <= going)

    mp.setattr(PagePool, "reclaimable", bad)


def double_free_two_paths(mp: pytest.MonkeyPatch) -> None:
    """SGLang PR 12224: a release does not check that its owner holds the
    page, so a second release path frees the same pages again."""
    def bad(self: PagePool, owner: Hashable, pages: list[int]) -> None:
        self._check_distinct(pages, PageRefError, "a release")

    mp.setattr(PagePool, "_check_release", bad)


def write_without_copy(mp: pytest.MonkeyPatch) -> None:
    """Issue 18: a missing copy-on-write: a write into a shared page passes."""
    def bad(self: PagePool, owner: Hashable, page: int) -> None:
        self._check_page(page, PageNotWritableError)
        if owner not in self._owners(page):
            raise PageNotWritableError(f"page {page}: {owner!r} does not hold it")

    mp.setattr(PagePool, "check_writable", bad)


# plant -> (the anchor's report, the model rule that prevents it)
PLANTS: dict[str, tuple[Plant, str, str]] = {
    "evicted_page_stays_indexed": (evicted_page_stays_indexed, "vLLM PR 4761",
                                   "EVICT_DROPS_KEY"),
    "hit_leaves_page_queued": (hit_leaves_page_queued, "vLLM 16825", "HIT_LEAVES_LRU"),
    "untagged_extra_keys": (untagged_extra_keys, "vLLM 44701", "TAGGED_EXTRAS"),
    "cached_length_not_capped": (cached_length_not_capped, "vLLM PR 11186",
                                 "CAP_BEFORE_LAST_TOKEN"),
    "same_page_twice_in_release": (same_page_twice_in_release, "vLLM 42571",
                                   "RELEASE_REFUSES_DUPLICATES"),
    "dedup_frees_referenced_page": (dedup_frees_referenced_page, "mini-sglang PR 142",
                                    "DEDUP_KEEPS_PAGE"),
    "evictable_counts_shared_twice": (evictable_counts_shared_twice, "SGLang 35270",
                                      "RECLAIM_COUNTS_PAGES_ONCE"),
    "double_free_two_paths": (double_free_two_paths, "SGLang PR 12224",
                              "RELEASE_CHECKS_HOLDER"),
    "write_without_copy": (write_without_copy, "issue 18 (copy-on-write)",
                           "WRITE_NEEDS_PRIVATE"),
}


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_lockstep_finds_the_plant(name: str, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    plant, anchor, _ = PLANTS[name]
    plant(monkeypatch)
    PagePoolLockstep.runs = 0
    with pytest.raises(AssertionError) as found:
        run_state_machine_as_test(PagePoolLockstep, settings=BUDGET)
    with capsys.disabled():
        first = str(found.value).splitlines()[0][:150] if str(found.value) else "?"
        print(f"\n  {name} ({anchor}), example {PagePoolLockstep.runs}: "
              f"{type(found.value).__name__}: {first}")


def test_the_clean_pool_passes_the_same_budget() -> None:
    run_state_machine_as_test(PagePoolLockstep, settings=BUDGET)


def test_the_stale_index_is_hit_after_reuse_even_without_sanity_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # sanity_check finds vLLM PR 4761's index entry at once; without it, the
    # lockstep comparison finds the symptom the anchor shipped: a hit (or a
    # dedup) on a page that was evicted and handed to another stream
    evicted_page_stays_indexed(monkeypatch)
    monkeypatch.setattr(PagePool, "sanity_check", lambda self: None)
    with pytest.raises(AssertionError, match=r"^(Match|Lookup|Register)\("):
        run_state_machine_as_test(PagePoolLockstep, settings=BUDGET)


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_model_checker_finds_the_rule_removed(name: str) -> None:
    _, _, rule = PLANTS[name]
    rep = check(variant(rule)(SCOPE))
    assert rep.violations, f"the model without {rule} broke no invariant"
