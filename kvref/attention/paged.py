"""Paged attention over a kvref page table: a torch reference, FlashInfer on CUDA.

The page table is FlashInfer's CSR form (`PagedIndptrs`): request ``i`` owns
query rows ``qo_indptr[i]:qo_indptr[i+1]`` and pages
``paged_kv_indices[paged_kv_indptr[i]:paged_kv_indptr[i+1]]``, all full but
the last, which holds ``paged_kv_last_page_len[i]`` tokens. The step's new
K/V are already written to the cache (``write_kv`` runs before attention), so
a request's ``q_len`` queries are the last ``q_len`` of its ``kv_len``
positions: query ``j`` sits at position ``kv_len - q_len + j``.

Layers call `PagedAttention`: ``plan`` once per step, ``run`` once per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvref.attention.flashinfer import (
    DEFAULT_WORKSPACE_BYTES,
    FlashInferPagedAttention,
    flashinfer_available,
    graph_padded,
    import_flashinfer,
    is_decode_table,
)
from kvref.attention.flashinfer import layout_of as _layout_of
from kvref.attention.sdpa import SdpaPlan, plan_sdpa, run_sdpa_plan
from kvref.core.config import KVConfig, KVLayout
from kvref.core.errors import KVShapeError
from kvref.stepping.plan import KVPlanOutput, PagedIndptrs

Backend = Literal["auto", "torch", "sdpa", "flashinfer"]

# the names this module had before FlashInfer moved to its own
_graph_padded = graph_padded
_is_decode = is_decode_table
_import_flashinfer = import_flashinfer
__all__ = [
    "DEFAULT_WORKSPACE_BYTES",
    "FlashInferPagedAttention",
    "PagedAttention",
    "flashinfer_available",
    "paged_attention_reference",
]


def _page_size_of(kv_layer: torch.Tensor, layout: KVLayout) -> int:
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2:
        raise KVShapeError(
            f"kv_layer must be one layer's pages [pages, 2, ...], got {tuple(kv_layer.shape)}"
        )
    return int(kv_layer.shape[2] if layout is KVLayout.NHD else kv_layer.shape[3])


@dataclass(frozen=True)
class _Request:
    q_start: int
    q_end: int
    kv_len: int
    page_start: int  # into the batch's gathered pages
    page_end: int


@dataclass(frozen=True)
class _TorchPlan:
    """The page table unpacked once on the host, reused by every layer."""

    requests: tuple[_Request, ...]
    pages: tuple[int, ...]  # every request's pages, request-major
    num_tokens: int
    page_size: int


def _unpack(indptrs: PagedIndptrs, page_size: int) -> _TorchPlan:
    # .tolist() syncs a device table; callers that have the host copy pass it
    qo = indptrs.qo_indptr.tolist()
    kv = indptrs.paged_kv_indptr.tolist()
    last = indptrs.paged_kv_last_page_len.tolist()
    indices = indptrs.paged_kv_indices.tolist()
    if not (len(qo) == len(kv) == len(last) + 1):
        raise KVShapeError(
            f"page table sizes disagree: qo_indptr {len(qo)}, paged_kv_indptr {len(kv)}, "
            f"last_page_len {len(last)}"
        )
    requests: list[_Request] = []
    pages: list[int] = []
    for i in range(len(last)):
        n_pages = kv[i + 1] - kv[i]
        q_len = qo[i + 1] - qo[i]
        kv_len = (n_pages - 1) * page_size + last[i] if n_pages else 0
        if n_pages and not 1 <= last[i] <= page_size:
            raise KVShapeError(f"request {i}: last_page_len {last[i]} outside [1, {page_size}]")
        if q_len > kv_len:
            # the step's own tokens are in the cache before attention runs
            raise KVShapeError(f"request {i}: {q_len} queries but only {kv_len} cached tokens")
        start = len(pages)
        pages.extend(indices[kv[i] : kv[i + 1]])
        requests.append(_Request(qo[i], qo[i + 1], kv_len, start, len(pages)))
    return _TorchPlan(tuple(requests), tuple(pages), qo[-1], page_size)


def _reference_run(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    plan: _TorchPlan,
    layout: KVLayout,
    sm_scale: float | None,
    causal: bool,
    window_left: int = -1,
    chunk: int = 0,
) -> torch.Tensor:
    num_rows, num_qo_heads, head_dim = q.shape
    if num_rows < plan.num_tokens:
        raise KVShapeError(f"q has {num_rows} rows, the page table needs {plan.num_tokens}")
    if _page_size_of(kv_layer, layout) != plan.page_size:
        raise KVShapeError(
            f"kv_layer page size {_page_size_of(kv_layer, layout)} != plan's {plan.page_size}"
        )
    num_kv_heads = int(kv_layer.shape[3] if layout is KVLayout.NHD else kv_layer.shape[2])
    if num_qo_heads % num_kv_heads or int(kv_layer.shape[4]) != head_dim:
        raise KVShapeError(
            f"q heads/dim {num_qo_heads}x{head_dim} do not fit kv heads/dim "
            f"{num_kv_heads}x{int(kv_layer.shape[4])}"
        )
    group = num_qo_heads // num_kv_heads
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    # rows past the table (a graph's padding) have no request: leave them zero
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    if not plan.pages:
        return out
    # one gather per layer: only the pages the batch reads, never the whole layer
    idx = torch.tensor(plan.pages, dtype=torch.long, device=kv_layer.device)
    blocks = kv_layer.index_select(0, idx)
    if layout is KVLayout.HND:
        blocks = blocks.transpose(2, 3)  # -> [n, 2, ps, H, D]
    ps = plan.page_size
    for r in plan.requests:
        q_len = r.q_end - r.q_start
        if q_len == 0:
            continue
        n = r.page_end - r.page_start
        kv = blocks[r.page_start : r.page_end].float()
        k = kv[:, 0].reshape(n * ps, num_kv_heads, head_dim)[: r.kv_len]
        v = kv[:, 1].reshape(n * ps, num_kv_heads, head_dim)[: r.kv_len]
        # GQA: qo head h reads kv head h // group, as FlashInfer and HF's repeat_kv do
        qr = q[r.q_start : r.q_end].float().view(q_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("qhgd,khd->hgqk", qr, k) * scale
        if causal:
            q_pos = torch.arange(r.kv_len - q_len, r.kv_len, device=q.device)
            k_pos = torch.arange(r.kv_len, device=q.device)
            allowed = k_pos[None, :] <= q_pos[:, None]
            if window_left >= 0:  # a sliding window: W - 1 tokens before the query
                allowed = allowed & (k_pos[None, :] >= q_pos[:, None] - window_left)
            if chunk > 0:  # chunked local attention: a query reads its own chunk
                allowed = allowed & (k_pos[None, :] >= q_pos[:, None] // chunk * chunk)
            scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("hgqk,khd->qhgd", probs, v)
        out[r.q_start : r.q_end] = o.reshape(q_len, num_qo_heads, head_dim).to(q.dtype)
    return out


def paged_attention_reference(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    indptrs: PagedIndptrs,
    layout: KVLayout | str,
    page_size: int | None = None,
    *,
    sm_scale: float | None = None,
    causal: bool = True,
    window_left: int = -1,
    chunk: int = 0,
) -> torch.Tensor:
    """Attention of ``q: [num_tokens, num_qo_heads, head_dim]`` over one layer's pages.

    ``kv_layer`` is `KVCache.layer_view` (``[pages, 2, ps, H, D]`` for NHD,
    ``[pages, 2, H, ps, D]`` for HND). Computed in float32, returned in
    ``q.dtype``; ``sm_scale`` defaults to ``1/sqrt(head_dim)``.
    ``window_left`` >= 0 (causal only): a query reads at most that many
    tokens before its own position, FlashInfer's sliding window (a windowed
    label: `RetentionPolicy.window_left`); -1 reads every token before it.
    ``chunk`` > 0 (causal only): chunked local attention, a query at view
    position p reads from ``p // chunk * chunk`` on (a chunked group's
    `ChunkedAttention.size`; its view starts on a chunk, H7).
    """
    lay = _layout_of(layout)
    ps = _page_size_of(kv_layer, lay)
    if page_size is not None and page_size != ps:
        raise KVShapeError(f"page_size {page_size} but kv_layer pages hold {ps} tokens")
    return _reference_run(q, kv_layer, _unpack(indptrs, ps), lay, sm_scale, causal,
                          window_left, chunk)


# ---------------------------------------------------------------------------
# The facade attention layers use


class PagedAttention:
    """What an attention layer calls: ``plan`` once per step, ``run`` per layer.

    ``backend="auto"`` runs FlashInfer when ``q`` is on CUDA and flashinfer
    imports, the batched SDPA path (`kvref.attention.sdpa`) otherwise;
    ``"torch"`` (the reference, the oracle), ``"sdpa"`` and ``"flashinfer"``
    force one (``"flashinfer"`` raises where it cannot run). FlashInfer's
    plan needs the query dtype, so unless ``plan`` is told ``q_dtype`` (and
    must be, before a CUDA-graph capture) it is planned on the first
    ``run`` and again only if the dtype changes.
    """

    def __init__(
        self,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        layout: KVLayout | str = KVLayout.NHD,
        backend: Backend = "auto",
        sm_scale: float | None = None,
        causal: bool = True,
        flashinfer: FlashInferPagedAttention | None = None,
        window_left: int = -1,
        chunk: int = 0,
    ) -> None:
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"{num_qo_heads} qo heads are not a multiple of {num_kv_heads}")
        if backend not in ("auto", "torch", "sdpa", "flashinfer"):
            raise ValueError(f"unknown attention backend {backend!r}")
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.layout = _layout_of(layout)
        self.backend: Backend = backend
        self.sm_scale = sm_scale
        self.causal = causal
        # a sliding window (a windowed label's `RetentionPolicy.window_left`): a
        # query reads at most this many tokens before its own; -1: all
        self.window_left = window_left
        # chunked local attention (a chunked group's `ChunkedAttention.size`):
        # a query reads only its own chunk; 0: none
        self.chunk = chunk
        self._fi = flashinfer
        self._indptrs: PagedIndptrs | None = None
        self._torch_plan: _TorchPlan | None = None
        self._sdpa_plan: SdpaPlan | None = None
        self._fi_planned_for: tuple[torch.dtype, torch.dtype] | None = None
        self.last_backend: Literal["torch", "sdpa", "flashinfer"] | None = None

    @classmethod
    def from_config(cls, cfg: KVConfig, **kwargs: Any) -> PagedAttention:
        return cls(
            num_qo_heads=cfg.num_qo_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            page_size=cfg.page_size,
            layout=cfg.layout,
            **kwargs,
        )

    def plan(
        self,
        plan: KVPlanOutput | PagedIndptrs,
        *,
        q_dtype: torch.dtype | None = None,
        kv_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """Take one plan label's page table (the host copy of a `KVPlanOutput`).

        With ``q_dtype`` and a CUDA ``device`` FlashInfer is planned now,
        outside any graph capture; otherwise on the first ``run``.
        """
        indptrs = plan.cpu_indptrs if isinstance(plan, KVPlanOutput) else plan
        self._indptrs = indptrs
        # unpacked on the first torch or sdpa run: FlashInfer steps never need them
        self._torch_plan = None
        self._sdpa_plan = None
        self._fi_planned_for = None
        if (
            q_dtype is not None
            and device is not None
            and self._use_flashinfer(torch.device(device))
        ):
            self._plan_flashinfer(q_dtype, kv_dtype if kv_dtype is not None else q_dtype)

    def run(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        """``q: [num_tokens, num_qo_heads, head_dim]`` -> same shape, ``q.dtype``."""
        if self._indptrs is None:
            raise RuntimeError("PagedAttention.run before plan")
        if q.dim() != 3 or q.shape[1] != self.num_qo_heads or q.shape[2] != self.head_dim:
            raise KVShapeError(
                f"q must be [tokens, {self.num_qo_heads}, {self.head_dim}], got {tuple(q.shape)}"
            )
        if self._use_flashinfer(q.device):
            if self._fi_planned_for != (q.dtype, kv_layer.dtype):
                self._plan_flashinfer(q.dtype, kv_layer.dtype)
            assert self._fi is not None
            if self.chunk > 0:
                self._check_one_chunk()
            self.last_backend = "flashinfer"
            return self._fi.run(q, kv_layer)
        if self.backend != "torch":
            if self._sdpa_plan is None:
                heads = (self.num_qo_heads, self.num_kv_heads, self.head_dim)
                self._sdpa_plan = plan_sdpa(self._indptrs, self.page_size, q.device, heads)
            self.last_backend = "sdpa"
            return run_sdpa_plan(
                q, kv_layer, self._sdpa_plan, self.layout, self.sm_scale, self.causal,
                self.window_left, self.chunk,
            )
        if self._torch_plan is None:
            self._torch_plan = _unpack(self._indptrs, self.page_size)
        self.last_backend = "torch"
        return _reference_run(
            q, kv_layer, self._torch_plan, self.layout, self.sm_scale, self.causal,
            self.window_left, self.chunk,
        )

    def _check_one_chunk(self) -> None:
        """FlashInfer has no chunk mask: its tables must each be one chunk.
        A chunked group's view starts on its chunk (H7), so every decode
        table is; a prefill that crosses a chunk boundary is not, and the
        engine splits it there (as vLLM's local-attention virtual batches
        do), or runs it on the torch or SDPA backend."""
        t = self._indptrs
        assert t is not None
        kv = t.paged_kv_indptr.tolist()
        last = t.paged_kv_last_page_len.tolist()
        for i, n in enumerate(last):
            length = (kv[i + 1] - kv[i] - 1) * self.page_size + n if kv[i + 1] > kv[i] else 0
            if length > self.chunk:
                raise ValueError(
                    f"request {i} of the table reads {length} tokens, past its chunk of "
                    f"{self.chunk}: FlashInfer has no chunk mask; split the step at the "
                    "chunk boundary, or use backend='torch' or 'sdpa'")

    def _use_flashinfer(self, device: torch.device) -> bool:
        if self.backend in ("torch", "sdpa"):
            return False
        usable = device.type == "cuda" and _import_flashinfer() is not None
        if self.backend == "flashinfer" and not usable:
            raise RuntimeError(
                f"backend='flashinfer' needs CUDA tensors and flashinfer (device {device})"
            )
        return usable

    def _plan_flashinfer(self, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        assert self._indptrs is not None
        if self._fi is None:
            device = torch.device("cuda", torch.cuda.current_device())
            self._fi = FlashInferPagedAttention(device, self.layout)
        self._fi.plan(
            self._indptrs,
            num_qo_heads=self.num_qo_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            page_size=self.page_size,
            q_dtype=q_dtype,
            kv_dtype=kv_dtype,
            sm_scale=self.sm_scale,
            causal=self.causal,
            window_left=self.window_left,
        )
        self._fi_planned_for = (q_dtype, kv_dtype)
