"""Host copies of offloaded streams."""

from __future__ import annotations

import dataclasses
import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from kvref.core.allocator import PageAllocator
from kvref.core.cache import KVCache, copy_page_blocks, page_runs
from kvref.core.runtime import Runtime, default_runtime, fault_hook, shared
from kvref.observation import HostCopyObservation, HostPoolObservation
from kvref.offload.outcomes import HostPoolView
from kvref.prefix.keys import PageKey


@dataclass(frozen=True)
class HostCopy:
    """One stream's pages on the host, and the lengths they were copied at.

    ``keys``: per host page, the prefix-cache key its device page had when the
    offload committed (None: not keyed); a reload shares again the pages the
    cache still holds under them instead of copying them back (S29)."""

    pages: list[int]
    stored_len: int
    position: int
    released: int
    keys: tuple[PageKey | None, ...] = ()


class CPUPagePool:
    """A fixed pool of host pages with one copy per (request, label).

    Invariant (I6): every host page is free in ``_allocator`` or in exactly
    one ``HostCopy``; host pages freed by a reload whose copy may still be
    in flight wait in ``_pending_free`` until `sync`.
    On CUDA the pool is pinned and copies run on a side stream, so an
    offload overlaps the step that is running; `sync` orders them before a
    device page is released or a reloaded page is read.
    """

    def __init__(
        self,
        config: object,
        kv_cache: KVCache,
        max_cpu_pages: int,
        lock: AbstractContextManager[Any] | None = None,
        runtime: Runtime | None = None,
    ) -> None:
        del config  # the cache carries the shape; kept for the reference's signature
        if max_cpu_pages <= 0:
            raise ValueError(f"a host pool needs pages, got {max_cpu_pages}")
        self.kv_cache = kv_cache
        on_cuda = kv_cache.device.type == "cuda"
        shape = KVCache.shape_for(kv_cache.config, max_cpu_pages)
        if on_cuda:
            # page-major ([pages, layers, ...]): each host page is one
            # contiguous block, so a D2H copy lands in pinned memory as a
            # plain memcpy instead of a strided copy through a pageable temp
            shape = (shape[1], shape[0], *shape[2:])
        self.tensor = torch.zeros(shape, dtype=kv_cache.dtype, pin_memory=on_cuda)
        self._allocator = PageAllocator(max_cpu_pages, runtime, name="host pages")
        # offloads of different requests copy concurrently, outside the
        # manager's lock; this one guards only the pool's own bookkeeping
        self._lock: AbstractContextManager[Any] = lock if lock is not None else threading.RLock()
        # the copies table is read and written only by callers holding the
        # manager's lock (R31); the pending list only under this pool's lock
        rt = runtime if runtime is not None else default_runtime()
        self._copies: dict[str, dict[str, HostCopy]] = shared(rt, {}, "host.copies")
        self._pending_free: list[int] = shared(rt, [], "host.pending_free")
        self._stream = torch.cuda.Stream(kv_cache.device) if on_cuda else None  # type: ignore[no-untyped-call]
        self._fault = fault_hook(rt)  # a test fails a host copy here

    @property
    def num_free(self) -> int:
        return self._allocator.num_free

    @property
    def capacity(self) -> int:
        return self._allocator.num_pages

    def view(self) -> HostPoolView:
        """What `KVManager.host_pool` reports: one read of the free count."""
        free = self.num_free
        return HostPoolView(self.capacity, free, self.capacity - free)

    def observe(self) -> HostPoolObservation:
        """The pool for `KVManager.observe`: copies of every list, under its lock."""
        with self._lock:
            copies = tuple(
                HostCopyObservation(rid, label, tuple(c.pages), c.stored_len, c.released)
                for rid, labels in self._copies.items() for label, c in labels.items())
            return HostPoolObservation(self.capacity, self.num_free, len(self._pending_free),
                                       copies)

    def is_offloaded(self, rid: str) -> bool:
        return bool(self._copies.get(rid))

    def labels(self, rid: str) -> list[str]:
        return list(self._copies.get(rid, {}))

    def num_pages(self, rid: str, label: str) -> int:
        return len(self._copies[rid][label].pages)

    def copy_of(self, rid: str, label: str) -> HostCopy | None:
        return self._copies.get(rid, {}).get(label)

    def offload_stream(
        self,
        rid: str,
        label: str,
        gpu_kv_cache: torch.Tensor,
        gpu_page_indices: list[int],
        stored_len: int,
        position: int = 0,
        released: int = 0,
    ) -> bool:
        """Copy the pages ``stored_len`` needs to the host; False if they don't fit.

        Only the pages holding tokens travel: a high-water stream's spare
        pages would cost host space for nothing. The three steps are also
        callable one by one (`reserve`, `copy_out`, `record`), so a caller can
        make the decision and the record under its own lock and copy outside it.
        """
        host_pages = self.reserve(rid, label, stored_len, len(gpu_page_indices))
        if host_pages is None:
            return False
        try:
            self.copy_out(gpu_kv_cache, gpu_page_indices, host_pages)
        except BaseException:
            self.release(host_pages)  # nothing was recorded: back, or they leak
            raise
        self.record(rid, label, host_pages, stored_len, position, released)
        return True

    def reserve(self, rid: str, label: str, stored_len: int, held: int) -> list[int] | None:
        """Host pages for a copy of ``stored_len`` tokens, or None if they don't fit."""
        n = -(-stored_len // self.kv_cache.page_size)
        if n > held:
            raise ValueError(
                f"request {rid!r} label {label!r}: {stored_len} tokens need {n} pages, "
                f"stream holds {held}"
            )
        with self._lock:
            if label in self._copies.get(rid, {}):
                raise ValueError(f"request {rid!r} label {label!r} already has a host copy")
            return self._allocator.try_allocate(n)

    def copy_out(
        self, gpu_kv_cache: torch.Tensor, gpu_page_indices: list[int], host_pages: list[int]
    ) -> None:
        if self._fault is not None:
            self._fault("offload.copy")
        self._copy_out(gpu_kv_cache, gpu_page_indices[: len(host_pages)], host_pages)

    def record(
        self, rid: str, label: str, host_pages: list[int], stored_len: int,
        position: int = 0, released: int = 0,
    ) -> None:
        with self._lock:
            self._copies.setdefault(rid, {})[label] = HostCopy(
                pages=host_pages, stored_len=stored_len, position=position, released=released
            )

    def remember_keys(self, rid: str, label: str, keys: tuple[PageKey | None, ...]) -> None:
        """Record the keys the copy's device pages had as its offload commits."""
        with self._lock:
            copy = self._copies[rid][label]
            self._copies[rid][label] = dataclasses.replace(copy, keys=keys)

    def release(self, host_pages: list[int]) -> None:
        """Return reserved pages that were never recorded."""
        if host_pages:
            self.sync()  # a D2H copy may still be writing them
            with self._lock:
                self._allocator.free(host_pages)

    def reload_stream(
        self, rid: str, label: str, gpu_kv_cache: torch.Tensor, gpu_page_indices: list[int]
    ) -> HostCopy:
        """Copy a host copy back onto ``gpu_page_indices`` and drop it from the pool."""
        copy = self.copy_in(rid, label, gpu_kv_cache, gpu_page_indices)
        self.drop_reloaded(rid, label)
        return copy

    def copy_in(
        self, rid: str, label: str, gpu_kv_cache: torch.Tensor, gpu_page_indices: list[int],
        slots: list[int] | None = None,
    ) -> HostCopy:
        """Copy a host copy back onto ``gpu_page_indices``; the copy stays in the
        pool until `drop_reloaded`, so a reload whose later copy fails loses nothing.
        ``slots``: only these of its pages, onto ``gpu_page_indices`` in order
        (a reload that shares the others again, S29)."""
        with self._lock:
            copy = self._copies[rid][label]
        want = copy.pages if slots is None else [copy.pages[i] for i in slots]
        if len(gpu_page_indices) < len(want):
            raise ValueError(
                f"reload of {rid!r}/{label!r} onto {len(gpu_page_indices)} pages; "
                f"it needs {len(want)}"
            )
        if self._fault is not None:
            self._fault("reload.copy")
        if want:
            self._copy_in(gpu_kv_cache, gpu_page_indices[: len(want)], want)
        return copy

    def drop_reloaded(self, rid: str, label: str) -> None:
        """Forget a host copy that `copy_in` brought back to the device."""
        with self._lock:
            copy = self._copies[rid][label]
            self._drop(rid, label)
            if self._stream is None:
                self._allocator.free(copy.pages)
            else:
                # the H2D copy may still be reading these; a new offload must
                # not overwrite them before `sync`
                self._pending_free.extend(copy.pages)

    def discard(self, rid: str, label: str) -> None:
        """Forget a host copy (an abandoned offload); a no-op if there is none."""
        self.sync()  # its D2H copy may still be writing
        with self._lock:
            copy = self._copies.get(rid, {}).get(label)
            if copy is None:
                return
            self._drop(rid, label)
            self._allocator.free(copy.pages)

    def remove_request(self, rid: str) -> None:
        for label in self.labels(rid):
            self.discard(rid, label)

    def sync(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        with self._lock:
            # emptied in place, not rebound: the list is the instrumented
            # container the race detector watches
            pages = list(self._pending_free)
            if pages:
                self._pending_free.clear()
                self._allocator.free(pages)

    def _drop(self, rid: str, label: str) -> None:
        copies = self._copies[rid]
        del copies[label]
        if not copies:
            del self._copies[rid]

    def _copy_out(self, cache: torch.Tensor, pages: list[int], host_pages: list[int]) -> None:
        if self._stream is None:
            copy_page_blocks(self.tensor, host_pages, cache, pages)
            return
        device = self.kv_cache.device
        # the side stream must see every write the compute streams queued
        self.kv_cache.order_after_compute(self._stream)
        with torch.cuda.stream(self._stream):
            index = torch.tensor(pages, dtype=torch.long).to(device, non_blocking=True)
            staged = cache.index_select(1, index).transpose(0, 1).contiguous()
            for src, dst, n in page_runs(list(range(len(pages))), host_pages):
                self.tensor[dst : dst + n].copy_(staged[src : src + n], non_blocking=True)

    def _copy_in(self, cache: torch.Tensor, pages: list[int], host_pages: list[int]) -> None:
        if self._stream is None:
            copy_page_blocks(cache, pages, self.tensor, host_pages)
            return
        device = self.kv_cache.device
        # and no kernel may still read the pages this overwrites
        self.kv_cache.order_after_compute(self._stream)
        with torch.cuda.stream(self._stream):
            staged = torch.empty(
                (len(pages), *self.tensor.shape[1:]), dtype=self.tensor.dtype, device=device
            )
            for dst, src, n in page_runs(list(range(len(pages))), host_pages):
                staged[dst : dst + n].copy_(self.tensor[src : src + n], non_blocking=True)
            index = torch.tensor(pages, dtype=torch.long).to(device, non_blocking=True)
            cache.index_copy_(1, index, staged.transpose(0, 1))
