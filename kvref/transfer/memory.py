"""Where transferred pages live and how they are copied: the shared-memory
segments behind ``shm`` caches, the registry of this process's caches (and
their publishers' generations), and the page and token copy loops that
`kvref.transfer.engine.KVTransferManager` runs in the background."""

from __future__ import annotations

import contextlib
import math
import os
import threading
import uuid
import weakref
from collections.abc import Callable, Sequence
from multiprocessing import shared_memory
from typing import Any

import torch

from kvref.core.cache import KVCache, copy_page_blocks
from kvref.core.config import KVLayout
from kvref.transfer.engine_types import (
    _SHM_DIR,
    RemoteCacheGoneError,
    TransferConfigError,
    TransferEngineInfo,
)

# -- shared memory ----------------------------------------------------------

# allocate_cache_tensor -> KVTransferManager hand-off of the segment behind a
# tensor, by data pointer; the finalizer unlinks the name once the tensor is
# gone, so a tensor never handed to a transfer manager does not leak a segment
_shm_lock = threading.Lock()
_shm_segments: dict[int, tuple[str, weakref.finalize[Any, Any]]] = {}


def _unlink_segment(shm: shared_memory.SharedMemory) -> None:
    # already unlinked: by an earlier cleanup, or by the resource tracker at exit
    with contextlib.suppress(FileNotFoundError):
        shm.unlink()


def _map_shm(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    # torch maps the file itself (MAP_SHARED), so the mapping lives exactly as
    # long as the tensor and no Python buffer export pins a SharedMemory open.
    # Attaching through SharedMemory(name=...) would also register the segment
    # with this process's resource tracker (Python < 3.13), which would unlink
    # the owner's segment when this process exits
    path = os.path.join(_SHM_DIR, name)
    if not os.path.exists(path):
        raise RemoteCacheGoneError(f"shared-memory segment {name!r} does not exist")
    return torch.from_file(path, shared=True, size=numel, dtype=dtype)


def allocate_cache_tensor(
    info: TransferEngineInfo,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Zeros of ``shape`` in storage the engine ``info.kind`` can share.

    Build the `KVCache` over this tensor (``KVCache(cfg, device, dtype,
    tensor=...)``) and hand that cache to `KVTransferManager`.
    """
    device = torch.device(device)
    shape = tuple(int(s) for s in shape)
    if info.kind == "local":
        return torch.zeros(shape, dtype=dtype, device=device)
    if info.kind == "cuda_ipc":
        if device.type != "cuda":
            raise TransferConfigError(f"kind 'cuda_ipc' needs a CUDA device, got {device}")
        return torch.zeros(shape, dtype=dtype, device=device)
    if device.type != "cpu":
        raise TransferConfigError(f"kind 'shm' needs a CPU cache, got {device}")
    if not os.path.isdir(_SHM_DIR):
        raise TransferConfigError(f"kind 'shm' needs POSIX shared memory at {_SHM_DIR}")
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    shm = shared_memory.SharedMemory(
        name=f"{info.shm_prefix}{uuid.uuid4().hex[:16]}", create=True, size=max(nbytes, 1)
    )
    try:
        # a fresh segment is zero-filled (ftruncate), so no zero_() pass
        tensor = _map_shm(shm.name, numel, dtype).view(shape)
    except BaseException:
        shm.close()
        _unlink_segment(shm)
        raise
    # only the name is needed from here on (to unlink it); the SharedMemory
    # object stays registered with the resource tracker, which unlinks the
    # segment if this process dies without cleaning up
    shm.close()
    ptr = tensor.data_ptr()
    finalizer = weakref.finalize(tensor, _release_segment, ptr, shm)
    with _shm_lock:
        _shm_segments[ptr] = (shm.name, finalizer)
    return tensor


def _release_segment(ptr: int, shm: shared_memory.SharedMemory) -> None:
    # forget the hand-off entry too: a later tensor at the same address must
    # not be taken for this (unlinked) segment
    with _shm_lock:
        entry = _shm_segments.get(ptr)
        if entry is not None and entry[0] == shm.name:
            del _shm_segments[ptr]
    _unlink_segment(shm)


# -- caches of this process ---------------------------------------------------

# weak: the registry must not keep a cleaned-up manager's cache alive, and a
# retrieve from a cache that is gone must fail rather than read freed pages.
# A plain lock: module state with no runtime to ask, held for a dict operation
# only, so it never blocks across a scheduling point
_live_lock = threading.Lock()
_live_caches: dict[str, weakref.ref[KVCache]] = {}


def _register(cache_id: str, cache: KVCache) -> None:
    with _live_lock:
        for key in [k for k, ref in _live_caches.items() if ref() is None]:
            del _live_caches[key]
        _live_caches[cache_id] = weakref.ref(cache)


def _lookup(cache_id: str) -> KVCache | None:
    with _live_lock:
        ref = _live_caches.get(cache_id)
    return None if ref is None else ref()


def _unregister(cache_id: str) -> None:
    with _live_lock:
        _live_caches.pop(cache_id, None)
        _generations.pop(cache_id, None)


# (request id, label) -> the publisher's stream generation now, None if gone
GenerationOf = Callable[[str, str], "int | None"]
# cache id -> its manager's generations, weakly (a bound method of its retrieval)
_generations: dict[str, weakref.WeakMethod[GenerationOf]] = {}


# -- copying ------------------------------------------------------------------


def _token_axis(layout: str) -> int:
    """Axis of the in-page token offset in one page ``[layers, 2, ...]``."""
    return 2 if layout == KVLayout.NHD.value else 3


def _copy_pages_aligned(
    dst: torch.Tensor,
    dst_pages: list[int],
    src: torch.Tensor,
    src_pages: list[int],
    layout: str,
    page_size: int,
    start: int,
    end: int,
) -> None:
    """Same page size and layout: the range is whole pages plus two partial ends."""
    axis = _token_axis(layout)

    def partial(page: int, lo: int, hi: int) -> None:
        # every layer, K and V, in-page offsets [lo, hi) of one logical page
        dst[:, dst_pages[page]].narrow(axis, lo, hi - lo).copy_(
            src[:, src_pages[page]].narrow(axis, lo, hi - lo)
        )

    first_full = -(-start // page_size)
    end_full = end // page_size
    if first_full > end_full:
        # the range lies inside one page and touches neither of its edges
        partial(start // page_size, start % page_size, end % page_size)
        return
    if start % page_size:
        partial(start // page_size, start % page_size, page_size)
    full_dst, full_src = dst_pages[first_full:end_full], src_pages[first_full:end_full]
    if dst.device == src.device:
        copy_page_blocks(dst, full_dst, src, full_src)
    elif full_src:
        # copy_page_blocks stays on one device; a retrieve may cross (a CPU
        # shm cache into a CUDA one, another GPU's cache over IPC): gather on
        # the source, one transfer, scatter on the destination
        index = torch.tensor(full_src, dtype=torch.long, device=src.device)
        block = src.index_select(1, index).to(dst.device)
        dst.index_copy_(1, torch.tensor(full_dst, dtype=torch.long, device=dst.device), block)
    if end % page_size:
        partial(end_full, 0, end % page_size)


def _token_index(
    tensor: torch.Tensor, layout: str, pages: list[int], page_size: int, start: int, end: int
) -> tuple[Any, ...]:
    """Advanced index of tokens ``[start, end)``; selects ``[n, layers, 2, H, D]``.

    Two index tensors split by a slice put the token axis first, whichever
    layout, so both sides of a cross-layout copy agree on the order.
    """
    pos = torch.arange(start, end, device=tensor.device)
    table = torch.tensor(pages, dtype=torch.long, device=tensor.device)
    page_idx, offset = table[pos // page_size], pos % page_size
    if layout == KVLayout.NHD.value:
        return (slice(None), page_idx, slice(None), offset)
    return (slice(None), page_idx, slice(None), slice(None), offset)


def _copy_tokens(
    dst: torch.Tensor,
    dst_layout: str,
    dst_pages: list[int],
    dst_page_size: int,
    src: torch.Tensor,
    src_layout: str,
    src_pages: list[int],
    src_page_size: int,
    start: int,
    end: int,
) -> None:
    """Different page size or layout: one gather, one scatter, vectorised."""
    tokens = src[_token_index(src, src_layout, src_pages, src_page_size, start, end)]
    dst[_token_index(dst, dst_layout, dst_pages, dst_page_size, start, end)] = tokens.to(dst.device)
