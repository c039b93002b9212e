"""The batched SDPA path against the torch reference (the oracle)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.attention.paged import paged_attention_reference
from kvref.attention.sdpa import StaticDenseTable, paged_attention_sdpa
from kvref.core.config import KVLayout
from kvref.core.errors import KVShapeError
from tests.unit.test_attention import Case, Req, make_case


def _both(case: Case, chunk_bytes: int = 1 << 26) -> tuple[torch.Tensor, torch.Tensor]:
    layer, ind = case.cache.layer_view(0), case.plan.cpu_indptrs
    lay, ps = case.cache.layout, case.cache.page_size
    want = paged_attention_reference(case.q, layer, ind, lay)
    got = paged_attention_sdpa(case.q, layer, ind, lay, ps, chunk_bytes=chunk_bytes)
    return got, want


@settings(max_examples=60, deadline=None)
@given(
    layout=st.sampled_from(list(KVLayout)),
    page_size=st.sampled_from([1, 4, 16]),
    heads=st.sampled_from([(4, 4), (8, 2), (7, 1), (6, 3)]),
    reqs=st.lists(
        st.builds(Req, cached=st.integers(0, 40), q_len=st.integers(0, 12),
                  spare_pages=st.integers(0, 2)),
        min_size=1, max_size=6,
    ).filter(lambda rs: any(r.q_len for r in rs) and all(r.cached + r.q_len for r in rs)),
    chunk_bytes=st.sampled_from([1, 1 << 12, 1 << 26]),
    seed=st.integers(0, 2**16),
)
def test_matches_reference(
    layout: KVLayout, page_size: int, heads: tuple[int, int], reqs: list[Req],
    chunk_bytes: int, seed: int,
) -> None:
    # the cache is NaN outside written tokens: a gathered slot that is not
    # masked out of P @ V shows up as NaN
    case = make_case(reqs, layout=layout, page_size=page_size, num_qo_heads=heads[0],
                     num_kv_heads=heads[1], seed=seed)
    got, want = _both(case, chunk_bytes=chunk_bytes)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_bf16_and_rows_past_the_table() -> None:
    case = make_case([Req(3, 2), Req(0, 4), Req(9, 1)], layout=KVLayout.NHD, page_size=4,
                     dtype=torch.bfloat16)
    case.q = torch.cat((case.q, torch.randn(3, *case.q.shape[1:]).to(torch.bfloat16)))
    got, want = _both(case)
    assert got.dtype == torch.bfloat16 and not got[-3:].any()
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


def test_static_table_reused_across_steps() -> None:
    # what a captured graph does: one set of buffers, a new table per step
    static = StaticDenseTable(batch=4, max_pages=8, max_q=6, num_rows=10, device="cpu")
    for reqs in ([Req(3, 2), Req(0, 4)], [Req(20, 1), Req(1, 1), Req(7, 6)], []):
        case = make_case(reqs or [Req(2, 0)], layout=KVLayout.HND, page_size=4)
        static.update(case.plan.cpu_indptrs, 4)
        q = torch.cat((case.q, torch.randn(10 - case.q.shape[0], *case.q.shape[1:])))
        got = static.run(q, case.cache.layer_view(0), KVLayout.HND)
        want = paged_attention_reference(q, case.cache.layer_view(0), case.plan.cpu_indptrs,
                                         KVLayout.HND)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        assert not got[case.q.shape[0]:].any()


def test_static_table_rejects_what_does_not_fit() -> None:
    static = StaticDenseTable(batch=1, max_pages=2, max_q=2, num_rows=4, device="cpu")
    case = make_case([Req(0, 1), Req(0, 1)], layout=KVLayout.NHD, page_size=4)
    with pytest.raises(KVShapeError, match="exceeds"):
        static.update(case.plan.cpu_indptrs, 4)
    case = make_case([Req(20, 1)], layout=KVLayout.NHD, page_size=4)
    with pytest.raises(KVShapeError, match="pages"):
        static.update(case.plan.cpu_indptrs, 4)


def test_empty_batch_is_zeros() -> None:
    case = make_case([Req(2, 0)], layout=KVLayout.NHD, page_size=4)
    q = torch.randn(2, 8, 16)
    out = paged_attention_sdpa(q, case.cache.layer_view(0), case.plan.cpu_indptrs,
                               KVLayout.NHD, 4)
    assert out.shape == q.shape and not out.any()
