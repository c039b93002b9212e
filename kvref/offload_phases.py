"""Eviction to host memory: an offload's claim, copy, commit and abandon, and reload.

The phases work on the shared stream table and the host page pool; the
`Offload` handle a claim returns calls back into this object, never into
the manager. Claim, commit and abandon are one critical section each under
the table's lock; a host copy is decided under it, runs outside it (steps
of other requests go on) and is recorded under it again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from kvref.cache import KVCache
from kvref.errors import ReloadCopyError
from kvref.host_pool import CPUPagePool
from kvref.offload import Offload
from kvref.stream_table import StreamTable
from kvref.streams import ClaimedStream


class HostOffload:
    """The offload phases (see `kvref.offload.OffloadPhases`) and reload, over one pool."""

    def __init__(self, table: StreamTable, pool: CPUPagePool, kv_cache: KVCache,
                 offloads: dict[str, Offload]) -> None:
        self.table = table
        self.pool = pool
        self._kv_cache = kv_cache
        # rid -> the offload between its claim and its commit/abandon (R6);
        # the manager's container, which remove_request cancels from
        self.offloads = offloads

    def claim(self, rid: str) -> Offload | None:
        """See `KVManager.begin_offload`."""
        with self.table.lock:
            streams = self.table.streams.get(rid)
            if streams is None or rid in self.offloads:
                return None
            if any(s.step_in_flight for s in streams.values()):
                return None
            if self.table.leases.held(rid):
                return None  # a peer may be copying these pages (R33)
            claims: list[ClaimedStream] = []
            reads: dict[str, Future[Any]] = {}
            for label, s in streams.items():
                if s.offloaded or not s.page_indices:
                    continue
                s.offloaded = True
                claims.append(ClaimedStream(label, list(s.page_indices), s.generation,
                                            s.stored_len, s.position, s.released))
                if s.read_future is not None:
                    reads[label] = s.read_future
            if not claims:
                return None
            offload = self.offloads[rid] = Offload(self, rid, claims, reads)
        self.table.runtime.checkpoint("offload.claimed")
        return offload

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

    def copy_to_host(self, offload: Offload, claim: ClaimedStream) -> bool:
        """One stream's host copy; False if the offload went stale or it does not fit.

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
                return False
            host_pages = pool.reserve(rid, claim.label, claim.stored_len, len(claim.pages))
            if host_pages is None:
                return False
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
        return True

    def commit(
        self, offload: Offload, claims: Mapping[str, ClaimedStream], copied: Sequence[str]
    ) -> int:
        rid = offload.request_id
        # the device pages must not be released before the D2H copy read them
        self.pool.sync()
        with self.table.lock:
            if offload.cancelled:
                return 0  # the removal released everything, host copies included
            self.offloads.pop(rid, None)
            streams = self.table.streams.get(rid, {})
            intact = all(
                (s := streams.get(label)) is not None
                and s.generation == claims[label].generation
                for label in copied
            )
            moved = copied if intact else []
            for label in claims:
                if label in moved:
                    continue
                # did not fit on the host, or the request changed behind us
                self.pool.discard(rid, label)
                stream = streams.get(label)
                if stream is not None:
                    stream.offloaded = False
            freed = 0
            for label in moved:
                stream = streams[label]
                freed += len(stream.page_indices)
                self.table.allocator.free(stream.page_indices)
                # the tokens are on the host: the length stays, the pages go
                stream.page_indices = []
                stream.generation += 1
            return freed

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
                self.pool.discard(rid, label)
                stream = streams.get(label)
                if stream is not None:
                    stream.offloaded = False

    def reload(self, rid: str) -> bool:
        """See `KVManager.reload`."""
        pool = self.pool
        allocator = self.table.allocator
        with self.table.lock:
            if rid in self.offloads or rid not in self.table.streams or (
                    not pool.is_offloaded(rid)):
                return False
            labels = pool.labels(rid)
            needed = sum(pool.num_pages(rid, label) for label in labels)
            if needed > allocator.num_free:
                return False
            taken: list[tuple[str, list[int]]] = []
            try:
                for label in labels:
                    pages = allocator.try_allocate(pool.num_pages(rid, label))
                    assert pages is not None  # counted above, under the same lock
                    taken.append((label, pages))
                    pool.copy_in(rid, label, self._kv_cache.tensor, pages)
            except Exception as err:
                # all streams or none (R26): the pages go back, the host copies
                # stay, and a later reload can try again
                for _, pages in taken:
                    allocator.free(pages)
                raise ReloadCopyError(
                    f"host-to-device copy failed ({type(err).__name__}: {err}); nothing "
                    "was reloaded", request_id=rid, label=taken[-1][0] if taken else None,
                ) from err
            streams = self.table.streams[rid]
            for label, pages in taken:
                copy = pool.copy_of(rid, label)
                assert copy is not None
                pool.drop_reloaded(rid, label)
                stream = streams[label]
                stream.page_indices = pages
                stream.stored_len = copy.stored_len
                stream.position = copy.position
                stream.released = copy.released
                stream.offloaded = False
                stream.generation += 1
        # outside the lock: orders the H2D copies before attention reads the
        # pages; the pages are already assigned, so no shared state is touched
        pool.sync()
        return True
