"""What an engine's scheduler calls to evict to host memory and bring back:
claim, offload, reload, and the queries that decide a victim (R44-R46).
The phases themselves are `kvref.offload.phases`; this is the public face."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from kvref import validate
from kvref.core.config import KVConfig
from kvref.core.stream_table import StreamTable
from kvref.core.streams import CacheStream
from kvref.hybrid.layout import GroupLayout
from kvref.offload.handle import Offload
from kvref.offload.host_pool import CPUPagePool
from kvref.offload.outcomes import (
    HostPoolView,
    OffloadOutcome,
    OffloadReason,
    ReloadOutcome,
    ReloadReason,
)
from kvref.offload.phases import HostOffload
from kvref.stepping.page_needs import step_pages
from kvref.stepping.step import KVStep, StepContext


class EvictionCalls:
    """Host offload and reload; `KVManager` is one."""

    # set by the subclass's constructor
    config: KVConfig
    _table: StreamTable
    _lock: AbstractContextManager[Any, bool | None]
    _streams: dict[str, dict[str, CacheStream]]
    _cpu_pool: CPUPagePool | None
    _host_offload: HostOffload | None
    _groups: GroupLayout | None

    @property
    def supports_eviction(self) -> bool:
        """Whether offload can move streams to a host pool (``cpu_offload_pages``)."""
        return self._cpu_pool is not None

    def is_offloaded(self, rid: str) -> bool:
        """True from the moment an offload claims the request, not only once
        its pages are on the host: admission and the victim filter must not
        schedule, or pick again, a request already on its way out."""
        if self._cpu_pool is None:
            return False
        with self._lock:
            return any(s.offloaded for s in self._streams.get(rid, {}).values())

    def begin_offload(self, rid: str) -> Offload | None:
        """Claim every stream of ``rid`` that holds pages; None if refused or nothing to claim.

        Refused for the whole request while any of its streams is in flight
        (R4): a step already holds addressing into these pages; and while its
        publication is leased (R33): a peer may be copying them.
        """
        validate.request_id(rid, "begin_offload")
        claimed = self._host_offload.claim(rid) if self._host_offload is not None else None
        return claimed if isinstance(claimed, Offload) else None

    def offload_outcome(self, rid: str) -> OffloadOutcome:
        """`offload`, with the labels moved and kept and why not all (R44)."""
        validate.request_id(rid, "offload")
        if self._host_offload is None:
            return OffloadOutcome(reason=OffloadReason.NO_HOST_POOL)
        return self._host_offload.offload(rid, self.begin_offload)

    def offload(self, rid: str) -> int:
        """Move ``rid``'s streams to the host; device pages freed (`offload_outcome`: why)."""
        return self.offload_outcome(rid).pages_freed

    def reload_outcome(self, rid: str) -> ReloadOutcome:
        """`reload`, with the pages taken, or why nothing moved (R44)."""
        validate.request_id(rid, "reload")
        if self._host_offload is None:
            return ReloadOutcome(reason=ReloadReason.NO_HOST_POOL)
        return self._host_offload.reload(rid)

    def reload(self, rid: str) -> bool:
        """Bring ``rid``'s offloaded streams back, all or none (`reload_outcome`: why not)."""
        return self.reload_outcome(rid).reloaded

    def reload_pages_needed(self, rid: str) -> int:
        """Device pages `reload` would take now; 0 if it would refuse but for room (R46)."""
        validate.request_id(rid, "reload_pages_needed")
        return self._host_offload.reload_pages_needed(rid) if self._host_offload else 0

    def pages_needed(self, step: KVStep, ctx: StepContext) -> int:
        """New device pages `admit` would take now, forks included; changes nothing (R46)."""
        validate.step(step, ctx)
        if self._groups is not None:
            step = self._groups.expand(step)  # what admit reserves: every group's (H1)
        with self._lock:
            return step_pages(self._table, step, ctx, self.config.max_seq_len)

    def host_pool(self) -> HostPoolView:
        """Host pages: capacity, free, used; all 0 without a pool (R46)."""
        return self._cpu_pool.view() if self._cpu_pool is not None else HostPoolView()

    def reclaimable(self, rid: str) -> int:
        """Device pages that would go free if the request let all of its go:
        a page another request also holds (a shared prefix) is not counted,
        and one two of its own streams share is counted once (S13); 0 once
        offloaded. `UnknownRequestError` for a request never ingested or
        removed (S28), as every call naming one."""
        validate.request_id(rid, "reclaimable")
        with self._lock:
            streams = self._table.request(rid)
            return self._table.pages.reclaimable(
                {(rid, label): s.page_indices for label, s in streams.items()})

    def get_offload_priority(self, rid: str) -> float:
        """Higher: offload first; the device pages a claim would free now: 0 if
        it is refused, and 0 if it would free nothing (every page shared, R45)."""
        validate.request_id(rid, "get_offload_priority")
        return float(self._host_offload.priority(rid)) if self._host_offload else 0.0
