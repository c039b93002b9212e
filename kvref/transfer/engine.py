"""Moving KV pages between caches: in one process, over shared memory, over CUDA IPC.

A cache publishes a `KVTransferInfo` ("where my pages live"); another cache's
`KVTransferManager.start_async_retrieve` resolves that descriptor to a tensor
it can read and copies a token range across, page by page, in the background.

Engines (``TransferEngineInfo.kind``):

- ``"local"``: caches of one process, found by id in a registry of weak
  references (a dead cache is a failed retrieve, not a crash);
- ``"shm"``: a CPU cache in a named POSIX shared-memory segment that another
  process maps by name;
- ``"cuda_ipc"``: a CUDA cache another process opens through a CUDA IPC handle.

Whatever the publisher's kind, a descriptor of a cache that lives in this very
process is read directly: mapping your own segment twice is wasteful, and
opening your own CUDA IPC handle fails (``invalid device context``).
"""

from __future__ import annotations

import math
import os
import uuid
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from kvref.core.cache import KVCache
from kvref.core.runtime import Runtime, default_runtime, fault_hook
from kvref.transfer.engine_types import (
    _SHM_DIR as _SHM_DIR,
)
from kvref.transfer.engine_types import (
    KINDS as KINDS,
)
from kvref.transfer.engine_types import (
    InjectedTransferError as InjectedTransferError,
)
from kvref.transfer.engine_types import (
    RemoteCacheGoneError as RemoteCacheGoneError,
)
from kvref.transfer.engine_types import (
    StaleSourceError as StaleSourceError,
)
from kvref.transfer.engine_types import (
    TransferConfigError as TransferConfigError,
)
from kvref.transfer.engine_types import (
    TransferEngineInfo as TransferEngineInfo,
)
from kvref.transfer.engine_types import (
    TransferError as TransferError,
)
from kvref.transfer.engine_types import (
    TransferRangeError as TransferRangeError,
)
from kvref.transfer.memory import (
    GenerationOf,
    _copy_pages_aligned,
    _copy_tokens,
    _generations,
    _live_lock,
    _lookup,
    _map_shm,
    _register,
    _shm_lock,
    _shm_segments,
    _unregister,
)
from kvref.transfer.memory import (
    allocate_cache_tensor as allocate_cache_tensor,
)


@dataclass(frozen=True)
class KVTransferInfo:
    """Where one cache's pages live: picklable, hashable, compared with ``==``.

    ``cache_id`` is unique per cache (a fresh uuid), so two descriptors are
    equal exactly when they name the same cache: that is how a manager spots a
    self-retrieve. ``num_pages`` / ``page_size`` let it validate published page
    indices before anything is copied (`page_problem`).
    """

    kind: str
    cache_id: str
    num_pages: int
    page_size: int
    layout: str  # KVLayout value: "NHD" | "HND"
    shape: tuple[int, ...]
    dtype: str  # "float32", "bfloat16", ...
    shm_name: str | None = None
    # the arguments of torch.multiprocessing.reductions.rebuild_cuda_tensor
    # (IPC memory handle, ref-counter handle, event handle, sizes)
    cuda_ipc: tuple[Any, ...] | None = None
    # an interprocess CUDA event the publisher records each time it hands
    # this descriptor out (`KVTransferManager.mark_published`); a consumer's
    # copy waits on it, so it never reads pages before the writes published
    # with them landed. The handle is fixed, so the descriptor stays equal
    cuda_ipc_event: bytes | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise TransferConfigError(f"descriptor names unknown dtype {self.dtype!r}")
        return dtype

    def pages_needed(self, seq_len: int) -> int:
        return -(-seq_len // self.page_size)

    def page_problem(self, page_indices: Sequence[int], seq_len: int) -> str | None:
        """Why ``page_indices`` cannot hold ``seq_len`` tokens of this cache, or None."""
        return _page_problem(page_indices, 0, seq_len, self.page_size, self.num_pages)


def _page_problem(
    pages: Sequence[int], start: int, end: int, page_size: int, num_pages: int
) -> str | None:
    first, needed = start // page_size, -(-end // page_size)
    if len(pages) < needed:
        return f"{end} tokens need {needed} pages of {page_size}, got {len(pages)}"
    for p in pages[first:needed]:
        if not 0 <= p < num_pages:
            return f"page {p} out of range [0, {num_pages})"
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class KVTransferManager:
    """One cache's side of KV transfers: publishes it, pulls remote pages into it.

    Retrieves run on the runtime's executor; the returned future resolves
    once the bytes are in this cache (on CUDA: once the copy stream finished).
    """

    def __init__(
        self, info: TransferEngineInfo, kv_cache: KVCache, runtime: Runtime | None = None
    ) -> None:
        self.info = info
        self.kv_cache = kv_cache
        self._runtime = runtime if runtime is not None else default_runtime()
        self._lock = self._runtime.lock()
        # retrieves still to fail on purpose: each start_async_retrieve takes one
        # and its future raises InjectedTransferError (decided when the retrieve
        # starts, so which retrieve fails does not depend on thread timing)
        self.fail_next = 0
        self._fault = fault_hook(self._runtime)  # a test fails a retrieve's start here
        self._cache_id = uuid.uuid4().hex
        self._remote: dict[str, torch.Tensor] = {}
        self._pending: list[Future[None]] = []
        self._shm_finalizer: weakref.finalize[Any, Any] | None = None
        self._copy_stream: Any = None
        self._remote_events: dict[str, Any] = {}
        self._publish_event: Any = None
        self._publish_stream: Any = None
        self._closed = False
        tensor = kv_cache.tensor
        shm_name: str | None = None
        cuda_ipc: tuple[Any, ...] | None = None
        cuda_ipc_event: bytes | None = None
        if info.kind == "shm":
            with _shm_lock:
                segment = _shm_segments.pop(tensor.data_ptr(), None)
            if segment is None:
                raise TransferConfigError(
                    "kind 'shm': the KVCache tensor must come from "
                    "allocate_cache_tensor(TransferEngineInfo(kind='shm'), ...)"
                )
            shm_name, self._shm_finalizer = segment
        elif info.kind == "cuda_ipc":
            if not tensor.is_cuda:
                raise TransferConfigError(
                    f"kind 'cuda_ipc' needs a CUDA cache, got one on {tensor.device}"
                )
            from torch.multiprocessing.reductions import reduce_tensor

            # once: every reduction makes new ref-counter and event handles, and
            # the descriptor must stay equal to itself across publishes
            _, args = reduce_tensor(tensor)  # type: ignore[no-untyped-call]
            cuda_ipc = tuple(args)
            # the event inside the reduction was recorded once, here, before
            # any KV was written: useless for ordering later writes
            self._publish_event = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
            self._publish_stream = torch.cuda.Stream(device=tensor.device)  # type: ignore[no-untyped-call]
            self._publish_event.record(self._publish_stream)
            cuda_ipc_event = bytes(self._publish_event.ipc_handle())
        self._info = KVTransferInfo(
            kind=info.kind,
            cache_id=self._cache_id,
            num_pages=int(tensor.shape[1]),
            page_size=kv_cache.page_size,
            layout=kv_cache.layout.value,
            shape=tuple(int(s) for s in tensor.shape),
            dtype=_dtype_name(tensor.dtype),
            shm_name=shm_name,
            cuda_ipc=cuda_ipc,
            cuda_ipc_event=cuda_ipc_event,
        )
        _register(self._cache_id, kv_cache)

    def get_kv_transfer_info(self) -> KVTransferInfo:
        """This cache's descriptor; for ``cuda_ipc`` also `mark_published`.

        ``KVManager.publish`` hands the descriptor out through here, so every
        publish orders the consumer's copy after the writes queued so far.
        """
        self.mark_published()
        return self._info

    def mark_published(self) -> None:
        """Record the IPC event after every write queued on the cache's compute streams.

        A consumer in another process waits on the latest record before it
        copies (CUDA IPC events order across processes on one device). A
        no-op for the other kinds: within a process a retrieve waits on the
        source cache's streams directly, and CPU writes are synchronous.
        """
        if self._publish_event is None:
            return
        with self._lock:
            self.kv_cache.order_after_compute(self._publish_stream)
            self._publish_event.record(self._publish_stream)

    def serve_generations(self, generation_of: GenerationOf) -> None:
        """Publisher side: how a consumer in this process reads a published
        stream's generation now (R35). ``generation_of`` is a bound method."""
        with _live_lock:
            _generations[self._cache_id] = weakref.WeakMethod(generation_of)

    @staticmethod
    def source_current(remote: KVTransferInfo, rid: str | None, label: str,
                       generation: int | None) -> bool | None:
        """Whether the publisher's (rid, label) still is at ``generation``: False
        once it moved on or is gone; None when that cannot be told (a hand-built
        publication, or a publisher in another process: there its lease is what
        holds the pages)."""
        if rid is None or generation is None:
            return None
        with _live_lock:
            ref = _generations.get(remote.cache_id)
        fn = None if ref is None else ref()
        if fn is None:
            return None
        return fn(rid, label) == generation

    def start_async_retrieve(
        self,
        start_len: int,
        end_len: int,
        local_page_indices: Sequence[int],
        remote_page_indices: Sequence[int],
        kv_transfer_info: KVTransferInfo,
        source: tuple[str | None, str, int | None] | None = None,
    ) -> Future[None] | None:
        """Copy tokens ``[start_len, end_len)`` of the remote cache into this one.

        Token ``p`` lives at ``(pages[p // page_size], p % page_size)`` on each
        side, with each side's own page size. None when the range is empty.
        Bad arguments raise `TransferRangeError` here; everything that can only
        be found out by reaching the remote (it is gone, a mapping fails) makes
        the future raise a `TransferError`. ``source``: the publisher's (request,
        label, generation); the copy checks it before and after it reads, and
        raises `StaleSourceError` if the publisher's stream moved (R35).
        """
        if self._fault is not None:
            self._fault("retrieve.start")
        if start_len >= end_len:
            return None
        if self._closed:
            raise TransferError("retrieve on a KVTransferManager after cleanup()")
        self.check_remote(start_len, end_len, remote_page_indices, kv_transfer_info)
        remote = kv_transfer_info
        # snapshot: the caller's page list is a live stream list that may grow
        local_pages, remote_pages = list(local_page_indices), list(remote_page_indices)
        problem = _page_problem(local_pages, start_len, end_len, self.kv_cache.page_size,
                                int(self.kv_cache.tensor.shape[1]))
        if problem is not None:
            raise TransferRangeError(
                f"retrieve of tokens [{start_len}, {end_len}): local pages: {problem}"
            )
        fail = self.fail_next > 0
        if fail:
            self.fail_next -= 1
        future = self._runtime.submit(
            self._retrieve, start_len, end_len, local_pages, remote_pages, remote, fail, source
        )
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(future)
        return future

    def check_remote(
        self, start_len: int, end_len: int, remote_page_indices: Sequence[int],
        kv_transfer_info: KVTransferInfo,
    ) -> None:
        """Raise `TransferRangeError` for what `start_async_retrieve` would refuse on
        the remote side (descriptor, geometry, dtype, pages), without starting
        anything: a caller checks every label before it takes a page."""
        if not isinstance(kv_transfer_info, KVTransferInfo):
            raise TransferRangeError(
                f"kv_transfer_info must be a KVTransferInfo, got {type(kv_transfer_info).__name__}"
            )
        if start_len < 0:
            raise TransferRangeError(f"negative start_len {start_len}")
        remote = kv_transfer_info
        self._check_compatible(remote)
        problem = _page_problem(list(remote_page_indices), start_len, end_len,
                                remote.page_size, remote.num_pages)
        if problem is not None:
            raise TransferRangeError(
                f"retrieve of tokens [{start_len}, {end_len}): remote pages: {problem}"
            )

    def cleanup(self) -> None:
        """Wait for retrieves in flight, drop remote mappings, unpublish this cache.

        Idempotent. The cache tensor itself stays usable; only its name (shm)
        and its registry entry go, so later retrieves *from* it fail cleanly.
        """
        with self._lock:
            pending, self._pending = self._pending, []
        self._runtime.wait(pending)
        with self._lock:
            self._closed = True
            self._remote.clear()
            self._remote_events.clear()
        _unregister(self._cache_id)
        if self._shm_finalizer is not None:
            self._shm_finalizer()

    # -- the background half ----------------------------------------------

    def _check_compatible(self, remote: KVTransferInfo) -> None:
        local = self.kv_cache.tensor
        # [layers, pages, 2, ...]: page size and layout may differ, but not
        # what one token of one layer is
        want = (local.shape[0], *self.kv_cache.token_shape, _dtype_name(local.dtype))
        rshape = remote.shape
        heads_dim = (rshape[4], rshape[5]) if remote.layout == "NHD" else (rshape[3], rshape[5])
        got = (rshape[0], *heads_dim, remote.dtype)
        if tuple(want) != got:
            raise TransferRangeError(
                "remote cache holds tokens of (layers, heads, head_dim, dtype) "
                f"{got}, this cache {tuple(want)}"
            )

    def _retrieve(
        self,
        start: int,
        end: int,
        local_pages: list[int],
        remote_pages: list[int],
        remote: KVTransferInfo,
        fail: bool,
        source: tuple[str | None, str, int | None] | None = None,
    ) -> None:
        if fail:
            raise InjectedTransferError(
                f"injected failure of the retrieve of tokens [{start}, {end}) "
                f"from cache {remote.cache_id}"
            )
        # a sequence lock: the generation before the read and after it; a change
        # in between means the bytes read may be anyone's
        self._check_source(remote, source, "before")
        src = self._resolve(remote)
        dst = self.kv_cache.tensor
        if dst.is_cuda or src.is_cuda:
            self._copy_on_stream(src, remote, local_pages, remote_pages, start, end)
        else:
            self._copy(src, remote, local_pages, remote_pages, start, end)
        # the bytes are read; a publisher that moved since the first check
        # did so while they were read (the concurrency tests switch here)
        self._runtime.checkpoint("retrieve.copied")
        self._check_source(remote, source, "while")

    def _check_source(self, remote: KVTransferInfo,
                      source: tuple[str | None, str, int | None] | None, when: str) -> None:
        if source is not None and self.source_current(remote, *source) is False:
            rid, label, generation = source
            raise StaleSourceError(
                f"the publisher's {rid!r}/{label!r} left generation {generation} {when} "
                "the copy: its pages no longer hold what was published")

    def _copy(
        self,
        src: torch.Tensor,
        remote: KVTransferInfo,
        local_pages: list[int],
        remote_pages: list[int],
        start: int,
        end: int,
    ) -> None:
        dst, layout, ps = self.kv_cache.tensor, self.kv_cache.layout.value, self.kv_cache.page_size
        if remote.layout == layout and remote.page_size == ps:
            _copy_pages_aligned(dst, local_pages, src, remote_pages, layout, ps, start, end)
        else:
            src_side = (src, remote.layout, remote_pages, remote.page_size)
            _copy_tokens(dst, layout, local_pages, ps, *src_side, start, end)

    def _copy_on_stream(
        self,
        src: torch.Tensor,
        remote: KVTransferInfo,
        local_pages: list[int],
        remote_pages: list[int],
        start: int,
        end: int,
    ) -> None:
        # a side stream so the copy does not queue behind the forward pass;
        # it first waits for work already queued on this device (an earlier
        # step may still be writing these pages' previous owner), and the
        # future resolves only once the bytes have landed
        device = self.kv_cache.tensor.device if self.kv_cache.tensor.is_cuda else src.device
        with self._lock:
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            stream = self._copy_stream
        # the destination pages' previous owner may still be read or written
        # by any stream the engine computes on, not only this thread's
        self.kv_cache.order_after_compute(stream)
        if device.type == "cuda":
            stream.wait_stream(torch.cuda.current_stream(device))
        source = _lookup(remote.cache_id)
        if source is not None:
            # a cache of this process: wait on its compute streams directly
            source.order_after_compute(stream)
        elif remote.kind == "cuda_ipc" and remote.cuda_ipc_event is not None:
            stream.wait_event(self._remote_event(remote, device))
        with torch.cuda.stream(stream):
            self._copy(src, remote, local_pages, remote_pages, start, end)
        stream.synchronize()

    def _remote_event(self, remote: KVTransferInfo, device: torch.device) -> Any:
        """The publisher's IPC event, opened once per remote cache."""
        with self._lock:
            event = self._remote_events.get(remote.cache_id)
        if event is None:
            try:
                event = torch.cuda.Event.from_ipc_handle(  # type: ignore[no-untyped-call]
                    device, remote.cuda_ipc_event
                )
            except Exception as e:
                raise TransferError(
                    f"cannot open the IPC event of cache {remote.cache_id}: {e}"
                ) from e
            with self._lock:
                event = self._remote_events.setdefault(remote.cache_id, event)
        return event

    def _resolve(self, remote: KVTransferInfo) -> torch.Tensor:
        """The remote cache's tensor, mapped into this process (cached per cache)."""
        cache = _lookup(remote.cache_id)
        if cache is not None:
            return cache.tensor
        if remote.kind == "local":
            raise RemoteCacheGoneError(
                f"local cache {remote.cache_id} no longer exists in this process "
                "(cleaned up or garbage collected)"
            )
        if remote.kind == "shm":
            assert remote.shm_name is not None
            # a cached mapping outlives the owner's unlink; checking the name
            # each time keeps "the remote is gone" a failure rather than a
            # silent read of pages nobody maintains any more
            if not os.path.exists(os.path.join(_SHM_DIR, remote.shm_name)):
                with self._lock:
                    self._remote.pop(remote.cache_id, None)
                raise RemoteCacheGoneError(
                    f"shared-memory segment {remote.shm_name!r} of cache "
                    f"{remote.cache_id} no longer exists"
                )
        with self._lock:
            mapped = self._remote.get(remote.cache_id)
        if mapped is not None:
            return mapped
        try:
            mapped = self._open(remote)
        except TransferError:
            raise
        except Exception as e:
            raise TransferError(
                f"cannot open remote {remote.kind} cache {remote.cache_id}: {type(e).__name__}: {e}"
            ) from e
        if tuple(mapped.shape) != remote.shape:
            raise TransferError(
                f"remote cache {remote.cache_id} mapped as {tuple(mapped.shape)}, "
                f"descriptor says {remote.shape}"
            )
        with self._lock:
            # two retrieves may race to open the same remote: keep the first
            return self._remote.setdefault(remote.cache_id, mapped)

    @staticmethod
    def _open(remote: KVTransferInfo) -> torch.Tensor:
        if remote.kind == "shm":
            assert remote.shm_name is not None
            return _map_shm(remote.shm_name, math.prod(remote.shape), remote.torch_dtype).view(
                remote.shape
            )
        if remote.kind == "cuda_ipc":
            if remote.cuda_ipc is None:
                raise TransferError(f"cuda_ipc descriptor {remote.cache_id} has no handle")
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            tensor: torch.Tensor = rebuild_cuda_tensor(*remote.cuda_ipc)  # type: ignore[no-untyped-call]
            return tensor
        raise TransferError(f"descriptor of unknown kind {remote.kind!r}")
