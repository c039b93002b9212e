"""FlashInfer's batch prefill and decode wrappers over a kvref page table.

The decisions that do not need a GPU are pure functions here, so that CPU
tests pin them down: how a table is padded to a CUDA graph's fixed batch
(`graph_padded`), how large the graph's page-index buffers must be for that
padding (`graph_indices_capacity`), when decode needs tensor cores
(`decode_needs_tensor_cores`), and which kernel and window a graph-mode plan
may use (`graph_plan_kind`, `graph_window_left`).
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Literal

import torch

from kvref.core.config import KVLayout
from kvref.core.errors import KVShapeError
from kvref.stepping.plan import SINK_PAGE, PagedIndptrs

Kind = Literal["prefill", "decode"]

# FlashInfer's documented default; its split-kv scratch grows with batch and length
DEFAULT_WORKSPACE_BYTES = 128 * 1024 * 1024

# q heads per kv head that FlashInfer's CUDA-core decode kernels are built
# for; any other group size fails at its first decode unless tensor cores
# (the prefill kernels with one query) run it instead
CUDA_CORE_DECODE_GROUP_SIZES = frozenset({1, 2, 3, 4, 6, 8, 16})


def layout_of(layout: KVLayout | str) -> KVLayout:
    return layout if isinstance(layout, KVLayout) else KVLayout(layout)


def decode_needs_tensor_cores(num_qo_heads: int, num_kv_heads: int) -> bool:
    """True when FlashInfer's CUDA-core decode has no kernel for this head grouping."""
    return num_qo_heads // num_kv_heads not in CUDA_CORE_DECODE_GROUP_SIZES


def is_decode_table(indptrs: PagedIndptrs) -> bool:
    """Every request has exactly one query (an empty batch is not a decode)."""
    qo = indptrs.qo_indptr
    return indptrs.batch_size > 0 and bool(((qo[1:] - qo[:-1]) == 1).all())


def graph_plan_kind(fixed: Kind | None, is_decode: bool, empty: bool = False) -> Kind:
    """The kernel a graph-mode plan uses, given the kind the graph was first planned as.

    A captured graph replays the kernel it recorded, whatever is planned
    later, so the kind is fixed by the first plan. A prefill graph runs
    decode-shaped batches too (prefill with one query each is correct); a
    decode graph cannot run a prefill, and silently replaying decode over a
    prefill table is wrong output, so that raises.
    """
    if fixed is None:
        return "decode" if is_decode else "prefill"
    if fixed == "decode" and not is_decode and not empty:
        raise KVShapeError(
            "a prefill table planned on a CUDA-graph wrapper captured as decode: the graph "
            "would replay the decode kernel; use a prefill bucket (its own wrapper)"
        )
    return fixed


def graph_window_left(fixed: int | None, window_left: int) -> int:
    """The ``window_left`` a graph-mode plan may use, given the first plan's.

    FlashInfer picks the kernel (sliding window or not) and its window at
    ``plan``; a captured graph replays what it recorded, so a later plan with
    another window would silently attend over the recorded one. A windowed
    label and a full one each need their own graph wrapper.
    """
    if fixed is not None and window_left != fixed:
        raise KVShapeError(
            f"window_left {window_left} planned on a CUDA-graph wrapper captured with "
            f"{fixed}: the graph would replay the other window; use a wrapper per window")
    return window_left


def graph_indices_capacity(
    max_num_pages: int, batch_size: int, page_size: int, num_rows: int | None = None
) -> int:
    """Entries a graph wrapper's ``paged_kv_indices`` buffer needs (defect D1).

    The real requests index at most every page of the cache once. Padding
    adds one sink entry per padded request (at most ``batch_size``), and in
    prefill one more request absorbs the spare query rows over
    ``ceil(rows / page_size)`` sink entries (`graph_padded`).
    """
    extra = batch_size
    if num_rows is not None:
        extra += -(-max(num_rows, 1) // page_size)
    return max_num_pages + extra


def graph_batch_size(batch_size: int, decode: bool) -> int:
    """The fixed FlashInfer batch of a bucket: prefill has one more, the row absorber."""
    return batch_size if decode else batch_size + 1


def graph_padded(
    indptrs: PagedIndptrs,
    batch_size: int,
    *,
    decode: bool,
    num_rows: int | None = None,
    page_size: int | None = None,
) -> PagedIndptrs:
    """Pad a host table to a graph's fixed batch and row count (defect D2).

    A wrapper in CUDA-graph mode replays a fixed batch over a fixed ``q``.
    Decode: every padded request owns one row and reads one sink token, so
    the batch is ``batch_size`` requests over ``batch_size`` rows. Prefill:
    FlashInfer requires ``q.shape[0] == qo_indptr[-1]``, so the padded
    requests own no rows and one extra request (always present, so the batch
    stays ``batch_size + 1``) absorbs the bucket's spare rows, attending
    causally over as many sink tokens as it has rows. Every plan of a prefill
    bucket thus has exactly ``num_rows`` rows.
    """
    n = indptrs.batch_size
    if n > batch_size:
        raise KVShapeError(f"batch of {n} requests exceeds the graph's {batch_size}")
    qo = indptrs.qo_indptr.cpu()
    kv = indptrs.paged_kv_indptr.cpu()
    indices = indptrs.paged_kv_indices.cpu()[: int(kv[-1])]
    last = indptrs.paged_kv_last_page_len.cpu()
    i32 = torch.int32
    pad = batch_size - n
    if decode:
        if pad == 0:
            return indptrs
        ones = torch.arange(1, pad + 1, dtype=i32)
        return PagedIndptrs(
            qo_indptr=torch.cat((qo, qo[-1] + ones)),
            paged_kv_indptr=torch.cat((kv, kv[-1] + ones)),
            paged_kv_indices=torch.cat((indices, torch.full((pad,), SINK_PAGE, dtype=i32))),
            paged_kv_last_page_len=torch.cat((last, torch.ones(pad, dtype=i32))),
        )
    if num_rows is None or page_size is None:
        raise KVShapeError("a prefill graph needs the bucket's num_rows and the page size")
    rows = int(qo[-1])
    if rows > num_rows:
        raise KVShapeError(f"{rows} query rows exceed the graph's {num_rows}")
    spare = num_rows - rows
    tokens = max(spare, 1)  # a request must read a real token, even with no rows
    absorber_pages = -(-tokens // page_size)
    ones = torch.arange(1, pad + 1, dtype=i32)
    kv_pad = torch.cat((kv[-1] + ones, (kv[-1] + pad + absorber_pages).view(1).to(i32)))
    return PagedIndptrs(
        qo_indptr=torch.cat(
            (qo, torch.full((pad,), rows, dtype=i32), torch.tensor([num_rows], dtype=i32))
        ),
        paged_kv_indptr=torch.cat((kv, kv_pad)),
        paged_kv_indices=torch.cat(
            (indices, torch.full((pad + absorber_pages,), SINK_PAGE, dtype=i32))
        ),
        paged_kv_last_page_len=torch.cat(
            (
                last,
                torch.ones(pad, dtype=i32),
                torch.tensor([tokens - (absorber_pages - 1) * page_size], dtype=i32),
            )
        ),
    )


# ---------------------------------------------------------------------------
# The wrapper (CUDA and flashinfer only)


_flashinfer: Any = None
_flashinfer_checked = False


def import_flashinfer() -> Any:
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
    return torch.cuda.is_available() and import_flashinfer() is not None


def _accepts(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class FlashInferPagedAttention:
    """FlashInfer's batch prefill and decode wrappers over a kvref page table.

    Decode (every request one query) takes the decode wrapper, anything else
    the prefill wrapper with a causal mask; an empty batch plans nothing and
    runs to zeros, as the torch reference does. Decode uses tensor cores
    where the CUDA-core kernels lack the head grouping
    (``use_tensor_cores=None``, the default) or where told to.

    CUDA-graph mode (``cuda_graph_batch_size``): one wrapper per graph
    bucket, its page table in static buffers allocated here, so a captured
    ``run`` reads whatever the latest ``plan`` copied in. Smaller batches are
    padded (`graph_padded`). A prefill bucket also needs
    ``cuda_graph_num_rows``, the bucket's token count: ``q`` must have
    exactly that many rows, and the first plan fixes the bucket's kind.
    """

    def __init__(
        self,
        device: torch.device | str,
        layout: KVLayout | str,
        *,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        cuda_graph_batch_size: int | None = None,
        cuda_graph_num_rows: int | None = None,
        max_num_pages: int | None = None,
        page_size: int | None = None,
        use_tensor_cores: bool | None = None,
    ) -> None:
        fi = import_flashinfer()
        if fi is None:
            raise RuntimeError("flashinfer is not importable; use the torch backend")
        self._fi = fi
        self.device = torch.device(device)
        self.layout = layout_of(layout)
        self.cuda_graph_batch_size = cuda_graph_batch_size
        self.cuda_graph_num_rows = cuda_graph_num_rows
        self.use_tensor_cores = use_tensor_cores
        if cuda_graph_batch_size is not None and (max_num_pages is None or page_size is None):
            raise KVShapeError("CUDA-graph mode needs max_num_pages and page_size to size buffers")
        self._max_num_pages = max_num_pages
        self._page_size = page_size
        # FlashInfer asks for a zeroed workspace on first use
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        # made on first use: a decode wrapper per tensor-core choice, and the
        # graph buffers only for the kind the bucket turns out to be
        self._prefill: Any = None
        self._decode: dict[bool, Any] = {}
        self._graph_kind: Kind | None = None
        self._graph_window_left: int | None = None
        self._planned: Any = None  # the wrapper `run` uses; None: an empty batch
        self._empty = False

    def _i32(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int32, device=self.device)

    def _graph_capacity(self, decode: bool) -> int:
        assert self._max_num_pages is not None and self._page_size is not None
        b = self.cuda_graph_batch_size
        assert b is not None
        rows = None if decode else self.cuda_graph_num_rows
        return graph_indices_capacity(self._max_num_pages, b, self._page_size, rows)

    def _prefill_wrapper(self) -> Any:
        if self._prefill is None:
            kwargs: dict[str, Any] = {}
            b = self.cuda_graph_batch_size
            if b is not None:
                fixed = graph_batch_size(b, decode=False)
                kwargs = {
                    "use_cuda_graph": True,
                    "qo_indptr_buf": self._i32(fixed + 1),
                    "paged_kv_indptr_buf": self._i32(fixed + 1),
                    "paged_kv_indices_buf": self._i32(self._graph_capacity(decode=False)),
                    "paged_kv_last_page_len_buf": self._i32(fixed),
                }
                cls = self._fi.BatchPrefillWithPagedKVCacheWrapper
                # newer FlashInfer: declare the row capacity instead of
                # letting the first plan fix it (every plan has exactly it)
                if _accepts(cls.__init__, "max_total_num_rows"):
                    kwargs["max_total_num_rows"] = self.cuda_graph_num_rows
            self._prefill = self._fi.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, self.layout.value, **kwargs
            )
        return self._prefill

    def _decode_wrapper(self, tensor_cores: bool) -> Any:
        wrapper = self._decode.get(tensor_cores)
        if wrapper is None:
            kwargs: dict[str, Any] = {}
            b = self.cuda_graph_batch_size
            if b is not None:
                kwargs = {
                    "use_cuda_graph": True,
                    "paged_kv_indptr_buffer": self._i32(b + 1),
                    "paged_kv_indices_buffer": self._i32(self._graph_capacity(decode=True)),
                    "paged_kv_last_page_len_buffer": self._i32(b),
                }
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, self.layout.value, use_tensor_cores=tensor_cores, **kwargs
            )
            self._decode[tensor_cores] = wrapper
        return wrapper

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
        window_left: int = -1,
    ) -> None:
        """Plan this step once; every layer's ``run`` reuses it.

        ``window_left`` >= 0: a sliding window (a windowed label's
        `RetentionPolicy.window_left`), passed to both wrappers' ``plan`` as
        FlashInfer's own ``window_left``; -1 (their default) is not passed.

        Pass the host table: FlashInfer's planner reads the indptrs on the
        host, and a device table would cost it a sync per plan.
        """
        empty = indptrs.batch_size == 0
        is_decode = is_decode_table(indptrs) if decode is None else decode
        graph = self.cuda_graph_batch_size is not None
        if graph:
            if self._page_size is not None and page_size != self._page_size:
                raise KVShapeError(f"page_size {page_size}, the graph buffers are for "
                                   f"{self._page_size}")
            kind = graph_plan_kind(self._graph_kind, is_decode, empty)
            if kind == "prefill" and self.cuda_graph_num_rows is None:
                raise KVShapeError("a prefill CUDA graph needs cuda_graph_num_rows")
            self._graph_kind = kind
            self._graph_window_left = graph_window_left(self._graph_window_left, window_left)
            assert self.cuda_graph_batch_size is not None
            indptrs = graph_padded(
                indptrs, self.cuda_graph_batch_size, decode=kind == "decode",
                num_rows=self.cuda_graph_num_rows, page_size=page_size,
            )
        elif empty:
            self._planned, self._empty = None, True
            return
        else:
            kind = "decode" if is_decode else "prefill"
        self._empty = False
        scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        common: dict[str, Any] = {
            "q_data_type": q_dtype,
            "kv_data_type": kv_dtype if kv_dtype is not None else q_dtype,
            "sm_scale": scale,
        }
        if window_left >= 0:
            common["window_left"] = window_left
        table = (indptrs.paged_kv_indptr, indptrs.paged_kv_indices,
                 indptrs.paged_kv_last_page_len)
        heads = (num_qo_heads, num_kv_heads, head_dim, page_size)
        if kind == "decode":
            tc = self.use_tensor_cores
            if tc is None:
                tc = decode_needs_tensor_cores(num_qo_heads, num_kv_heads)
            wrapper = self._decode_wrapper(tc)
            # one query per request attends to all of its context: causal by construction
            wrapper.plan(*table, *heads, **common)
        else:
            wrapper = self._prefill_wrapper()
            wrapper.plan(indptrs.qo_indptr, *table, *heads, causal=causal, **common)
        self._planned = wrapper

    def run(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        if self._empty:
            return torch.zeros_like(q)
        if self._planned is None:
            raise RuntimeError("FlashInferPagedAttention.run before plan")
        out: torch.Tensor = self._planned.run(q, kv_layer)
        return out
