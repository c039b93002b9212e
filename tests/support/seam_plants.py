"""Defects planted in kvref's manager at the seams of shared pages, windows,
offload and transfer (issue 27 part 5), as monkeypatches: each is applied to
kvref for one test and found by the composed layers (the lockstep,
exhaustive replay or controlled scheduler in kvref's default configuration).
Moved here from the retired sharing and retention kvref plants, which their
own locksteps found; tests/conformance/test_seam_plants.py runs them."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvref.core.stream_table import Key, StreamTable
from kvref.core.streams import CacheStream
from kvref.manager import KVManager
from kvref.offload.calls import EvictionCalls
from kvref.prefix import cache as prefix_cache
from kvref.stepping import truncation
from kvref.stepping.forks import Forks
from kvref.transfer.published import KVSequenceInfo, PublishedKVInfo
from kvref.transfer.retrieval import Retrieval

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


def window_pages_cached(mp: pytest.MonkeyPatch) -> None:
    """(a) vLLM 42948: cache_prefix registers a windowed label's pages (W9
    off), so the window's release leaves them on the LRU as cached."""
    orig = prefix_cache.cache_prefix

    def bad(table: StreamTable, rid: str, label: str, tokens: object, start: int = 0) -> int:
        windows, table.windows = table.windows, {}
        try:
            return orig(table, rid, label, tokens, start)  # type: ignore[arg-type]
        finally:
            table.windows = windows

    mp.setattr(prefix_cache, "cache_prefix", bad)


def stale_window(mp: pytest.MonkeyPatch) -> None:
    """(b) SGLang PR 27586: the release works the window out from `position`,
    which a truncate and a fork leave stale (W4 off): the next commit frees
    a page of the window."""
    orig_truncate, orig_apply = truncation.truncate, Forks.apply

    def truncate(table: StreamTable, rid: str, label: str, new_len: int) -> int:
        stream = table.stream(rid, label)
        position = stream.position
        try:
            return orig_truncate(table, rid, label, new_len)
        finally:
            stream.position = position

    def apply(self: Forks, rid: str, from_label: str, to_label: str,
              created: set[Key], span: int = 0, copy: bool = False) -> None:
        dst = self._table.streams[rid][to_label]
        position = dst.position
        orig_apply(self, rid, from_label, to_label, created, span, copy)
        dst.position = position

    def retire(self: StreamTable, key: Key, stream: CacheStream) -> int:
        w = self.windows.get(key[1])
        if w is None:
            return 0
        ps = self.page_size
        # the commit's span moved position on from the stale value
        upto = min(max(0, stream.position - w) // ps, -(-stream.stored_len // ps))
        off = stream.released // ps
        if upto <= off:
            return 0
        go = stream.page_indices[:upto - off]
        stream.page_indices = stream.page_indices[upto - off:]
        stream.released = upto * ps
        return self.give_back(key, go)

    def add_position(self: object, step: object, streams: object = None) -> None:
        # position moves by the span, not to the length
        for seg in step.segments:  # type: ignore[attr-defined]
            if seg.span:
                s = self._table.streams[seg.request_id][seg.label]  # type: ignore[attr-defined]
                if not s.offloaded:
                    s.stored_len += seg.span
                    s.position += seg.span
                    s.generation += 1
                    self._table.retire((seg.request_id, seg.label), s)  # type: ignore[attr-defined]

    from kvref.stepping.admit_plan_commit import Stepping
    mp.setattr(truncation, "truncate", truncate)
    mp.setattr(Forks, "apply", apply)
    mp.setattr(StreamTable, "retire", retire)
    mp.setattr(Stepping, "_add_spans", add_position)


RETIRED: dict[Key, list[int]] = {}


def release_lists_name_retired_pages(mp: pytest.MonkeyPatch) -> None:
    """(c) vLLM 42571: the eager-store list keeps the ids of the pages the
    window retired, and a remove's or an offload's release list names them
    again (W7 off)."""
    orig_retire = StreamTable.retire
    RETIRED.clear()

    def retire(self: StreamTable, key: Key, stream: CacheStream) -> int:
        before = list(stream.page_indices)
        freed = orig_retire(self, key, stream)
        gone = before[:len(before) - len(stream.page_indices)]
        RETIRED.setdefault(key, []).extend(gone)
        return freed

    orig_remove = KVManager.remove_request

    def remove(self: KVManager, rid: str) -> None:
        for label, s in self._streams.get(rid, {}).items():
            s.page_indices = s.page_indices + RETIRED.pop((rid, label), [])
        orig_remove(self, rid)

    mp.setattr(StreamTable, "retire", retire)
    mp.setattr(KVManager, "remove_request", remove)


def off_by_one_at_the_window(mp: pytest.MonkeyPatch) -> None:
    """(d) the release drops a page that *starts* before the window's first
    token f (ceil(f / ps) slots, not f // ps): token f is gone (W2 off)."""

    def retire(self: StreamTable, key: Key, stream: CacheStream) -> int:
        w = self.windows.get(key[1])
        if w is None:
            return 0
        ps = self.page_size
        upto = min(-(-max(0, stream.stored_len - w) // ps), -(-stream.stored_len // ps))
        off = stream.released // ps
        if upto <= off:
            return 0
        go = stream.page_indices[:upto - off]
        stream.page_indices = stream.page_indices[upto - off:]
        stream.released = upto * ps
        return self.give_back(key, go)

    mp.setattr(StreamTable, "retire", retire)


def margin_ignored(mp: pytest.MonkeyPatch) -> None:
    """(e) the commit releases from n - W (W15 off): a rollback of the
    margin's tokens is then refused, and the stream holds fewer pages."""
    orig = StreamTable.retire

    def retire(self: StreamTable, key: Key, stream: CacheStream) -> int:
        margins, self.margins = self.margins, {}
        try:
            return orig(self, key, stream)
        finally:
            self.margins = margins

    mp.setattr(StreamTable, "retire", retire)


def margin_counted_as_window(mp: pytest.MonkeyPatch) -> None:
    """(f) the truncate's check uses W + k, as configuring a larger window
    would (the example engine's finding): a rollback within the margin is
    refused with ReleasedPrefixError."""
    orig = truncation.truncate

    def truncate(table: StreamTable, rid: str, label: str, new_len: int) -> int:
        windows = table.windows
        table.windows = {lb: w + table.margins.get(lb, 0) for lb, w in windows.items()}
        try:
            return orig(table, rid, label, new_len)
        finally:
            table.windows = windows

    mp.setattr(truncation, "truncate", truncate)


def retrieve_ignores_released(mp: pytest.MonkeyPatch) -> None:
    """(g) the consumer keeps its own `released`, not the peer's (W16 off): it
    gives the slots the peer released pages, holding more than the window."""

    def own(self: Retrieval, label: str, stream: CacheStream | None,
            info: KVSequenceInfo) -> int:
        return stream.released if stream is not None else 0

    mp.setattr(Retrieval, "_released_after", own)


def publish_forgets_released(mp: pytest.MonkeyPatch) -> None:
    """(h) publish names the retained pages but says nothing was released
    (W17 off): read by position, each page would be taken for an earlier slot;
    the consumer must refuse it."""
    orig = Retrieval.publish

    def publish(self: Retrieval, rid: str) -> object:
        pub = orig(self, rid)
        if isinstance(pub, PublishedKVInfo):
            for info in pub.get(0).values():
                info.released = 0
        return pub

    mp.setattr(Retrieval, "publish", publish)




# --- issue 27 part 5: new plants at the seams (found by the composed layers
# once their clean run passes the CI budget; not yet run there)


def received_kv_cached(mp: pytest.MonkeyPatch) -> None:
    """S30/R55 off: cache_prefix keys a stream whose KV a peer sent (a
    retrieve, or a fork of it), so a later match hits KV nobody computed
    here."""
    orig = prefix_cache.cache_prefix

    def bad(table: StreamTable, rid: str, label: str, tokens: object, start: int = 0) -> int:
        stream = table.stream(rid, label)
        received, stream.received = stream.received, False
        try:
            return orig(table, rid, label, tokens, start)  # type: ignore[arg-type]
        finally:
            stream.received = received

    mp.setattr(prefix_cache, "cache_prefix", bad)
