"""kvref.attention.paged: the paged torch reference against dense attention without pages.

Every case fills a real `KVCache` through `write_tokens`, with slots from
`packed_plan_state` (or `decode_plan_state`) over views whose pages are
shuffled, non-contiguous and fewer than their stream holds, so the page
table and the write addressing are exercised together. The cache starts as
NaN: a read of any slot outside a request's tokens poisons its output.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.attention.paged import (
    FlashInferPagedAttention,
    PagedAttention,
    _graph_padded,
    _is_decode,
    flashinfer_available,
    paged_attention_reference,
)
from kvref.core.cache import KVCache
from kvref.core.config import KVConfig, KVLayout
from kvref.core.errors import KVShapeError
from kvref.stepping.plan import (
    SINK_PAGE,
    KVPlanOutput,
    PagedIndptrs,
    SequenceView,
    build_paged_indptrs,
    decode_plan_state,
    packed_plan_state,
)


@dataclass
class Req:
    cached: int  # tokens already in the cache before this step
    q_len: int  # tokens this step computes
    spare_pages: int = 0  # pages the stream holds beyond what it needs


@dataclass
class Case:
    cache: KVCache
    plan: KVPlanOutput
    q: torch.Tensor  # [tokens, Hq, D], this step's queries, request-major
    keys: list[torch.Tensor]  # per request, all kv_len tokens [kv_len, Hkv, D]
    values: list[torch.Tensor]
    reqs: list[Req]


def _views(
    reqs: list[Req], held: list[list[int]], ps: int, upto_cached: bool
) -> list[SequenceView]:
    views = []
    for i, (r, pages) in enumerate(zip(reqs, held, strict=True)):
        length = r.cached if upto_cached else r.cached + r.q_len
        to_compute = r.cached if upto_cached else r.q_len
        # the manager slices a stream's high-water page list to what length needs
        need = -(-length // ps)
        views.append(SequenceView(f"r{i}", "main", pages[:need], length, to_compute, 0))
    return views


def make_case(
    reqs: list[Req],
    *,
    layout: KVLayout,
    page_size: int,
    num_qo_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    held_counts = [-(-(r.cached + r.q_len) // page_size) + r.spare_pages for r in reqs]
    num_pages = sum(held_counts) + 1 + rng.randint(0, 3)  # + sink + never-used pages
    cfg = KVConfig(
        num_layers=1,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_seq_len=4096,
        max_num_pages=num_pages,
        page_size=page_size,
        num_qo_heads=num_qo_heads,
        layout=layout,
    )
    cache = KVCache(cfg, torch.device("cpu"), dtype)
    cache.tensor.fill_(float("nan"))
    free = list(range(1, num_pages))
    rng.shuffle(free)  # shuffled and interleaved across requests: non-contiguous
    held: list[list[int]] = []
    for n in held_counts:
        held.append(free[:n])
        free = free[n:]

    keys = [torch.randn(r.cached + r.q_len, num_kv_heads, head_dim, generator=gen) for r in reqs]
    values = [torch.randn(r.cached + r.q_len, num_kv_heads, head_dim, generator=gen) for r in reqs]

    # step 1: the context already cached (a previous chunk), written the same way
    prior = [(i, r) for i, r in enumerate(reqs) if r.cached]
    if prior:
        views = _views([r for _, r in prior], [held[i] for i, _ in prior], page_size, True)
        ind = build_paged_indptrs(views, page_size)
        total = sum(r.cached for _, r in prior)
        st_ = packed_plan_state(ind, page_size, total, torch.device("cpu"))
        k = torch.cat([keys[i][: r.cached] for i, r in prior])
        v = torch.cat([values[i][: r.cached] for i, r in prior])
        cache.write_tokens(0, k, v, st_.token_to_page, st_.token_to_cache)

    # step 2: this step's tokens, then attention over everything
    views = _views(reqs, held, page_size, False)
    ind = build_paged_indptrs(views, page_size)
    total = sum(r.q_len for r in reqs)
    if all(r.q_len == 1 for r in reqs):
        st_ = decode_plan_state(views, page_size, torch.device("cpu"))
        # the decode fast path must address exactly what the packed path does
        packed = packed_plan_state(ind, page_size, total, torch.device("cpu"))
        assert torch.equal(st_.token_to_page, packed.token_to_page)
        assert torch.equal(st_.token_to_cache, packed.token_to_cache)
    else:
        st_ = packed_plan_state(ind, page_size, total, torch.device("cpu"))
    k = torch.cat([keys[i][r.cached :] for i, r in enumerate(reqs)])
    v = torch.cat([values[i][r.cached :] for i, r in enumerate(reqs)])
    cache.write_tokens(0, k, v, st_.token_to_page, st_.token_to_cache)

    q = torch.randn(total, num_qo_heads, head_dim, generator=gen).to(dtype)
    return Case(cache, KVPlanOutput(ind, views), q, keys, values, reqs)


def dense_attention(case: Case, sm_scale: float | None = None) -> torch.Tensor:
    """Per request, no pages: plain K/V tensors, causal by absolute position, float64."""
    outs = []
    qo = 0
    for r, k, v in zip(case.reqs, case.keys, case.values, strict=True):
        q = case.q[qo : qo + r.q_len].double()
        qo += r.q_len
        group = q.shape[1] // k.shape[1]
        kr = k.double().repeat_interleave(group, dim=1)  # qo head h -> kv head h // group
        vr = v.double().repeat_interleave(group, dim=1)
        scale = sm_scale if sm_scale is not None else 1 / math.sqrt(q.shape[-1])
        s = torch.einsum("qhd,khd->hqk", q, kr) * scale
        q_pos = torch.arange(r.cached, r.cached + r.q_len)
        mask = torch.arange(k.shape[0])[None, :] > q_pos[:, None]
        s = s.masked_fill(mask, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vr))
    return torch.cat(outs).float()


def check(case: Case, atol: float = 2e-5) -> None:
    layout = case.cache.layout
    out = paged_attention_reference(
        case.q, case.cache.layer_view(0), case.plan.cpu_indptrs, layout, case.cache.page_size
    )
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), dense_attention(case), atol=atol, rtol=1e-4)


LAYOUTS = [KVLayout.NHD, KVLayout.HND]
PAGE_SIZES = [1, 4, 16]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_prefill(layout: KVLayout, page_size: int) -> None:
    reqs = [Req(0, 7, 1), Req(0, 1), Req(0, 33, 2), Req(0, 16)]
    check(make_case(reqs, layout=layout, page_size=page_size))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_chunked_prefill(layout: KVLayout, page_size: int) -> None:
    # the second chunk's queries attend to the first chunk, already in the cache,
    # and causally to each other; chunk boundaries inside and at page edges
    reqs = [Req(5, 9, 1), Req(16, 16), Req(1, 3, 3), Req(20, 1)]
    check(make_case(reqs, layout=layout, page_size=page_size, seed=1))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_decode(layout: KVLayout, page_size: int) -> None:
    reqs = [Req(0, 1), Req(3, 1, 2), Req(15, 1), Req(16, 1), Req(40, 1, 1)]
    case = make_case(reqs, layout=layout, page_size=page_size, seed=2)
    assert case.plan.is_decode
    check(case)


@pytest.mark.parametrize(("qo", "kv"), [(8, 2), (4, 4), (6, 1)])
def test_gqa_head_groups(qo: int, kv: int) -> None:
    reqs = [Req(3, 5), Req(0, 9)]
    check(make_case(reqs, layout=KVLayout.HND, page_size=4, num_qo_heads=qo, num_kv_heads=kv))


def test_sm_scale_and_non_causal() -> None:
    case = make_case([Req(4, 6), Req(0, 3)], layout=KVLayout.NHD, page_size=4, seed=3)
    ind = case.plan.cpu_indptrs
    out = paged_attention_reference(case.q, case.cache.layer_view(0), ind, "NHD", sm_scale=0.3)
    torch.testing.assert_close(out, dense_attention(case, sm_scale=0.3), atol=2e-5, rtol=1e-4)
    # non-causal: the last query of each request already sees everything, so they agree there
    nc = paged_attention_reference(case.q, case.cache.layer_view(0), ind, "NHD", causal=False)
    dense = dense_attention(case)
    last_rows = (ind.qo_indptr[1:] - 1).long()
    torch.testing.assert_close(nc[last_rows], dense[last_rows], atol=2e-5, rtol=1e-4)
    assert not torch.allclose(nc[0], dense[0])


def test_bf16_inputs_computed_in_float32() -> None:
    case = make_case(
        [Req(10, 5), Req(0, 12)], layout=KVLayout.NHD, page_size=4, dtype=torch.bfloat16
    )
    out = paged_attention_reference(
        case.q, case.cache.layer_view(0), case.plan.cpu_indptrs, KVLayout.NHD
    )
    assert out.dtype == torch.bfloat16
    # the dense oracle sees the same bf16-rounded K/V the cache stores
    case.keys = [k.bfloat16().float() for k in case.keys]
    case.values = [v.bfloat16().float() for v in case.values]
    torch.testing.assert_close(out.float(), dense_attention(case), atol=1e-2, rtol=1e-2)


@settings(max_examples=40, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    page_size=st.sampled_from(PAGE_SIZES),
    heads=st.sampled_from([(8, 2), (4, 4), (4, 1), (2, 2)]),
    head_dim=st.sampled_from([8, 16]),
    reqs=st.lists(
        st.builds(
            Req,
            cached=st.integers(0, 40),
            q_len=st.integers(1, 20),
            spare_pages=st.integers(0, 2),
        ),
        min_size=1,
        max_size=5,
    ),
    seed=st.integers(0, 2**16),
)
def test_matches_dense_any_shape(
    layout: KVLayout,
    page_size: int,
    heads: tuple[int, int],
    head_dim: int,
    reqs: list[Req],
    seed: int,
) -> None:
    case = make_case(
        reqs,
        layout=layout,
        page_size=page_size,
        num_qo_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        seed=seed,
    )
    check(case)


def test_device_table_same_as_host_table() -> None:
    # a KVPlanOutput may hand attention either copy; the reference reads both
    case = make_case([Req(2, 3), Req(0, 4)], layout=KVLayout.NHD, page_size=4)
    ind = case.plan.cpu_indptrs
    copy = PagedIndptrs(*(t.clone() for t in vars(ind).values()))
    a = paged_attention_reference(case.q, case.cache.layer_view(0), ind, KVLayout.NHD)
    b = paged_attention_reference(case.q, case.cache.layer_view(0), copy, KVLayout.NHD)
    assert torch.equal(a, b)


def test_padded_rows_past_the_table_are_zero() -> None:
    # a captured graph hands q with the bucket's padding rows after the real ones
    case = make_case([Req(2, 1), Req(5, 1)], layout=KVLayout.NHD, page_size=4)
    q = torch.cat((case.q, torch.randn(3, *case.q.shape[1:])))
    out = paged_attention_reference(
        q, case.cache.layer_view(0), case.plan.cpu_indptrs, KVLayout.NHD
    )
    torch.testing.assert_close(out[:2], dense_attention(case), atol=2e-5, rtol=1e-4)
    assert not out[2:].any()


# --- facade -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "ran"), [("auto", "sdpa"), ("sdpa", "sdpa"), ("torch", "torch")]
)
def test_facade_on_cpu(backend: str, ran: str) -> None:
    case = make_case([Req(6, 4), Req(0, 5), Req(9, 1)], layout=KVLayout.HND, page_size=4)
    attn = PagedAttention.from_config(case.cache.config, backend=backend)  # type: ignore[arg-type]
    attn.plan(case.plan)
    out = attn.run(case.q, case.cache.layer_view(0))
    assert attn.last_backend == ran
    torch.testing.assert_close(out, dense_attention(case), atol=2e-5, rtol=1e-4)
    # plan once, run per layer: a second run reuses the unpacked table
    assert torch.equal(attn.run(case.q, case.cache.layer_view(0)), out)


def test_facade_errors() -> None:
    case = make_case([Req(0, 3)], layout=KVLayout.NHD, page_size=4)
    attn = PagedAttention.from_config(case.cache.config)
    with pytest.raises(RuntimeError, match="before plan"):
        attn.run(case.q, case.cache.layer_view(0))
    attn.plan(case.plan)
    with pytest.raises(KVShapeError):
        attn.run(case.q[:, :3], case.cache.layer_view(0))
    if not flashinfer_available():
        forced = PagedAttention.from_config(case.cache.config, backend="flashinfer")
        forced.plan(case.plan)
        with pytest.raises(RuntimeError, match="flashinfer"):
            forced.run(case.q, case.cache.layer_view(0))
    with pytest.raises(ValueError, match="backend"):
        PagedAttention.from_config(case.cache.config, backend="triton")


def test_reference_rejects_inconsistent_tables() -> None:
    case = make_case([Req(0, 3)], layout=KVLayout.NHD, page_size=4)
    layer = case.cache.layer_view(0)
    ind = case.plan.cpu_indptrs
    more_q = PagedIndptrs(
        torch.tensor([0, 9], dtype=torch.int32),
        ind.paged_kv_indptr,
        ind.paged_kv_indices,
        ind.paged_kv_last_page_len,
    )
    with pytest.raises(KVShapeError, match="queries"):
        paged_attention_reference(torch.randn(9, 8, 16), layer, more_q, KVLayout.NHD)
    with pytest.raises(KVShapeError, match="page_size"):
        paged_attention_reference(case.q, layer, ind, KVLayout.NHD, page_size=16)
    with pytest.raises(KVShapeError, match="rows"):
        paged_attention_reference(case.q[:1], layer, ind, KVLayout.NHD)


def test_graph_padding_aims_at_the_sink() -> None:
    views = [SequenceView("a", "main", [5, 2], 6, 1, 0), SequenceView("b", "main", [7], 3, 1, 0)]
    ind = build_paged_indptrs(views, 4)
    assert _is_decode(ind)
    dec = _graph_padded(ind, 4, decode=True)
    assert dec.qo_indptr.tolist() == [0, 1, 2, 3, 4]
    assert dec.paged_kv_indptr.tolist() == [0, 2, 3, 4, 5]
    assert dec.paged_kv_indices.tolist() == [5, 2, 7, SINK_PAGE, SINK_PAGE]
    assert dec.paged_kv_last_page_len.tolist() == [2, 3, 1, 1]
    # prefill: padded requests own no rows; one more absorbs the spare rows (5 - 2)
    pre = _graph_padded(ind, 3, decode=False, num_rows=5, page_size=2)
    assert pre.qo_indptr.tolist() == [0, 1, 2, 2, 5]
    assert pre.paged_kv_indptr.tolist() == [0, 2, 3, 4, 6]
    assert pre.paged_kv_indices.tolist() == [5, 2, 7, SINK_PAGE, SINK_PAGE, SINK_PAGE]
    assert pre.paged_kv_last_page_len.tolist() == [2, 3, 1, 1]
    assert _graph_padded(ind, 2, decode=True) is ind
    with pytest.raises(KVShapeError):
        _graph_padded(ind, 1, decode=True)
    with pytest.raises(KVShapeError, match="rows"):
        _graph_padded(ind, 3, decode=False, num_rows=1, page_size=2)


# --- FlashInfer (CUDA only) ---------------------------------------------------

needs_flashinfer = pytest.mark.skipif(
    not flashinfer_available(), reason="needs CUDA and flashinfer"
)


def _to_cuda(case: Case, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    layer = case.cache.layer_view(0).nan_to_num(0.0).to("cuda", dtype)
    return case.q.to("cuda", dtype), layer


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kind", ["prefill", "chunked", "decode"])
def test_flashinfer_matches_reference(layout: KVLayout, page_size: int, kind: str) -> None:
    reqs = {
        "prefill": [Req(0, 37, 1), Req(0, 5), Req(0, 64)],
        "chunked": [Req(17, 20), Req(64, 3, 2), Req(1, 9)],
        "decode": [Req(0, 1), Req(30, 1, 1), Req(100, 1), Req(15, 1)],
    }[kind]
    case = make_case(reqs, layout=layout, page_size=page_size, head_dim=128, seed=7)
    q, layer = _to_cuda(case, torch.bfloat16)
    fi = FlashInferPagedAttention("cuda", layout)
    fi.plan(
        case.plan.cpu_indptrs,
        num_qo_heads=8,
        num_kv_heads=2,
        head_dim=128,
        page_size=page_size,
        q_dtype=torch.bfloat16,
    )
    got = fi.run(q, layer)
    want = paged_attention_reference(q, layer, case.plan.cpu_indptrs, layout)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
