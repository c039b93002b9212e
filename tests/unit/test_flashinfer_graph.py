"""The GPU-free decisions of the FlashInfer path (defects D1-D3 of issue 12).

`graph_padded` must hand FlashInfer's CUDA-graph wrappers a table they
accept: the fixed batch, exactly the bucket's rows in prefill (``run``
checks ``q.shape[0] == qo_indptr[-1]``), every request reading at least as
many tokens as it has queries, and no more page indices than the static
buffer `graph_indices_capacity` sizes. The checks below are the ones
FlashInfer 0.7's ``plan`` and ``run`` make, written out.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvref.attention.flashinfer import (
    CUDA_CORE_DECODE_GROUP_SIZES,
    decode_needs_tensor_cores,
    graph_batch_size,
    graph_indices_capacity,
    graph_padded,
    graph_plan_kind,
    is_decode_table,
)
from kvref.core.errors import KVShapeError
from kvref.stepping.plan import SINK_PAGE, PagedIndptrs, SequenceView, build_paged_indptrs


def _accepts(table: PagedIndptrs, batch: int, capacity: int, page_size: int) -> None:
    """What FlashInfer's graph-mode plan requires of a table (and what a kernel reads)."""
    qo = table.qo_indptr.tolist()
    kv = table.paged_kv_indptr.tolist()
    last = table.paged_kv_last_page_len.tolist()
    assert len(qo) == len(kv) == batch + 1 and len(last) == batch
    assert len(table.paged_kv_indices) <= capacity, "plan: indices exceed the buffer"
    for i in range(batch):
        pages = kv[i + 1] - kv[i]
        q_len = qo[i + 1] - qo[i]
        assert pages >= 1 and 1 <= last[i] <= page_size
        assert q_len >= 0 and q_len <= (pages - 1) * page_size + last[i]


@st.composite
def full_cache_tables(draw: st.DrawFn) -> tuple[PagedIndptrs, int, int, int, int]:
    """A batch that may hold every usable page of the cache (the D1 case)."""
    page_size = draw(st.sampled_from([1, 2, 16]))
    max_num_pages = draw(st.integers(2, 40))
    bucket = draw(st.integers(1, 8))
    n = draw(st.integers(0, bucket))
    decode = draw(st.booleans())
    free = list(range(1, max_num_pages))
    views = []
    for i in range(n):
        left = len(free) - (n - i - 1)  # leave a page for each request after this one
        if left < 1:
            break
        take = left if i == n - 1 and draw(st.booleans()) else draw(st.integers(1, left))
        pages, free = free[:take], free[take:]
        length = draw(st.integers((take - 1) * page_size + 1, take * page_size))
        q_len = 1 if decode else draw(st.integers(1, min(length, 20)))
        views.append(SequenceView(f"r{i}", "main", pages, length, q_len, 0))
    table = build_paged_indptrs(views, page_size)
    rows = int(table.qo_indptr[-1]) + draw(st.integers(0, 24))
    return table, bucket, page_size, max_num_pages, rows


@given(full_cache_tables())
def test_padded_table_fits_flashinfer_graph_wrappers(
    case: tuple[PagedIndptrs, int, int, int, int],
) -> None:
    table, bucket, page_size, max_num_pages, rows = case
    n = table.batch_size
    for decode in (True, False):
        if decode and not is_decode_table(table) and n:
            continue
        num_rows = None if decode else rows
        padded = graph_padded(
            table, bucket, decode=decode, num_rows=num_rows, page_size=page_size
        )
        batch = graph_batch_size(bucket, decode)
        capacity = graph_indices_capacity(max_num_pages, bucket, page_size, num_rows)
        _accepts(padded, batch, capacity, page_size)
        qo = padded.qo_indptr.tolist()
        # decode: one row per request; prefill: exactly the bucket's rows
        assert qo[-1] == (bucket if decode else rows)
        # the real requests are untouched, the padding reads only the sink
        kv_end = int(table.paged_kv_indptr[-1])
        assert padded.paged_kv_indices[:kv_end].tolist() == table.paged_kv_indices.tolist()
        assert set(padded.paged_kv_indices[kv_end:].tolist()) <= {SINK_PAGE}
        assert qo[: n + 1] == table.qo_indptr.tolist()


def test_buffers_sized_max_num_pages_overflow_when_the_cache_is_full() -> None:
    # D1 as found: a full cache (every usable page in the batch) plus one sink
    # entry per padded request is more than max_num_pages entries
    max_num_pages, bucket, ps = 9, 4, 16
    views = [SequenceView("a", "main", list(range(1, max_num_pages)), 8 * ps, 1, 0)]
    padded = graph_padded(build_paged_indptrs(views, ps), bucket, decode=True)
    assert len(padded.paged_kv_indices) > max_num_pages
    assert len(padded.paged_kv_indices) <= graph_indices_capacity(max_num_pages, bucket, ps)


@pytest.mark.parametrize(("qo", "kv"), [(7, 1), (5, 1), (14, 2), (24, 2), (32, 1), (8, 8)])
def test_tensor_cores_outside_the_cuda_core_group_sizes(qo: int, kv: int) -> None:
    # D3: 7 or 5 q heads per kv head have no CUDA-core decode kernel
    assert decode_needs_tensor_cores(qo, kv) == (qo // kv not in CUDA_CORE_DECODE_GROUP_SIZES)


def test_tensor_core_choice_per_group_size() -> None:
    needed = [g for g in range(1, 33) if decode_needs_tensor_cores(g, 1)]
    assert needed[:6] == [5, 7, 9, 10, 11, 12]
    assert not any(decode_needs_tensor_cores(g, 1) for g in (1, 2, 3, 4, 6, 8, 16))


def test_graph_kind_fixed_by_the_first_plan() -> None:
    assert graph_plan_kind(None, is_decode=True) == "decode"
    assert graph_plan_kind(None, is_decode=False) == "prefill"
    # a prefill graph runs decode-shaped batches through the prefill kernel
    assert graph_plan_kind("prefill", is_decode=True) == "prefill"
    assert graph_plan_kind("decode", is_decode=True) == "decode"
    assert graph_plan_kind("decode", is_decode=False, empty=True) == "decode"
    # a decode graph re-planned as prefill would replay the decode kernel
    with pytest.raises(KVShapeError, match="captured as decode"):
        graph_plan_kind("decode", is_decode=False)


def test_prefill_padding_needs_rows_and_page_size() -> None:
    table = build_paged_indptrs([SequenceView("a", "main", [3], 2, 2, 0)], 4)
    with pytest.raises(KVShapeError, match="num_rows"):
        graph_padded(table, 2, decode=False)
