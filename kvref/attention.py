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

from kvref.config import KVConfig, KVLayout
from kvref.errors import KVShapeError
from kvref.plan import SINK_PAGE, KVPlanOutput, PagedIndptrs

Backend = Literal["auto", "torch", "flashinfer"]

# FlashInfer's documented default; its split-kv scratch grows with batch and length
DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024


def _layout_of(layout: KVLayout | str) -> KVLayout:
    return layout if isinstance(layout, KVLayout) else KVLayout(layout)


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
) -> torch.Tensor:
    """Attention of ``q: [num_tokens, num_qo_heads, head_dim]`` over one layer's pages.

    ``kv_layer`` is `KVCache.layer_view` (``[pages, 2, ps, H, D]`` for NHD,
    ``[pages, 2, H, ps, D]`` for HND). Computed in float32, returned in
    ``q.dtype``; ``sm_scale`` defaults to ``1/sqrt(head_dim)``.
    """
    lay = _layout_of(layout)
    ps = _page_size_of(kv_layer, lay)
    if page_size is not None and page_size != ps:
        raise KVShapeError(f"page_size {page_size} but kv_layer pages hold {ps} tokens")
    return _reference_run(q, kv_layer, _unpack(indptrs, ps), lay, sm_scale, causal)


# ---------------------------------------------------------------------------
# FlashInfer


_flashinfer: Any = None
_flashinfer_checked = False


def _import_flashinfer() -> Any:
    """The flashinfer module, or None; imported once, on first use only.

    Lazy so that CPU installs never need it; any failure (missing CUDA
    libraries too, not only ImportError) means "not available".
    """
    global _flashinfer, _flashinfer_checked
    if not _flashinfer_checked:
        _flashinfer_checked = True
        try:
            import flashinfer

            _flashinfer = flashinfer
        except Exception:
            _flashinfer = None
    return _flashinfer


def flashinfer_available() -> bool:
    return torch.cuda.is_available() and _import_flashinfer() is not None


def _graph_padded(indptrs: PagedIndptrs, batch_size: int, decode: bool) -> PagedIndptrs:
    """Pad a table to a graph's fixed batch size with requests that read the sink.

    A wrapper in CUDA-graph mode replays a fixed batch. Padded requests get
    one sink token so the kernel reads a real page; in prefill they own no
    query rows, in decode each owns one (padded) row, as decode has one per
    request.
    """
    n = indptrs.batch_size
    if n > batch_size:
        raise KVShapeError(f"batch of {n} requests exceeds the graph's {batch_size}")
    pad = batch_size - n
    if pad == 0:
        return indptrs
    qo = indptrs.qo_indptr.cpu()
    kv = indptrs.paged_kv_indptr.cpu()
    step = 1 if decode else 0
    i32 = torch.int32
    return PagedIndptrs(
        qo_indptr=torch.cat((qo, qo[-1] + step * torch.arange(1, pad + 1, dtype=i32))),
        paged_kv_indptr=torch.cat((kv, kv[-1] + torch.arange(1, pad + 1, dtype=i32))),
        paged_kv_indices=torch.cat(
            (indptrs.paged_kv_indices.cpu(), torch.full((pad,), SINK_PAGE, dtype=i32))
        ),
        paged_kv_last_page_len=torch.cat(
            (indptrs.paged_kv_last_page_len.cpu(), torch.ones(pad, dtype=i32))
        ),
    )


def _is_decode(indptrs: PagedIndptrs) -> bool:
    qo = indptrs.qo_indptr
    return indptrs.batch_size > 0 and bool(((qo[1:] - qo[:-1]) == 1).all())


class FlashInferPagedAttention:
    """FlashInfer's batch prefill and decode wrappers over a kvref page table.

    Decode (every request one query) takes the decode wrapper, anything else
    the prefill wrapper with a causal mask. Both share one workspace; a step
    plans one of them.

    CUDA-graph mode (``cuda_graph_batch_size``): the wrappers keep the page
    table in static buffers allocated here, so a captured ``run`` reads
    whatever the latest ``plan`` copied in. The batch is fixed per wrapper
    (one wrapper per graph bucket): smaller batches are padded with requests
    that read the sink page, and ``q`` must carry the bucket's padded rows.
    FlashInfer sizes a graph-mode prefill by its first plan's row count, so
    plan the bucket's largest token count first (that is, at capture).
    """

    def __init__(
        self,
        device: torch.device | str,
        layout: KVLayout | str,
        *,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        cuda_graph_batch_size: int | None = None,
        max_num_pages: int | None = None,
        use_tensor_cores: bool = False,
    ) -> None:
        fi = _import_flashinfer()
        if fi is None:
            raise RuntimeError("flashinfer is not importable; use the torch backend")
        self.device = torch.device(device)
        self.layout = _layout_of(layout)
        self.cuda_graph_batch_size = cuda_graph_batch_size
        # FlashInfer asks for a zeroed workspace on first use
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        prefill_bufs: dict[str, Any] = {}
        decode_bufs: dict[str, Any] = {}
        if cuda_graph_batch_size is not None:
            if max_num_pages is None:
                raise ValueError("CUDA-graph mode needs max_num_pages to size the indices buffer")
            b = cuda_graph_batch_size

            def i32(n: int) -> torch.Tensor:
                return torch.zeros(n, dtype=torch.int32, device=self.device)

            # separate buffers per wrapper: each copies its plan into its own
            prefill_bufs = {
                "qo_indptr_buf": i32(b + 1),
                "paged_kv_indptr_buf": i32(b + 1),
                "paged_kv_indices_buf": i32(max_num_pages),
                "paged_kv_last_page_len_buf": i32(b),
            }
            decode_bufs = {
                "paged_kv_indptr_buffer": i32(b + 1),
                "paged_kv_indices_buffer": i32(max_num_pages),
                "paged_kv_last_page_len_buffer": i32(b),
            }
        graph = cuda_graph_batch_size is not None
        self._prefill = fi.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, self.layout.value, use_cuda_graph=graph, **prefill_bufs
        )
        self._decode = fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace,
            self.layout.value,
            use_cuda_graph=graph,
            use_tensor_cores=use_tensor_cores,
            **decode_bufs,
        )
        self._planned: Literal["prefill", "decode"] | None = None

    def plan(
        self,
        indptrs: PagedIndptrs,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        q_dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
        sm_scale: float | None = None,
        causal: bool = True,
        decode: bool | None = None,
    ) -> None:
        """Plan this step once; every layer's ``run`` reuses it.

        Pass the host table: FlashInfer's planner reads the indptrs on the
        host, and a device table would cost it a sync per plan.
        """
        is_decode = _is_decode(indptrs) if decode is None else decode
        if self.cuda_graph_batch_size is not None:
            indptrs = _graph_padded(indptrs, self.cuda_graph_batch_size, is_decode)
        scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        common: dict[str, Any] = {
            "q_data_type": q_dtype,
            "kv_data_type": kv_dtype if kv_dtype is not None else q_dtype,
            "sm_scale": scale,
        }
        if is_decode:
            # one query per request attends to all of its context: causal by construction
            self._decode.plan(
                indptrs.paged_kv_indptr,
                indptrs.paged_kv_indices,
                indptrs.paged_kv_last_page_len,
                num_qo_heads,
                num_kv_heads,
                head_dim,
                page_size,
                **common,
            )
            self._planned = "decode"
        else:
            self._prefill.plan(
                indptrs.qo_indptr,
                indptrs.paged_kv_indptr,
                indptrs.paged_kv_indices,
                indptrs.paged_kv_last_page_len,
                num_qo_heads,
                num_kv_heads,
                head_dim,
                page_size,
                causal=causal,
                **common,
            )
            self._planned = "prefill"

    def run(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        if self._planned is None:
            raise RuntimeError("FlashInferPagedAttention.run before plan")
        wrapper = self._decode if self._planned == "decode" else self._prefill
        out: torch.Tensor = wrapper.run(q, kv_layer)
        return out


# ---------------------------------------------------------------------------
# The facade attention layers use


class PagedAttention:
    """What an attention layer calls: ``plan`` once per step, ``run`` per layer.

    ``backend="auto"`` runs FlashInfer when ``q`` is on CUDA and flashinfer
    imports, the torch reference otherwise; ``"torch"`` / ``"flashinfer"``
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
    ) -> None:
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"{num_qo_heads} qo heads are not a multiple of {num_kv_heads}")
        if backend not in ("auto", "torch", "flashinfer"):
            raise ValueError(f"unknown attention backend {backend!r}")
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.page_size = page_size
        self.layout = _layout_of(layout)
        self.backend: Backend = backend
        self.sm_scale = sm_scale
        self.causal = causal
        self._fi = flashinfer
        self._indptrs: PagedIndptrs | None = None
        self._torch_plan: _TorchPlan | None = None
        self._fi_planned_for: tuple[torch.dtype, torch.dtype] | None = None
        self.last_backend: Literal["torch", "flashinfer"] | None = None

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
        self._torch_plan = None  # unpacked on first torch run: FlashInfer steps never need it
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
            self.last_backend = "flashinfer"
            return self._fi.run(q, kv_layer)
        if self._torch_plan is None:
            self._torch_plan = _unpack(self._indptrs, self.page_size)
        self.last_backend = "torch"
        return _reference_run(
            q, kv_layer, self._torch_plan, self.layout, self.sm_scale, self.causal
        )

    def _use_flashinfer(self, device: torch.device) -> bool:
        if self.backend == "torch":
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
        )
        self._fi_planned_for = (q_dtype, kv_dtype)
