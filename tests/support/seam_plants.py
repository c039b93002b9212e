"""Defects planted in kvref's manager at the seams of shared pages, windows,
offload and transfer (issue 27 part 5), as monkeypatches: each is applied to
kvref for one test and found by the composed layers (the lockstep,
exhaustive replay or controlled scheduler in kvref's default configuration).
Moved here from the retired sharing and retention kvref plants, which their
own locksteps found; tests/conformance/test_seam_plants.py runs them."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence

import pytest

from kvref.core.errors import KVRefError
from kvref.core.labels import LabelBehaviour, SlidingWindow
from kvref.core.page_pool import PagePool
from kvref.core.sharing import PageSharing, PrefixSharing
from kvref.core.stream_table import Key, StreamTable
from kvref.core.streams import CacheStream, FollowedTokens
from kvref.manager import KVManager
from kvref.offload.calls import EvictionCalls
from kvref.offload.phases import HostOffload
from kvref.prefix import cache as prefix_cache
from kvref.stepping import admission, truncation
from kvref.stepping.forks import Forks
from kvref.transfer.published import KVSequenceInfo, PublishedKVInfo
from kvref.transfer.retrieval import Retrieval

Plant = Callable[[pytest.MonkeyPatch], None]

def no_copy_on_write(mp: pytest.MonkeyPatch) -> None:
    """R52: the admit that writes into a shared partial page (after a truncate
    into it) writes in place, and the other holder reads the new tokens."""
    mp.setattr(PrefixSharing, "cow_needed", lambda self, key, stream: False)


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
    mp.setattr(PrefixSharing, "release_shared",
               lambda self, key, stream, private=None, head_first=False: None)


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


def window_of(table: StreamTable, label: str) -> int | None:
    """The label's window W, where it is a sliding window: what these plants
    work their own, wrong, release out from."""
    behaviour: LabelBehaviour = table.behaviour(label)
    return behaviour.window_tokens if isinstance(behaviour, SlidingWindow) else None


def window_pages_cached(mp: pytest.MonkeyPatch) -> None:
    """(a) vLLM 42948: cache_prefix registers a windowed label's pages (W9
    off), so the window's release leaves them on the LRU as cached."""
    orig = prefix_cache.cache_prefix

    def bad(table: StreamTable, rid: str, label: str, tokens: object, start: int = 0) -> int:
        behaviours, table.behaviours = table.behaviours, {}
        try:
            return orig(table, rid, label, tokens, start)  # type: ignore[arg-type]
        finally:
            table.behaviours = behaviours

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
        w = window_of(self, key[1])
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

    def add_position(self: object, step: object, streams: object = None,
                     due: object = None) -> None:
        # position moves by the span, not to the length
        for seg in step.segments:  # type: ignore[attr-defined]
            if seg.span:
                s = self._table.streams[seg.request_id][seg.label]  # type: ignore[attr-defined]
                if not s.offloaded:
                    s.stored_len += seg.span
                    s.position += seg.span
                    s.generation += 1
                    self._table.retire((seg.request_id, seg.label), s)  # type: ignore[attr-defined]

    def end_plain(self: object, step: object, streams: list[CacheStream],
                  due: object = None) -> None:
        # a plain admit's commit: its marks cleared, its spans added as above
        for s in streams:
            s.clear_in_flight()
        if step.commit:  # type: ignore[attr-defined]
            add_position(self, step)

    from kvref.stepping.admit_plan_commit import Stepping
    mp.setattr(truncation, "truncate", truncate)
    mp.setattr(Forks, "apply", apply)
    mp.setattr(StreamTable, "retire", retire)
    mp.setattr(Stepping, "_add_spans", add_position)
    mp.setattr(Stepping, "_end_plain", end_plain)


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

    def retire_each(self: StreamTable, keys: list[Key], streams: list[CacheStream]) -> None:
        for key, stream in zip(keys, streams, strict=True):
            retire(self, key, stream)

    mp.setattr(StreamTable, "retire", retire)
    # a decode step's commit retires its windows in one call
    mp.setattr(StreamTable, "retire_each", retire_each)
    mp.setattr(KVManager, "remove_request", remove)


def off_by_one_at_the_window(mp: pytest.MonkeyPatch) -> None:
    """(d) the release drops a page that *starts* before the window's first
    token f (ceil(f / ps) slots, not f // ps): token f is gone (W2 off).
    Planted in the window's arithmetic, which both the commit's question
    "did this stream's window pass a page?" and `StreamTable.retire` ask (a
    plant in `retire` alone is never reached: the commit asks first)."""

    def released_after(self: SlidingWindow, released: int, length: int, ps: int) -> int:
        upto = min(-(-max(0, length - self.window_tokens) // ps), -(-length // ps))
        return max(released, upto * ps)

    mp.setattr(SlidingWindow, "released_after", released_after)


def margin_ignored(mp: pytest.MonkeyPatch) -> None:
    """(e) the commit releases from n - W (W15 off): a rollback of the
    margin's tokens is then refused, and the stream holds fewer pages.
    Planted in the window's arithmetic, for the reason (d) is."""

    def released_after(self: SlidingWindow, released: int, length: int, ps: int) -> int:
        return max(released, max(0, length - self.window_tokens) // ps * ps)

    mp.setattr(SlidingWindow, "released_after", released_after)


def margin_counted_as_window(mp: pytest.MonkeyPatch) -> None:
    """(f) the truncate's check uses W + k, as configuring a larger window
    would (the example engine's finding): a rollback within the margin is
    refused with ReleasedPrefixError."""
    orig = truncation.truncate

    def truncate(table: StreamTable, rid: str, label: str, new_len: int) -> int:
        behaviours = table.behaviours
        table.behaviours = {lb: SlidingWindow(b.window_tokens + b.margin, b.margin)
                            if isinstance(b, SlidingWindow) else b
                            for lb, b in behaviours.items()}
        try:
            return orig(table, rid, label, new_len)
        finally:
            table.behaviours = behaviours

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




# --- issue 27 part 5: plants at the seams of two mechanisms. Which composed
# layer finds each, within what budget, and at which example:
# tests/conformance/test_interaction_plants.py (`FOUND_BY`)


def received_kv_cached(mp: pytest.MonkeyPatch) -> None:
    """S30/R55 off: cache_prefix keys a stream whose KV a peer sent (a
    retrieve, or a fork of it), so a later match hits KV nobody computed
    here."""
    orig = prefix_cache.cache_prefix

    def bad(table: StreamTable, rid: str, label: str, tokens: object, start: int = 0) -> int:
        stream = table.stream(rid, label)
        received, stream.received_at = stream.received_at, None
        try:
            return orig(table, rid, label, tokens, start)  # type: ignore[arg-type]
        finally:
            stream.received_at = received

    mp.setattr(prefix_cache, "cache_prefix", bad)


def offload_commit_frees_shared_pages(mp: pytest.MonkeyPatch) -> None:
    """vLLM 42571 class (shared pages x offload): the offload commit frees
    every page the stream lists, dropping the other holders' references too
    (as a free by block id would), so a page another stream still reads
    goes back to the free list (R53 off)."""
    orig = HostOffload.commit

    def commit(self: HostOffload, offload: object, claims: object, copied: object) -> object:
        table = self.table
        give_back = table.give_back

        def free_all(key: Key, pages: list[int]) -> int:
            for p in pages:
                for holder in table.pages.holders(p) - {key}:
                    table.pages.release(holder, [p])
            return give_back(key, pages)

        table.give_back = free_all  # type: ignore[method-assign]
        try:
            return orig(self, offload, claims, copied)  # type: ignore[arg-type]
        finally:
            del table.give_back

    mp.setattr(HostOffload, "commit", commit)


class _NoCow:
    """The manager's `PageSharing`, except that it never asks for a copy-on-write."""

    def __init__(self, inner: PageSharing) -> None:
        self.inner = inner

    def cow_needed(self, key: Key, stream: CacheStream) -> bool:
        return False

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def preplan_skips_copy_on_write(mp: pytest.MonkeyPatch) -> None:
    """Shared pages x preplan (R52 at R57): a preplanned admit writing into a
    shared partial page (after a truncate into it) reserves and makes no
    private copy, so the promoted step writes into the other holder's page."""
    orig = admission.reserve
    signature = inspect.signature(orig)

    def reserve(*args: object, **kwargs: object) -> object:
        # bound by name: the manager passes ``sharing`` by position
        bound = signature.bind(*args, **kwargs)
        sharing = bound.arguments.get("sharing")
        if bound.arguments.get("copy_forks") and sharing is not None:
            bound.arguments["sharing"] = _NoCow(sharing)  # type: ignore[arg-type]
        return orig(*bound.args, **bound.kwargs)  # type: ignore[arg-type]

    mp.setattr(admission, "reserve", reserve)


def offload_copy_forgets_the_window(mp: pytest.MonkeyPatch) -> None:
    """Windows x offload (W8 off): the offload's host copy of a windowed
    stream records it as if nothing were released, so the host holds the
    retained pages under slots from 0 and a reload puts the window's
    tokens at the released positions."""
    from kvref.offload.host_pool import CPUPagePool

    orig = HostOffload.copy_to_host

    def copy_to_host(self: HostOffload, offload: object, claim: object) -> object:
        record = self.pool.record

        def record_from_zero(rid: str, label: str, pages: list[int], stored_len: int,
                             position: int, released: int) -> None:
            record(rid, label, pages, stored_len - released, position - released, 0)

        self.pool.record = record_from_zero  # type: ignore[method-assign]
        try:
            return orig(self, offload, claim)  # type: ignore[arg-type]
        finally:
            del self.pool.record

    assert hasattr(CPUPagePool, "record")
    mp.setattr(HostOffload, "copy_to_host", copy_to_host)


def match_attaches_after_the_lock(mp: pytest.MonkeyPatch) -> None:
    """Shared pages x eviction, a race: match_prefix looks its pages up
    before it takes the manager's lock (the pool's own lock makes the
    lookup itself safe) and attaches what it found under it, without
    looking again, as a lookup-then-allocate scheduler does. An allocation
    that evicts a free-cached page in between hands it to another stream,
    and the hit attaches it anyway: two streams, one page, other tokens."""
    from kvref.prefix import keys as prefix_hash

    def match_prefix(self: KVManager, rid: str, label: str, token_ids: object) -> int:
        table = self._table
        extras = prefix_cache.extras_for(table, rid, label)
        hit = table.pages.lookup(token_ids, extras)  # type: ignore[arg-type]
        with self._lock:
            stream = table.request(rid).get(label)
            if (not hit.num_tokens or (stream is not None and stream.stored_len)
                    or not table.sharing.caches(table.behaviour(label))):
                return prefix_cache.match_prefix(table, rid, label, token_ids)  # type: ignore[arg-type]
            stream = table.request(rid).setdefault(label, CacheStream())
            key = (rid, label)
            for p in hit.pages:  # attached as looked up, held or free-cached
                if table.pages.refcount(p):
                    table.pages.share(key, [p])  # held: by a sharer, or since evicted
                else:
                    table.pages.attach(key, [p])
            n = hit.num_tokens
            stream.page_indices = list(hit.pages) + stream.page_indices
            stream.stored_len = stream.position = n
            stream.keys = list(hit.keys)
            raw = prefix_hash.token_bytes(token_ids)  # type: ignore[arg-type]
            stream.key_tokens = bytearray(raw[:n * 8])
            stream.generation += 1
            return n

    mp.setattr(KVManager, "match_prefix", match_prefix)


def reset_clears_the_sharers_chain(mp: pytest.MonkeyPatch) -> None:
    """Shared pages x reset: reset_request of one request drops the key
    chain of every stream that shares a page with it, the other sharer's
    too, so its next cache_prefix re-keys pages it had keyed (and its
    count of keyed pages is wrong)."""
    orig = KVManager.reset_request

    def reset(self: KVManager, rid: str, free: bool = False) -> None:
        mine = {p for s in self._streams.get(rid, {}).values() for p in s.page_indices}
        others = [s for r, streams in self._streams.items() if r != rid
                  for s in streams.values() if mine & set(s.page_indices)]
        orig(self, rid, free)
        for s in others:
            s.keys = []
            s.key_tokens = bytearray()

    mp.setattr(KVManager, "reset_request", reset)


def fork_drops_the_margin(mp: pytest.MonkeyPatch) -> None:
    """Windows x fork (W15 at W5): the fork target's window is worked out
    without its rollback margin, so it releases the margin's page at the
    fork and a rollback into the margin is refused there."""
    orig = Forks.apply

    def apply(self: Forks, rid: str, from_label: str, to_label: str,
              created: set[Key], span: int = 0, copy: bool = False) -> None:
        orig(self, rid, from_label, to_label, created, span, copy)
        table = self._table
        w = window_of(table, to_label)
        dst = table.streams[rid][to_label]
        if w is None or not dst.stored_len:
            return
        released = SlidingWindow(w).released_after(dst.released, dst.stored_len,
                                                   table.page_size)
        drop = (released - dst.released) // table.page_size
        if drop > 0:
            go = dst.page_indices[:drop]
            dst.page_indices = dst.page_indices[drop:]
            dst.released = released
            table.give_back((rid, to_label), go)

    mp.setattr(Forks, "apply", apply)


def fork_reserves_released_slots(mp: pytest.MonkeyPatch) -> None:
    """Windows x fork reservation (issue 27 defect 1 back): a step with forks
    (or a preplan) counts every stream from slot 0, released slots
    included, so a fork of a windowed stream reserves pages for slots
    nobody holds: refused where it fits, or spare pages kept."""
    orig = admission.reserve

    def reserve(table: object, *args: object, **kwargs: object) -> object:
        streams = [s for req in table.values() for s in req.values()]  # type: ignore[attr-defined]
        released = [s.released for s in streams]
        for s in streams:
            s.released = 0
        try:
            return orig(table, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            for s, r in zip(streams, released, strict=True):
                s.released = r

    mp.setattr(admission, "reserve", reserve)


def reset_cache_while_offloaded(mp: pytest.MonkeyPatch) -> None:
    """Prefix cache x offload (issue 27 defect 3 back, S30 off):
    reset_prefix_cache is accepted while a request is offloaded, so a
    reload and a cache_prefix make KV from before the reset findable."""
    orig = prefix_cache.reset_prefix_cache

    def reset(table: StreamTable) -> object:
        return table.pages.reset_prefix_cache()

    assert orig is not None
    mp.setattr(prefix_cache, "reset_prefix_cache", reset)


def reload_reattaches_without_a_reference(mp: pytest.MonkeyPatch) -> None:
    """Shared pages x reload (S29): the reload puts the cached pages its host
    copy's keys find back into the stream's table without taking a
    reference, so the page is free (or another's only) while it reads it."""
    orig = HostOffload.reload

    def reload(self: HostOffload, rid: str) -> object:
        pages = self.table.pages
        pages.attach = lambda owner, ps: None  # type: ignore[method-assign]
        try:
            return orig(self, rid)
        finally:
            del pages.attach

    mp.setattr(HostOffload, "reload", reload)


def truncate_forgets_the_shared_tail(mp: pytest.MonkeyPatch) -> None:
    """Shared pages x truncate (R52 after R54): a truncate into a shared full
    page does not mark the tail as maybe shared, so the next write lands in
    the page the other holder reads."""
    orig = truncation.truncate

    def truncate(table: StreamTable, rid: str, label: str, new_len: int) -> int:
        freed = orig(table, rid, label, new_len)
        table.stream(rid, label).tail_maybe_shared = False
        return freed

    mp.setattr(truncation, "truncate", truncate)


def failed_fork_keeps_shared_pages(mp: pytest.MonkeyPatch) -> None:
    """Shared pages x faults (R26 at R51): a fork copy that fails empties its
    target but leaves it holding the pages it shared, as spare pages: the
    next write into the target lands in a page another stream reads."""
    def emptied(self: Forks, rid: str, label: str, dst: CacheStream) -> None:
        dst.stored_len = 0
        dst.position = 0
        dst.released = 0
        dst.keys = []
        dst.key_tokens = bytearray()
        dst.generation += 1

    mp.setattr(Forks, "_emptied", emptied)


# -- pages keyed as they fill (S33) -------------------------------------------


def truncate_hides_the_fill(mp: pytest.MonkeyPatch) -> None:
    """A truncate cuts a followed stream's chain but leaves its commit mark
    (`key_at`) where the old chain had it: the pages written after the cut
    fill unseen, and stay unkeyed until the stream grows past the old mark."""
    orig = CacheStream.truncate_to

    def bad(self: CacheStream, new_len: int, keep: int, page_size: int) -> list[int]:
        mark = self.key_at
        cut = orig(self, new_len, keep, page_size)
        self.key_at = mark
        return cut

    mp.setattr(CacheStream, "truncate_to", bad)


def reset_stops_following(mp: pytest.MonkeyPatch) -> None:
    """A reset request forgets the engine's list, so the commits recomputing
    it key nothing (the model follows it through the reset, S33)."""
    orig = CacheStream.reset

    def bad(self: CacheStream, freed: bool = False) -> None:
        orig(self, freed)
        self.follow_with(None, 1)

    mp.setattr(CacheStream, "reset", bad)


def page_filled_at_its_end_missed(mp: pytest.MonkeyPatch) -> None:
    """Off by one: a commit looks at a followed stream only once it is past
    the end of the page after its chain, so the page a step fills exactly is
    keyed a step late."""
    # `look_at`: where every commit sets a followed stream's next look
    # (`looked`, `look_at`), and `look_all`, where a commit sets a decode
    # batch's rows' by one store (`extend_followed`)
    orig = CacheStream.look_at

    def bad(self: CacheStream, at: int) -> None:
        orig(self, at if self.follow is None else at + 1)

    mp.setattr(CacheStream, "look_at", bad)
    orig_all = CacheStream.look_all

    def bad_all(streams: Sequence[CacheStream], ats: list[int]) -> None:
        if streams and streams[0]._batch is not None:  # its rows: no `look_at` call
            ats = [at if s.follow is None else at + 1 for s, at in zip(streams, ats, strict=True)]
        orig_all(streams, ats)

    mp.setattr(CacheStream, "look_all", staticmethod(bad_all))
    orig_follow = CacheStream.follow_with

    def bad_follow(self: CacheStream, followed: FollowedTokens | None, page_size: int) -> None:
        orig_follow(self, followed, page_size)
        if followed is not None:
            self.key_at += 1

    mp.setattr(CacheStream, "follow_with", bad_follow)


def commit_keys_in_reverse(mp: pytest.MonkeyPatch) -> None:
    """The one-pass keying registers a step's filled pages last segment
    first: of two pages filled with one key in one step, the later
    segment's takes it (S11 gives it to the first)."""
    # the pool call both one-pass paths make (a followed commit's keying
    # and a batch of `cache_prefixes`): patching either caller alone left
    # the other path's order as it was
    orig = PagePool.register_filled

    def bad(self: PagePool, pages: list[int], keys: list[bytes]
            ) -> tuple[list[int], KVRefError | None]:
        took, err = orig(self, pages[::-1], keys[::-1])
        return took[::-1], err

    mp.setattr(PagePool, "register_filled", bad)


# --- issue 44, item 1: a retrieve (or a step's copy-on-write) under the
# request's own lease (R71). Found by the seam traces "retrieve into a
# leased window" and "write after a truncate into a keyed page, leased"


def retrieve_ignores_the_lease(mp: pytest.MonkeyPatch) -> None:
    """R71 off in the retrieve: into a request whose publication is leased, its
    window's release (W16) and its copy-on-write (R52) give back pages the
    publication names, free to be reused while the peer copies them."""
    mp.setattr(Retrieval, "_gives_back_leased", lambda *args: None)


def copy_on_write_ignores_the_lease(mp: pytest.MonkeyPatch) -> None:
    """R71 off in the admit: a step writing after a leased request's shared
    partial page copies it first and gives back the page the lease names."""
    mp.setattr(admission, "leased_cow", lambda *args: None)


# -- issue 44: planted bugs no layer found (each with the reach it lacked in
# docs/verification/planted-bugs.md) ------------------------------------------


def cache_prefix_compares_from_token_0(mp: pytest.MonkeyPatch) -> None:
    """cache_prefix with 0 < start < the keyed end checks the ids it is given
    against the keyed tokens from token 0, not from ``start``: a correct
    call is refused (or, with ids alike, a wrong one passes)."""
    orig = prefix_cache._checked

    def checked(table: StreamTable, rid: str, label: str, tokens: object, start: int
                ) -> object:
        stream = table.stream(rid, label)
        raw = bytes(stream.key_tokens)
        if isinstance(start, int) and not isinstance(start, bool) and start > 0:
            # what the buggy compare reads at ``start``: the keyed tokens from 0
            stream.key_tokens = bytearray(start * 8) + bytearray(raw)
        try:
            return orig(table, rid, label, tokens, start)  # type: ignore[arg-type]
        finally:
            stream.key_tokens = bytearray(raw)

    mp.setattr(prefix_cache, "_checked", checked)


def preplan_privatises_by_refcount(mp: pytest.MonkeyPatch) -> None:
    """Forks x preplan x prefix cache (R57): a preplanned fork's target is
    made private by reference count alone, so a registered page only it
    holds stays, and the fork copies into a page the cache names."""
    def privatise(self: Forks, rid: str, label: str) -> None:
        table = self._table
        key = (rid, label)
        stream = table.streams[rid][label]
        pages = list(stream.page_indices)
        shared = [i for i, p in enumerate(pages) if table.pages.refcount(p) > 1]
        if not shared:
            return
        fresh = table.take(key, len(shared))
        self._kv_cache.copy_pages([pages[i] for i in shared], fresh)
        old = [pages[i] for i in shared]
        for i, p in zip(shared, fresh, strict=True):
            pages[i] = p
        table.give_back(key, old)
        stream.rehome_pages(pages)

    mp.setattr(Forks, "privatise", privatise)


def fork_drops_received(mp: pytest.MonkeyPatch) -> None:
    """Forks x retrieve x prefix cache (R55): the fork target does not carry
    the source's ``received_at``, so a sample forked from a retrieved
    stream has a peer's KV keyed by cache_prefix."""
    orig = CacheStream.fork_from

    def fork_from(self: CacheStream, src: CacheStream, space: str, page_size: int) -> None:
        orig(self, src, space, page_size)
        self.received_at = None

    mp.setattr(CacheStream, "fork_from", fork_from)


def cow_ignores_released(mp: pytest.MonkeyPatch) -> None:
    """Windows x forks x copy-on-write (R52 at W2): the check finds the
    partial page from slot 0, not from the first retained slot, so after a
    truncate within the rollback margin into a page a fork shares, the
    next write lands in the shared page."""
    def cow_needed(self: PrefixSharing, key: Key, stream: CacheStream) -> bool:
        if not stream.tail_maybe_shared:
            return False
        ps = self._page_size
        n = stream.stored_len
        i = n // ps
        return (n % ps != 0 and i < len(stream.page_indices)
                and not self._pages.writable(key, stream.page_indices[i]))

    mp.setattr(PrefixSharing, "cow_needed", cow_needed)


def follow_ignores_the_forks_label(mp: pytest.MonkeyPatch) -> None:
    """follow_tokens x forks (S33): the one-pass keying of a commit takes the
    extra keys worked out when the engine handed its ids over, though a
    fork since gave the stream its source's label: the next page is keyed
    under the wrong label, where no hit finds it."""
    from kvref.prefix import follow

    orig = follow.key_followed

    def key_followed(table: StreamTable, due: list[CacheStream], unkeyable: object) -> None:
        for stream in due:
            if stream.follow is not None:
                stream.follow = dataclasses.replace(stream.follow, space=stream.space)
        orig(table, due, unkeyable)  # type: ignore[arg-type]

    mp.setattr(follow, "key_followed", key_followed)


def release_shared_head_first(mp: pytest.MonkeyPatch) -> None:
    """release_shared (a reset that keeps its pages, a failed fork) lets go
    of the shared and keyed pages head first: a chain's first page is
    evicted before its suffix, which then stays cached and unreachable."""
    def release_shared(self: PrefixSharing, key: Key, stream: CacheStream,
                       private: list[bool] | None = None, head_first: bool = False) -> None:
        pages = stream.page_indices
        if not pages:
            return
        if private is None:
            private = self._pages.private_pages(key, pages)
        if all(private):
            return
        kept = [p for p, mine in zip(pages, private, strict=True) if mine]
        shared = [p for p, mine in zip(pages, private, strict=True) if not mine]
        self._pages.release_table(key, shared)
        stream.keep_spare(kept)

    mp.setattr(PrefixSharing, "release_shared", release_shared)


def failed_reload_gives_back_reversed(mp: pytest.MonkeyPatch) -> None:
    """A reload whose copy fails gives its pages back head first (each
    stream's list reversed before `give_back`, which lets go tail first):
    the free queue comes back in another order than the pages were taken."""
    orig = HostOffload.reload

    def reload(self: HostOffload, rid: str) -> object:
        table = self.table
        give_back = type(table).give_back

        def reversed_give_back(key: Key, pages: list[int]) -> int:
            return give_back(table, key, pages[::-1])

        table.give_back = reversed_give_back  # type: ignore[method-assign]
        try:
            return orig(self, rid)
        finally:
            del table.give_back

    mp.setattr(HostOffload, "reload", reload)


def one_pass_ignores_extra_keys(mp: pytest.MonkeyPatch) -> None:
    """Keying one page at a time (cache_prefix of the page that filled,
    cache_prefixes of a decode batch) hashes a request without a salt with
    its label alone, dropping its typed extra keys (LoRA, multimodal): two
    adapters' pages of the same ids get one key."""
    orig = prefix_cache.one_page_each

    def one_page_each(table: StreamTable, calls: object, fork_targets: object) -> object:
        saved = {}
        for call in calls if isinstance(calls, list) else ():
            rid = call[0] if isinstance(call, tuple) and call else None
            cfg = table.overrides.get(rid) if isinstance(rid, str) else None
            if cfg is not None and cfg.cache_salt is None and cfg.extra_keys:
                saved[rid] = cfg
                table.overrides[rid] = dataclasses.replace(cfg, extra_keys=())
        try:
            return orig(table, calls, fork_targets)  # type: ignore[arg-type]
        finally:
            table.overrides.update(saved)

    mp.setattr(prefix_cache, "one_page_each", one_page_each)


def remove_keeps_the_config(mp: pytest.MonkeyPatch) -> None:
    """remove_request leaves the request's config behind: a request id used
    again keys and looks up under the old tenant's salt and extra keys."""
    from kvref.lifecycle.requests import RequestLifecycle

    orig = RequestLifecycle._release

    def release(self: RequestLifecycle, rid: str, streams: object) -> None:
        cfg = self._table.overrides.get(rid)
        orig(self, rid, streams)  # type: ignore[arg-type]
        if cfg is not None:
            self._table.overrides[rid] = cfg

    mp.setattr(RequestLifecycle, "_release", release)
