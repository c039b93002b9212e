"""KVCache: both layouts, (page, offset) addressing, page copies, FlashInfer views."""

from __future__ import annotations

import pytest
import torch

from kvref.core.cache import KVCache, page_runs
from kvref.core.config import KVConfig, KVLayout

L, H, D, PS, PAGES = 3, 2, 5, 4, 6


def cfg(layout: KVLayout) -> KVConfig:
    return KVConfig(num_layers=L, num_kv_heads=H, head_dim=D, max_seq_len=64,
                    max_num_pages=PAGES, page_size=PS, num_qo_heads=4, layout=layout)


LAYOUTS = [KVLayout.NHD, KVLayout.HND]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shapes(layout: KVLayout) -> None:
    c = KVCache(cfg(layout), torch.device("cpu"), torch.float32)
    if layout is KVLayout.NHD:
        assert tuple(c.tensor.shape) == (L, PAGES, 2, PS, H, D)
        assert tuple(c.layer_view(1).shape) == (PAGES, 2, PS, H, D)
    else:
        assert tuple(c.tensor.shape) == (L, PAGES, 2, H, PS, D)
        assert tuple(c.layer_view(1).shape) == (PAGES, 2, H, PS, D)
    # the view is the storage, not a copy: FlashInfer reads what we wrote
    assert c.layer_view(1).data_ptr() == c.tensor[1].data_ptr()
    assert c.token_shape == (H, D)
    assert c.bytes_per_page == L * 2 * PS * H * D * 4


def test_wrong_tensor_rejected() -> None:
    with pytest.raises(ValueError):
        KVCache(cfg(KVLayout.NHD), torch.device("cpu"), torch.float32,
                tensor=torch.zeros(L, PAGES, 2, H, PS, D))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_read_by_page_offset(layout: KVLayout) -> None:
    c = KVCache(cfg(layout), torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(0)
    pages = torch.tensor([2, 2, 5, 1, 3])
    offs = torch.tensor([0, 3, 1, 2, 3])
    k = torch.randn(5, H, D, generator=gen)
    v = torch.randn(5, H, D, generator=gen)
    out = c.write_tokens(1, k, v, pages, offs, return_tensor=True)
    assert out is not None and tuple(out.shape) == (5, 2, H, D)
    assert torch.equal(out[:, 0], k) and torch.equal(out[:, 1], v)
    # the bytes are where the layout says, per head
    view = c.layer_view(1)
    for i in range(5):
        p, o = int(pages[i]), int(offs[i])
        if layout is KVLayout.NHD:
            got_k, got_v = view[p, 0, o], view[p, 1, o]
        else:
            got_k, got_v = view[p, 0, :, o], view[p, 1, :, o]
        assert torch.equal(got_k, k[i]) and torch.equal(got_v, v[i])
    # nothing else moved: other layers untouched, only 10 (K+V) slots per layer set
    assert c.tensor[0].count_nonzero() == 0 and c.tensor[2].count_nonzero() == 0
    assert int((c.tensor[1] != 0).sum()) == 5 * 2 * H * D
    back = c.read_tokens(1, pages, offs)
    assert torch.equal(back, out)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_copy_pages_all_layers(layout: KVLayout) -> None:
    c = KVCache(cfg(layout), torch.device("cpu"), torch.float32)
    c.tensor.copy_(torch.randn(c.tensor.shape, generator=torch.Generator().manual_seed(1)))
    before = c.tensor.clone()
    c.copy_pages([1, 2, 4], [3, 5, 0])
    for s, d in ((1, 3), (2, 5), (4, 0)):
        assert torch.equal(c.tensor[:, d], before[:, s])
    for p in (1, 2, 4):
        assert torch.equal(c.tensor[:, p], before[:, p])
    with pytest.raises(ValueError):
        c.copy_pages([1, 2], [3])


def test_page_runs_coalesce() -> None:
    assert page_runs([1, 2, 3, 7], [4, 5, 6, 8]) == [(1, 4, 3), (7, 8, 1)]
    assert page_runs([1, 2], [5, 4]) == [(1, 5, 1), (2, 4, 1)]
    assert page_runs([], []) == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_stream(layout: KVLayout) -> None:
    c = KVCache(cfg(layout), torch.device("cpu"), torch.float32)
    stream_pages = [4, 1, 3]
    n = 10  # 2 full pages + 2 tokens
    toks = torch.arange(L * n * 2 * H * D, dtype=torch.float32).reshape(L, n, 2, H, D)
    pos = torch.arange(n)
    page_idx = torch.tensor(stream_pages)[pos // PS]
    for layer in range(L):
        c.write_tokens(layer, toks[layer, :, 0], toks[layer, :, 1], page_idx, pos % PS)
    assert torch.equal(c.gather_stream(stream_pages, n), toks)
    assert torch.equal(c.gather_stream([*stream_pages, 5], 7), toks[:, :7])
    assert tuple(c.gather_stream([], 0).shape) == (L, 0, 2, H, D)
    with pytest.raises(ValueError):
        c.gather_stream(stream_pages[:2], n)
