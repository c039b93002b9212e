"""Paged attention as one batched gather and `scaled_dot_product_attention`.

The torch reference (`kvref.attention.paged.paged_attention_reference`) loops over
requests in Python; it is the oracle. This path pads the batch's requests
to a dense block table ``[B, P]``, gathers their K pages and their V pages
in one ``index_select`` each and runs one masked SDPA (requests grouped by
length, so the padding stays small), so on CPU it costs a few large kernels
instead of several small ones per request, and on CUDA it is capturable in a graph
without FlashInfer: every shape is fixed by the table's buffers and nothing
reads the device on the host (`StaticDenseTable`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvref.core.config import KVLayout
from kvref.core.errors import KVShapeError
from kvref.stepping.plan import SINK_PAGE, PagedIndptrs

# eager mode splits the batch so one gather stays under this (K and V, float32)
DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024


@dataclass
class DenseTable:
    """A page table as dense tensors, request-major, padded.

    ``block_table[b, p]``: page ``p`` of request ``b`` (the sink past its
    pages); ``kv_len[b]``, ``q_len[b]``: its cached tokens and its queries,
    the last ``q_len`` positions; ``row_src[r]``: where output row ``r`` is
    in the flattened ``[B * max_q]`` result, or ``B * max_q`` (a zero row)
    for a row no request owns.
    """

    block_table: torch.Tensor  # [B, P] long
    kv_len: torch.Tensor  # [B] long
    q_len: torch.Tensor  # [B] long
    q_start: torch.Tensor  # [B] long
    row_src: torch.Tensor  # [num_rows] long
    # eager tables: flat indices into [B * P * page_size] of the slots past
    # each request's tokens (None in a graph's static table: masked instead)
    stale: torch.Tensor | None = None


def _host_rows(
    indptrs: PagedIndptrs, page_size: int
) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """(q_start, q_len, kv_len, pages) per request, checked, from the host table."""
    qo = indptrs.qo_indptr.tolist()
    kv = indptrs.paged_kv_indptr.tolist()
    last = indptrs.paged_kv_last_page_len.tolist()
    indices = indptrs.paged_kv_indices.tolist()
    if not len(qo) == len(kv) == len(last) + 1:
        raise KVShapeError(
            f"page table sizes disagree: qo_indptr {len(qo)}, paged_kv_indptr {len(kv)}, "
            f"last_page_len {len(last)}"
        )
    starts, qlens, kvlens, pages = [], [], [], []
    for i in range(len(last)):
        n = kv[i + 1] - kv[i]
        if n and not 1 <= last[i] <= page_size:
            raise KVShapeError(f"request {i}: last_page_len {last[i]} outside [1, {page_size}]")
        kv_len = (n - 1) * page_size + last[i] if n else 0
        q_len = qo[i + 1] - qo[i]
        if q_len > kv_len:
            raise KVShapeError(f"request {i}: {q_len} queries but only {kv_len} cached tokens")
        starts.append(qo[i])
        qlens.append(q_len)
        kvlens.append(kv_len)
        pages.append(indices[kv[i] : kv[i + 1]])
    return starts, qlens, kvlens, pages


def _fill(
    which: list[int],
    rows: tuple[list[int], list[int], list[int], list[list[int]]],
    num_rows: int,
    batch: int,
    max_pages: int,
    max_q: int,
) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    starts, qlens, kvlens, pages = rows
    table = [SINK_PAGE] * (batch * max_pages)
    kv_len, q_len, q_start = [0] * batch, [0] * batch, [0] * batch
    zero_row = batch * max_q
    row_src = [zero_row] * num_rows
    for b, i in enumerate(which):
        table[b * max_pages : b * max_pages + len(pages[i])] = pages[i]
        kv_len[b], q_len[b], q_start[b] = kvlens[i], qlens[i], starts[i]
        for j in range(qlens[i]):
            row_src[starts[i] + j] = b * max_q + j
    return table, kv_len, q_len, q_start, row_src


def dense_table(
    indptrs: PagedIndptrs,
    page_size: int,
    device: torch.device | str,
    which: list[int] | None = None,
    num_rows: int | None = None,
) -> DenseTable:
    """The requests ``which`` (default all) of a host table, sized to fit them exactly."""
    rows = _host_rows(indptrs, page_size)
    sel = list(range(len(rows[0]))) if which is None else which
    batch = len(sel)
    max_pages = max((len(rows[3][i]) for i in sel), default=0)
    max_q = max((rows[1][i] for i in sel), default=0)
    n = int(indptrs.qo_indptr[-1]) if num_rows is None else num_rows
    pages = max(max_pages, 1)
    parts = _fill(sel, rows, n, batch, pages, max_q)
    table = _to_table(parts, batch, pages, device)[0]
    keys = pages * page_size
    stale = [b * keys + t for b, i in enumerate(sel) for t in range(rows[2][i], keys)]
    table.stale = torch.tensor(stale, dtype=torch.long).to(device)
    return table


def _to_table(
    parts: tuple[list[int], list[int], list[int], list[int], list[int]],
    batch: int,
    max_pages: int,
    device: torch.device | str,
) -> tuple[DenseTable, torch.Tensor]:
    table, kv_len, q_len, q_start, row_src = parts
    flat = torch.tensor(table + kv_len + q_len + q_start + row_src, dtype=torch.long)
    flat = flat.to(device)
    b, t = batch, batch * max_pages
    fields = DenseTable(
        block_table=flat[:t].view(batch, max_pages),
        kv_len=flat[t : t + b],
        q_len=flat[t + b : t + 2 * b],
        q_start=flat[t + 2 * b : t + 3 * b],
        row_src=flat[t + 3 * b :],
    )
    return fields, flat


def sdpa_run(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    table: DenseTable,
    layout: KVLayout,
    max_q: int,
    sm_scale: float | None = None,
    causal: bool = True,
    window_left: int = -1,
    chunk: int = 0,
) -> torch.Tensor:
    """Attention of ``q`` over ``table``'s requests; rows no request owns are zero.
    ``window_left`` >= 0: a sliding window, ``chunk`` > 0: chunked local
    attention, each as the torch reference's.

    No host reads: capturable in a CUDA graph when ``table`` is static.
    ``max_q`` is the query rows per request the table was padded for.
    """
    num_rows, hq, d = q.shape
    batch, max_pages = table.block_table.shape
    if batch == 0 or max_q == 0:
        return torch.zeros_like(q)
    token_major = kv_layer if layout is KVLayout.NHD else kv_layer.transpose(2, 3)
    ps, hkv = int(token_major.shape[2]), int(token_major.shape[3])
    if hq % hkv or int(token_major.shape[4]) != d:
        raise KVShapeError(f"q heads/dim {hq}x{d} do not fit kv heads/dim "
                           f"{hkv}x{token_major.shape[4]}")
    group, n_keys = hq // hkv, max_pages * ps
    compute = torch.float32 if q.device.type == "cpu" else q.dtype
    # K and V gathered apart, so each lands contiguous as [B, P * ps, H, D];
    # index_select copies whole pages, several times faster than [] indexing
    pages = table.block_table.view(-1)

    def gather(which: int) -> torch.Tensor:
        got = token_major[:, which].index_select(0, pages).to(compute)
        return got.contiguous().view(batch, n_keys, hkv, d)

    k, v = gather(0), gather(1)
    kpos = torch.arange(n_keys, device=q.device)
    # slots past a request's tokens (the rest of its last page, the sink
    # padding) may hold anything, NaN included, and a masked NaN still
    # poisons the scores and P @ V: zero them
    if table.stale is not None:  # eager: the few slots the host listed
        k.view(-1, hkv, d).index_fill_(0, table.stale, 0.0)
        v.view(-1, hkv, d).index_fill_(0, table.stale, 0.0)
    else:  # a graph: a fixed-shape pass
        stale = (kpos[None, :] >= table.kv_len[:, None])[:, :, None, None]
        k, v = k.masked_fill(stale, 0.0), v.masked_fill(stale, 0.0)
    j = torch.arange(max_q, device=q.device)
    valid = j[None, :] < table.q_len[:, None]  # [B, Q]
    rows = (table.q_start[:, None] + j[None, :]).clamp(max=max(num_rows - 1, 0))
    # GQA without repeating K/V: the group's q heads become extra query rows
    # of their kv head, [B, Hkv, G * Q, D] (qo head h reads kv head h // G)
    qb = q[rows].to(compute).view(batch, max_q, hkv, group, d)
    qb = qb.permute(0, 2, 3, 1, 4).reshape(batch, hkv, group * max_q, d)
    allowed = kpos[None, None, :] < table.kv_len[:, None, None]  # [B, 1|Q, K]
    if causal:
        qpos = table.kv_len[:, None] - table.q_len[:, None] + j[None, :]
        allowed = allowed & (kpos[None, None, :] <= qpos[:, :, None])
        if window_left >= 0:
            allowed = allowed & (kpos[None, None, :] >= qpos[:, :, None] - window_left)
        if chunk > 0:
            allowed = allowed & (kpos[None, None, :] >= qpos[:, :, None] // chunk * chunk)
    # a padded query row with nothing to read would be NaN: let it read key 0
    allowed = allowed | ((~valid)[:, :, None] & (kpos == 0)[None, None, :])
    mask = allowed.expand(batch, max_q, n_keys)[:, None].expand(batch, group, max_q, n_keys)
    mask = mask.reshape(batch, 1, group * max_q, n_keys)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    o = F.scaled_dot_product_attention(qb, k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask, scale=scale)
    o = o.view(batch, hkv, group, max_q, d).permute(0, 3, 1, 2, 4)
    flat = o.reshape(batch * max_q, hq, d)
    flat = torch.cat((flat, flat.new_zeros(1, hq, d)))
    return flat[table.row_src].to(q.dtype)


# queries per request up to which requests share a padded batch (decode,
# speculative verification); a longer chunk runs alone
SHARED_MAX_Q = 16


def _chunks(kv_lens: list[int], q_lens: list[int], row_bytes: int, budget: int) -> list[list[int]]:
    """Groups of requests, each padded as little as it can be.

    A prefill chunk padded into a batch of decodes would multiply their
    query rows, so requests are pooled by query count (rounded up to a power
    of two; past `SHARED_MAX_Q` each is alone), then by length, each group's
    padded gather under ``budget``.
    """
    pools: dict[int, list[int]] = {}
    groups: list[list[int]] = []
    for i, n in enumerate(q_lens):
        if n > SHARED_MAX_Q:
            groups.append([i])
        else:
            pools.setdefault(1 << max(n - 1, 0).bit_length(), []).append(i)
    for members in pools.values():
        cur: list[int] = []
        for i in sorted(members, key=lambda i: kv_lens[i]):
            # ascending: the newest member is the longest, it sets the padding
            if cur and (len(cur) + 1) * max(kv_lens[i], 1) * row_bytes > budget:
                groups.append(cur)
                cur = []
            cur.append(i)
        if cur:
            groups.append(cur)
    return groups


@dataclass
class SdpaPlan:
    """A step's requests in length-sorted groups, each a dense table; reused per layer."""

    groups: list[tuple[DenseTable, int, torch.Tensor]]  # table, max_q, rows it owns
    num_rows: int


def plan_sdpa(
    indptrs: PagedIndptrs,
    page_size: int,
    device: torch.device | str,
    heads: tuple[int, int, int],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> SdpaPlan:
    """Group the requests (``heads``: qo heads, kv heads, head_dim) and build their tables."""
    rows = _host_rows(indptrs, page_size)
    num_rows = int(indptrs.qo_indptr[-1])
    hq, hkv, d = heads
    # a key's float32 K and V, and its column of scores over the group's queries
    row_bytes = 4 * d * 2 * hkv + 4 * hq
    groups = []
    for group in _chunks(rows[2], rows[1], row_bytes, chunk_bytes):
        live = [i for i in group if rows[1][i]]
        if live:
            table = dense_table(indptrs, page_size, device, live, num_rows=num_rows)
            max_q = max(rows[1][i] for i in live)
            groups.append((table, max_q, table.row_src < len(live) * max_q))
    return SdpaPlan(groups, num_rows)


def run_sdpa_plan(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    plan: SdpaPlan,
    layout: KVLayout,
    sm_scale: float | None = None,
    causal: bool = True,
    window_left: int = -1,
    chunk: int = 0,
) -> torch.Tensor:
    if q.shape[0] < plan.num_rows:
        raise KVShapeError(f"q has {q.shape[0]} rows, the page table needs {plan.num_rows}")
    if len(plan.groups) == 1 and q.shape[0] == plan.num_rows:
        table, max_q, _ = plan.groups[0]
        return sdpa_run(q, kv_layer, table, layout, max_q, sm_scale, causal, window_left, chunk)
    out = torch.zeros_like(q)
    head = q[: plan.num_rows]
    for table, max_q, owned in plan.groups:
        part = sdpa_run(head, kv_layer, table, layout, max_q, sm_scale, causal, window_left,
                        chunk)
        out[: plan.num_rows][owned] = part[owned]
    return out


def paged_attention_sdpa(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    indptrs: PagedIndptrs,
    layout: KVLayout,
    page_size: int,
    *,
    sm_scale: float | None = None,
    causal: bool = True,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    window_left: int = -1,
) -> torch.Tensor:
    """Same contract and result as the torch reference, batched (eager mode)."""
    hkv = int(kv_layer.shape[3] if layout is KVLayout.NHD else kv_layer.shape[2])
    heads = (int(q.shape[1]), hkv, int(q.shape[2]))
    plan = plan_sdpa(indptrs, page_size, q.device, heads, chunk_bytes)
    return run_sdpa_plan(q, kv_layer, plan, layout, sm_scale, causal, window_left)


class StaticDenseTable:
    """Fixed-shape device buffers for a graph: ``update`` copies each step's table in.

    ``batch`` requests of at most ``max_pages`` pages and ``max_q`` queries
    each, over ``num_rows`` rows of ``q``; a captured `run` reads whatever
    the latest ``update`` wrote.
    """

    def __init__(
        self, batch: int, max_pages: int, max_q: int, num_rows: int, device: torch.device | str
    ) -> None:
        self.batch, self.max_pages, self.max_q, self.num_rows = batch, max_pages, max_q, num_rows
        empty = ([SINK_PAGE] * (batch * max_pages), [0] * batch, [0] * batch, [0] * batch,
                 [batch * max_q] * num_rows)
        # every field is a view of _flat: a step's update is one copy
        self.table, self._flat = _to_table(empty, batch, max_pages, device)

    def update(self, indptrs: PagedIndptrs, page_size: int) -> None:
        rows = _host_rows(indptrs, page_size)
        n = len(rows[0])
        if n > self.batch:
            raise KVShapeError(f"batch of {n} requests exceeds the graph's {self.batch}")
        if max((len(p) for p in rows[3]), default=0) > self.max_pages:
            raise KVShapeError(f"a request holds more than the graph's {self.max_pages} pages")
        if max(rows[1], default=0) > self.max_q or int(indptrs.qo_indptr[-1]) > self.num_rows:
            raise KVShapeError(f"queries exceed the graph's {self.max_q} per request "
                               f"or {self.num_rows} rows")
        parts = _fill(list(range(n)), rows, self.num_rows, self.batch, self.max_pages, self.max_q)
        host = torch.tensor([x for part in parts for x in part], dtype=torch.long)
        if self._flat.is_cuda:
            # pinned, so the copy is async yet its source outlives it (see plan.host_to_device)
            host = host.pin_memory()
        self._flat.copy_(host, non_blocking=True)

    def run(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        layout: KVLayout,
        sm_scale: float | None = None,
        causal: bool = True,
        window_left: int = -1,
    ) -> torch.Tensor:
        return sdpa_run(q, kv_layer, self.table, layout, self.max_q, sm_scale, causal,
                        window_left)
