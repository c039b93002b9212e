"""The anchors' shared-page defects, planted in kvref's manager, each found by
the sharing lockstep (tests/conformance/test_sharing_lockstep.py) within the
budget the clean manager passes (`run_lockstep`: its BUDGET, derandomized,
300 runs of at most 40 calls, then its SCENARIOS of rare cases).

The pool-level defects (an evicted page left in the index, a hit left in
the LRU, untagged extra keys, an uncapped hit, a page released twice in one
list, a deduplicating register that frees, two release paths) are planted
in `kvref.core.page_pool` and found by the pool's lockstep
(tests/conformance/test_page_pool_plants.py). These are the manager's:
what a stream does with shared pages. Each is adapted from a reported bug,
or is a rule of specs/rules.md (R51-R62) broken.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis.errors import Flaky

from kvref.core.stream_table import StreamTable
from kvref.core.streams import CacheStream
from kvref.manager import KVManager
from kvref.offload.calls import EvictionCalls
from kvref.prefix import cache as prefix_cache
from kvref.stepping import truncation
from kvref.stepping.forks import Forks
from tests.conformance.test_sharing_lockstep import SharingLockstep, run_lockstep

Plant = Callable[[pytest.MonkeyPatch], None]


def no_copy_on_write(mp: pytest.MonkeyPatch) -> None:
    """R52: the admit that writes into a shared partial page (after a truncate
    into it) writes in place, and the other holder reads the new tokens."""
    mp.setattr(StreamTable, "cow_needed", lambda self, key, stream: False)


def fork_shares_the_partial_page(mp: pytest.MonkeyPatch) -> None:
    """R51: the fork shares the source's partly filled last page too, so the
    next write of either stream lands in the other's page."""
    orig = Forks._share

    def bad(self: Forks, rid: str, from_label: str, to_label: str, span: int = 0) -> None:
        src = self._table.streams[rid][from_label]
        ps = self._table.page_size
        if src.stored_len % ps == 0:
            return orig(self, rid, from_label, to_label, span)
        # round the source up to whole pages: the part page is shared as if full
        n = src.stored_len
        src.stored_len = -(-n // ps) * ps
        try:
            orig(self, rid, from_label, to_label, span)
        finally:
            src.stored_len = n

    mp.setattr(Forks, "_share", bad)


def truncate_keeps_the_chain(mp: pytest.MonkeyPatch) -> None:
    """vLLM PRs 18668/19006, adapted: rejected draft tokens stay named in the
    stream's chain after the truncate, so the pages written after it are
    keyed as if they held the drafts."""
    orig = truncation.truncate

    def bad(table: StreamTable, rid: str, label: str, new_len: int) -> int:
        stream = table.stream(rid, label)
        keys, raw = list(stream.keys), bytearray(stream.key_tokens)
        freed = orig(table, rid, label, new_len)
        stream.keys, stream.key_tokens = keys, raw
        return freed

    mp.setattr(truncation, "truncate", bad)


def draft_tokens_cached(mp: pytest.MonkeyPatch) -> None:
    """vLLM PRs 18668/19006: tokens not yet committed (a draft before its
    verify) are registered: cache_prefix does not check the committed length."""
    orig = prefix_cache.cache_prefix

    def bad(table: StreamTable, rid: str, label: str, tokens: object, start: int = 0) -> int:
        stream = table.stream(rid, label)
        n = stream.stored_len
        stream.stored_len = max(n, start + len(tokens))  # type: ignore[arg-type]
        try:
            return orig(table, rid, label, tokens, start)  # type: ignore[arg-type]
        finally:
            stream.stored_len = n

    mp.setattr(prefix_cache, "cache_prefix", bad)


def reset_keeps_shared_pages(mp: pytest.MonkeyPatch) -> None:
    """R62: reset_request(free=False) keeps every page as spare, shared ones
    included, and the next write into them lands in another stream's page."""
    mp.setattr(StreamTable, "release_shared",
               lambda self, key, stream, private=None: None)


def reclaimable_counts_shared_pages(mp: pytest.MonkeyPatch) -> None:
    """SGLang 35270: the evictable size counts pages other requests hold."""
    def bad(self: KVManager, rid: str) -> int:
        with self._lock:
            return len({p for s in self._streams.get(rid, {}).values()
                        for p in s.page_indices})

    mp.setattr(EvictionCalls, "reclaimable", bad)


def hit_onto_a_stream_with_tokens(mp: pytest.MonkeyPatch) -> None:
    """R58: a hit attaches cached pages to a stream that holds tokens: its
    tokens are dropped, or its pages become spare while shared."""
    orig = prefix_cache.match_prefix

    def bad(table: StreamTable, rid: str, label: str, tokens: object) -> int:
        stream = table.request(rid).get(label)
        if stream is None or not stream.stored_len:
            return orig(table, rid, label, tokens)  # type: ignore[arg-type]
        n = stream.stored_len
        stream.stored_len = 0
        try:
            return orig(table, rid, label, tokens)  # type: ignore[arg-type]
        finally:
            if not stream.stored_len:
                stream.stored_len = n

    mp.setattr(prefix_cache, "match_prefix", bad)


def fork_keeps_the_targets_key_chain(mp: pytest.MonkeyPatch) -> None:
    """A fork target keeps its old chain of keys: the next cache_prefix skips
    (or mis-keys) the pages the fork gave it."""
    orig = Forks.apply

    def bad(self: Forks, rid: str, from_label: str, to_label: str,
            created: set[tuple[str, str]], span: int = 0, copy: bool = False) -> None:
        dst: CacheStream = self._table.streams[rid][to_label]
        keys, raw = list(dst.keys), bytearray(dst.key_tokens)
        orig(self, rid, from_label, to_label, created, span, copy)
        if keys:
            dst.keys, dst.key_tokens = keys, raw

    mp.setattr(Forks, "apply", bad)


PLANTS: dict[str, Plant] = {
    "no copy-on-write after a truncate into a shared page (R52)": no_copy_on_write,
    "a fork shares the partial last page (R51)": fork_shares_the_partial_page,
    "a truncate keeps the chain's keys (vLLM 18668/19006)": truncate_keeps_the_chain,
    "draft tokens cached before commit (vLLM 18668/19006)": draft_tokens_cached,
    "reset keeps shared pages as spare (R62)": reset_keeps_shared_pages,
    "reclaimable counts shared pages (SGLang 35270)": reclaimable_counts_shared_pages,
    "a hit onto a stream that holds tokens (R58)": hit_onto_a_stream_with_tokens,
    "a fork target keeps its old key chain": fork_keeps_the_targets_key_chain,
}


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_sharing_lockstep_finds_the_plant(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    PLANTS[name](monkeypatch)
    SharingLockstep.seen.clear()
    with pytest.raises((AssertionError, Flaky)):
        run_lockstep()
