"""Reset and remove of a request, and the reset of the prefix cache.

`KVManager.reset_request`, `remove_request` and `reset_prefix_cache`
validate their arguments and call here; the state they change is the
shared `StreamTable`, the open offloads and the host pool, as every
mechanism's is. The lifecycle is in ``specs/stream-lifecycle.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

from kvref.core.errors import StepInFlightError
from kvref.core.page_pool import ResetRefused
from kvref.core.runtime import Runtime
from kvref.core.stream_table import StreamTable
from kvref.core.streams import CacheStream
from kvref.offload.handle import Offload
from kvref.offload.host_pool import CPUPagePool
from kvref.prefix import cache as prefix_cache


class RequestLifecycle:
    """Forget a request's tokens (reset) or the request itself (remove).

    Invariants it keeps (each also checked by the lockstep against the model):

    - neither runs while a step of the request is in flight (R5) nor while
      its publication is leased (R33): refused before anything changes;
    - no page is given back or reused while a retrieve still writes into it:
      in-flight retrieves are drained first, outside the lock (R17), and a
      retrieve started between the drain and the lock means draining again;
    - the streams are read under the lock, the in-flight check included (R32);
    - a reset keeps, as spare, only the pages private to each stream when the
      call was made (R62); a committed host copy is forgotten too (R12),
      while an offload's claim in progress is left to fail its commit on the
      bumped generation;
    - a remove releases every device page and host copy the request holds and
      cancels its open offload (its later copies copy nothing, its commit
      frees nothing); a second remove is a no-op.
    """

    def __init__(self, table: StreamTable, offloads: MutableMapping[str, Offload],
                 cpu_pool: CPUPagePool | None, runtime: Runtime) -> None:
        self._table = table
        self._lock = table.lock
        self._offloads = offloads
        self._cpu_pool = cpu_pool
        self._runtime = runtime

    def reset(self, rid: str, free: bool) -> None:
        """See `KVManager.reset_request`."""
        table = self._table
        self.refuse_if_in_flight(rid, "reset")
        self.refuse_if_leased(rid, "reset")  # before the drain: a misuse changes nothing
        while True:
            # in-flight retrieves write into these pages: drain them before
            # the pages can be reused, outside the lock (a transfer does not
            # take it)
            self.drain_reads(rid)
            with self._lock:
                streams = table.request(rid)
                self.refuse_if_in_flight(rid, "reset")
                table.leases.refuse(rid, "reset")
                if self.reads_pending(streams):
                    # a retrieve started between the drain and the lock
                    continue
                offloading = self._offloads.get(rid)
                # what was private when reset was called (R62), not after a
                # sibling stream let its share of a page go
                private = {label: table.pages.private_pages((rid, label), s.page_indices)
                           for label, s in streams.items()} if not free else {}
                for label, stream in streams.items():
                    claimed = offloading is not None and label in offloading.labels
                    if stream.offloaded and not claimed:
                        # committed to the host: forgotten there too (R12)
                        if self._cpu_pool is not None:
                            self._cpu_pool.discard(rid, label)
                        stream.forget_offload()
                    if free:
                        table.give_back((rid, label), stream.page_indices)
                    # a claim in progress stays CLAIMED; the bumped
                    # generation fails its commit and the abandon clears it
                    stream.reset(freed=free)
                    # kept pages become spare: only those no one else reads
                    table.sharing.release_shared((rid, label), stream, private.get(label),
                                                 head_first=table.head_first(label))
                return

    def remove(self, rid: str) -> None:
        """See `KVManager.remove_request`."""
        drained = False
        while True:
            with self._lock:
                streams = self._table.streams.get(rid)
                if streams is None:
                    return
                # `refuse_if_in_flight` over the streams in hand, noting on
                # the way whether a retrieve ever started (one pass: remove
                # is on every finished request's path)
                read = False
                for label, stream in streams.items():
                    if stream.step_in_flight:
                        raise StepInFlightError("remove while a step is in flight; commit "
                                                "it first", request_id=rid, label=label)
                    read = read or stream.read_future is not None
                self._table.leases.refuse(rid, "remove")
                # the common case, a finished request with no retrieve ever
                # started, releases under the first acquisition, no drain;
                # after a drain, a retrieve started between it and the lock
                # means draining again
                if not read or (drained and not self.reads_pending(streams)):
                    self._release(rid, streams)
                    return
            self.drain_reads(rid)
            drained = True

    def reset_prefix_cache(self) -> int | ResetRefused:
        """See `KVManager.reset_prefix_cache`."""
        with self._lock:
            return prefix_cache.reset_prefix_cache(self._table)

    def _release(self, rid: str, streams: MutableMapping[str, CacheStream]) -> None:
        """`remove`'s release, under the lock, its checks passed."""
        for label, stream in streams.items():
            self._table.give_back((rid, label), stream.page_indices)
            stream.drop_pages()
        offload = self._offloads.pop(rid, None)
        if offload is not None:
            offload.cancel()
        if self._cpu_pool is not None:
            self._cpu_pool.remove_request(rid)
        del self._table.streams[rid]
        self._table.overrides.pop(rid, None)

    @staticmethod
    def reads_pending(streams: Mapping[str, CacheStream]) -> bool:
        return any(s.read_future is not None and not s.read_future.done()
                   for s in streams.values())

    def refuse_if_in_flight(self, rid: str, what: str) -> None:
        # under the lock also when called before it is taken: an admit may add
        # a label meanwhile, and iterating the labels then raises (R32)
        with self._lock:
            for label, stream in self._table.streams.get(rid, {}).items():
                if stream.step_in_flight:
                    raise StepInFlightError(
                        f"{what} while a step is in flight; commit it first",
                        request_id=rid, label=label,
                    )

    def refuse_if_leased(self, rid: str, what: str) -> None:
        with self._lock:
            self._table.leases.refuse(rid, what)

    def drain_reads(self, rid: str) -> None:
        # the streams are read under the lock (R32), the wait is outside it
        # (R17): a transfer does not take the lock, a reset must not hold it
        with self._lock:
            futures = [s.read_future for s in self._table.streams.get(rid, {}).values()
                       if s.read_future is not None]
        if futures:
            self._runtime.wait(futures)
