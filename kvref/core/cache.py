"""The paged K/V tensor and the ways bytes move in and out of it."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvref.core.config import KVConfig, KVLayout
from kvref.core.runtime import Runtime, fault_hook


def page_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Coalesce a page mapping into ``(src_start, dst_start, length)`` runs.

    Consecutive pages in both lists become one slice copy; allocation is FIFO,
    so a stream's pages are mostly consecutive and a fork copy is a few runs.
    """
    runs: list[tuple[int, int, int]] = []
    i, n = 0, len(src)
    while i < n:
        j = i + 1
        while j < n and src[j] == src[j - 1] + 1 and dst[j] == dst[j - 1] + 1:
            j += 1
        runs.append((src[i], dst[i], j - i))
        i = j
    return runs


def copy_page_blocks(
    dst: torch.Tensor, dst_pages: list[int], src: torch.Tensor, src_pages: list[int]
) -> None:
    """``dst[:, dst_pages] = src[:, src_pages]`` over axis 1 (pages).

    On CPU a gather/scatter through an index tensor runs at about a tenth of
    a plain copy (benchmarks/); copying each run of consecutive pages as one
    contiguous block per layer runs at about one. The blocks go through
    numpy byte views: a torch slice copy costs microseconds of dispatch, which
    for runs of one page (a fragmented stream) held it to a third of a plain
    copy. On CUDA one indexed kernel beats a launch per run, so index there.
    """
    if len(dst_pages) != len(src_pages):
        raise ValueError(f"copy of {len(src_pages)} pages onto {len(dst_pages)}")
    if not src_pages:
        return
    if dst.device != src.device:
        # host <-> device goes through CPUPagePool's staged copies, which keep
        # the pinned buffer contiguous; a strided cross-device copy would not
        raise ValueError(f"copy_page_blocks within one device, got {src.device} -> {dst.device}")
    if dst.device.type == "cuda":
        index = torch.tensor(src_pages + dst_pages, dtype=torch.long).to(dst.device)
        n = len(src_pages)
        dst.index_copy_(1, index[n:], src.index_select(1, index[:n]))
        return
    layers = list(zip(_page_bytes(dst), _page_bytes(src), strict=True))
    for s, d, n in page_runs(src_pages, dst_pages):
        if n == 1:  # a fragmented stream: indexing beats building two slices
            for dst_layer, src_layer in layers:
                dst_layer[d] = src_layer[s]
        else:
            for dst_layer, src_layer in layers:
                dst_layer[d : d + n] = src_layer[s : s + n]


def _page_bytes(t: torch.Tensor) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """``[layers, pages, bytes per page]``, a numpy view sharing ``t``'s memory.

    As bytes, so any dtype (bf16 has no numpy type) copies the same way.
    """
    if not t.is_contiguous():
        raise ValueError("page copies need a contiguous cache tensor")
    flat = t.view(t.shape[0], t.shape[1], -1)
    return flat.view(torch.uint8).numpy()


class KVCache:
    """``[layers, pages, 2, ...]``: one page is K then V for ``page_size`` tokens.

    Addressing is (page, offset-in-page) per token; `plan` computes it once a
    step and every layer reuses it.
    """

    def __init__(
        self,
        cfg: KVConfig,
        device: torch.device,
        dtype: torch.dtype,
        tensor: torch.Tensor | None = None,
        runtime: Runtime | None = None,
    ) -> None:
        self.config = cfg
        # the runtime's fault hook, if it has one: a test fails a page copy here
        self._fault = fault_hook(runtime) if runtime is not None else None
        self.page_size = cfg.page_size
        self.layout = cfg.layout
        self.device = torch.device(device)
        self.dtype = dtype
        shape = self.shape_for(cfg, cfg.max_num_pages)
        if tensor is None:
            tensor = torch.zeros(shape, dtype=dtype, device=device)
        elif tuple(tensor.shape) != shape or tensor.dtype != dtype:
            # a transfer engine allocates the storage (shared memory, IPC);
            # it must be exactly the cache this config describes
            raise ValueError(
                f"cache tensor {tuple(tensor.shape)} {tensor.dtype} does not match "
                f"config {shape} {dtype}"
            )
        self.tensor = tensor
        # CUDA streams that wrote or read these pages (see order_after_compute)
        self._compute_streams: dict[tuple[int, int], Any] = {}

    def add_compute_stream(self, stream: Any) -> None:
        """Declare a stream the engine runs attention or writes on.

        Side-stream copies (offload, reload, retrieve) wait for it as well as
        for the calling thread's current stream: an engine that computes on
        a stream of its own, and offloads from another thread, would
        otherwise have its pages copied before its writes landed, or
        overwritten while its kernels still read them. `write_tokens`
        declares the stream it runs on by itself.
        """
        key = (int(stream.device_index or 0), int(stream.cuda_stream))
        self._compute_streams.setdefault(key, stream)

    def compute_streams(self) -> list[Any]:
        return list(self._compute_streams.values())

    def order_after_compute(self, side: Any) -> None:
        """Make ``side`` wait for every compute stream known to touch this cache.

        Called before a copy queued on ``side`` reads or overwrites pages.
        """
        if self.device.type == "cuda":
            side.wait_stream(torch.cuda.current_stream(self.device))
        for stream in self.compute_streams():
            side.wait_stream(stream)

    @staticmethod
    def shape_for(cfg: KVConfig, num_pages: int) -> tuple[int, ...]:
        if cfg.layout is KVLayout.NHD:
            return (cfg.layers_per_page, num_pages, 2, cfg.page_size, cfg.num_kv_heads,
                    cfg.head_dim)
        return (cfg.layers_per_page, num_pages, 2, cfg.num_kv_heads, cfg.page_size, cfg.head_dim)

    @property
    def token_shape(self) -> tuple[int, int]:
        """(heads, head_dim) of one token's K (or V)."""
        return (self.config.num_kv_heads, self.config.head_dim)

    @property
    def bytes_per_page(self) -> int:
        return self.tensor[:, 0].numel() * self.tensor.element_size()

    def layer_view(self, layer_idx: int) -> torch.Tensor:
        """One layer's pages, ``[pages, 2, ps, H, D]`` (NHD) or ``[pages, 2, H, ps, D]``
        (HND): the paged_kv_cache FlashInfer's wrappers take."""
        return self.tensor[layer_idx]

    def _token_major(self, layer_idx: int) -> torch.Tensor:
        """One layer as ``[pages, 2, page_size, H, D]`` whatever the layout (a view)."""
        layer = self.tensor[layer_idx]
        return layer if self.layout is KVLayout.NHD else layer.transpose(2, 3)

    def write_tokens(
        self,
        layer_idx: int,
        k: torch.Tensor,
        v: torch.Tensor,
        page_idx: torch.Tensor,
        cache_idx: torch.Tensor,
        return_tensor: bool = False,
    ) -> torch.Tensor | None:
        """Scatter ``k, v: [n, H, D]`` into the slots ``(page_idx[i], cache_idx[i])``."""
        if self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            self.add_compute_stream(torch.cuda.current_stream(self.device))
        layer = self._token_major(layer_idx)
        layer[page_idx, 0, cache_idx] = k.to(self.dtype)
        layer[page_idx, 1, cache_idx] = v.to(self.dtype)
        if return_tensor:
            return self.read_tokens(layer_idx, page_idx, cache_idx)
        return None

    def read_tokens(
        self, layer_idx: int, page_idx: torch.Tensor, cache_idx: torch.Tensor
    ) -> torch.Tensor:
        """``[n, 2, H, D]``: K at index 0 and V at 1 of each addressed slot."""
        layer = self._token_major(layer_idx)
        return layer[page_idx, :, cache_idx]

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole pages, every layer, K and V."""
        if self._fault is not None:
            self._fault("fork.copy")
        copy_page_blocks(self.tensor, dst, self.tensor, src)

    def copy_page_head(self, src: int, dst: int, slots: int) -> None:
        """Copy the first ``slots`` token slots of page ``src`` into ``dst``,
        every layer, K and V; the rest of ``dst`` is not touched (a copy
        landing there may be writing it)."""
        if self._fault is not None:
            self._fault("fork.copy")
        for layer in range(self.tensor.shape[0]):
            view = self._token_major(layer)
            view[dst, :, :slots] = view[src, :, :slots]

    def gather_stream(self, pages: list[int], length: int) -> torch.Tensor:
        """``[layers, length, 2, H, D]``: a stream's first ``length`` tokens, in order."""
        cfg = self.config
        n_pages = -(-length // self.page_size)
        if n_pages > len(pages):
            raise ValueError(f"{length} tokens need {n_pages} pages, stream has {len(pages)}")
        if n_pages == 0:
            return self.tensor.new_zeros((cfg.layers_per_page, 0, 2, cfg.num_kv_heads,
                                          cfg.head_dim))
        blocks = self.tensor[:, torch.tensor(pages[:n_pages], dtype=torch.long, device=self.device)]
        if self.layout is KVLayout.HND:
            blocks = blocks.transpose(3, 4)  # -> [L, n, 2, ps, H, D]
        tokens = blocks.permute(0, 1, 3, 2, 4, 5).reshape(
            cfg.layers_per_page, n_pages * self.page_size, 2, cfg.num_kv_heads, cfg.head_dim
        )
        return tokens[:, :length]
