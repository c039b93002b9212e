"""Eviction to host memory: an offload's claim, copy, commit and abandon, and reload.

The phases work on the shared stream table and the host page pool; the
`Offload` handle a claim returns calls back into this object, never into
the manager. Claim, commit and abandon are one critical section each under
the table's lock; a host copy is decided under it, runs outside it (steps
of other requests go on) and is recorded under it again.

Each refusal is a typed reason (`kvref.offload.outcomes`); the queries an engine
schedules with (the offload priority, the pages a reload needs) are read
off the same functions the claim and the reload decide with, so a query
never says "yes" where the call says "no".
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from kvref.core.cache import KVCache
from kvref.core.errors import ReloadCopyError
from kvref.core.stream_table import StreamTable
from kvref.core.streams import CacheStream, ClaimedStream
from kvref.offload.handle import Offload
from kvref.offload.host_pool import CPUPagePool
from kvref.offload.outcomes import (
    OffloadOutcome,
    OffloadReason,
    ReloadOutcome,
    ReloadReason,
    kept_reason,
)
from kvref.prefix.keys import PageKey


def claimable(streams: Mapping[str, CacheStream]) -> list[tuple[str, CacheStream]]:
    """The streams a claim takes: resident ones that hold device pages."""
    return [(label, s) for label, s in streams.items() if not s.offloaded and s.page_indices]


def claim_refusal(streams: Mapping[str, CacheStream] | None, offload_running: bool,
                  leased: bool) -> OffloadReason | None:
    """Why a claim of a request with these streams is refused now, or None."""
    if streams is None:
        return OffloadReason.UNKNOWN_REQUEST
    if offload_running:
        return OffloadReason.OFFLOAD_RUNNING
    # a step in flight on any one label holds back the whole request (R4)
    if any(s.step_in_flight for s in streams.values()):
        return OffloadReason.STEP_IN_FLIGHT
    if leased:  # a peer may be copying these pages (R33)
        return OffloadReason.PUBLISH_LEASED
    if not claimable(streams):
        return OffloadReason.NOTHING_ON_DEVICE
    return None


# a `begin` that refused without reaching the claim (an override) is asked
# why in a second critical section; if the request became claimable in
# between, the claim is tried again, a few times at most
_CLAIM_TRIES = 3


class HostOffload:
    """The offload phases (see `kvref.offload.handle.OffloadPhases`) and reload, over one pool."""

    def __init__(self, table: StreamTable, pool: CPUPagePool, kv_cache: KVCache,
                 offloads: dict[str, Offload]) -> None:
        self.table = table
        self.pool = pool
        self._kv_cache = kv_cache
        # rid -> the offload between its claim and its commit/abandon (R6);
        # the manager's container, which remove_request cancels from
        self.offloads = offloads
        # why this thread's last claim was refused, set in the claim's own
        # critical section: `offload` reports it through the `begin_offload`
        # seam, which can only answer None (per thread: concurrent claims
        # each read their own)
        self._refused = threading.local()

    def claim(self, rid: str) -> Offload | OffloadReason:
        """See `KVManager.begin_offload`; a refusal is its reason."""
        with self.table.lock:
            streams = self.table.streams.get(rid)
            refused = claim_refusal(streams, rid in self.offloads,
                                    self.table.leases.held(rid))
            if refused is not None:
                self._refused.reason = refused
                return refused
            assert streams is not None
            claims: list[ClaimedStream] = []
            reads: dict[str, Future[Any]] = {}
            for label, s in claimable(streams):
                claims.append(s.claim_offload(label))
                if s.read_future is not None:
                    reads[label] = s.read_future
            offload = self.offloads[rid] = Offload(self, rid, claims, reads)
        self.table.runtime.checkpoint("offload.claimed")
        return offload

    def refusal(self, rid: str) -> OffloadReason | None:
        """Why a claim of ``rid`` would be refused now, or None."""
        with self.table.lock:
            return claim_refusal(self.table.streams.get(rid), rid in self.offloads,
                                 self.table.leases.held(rid))

    def priority(self, rid: str) -> int:
        """The device pages a claim of ``rid`` would free now; 0 if refused,
        and 0 for an accepted claim that frees nothing (R45)."""
        with self.table.lock:
            streams = self.table.streams.get(rid)
            if claim_refusal(streams, rid in self.offloads,
                             self.table.leases.held(rid)) is not None:
                return 0
            assert streams is not None
            # what the claim's commit would free: a page another request
            # shares is not (SGLang 35270 counted shared pages as evictable)
            return self.table.pages.reclaimable(
                {(rid, label): s.page_indices for label, s in claimable(streams)})

    def offload(self, rid: str, begin: Callable[[str], Offload | None]) -> OffloadOutcome:
        """See `KVManager.offload_outcome`: claim with ``begin``, copy all, commit.

        ``begin`` is the manager's `begin_offload`, the seam engines and the
        concurrency tests wrap; a refused claim's reason comes from the claim.
        """
        offload = None
        for _ in range(_CLAIM_TRIES):
            self._refused.reason = None
            offload = begin(rid)
            if offload is not None:
                break
            reason = self._refused.reason or self.refusal(rid)
            if reason is not None:
                return OffloadOutcome(reason=reason)
        if offload is None:
            # claimable each time it was asked, refused each time it was claimed
            return OffloadOutcome(reason=OffloadReason.REQUEST_CHANGED)
        try:
            offload.copy_all()
            self.table.runtime.checkpoint("offload.copied")
            offload.commit()
            assert offload.outcome is not None
            return offload.outcome
        finally:
            offload.abandon()  # a no-op once committed

    def wait(self, futures: Sequence[Future[Any]]) -> None:
        self.table.runtime.wait(futures)

    def _stale(self, offload: Offload) -> bool:
        """The offload was cancelled (request removed), or a claimed stream changed
        since the claim (a reset): its commit can only undo it. Under the lock."""
        if offload.cancelled:
            return True
        streams = self.table.streams.get(offload.request_id, {})
        return any(
            (s := streams.get(c.label)) is None or s.generation != c.generation
            for c in offload.claims.values()
        )

    def copy_to_host(self, offload: Offload, claim: ClaimedStream) -> OffloadReason | None:
        """One stream's host copy; why not if the offload went stale or it does not fit.

        Decided in one critical section (stale? room on the host?), copied
        outside the lock, recorded in a second: a reset racing the copy fails
        the commit's guard, a removal racing it drops the copy at the record,
        and neither changes what this call answers.
        """
        pool = self.pool
        rid = offload.request_id
        with self.table.lock:
            if self._stale(offload):
                # a reset (or removal) since the claim dooms the commit: a
                # copy now would only be thrown away
                return (OffloadReason.REQUEST_REMOVED if offload.cancelled
                        else OffloadReason.REQUEST_CHANGED)
            # only the retained tokens [released, n) travel; the released
            # slots stay released through the reload (W8)
            host_pages = pool.reserve(rid, claim.label, claim.stored_len - claim.released,
                                      len(claim.pages))
            if host_pages is None:
                return OffloadReason.HOST_POOL_FULL
        try:
            pool.copy_out(self._kv_cache.tensor, claim.pages, host_pages)
        except BaseException:
            pool.release(host_pages)
            raise
        with self.table.lock:
            if offload.cancelled:
                pool.release(host_pages)  # the removal already emptied the host
            else:
                pool.record(rid, claim.label, host_pages, claim.stored_len,
                            claim.position, claim.released)
        return None

    def commit(
        self, offload: Offload, claims: Mapping[str, ClaimedStream], copied: Sequence[str]
    ) -> OffloadOutcome:
        rid = offload.request_id
        # the device pages must not be released before the D2H copy read them
        self.pool.sync()
        with self.table.lock:
            if offload.cancelled:
                # the removal released everything, host copies included
                return OffloadOutcome(kept=tuple(claims),
                                      reason=OffloadReason.REQUEST_REMOVED)
            self.offloads.pop(rid, None)
            streams = self.table.streams.get(rid, {})
            intact = all(
                (s := streams.get(label)) is not None
                and s.generation == claims[label].generation
                for label in copied
            )
            moved = copied if intact else []
            for label in claims:
                if label not in moved:
                    # did not fit on the host, or the request changed behind us
                    self._give_back_claim(rid, streams, label)
            freed = 0
            for label in moved:
                stream = streams[label]
                # the host copy remembers its pages' keys, read before they go
                # (S29): a reload shares again those the cache still holds
                self.pool.remember_keys(rid, label, self._keys_of(label, stream))
                # only pages whose last holder this was go free (R53)
                freed += self.table.give_back((rid, label), stream.page_indices)
                # the tokens are on the host: the length stays, the pages go
                stream.commit_offload()
            kept = tuple(label for label in claims if label not in moved)
            reason = (kept_reason(kept, offload.refusals) if intact
                      else OffloadReason.REQUEST_CHANGED)
            return OffloadOutcome(freed, tuple(moved), kept, reason)

    def abandon(self, offload: Offload, labels: Sequence[str]) -> None:
        rid = offload.request_id
        with self.table.lock:
            if offload.cancelled:
                return  # the removal released everything, host copies included
            self.offloads.pop(rid, None)
            streams = self.table.streams.get(rid, {})
            for label in labels:
                # a raise mid-copy leaves a copy behind, and a reload would
                # then hand the stream fresh pages on top of its own
                self._give_back_claim(rid, streams, label)

    def _give_back_claim(self, rid: str, streams: Mapping[str, CacheStream],
                         label: str) -> None:
        """Drop ``label``'s host copy, if any, and return its stream (if it is
        still there) from the claim to the device. Under the lock."""
        self.pool.discard(rid, label)
        stream = streams.get(label)
        if stream is not None:
            stream.abandon_offload()

    def _keys_of(self, label: str, stream: CacheStream) -> tuple[PageKey | None, ...]:
        """The keys of the stream's full pages, one per host page (None where
        a page is not keyed); () where nothing is (`PageSharing.remembered_keys`),
        and for a window's stream: its copy remembers none (H6). Under the lock."""
        if self.table.behaviour(label).releases:
            return ()
        return self.table.sharing.remembered_keys(stream)

    def _reattach(self, rid: str, labels: Sequence[str]) -> dict[str, dict[int, int]]:
        """Per label, the host pages whose remembered key the prefix cache
        holds now, and the device page under it (S29). A key names its tokens,
        its chain before them and the request's extra keys, so the page under
        it holds the very bytes the host copy does; a reset cannot have made
        it stale while the request is on the host (S30 refuses it), and a page
        evicted and registered again is found only under its new key. Under
        the lock."""
        out: dict[str, dict[int, int]] = {}
        for label in labels:
            copy = self.pool.copy_of(rid, label)
            if copy is None or not copy.keys:
                continue
            hits = {}
            for i, key in enumerate(copy.keys):
                if key is not None and (p := self.table.pages.cached_page(key)) is not None:
                    hits[i] = p
            if hits:
                out[label] = hits
        return out

    def _reload_labels(self, rid: str) -> list[str]:
        """The request's labels with a host copy, in the request's label
        order, not the order the host copies were made: a stream offloaded
        alone, then its request, would otherwise take its pages first (S29;
        the sharing lockstep caught the two orders apart). Under the lock."""
        on_host = set(self.pool.labels(rid))
        return [label for label in self.table.streams[rid] if label in on_host]

    def _reload_refusal(self, rid: str) -> tuple[ReloadReason | None, int]:
        """Why a reload of ``rid`` moves nothing now (or None), and the free
        pages it takes: a fresh page for each host page it does not share
        again, and each free-cached page it shares again (once, though two
        streams name it); a page another stream holds costs nothing (S29).
        Under the lock."""
        if rid not in self.table.streams:
            return ReloadReason.UNKNOWN_REQUEST, 0
        if rid in self.offloads:
            # its offload is claimed but neither committed nor abandoned (R6)
            return ReloadReason.OFFLOAD_RUNNING, 0
        pool = self.pool
        if not pool.is_offloaded(rid):
            return ReloadReason.NOTHING_ON_HOST, 0
        labels = self._reload_labels(rid)
        hits = self._reattach(rid, labels)
        pages = self.table.pages
        cached = {p for h in hits.values() for p in h.values() if not pages.refcount(p)}
        needed = len(cached) + sum(pool.num_pages(rid, label) - len(hits.get(label, ()))
                                   for label in labels)
        if needed > pages.num_free:
            return ReloadReason.DEVICE_FULL, needed
        return None, needed

    def reload_pages_needed(self, rid: str) -> int:
        """See `KVManager.reload_pages_needed`."""
        with self.table.lock:
            reason, needed = self._reload_refusal(rid)
            return needed if reason in (None, ReloadReason.DEVICE_FULL) else 0

    def reload(self, rid: str) -> ReloadOutcome:
        """See `KVManager.reload_outcome`."""
        pool = self.pool
        table = self.table
        with self.table.lock:
            reason, needed = self._reload_refusal(rid)
            if reason is not None:
                short = (needed - table.pages.num_free if reason is ReloadReason.DEVICE_FULL
                         else 0)
                return ReloadOutcome(reason=reason, pages_short=short)
            labels = self._reload_labels(rid)
            hits = self._reattach(rid, labels)  # what the count above found
            taken: list[tuple[str, list[int]]] = []
            tables: dict[str, list[int]] = {}
            try:
                # first every stream shares again what the cache holds, then
                # each takes fresh pages for the rest: a fresh page never
                # evicts a page this reload shares again (S29)
                for label in labels:
                    if label in hits:
                        shared_again = list(hits[label].values())
                        table.pages.attach((rid, label), shared_again)
                        taken.append((label, shared_again))
                copies: list[tuple[str, list[int], list[int]]] = []
                for label in labels:
                    mine = hits.get(label, {})
                    n = pool.num_pages(rid, label)
                    slots = [i for i in range(n) if i not in mine]
                    # counted above, under the same lock
                    fresh = table.take((rid, label), len(slots))
                    taken.append((label, fresh))
                    got = iter(fresh)
                    tables[label] = [mine[i] if i in mine else next(got) for i in range(n)]
                    copies.append((label, fresh, slots))
                # every page is taken before any copy runs, so what a failed
                # copy gives back does not depend on which label's copy failed
                for label, fresh, slots in copies:
                    pool.copy_in(rid, label, self._kv_cache.tensor, fresh, slots)
            except Exception as err:
                # all streams or none (R26): the pages go back in the order
                # taken, the host copies stay, and a later reload can try
                # again. A free-cached page taken as a fresh one goes back
                # blank (its key was dropped when it was taken): the copy may
                # have written it before it failed
                for label, pages in taken:
                    table.give_back((rid, label), pages)
                raise ReloadCopyError(
                    f"host-to-device copy failed ({type(err).__name__}: {err}); nothing "
                    "was reloaded", request_id=rid, label=taken[-1][0] if taken else None,
                ) from err
            streams = self.table.streams[rid]
            for label in labels:
                copy = pool.copy_of(rid, label)
                assert copy is not None
                pool.drop_reloaded(rid, label)
                stream = streams[label]
                # only full pages are shared again: a part page is fresh, so
                # the tail stays private
                stream.reload(tables[label], copy.stored_len, copy.position, copy.released)
        # outside the lock: orders the H2D copies before attention reads the
        # pages; the pages are already assigned, so no shared state is touched
        pool.sync()
        return ReloadOutcome(needed, tuple(labels))
