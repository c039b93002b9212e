"""`KVManager.observe`: a read-only, immutable snapshot of a manager's state.

What a conformance harness, a debugger or an engine's metrics need to see,
without reaching into the manager: every stream (length, position, page
table, generation, in-flight mark, offload and retrieve state, what a window
released, the ids its keyed pages were keyed with), every request's cache
config (salt and extra keys), every device page (its holders, its
prefix-cache key, whether it is held, free-cached or free-blank), the staged
preplan and what it was planned against, the offloads open, the
publications leased and the host pool's copies. The pool's own consistency
(its key index, LRU and blank queue) is `KVManager.check`'s.

The snapshot is taken under the manager's lock, so it is one consistent
state, and it is built of frozen dataclasses, tuples, frozensets and
read-only mappings over fresh dicts: it shares no mutable object with the
manager, so later calls on the manager never change a snapshot already
taken, and nothing done to a snapshot changes the manager.
"""

from __future__ import annotations

import array
import enum
import sys
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from kvref.core.steps import Segment
from kvref.core.streams import OffloadState as OffloadState
from kvref.core.streams import RetrieveState as RetrieveState

if TYPE_CHECKING:
    from kvref.core.page_pool import PagePool
    from kvref.core.stream_table import StreamTable
    from kvref.core.streams import CacheStream
    from kvref.offload.handle import Offload
    from kvref.offload.host_pool import CPUPagePool
    from kvref.stepping.running_step import StagedPreplan


class PageState(enum.Enum):
    """Each device page but the sink is exactly one of these (I1)."""

    HELD = "held"  # named by one or more streams' page tables
    CACHED = "cached"  # free, but its prefix-cache key keeps it findable
    BLANK = "blank"  # free and unkeyed
    # neither held nor free: a page the pool lost (never, in a correct manager)
    LOST = "lost"


@dataclass(frozen=True, slots=True)
class StreamObservation:
    """One (request, label) stream."""

    request_id: str
    label: str
    stored_len: int  # committed tokens (`KVManager.stored_len`)
    # the page table: the pages of slots ``released // page_size`` onward, in
    # order; it may hold spare pages past ``stored_len`` (a reset that kept
    # them, a step admitted and not committed)
    pages: tuple[int, ...]
    generation: int  # bumped by every change of pages or length (I14)
    released: int  # tokens a windowed label let go of, whole pages from the front
    in_flight: bool  # a step holding addressing into it is admitted
    offload: OffloadState
    retrieve: RetrieveState
    received: bool  # a retrieve filled some of it (that page on: a peer's KV, never cached, R55)
    keyed_pages: int  # its first pages the prefix cache keys (`cached_tokens` / page size)
    followed: bool = False  # its commits key the pages they fill (`follow_tokens`, S33)
    # the next token's absolute position (W4): ``stored_len`` in every state
    # kvref reaches; a window's attention reads back from it
    position: int = 0
    # the ids the keyed pages were keyed with, ``keyed_pages * page_size`` of
    # them, as hashed (signed 64-bit little-endian): what a later
    # `cache_prefix` naming them otherwise is refused against. Bytes, so the
    # snapshot copies them in one go; `keyed_ids` reads them as ints
    key_tokens: bytes = b""

    def keyed_ids(self) -> tuple[int, ...]:
        """The ids of the keyed pages' tokens, in order (``key_tokens`` as ints)."""
        ids = array.array("q", self.key_tokens)
        if sys.byteorder != "little":
            ids.byteswap()
        return tuple(ids)


@dataclass(frozen=True, slots=True)
class RequestConfigObservation:
    """What a request's pages are keyed under (`KVReqConfig`, R58): pages
    hit only between requests whose salt and extra keys are the same."""

    cache_salt: str | None
    extra_keys: tuple[tuple[str, str | bytes | int], ...]


@dataclass(frozen=True, slots=True)
class PreplanObservation:
    """The staged preplan (R41): a step admitted, and maybe planned, while
    another runs, not yet promoted by the real plan."""

    segments: tuple[Segment, ...]  # as admitted
    padded: tuple[str, ...]  # the admit's padded request ids: what its forks apply to
    pre_forks: tuple[tuple[str, str], ...]
    post_forks: tuple[tuple[str, str], ...]
    commit: bool
    planned: bool  # its preplan pass planned it (page tables staged)
    # what it was planned against: for the streams the running step names
    # too, the length that step leaves once committed as admitted; a
    # promotion finding another length is refused (R42)
    basis: Mapping[tuple[str, str], int]
    # for those of them whose label releases: the tokens released then (R67)
    released: Mapping[tuple[str, str], int]
    created: tuple[tuple[str, str], ...]  # streams its admit created (gone if cleared, I9)


@dataclass(frozen=True, slots=True)
class PageObservation:
    """One device page (the sink excluded)."""

    page: int
    state: PageState
    holders: frozenset[Hashable]  # the (request, label) streams holding it
    key: bytes | None  # its prefix-cache key (None unkeyed; always None with sharing off)


@dataclass(frozen=True, slots=True)
class OffloadObservation:
    """An offload between its claim (`begin_offload`) and its commit or abandon."""

    request_id: str
    labels: tuple[str, ...]  # the streams it claimed
    copied: tuple[str, ...]  # those already copied to the host


@dataclass(frozen=True, slots=True)
class HostCopyObservation:
    """One stream's copy on the host pool."""

    request_id: str
    label: str
    pages: tuple[int, ...]  # host pages
    stored_len: int
    released: int


@dataclass(frozen=True, slots=True)
class HostPoolObservation:
    """The host pool (``KVConfig.cpu_offload_pages``)."""

    capacity: int
    free: int
    # host pages a reload freed while its copy may still read them: free at the
    # next sync (CUDA only); free + pending + the copies' pages = capacity (I6)
    pending_free: int
    copies: tuple[HostCopyObservation, ...]

    def used_by(self, rid: str) -> int:
        """Host pages the request's copies hold."""
        return sum(len(c.pages) for c in self.copies if c.request_id == rid)


@dataclass(frozen=True, slots=True)
class KVObservation:
    """A manager's state at one instant (`KVManager.observe`)."""

    page_size: int
    num_pages: int  # device pages, the sink (page 0) included: ``KVConfig.max_num_pages``
    sharing: bool  # ``KVConfig.enable_prefix_caching`` (`PageSharing.shares`)
    free_pages: int  # `KVManager.num_free_pages`: blank plus cached
    cached_pages: int  # `KVManager.num_cached_pages`
    # request id -> label -> stream, requests and labels in creation order
    requests: Mapping[str, Mapping[str, StreamObservation]]
    pages: tuple[PageObservation, ...]  # every page but the sink, by id
    free_cached: tuple[int, ...]  # free-cached pages, least recently used first
    free_blank: tuple[int, ...]  # free-blank pages, in the order they are handed out
    offloads: Mapping[str, OffloadObservation]  # request id -> its open offload
    leases: frozenset[str]  # requests whose publication is leased now (R33)
    host: HostPoolObservation | None  # None without a host pool
    # request id -> its cache config, for every request the manager keeps
    # one for (each ingested and not removed; a removed one's is gone)
    configs: Mapping[str, RequestConfigObservation]
    preplan: PreplanObservation | None  # the staged preplan, if any

    def streams(self) -> tuple[StreamObservation, ...]:
        """Every stream, request by request."""
        return tuple(s for labels in self.requests.values() for s in labels.values())

    def stream(self, rid: str, label: str = "main") -> StreamObservation:
        """The stream; `KeyError` if the request or label is unknown."""
        return self.requests[rid][label]

    def page(self, page: int) -> PageObservation:
        """The page's entry; `IndexError` for the sink or a page out of range."""
        first = self.num_pages - len(self.pages)
        if not first <= page < self.num_pages:
            raise IndexError(f"page {page} is not in [{first}, {self.num_pages})")
        return self.pages[page - first]

    def host_copy(self, rid: str, label: str) -> HostCopyObservation | None:
        """The stream's host copy, or None."""
        if self.host is None:
            return None
        return next((c for c in self.host.copies
                     if (c.request_id, c.label) == (rid, label)), None)


def take(table: StreamTable, pool: PagePool, offloads: Mapping[str, Offload],
         host: CPUPagePool | None, preplan: StagedPreplan | None = None) -> KVObservation:
    """The snapshot; the caller holds the manager's lock (``table.lock``)."""
    def stream(rid: str, label: str, s: CacheStream) -> StreamObservation:
        # the stream's own named states: nothing rebuilt from flags here
        return StreamObservation(
            request_id=rid, label=label, stored_len=s.stored_len,
            pages=tuple(s.page_indices), generation=s.generation, released=s.released,
            in_flight=s.step_in_flight, offload=s.offload,
            retrieve=s.retrieve, received=s.received,
            keyed_pages=len(s.keys), followed=s.follow is not None,
            position=s.position, key_tokens=bytes(s.key_tokens))

    requests: dict[str, Mapping[str, StreamObservation]] = {}
    for rid, labels in table.streams.items():
        requests[rid] = MappingProxyType({
            label: stream(rid, label, s) for label, s in labels.items()})
    snap = pool.snapshot()
    lru, blank = frozenset(snap.lru), frozenset(snap.blank)
    pages = []
    for i, (holders, key) in enumerate(zip(snap.holders, snap.keys, strict=True)):
        page = snap.first + i
        state = (PageState.HELD if holders else PageState.CACHED if page in lru
                 else PageState.BLANK if page in blank else PageState.LOST)
        pages.append(PageObservation(page, state, holders, key))
    return KVObservation(
        page_size=table.page_size, num_pages=pool.num_pages, sharing=table.sharing.shares,
        # the pool's counts, not the lists' lengths: a check compares the two
        free_pages=pool.num_free, cached_pages=pool.num_cached,
        requests=MappingProxyType(requests), pages=tuple(pages),
        free_cached=snap.lru, free_blank=snap.blank,
        offloads=MappingProxyType({
            rid: OffloadObservation(rid, tuple(off.labels), tuple(off.copied))
            for rid, off in offloads.items()}),
        leases=frozenset(table.leases.leased()),
        host=host.observe() if host is not None else None,
        configs=MappingProxyType({
            rid: RequestConfigObservation(cfg.cache_salt, tuple(cfg.extra_keys))
            for rid, cfg in table.overrides.items()}),
        preplan=_preplan(preplan) if preplan is not None else None,
    )


def _preplan(p: StagedPreplan) -> PreplanObservation:
    # the step as admitted (`shape_of`): the caller's lists may change after
    segments, commit, pre_forks, post_forks, _ = p.shape
    return PreplanObservation(
        segments=segments, padded=tuple(p.ctx.padded_request_ids),
        pre_forks=tuple((a, b) for a, b in pre_forks),
        post_forks=tuple((a, b) for a, b in post_forks), commit=commit,
        planned=p.outputs is not None, basis=MappingProxyType(dict(p.basis)),
        released=MappingProxyType(dict(p.released)), created=tuple(p.created))
