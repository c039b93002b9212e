"""Chunked local attention as an attention group (Llama 4; H7 of specs/retention.md).

`ChunkedAttention(C)` is a group's attention type beside full attention and
sliding windows: a token reads only its own chunk of C tokens, from
``n // C * C``. kvref handles it as it handles a window (its behaviour
class, `kvref.core.labels.ChunkedLocal`, is the one new piece): a commit
releases the pages before the chunk (blank, H3), a hit needs only the
pages of its chunk, a truncate may not reach back past the chunk's start
(W6), and a step's table for the group starts at the chunk, which
attention masks per chunk within a step (``PagedAttention(chunk=C)``).
Each expectation below is worked out from the chunk rule.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvref import (
    AttentionGroup,
    ChunkedAttention,
    KVConfig,
    KVManager,
    KVStep,
    Segment,
    StepContext,
    TransferEngineInfo,
    groups_for,
)
from kvref.attention.paged import PagedAttention
from kvref.core.errors import InvalidConfigError, ReleasedPrefixError
from kvref.observation import PageState

PS, C = 2, 4  # a chunk is two pages
HEAD = 4


def _cfg(pages: int = 24) -> KVConfig:
    return KVConfig(num_layers=2, num_kv_heads=1, head_dim=HEAD, max_seq_len=64,
                    max_num_pages=pages, page_size=PS, num_qo_heads=1,
                    groups=(AttentionGroup("full", (0,)),
                            AttentionGroup("c", (1,), ChunkedAttention(C))))


def _mgr(pages: int = 24) -> KVManager:
    return KVManager(_cfg(pages), "kv", None, TransferEngineInfo(), torch.device("cpu"),
                     dtype=torch.float32)


def _step(m: KVManager, rid: str, n: int) -> None:
    st = KVStep(segments=[Segment(rid, "main", n)])
    ctx = StepContext(padded_request_ids=[rid])
    assert m.admit(st, ctx).ok
    m.plan(st, ctx)
    for layer in range(2):
        kv = torch.full((n, 1, HEAD), float(10 * (layer + 1) + m.stored_len(rid)))
        m.write_kv(kv, kv, layer_idx=layer, label="main")
    m.commit(st, ctx)


def _chunk(m: KVManager, rid: str) -> tuple[int, tuple[int, ...], int]:
    s = next(s for s in m.observe().streams() if s.request_id == rid and s.label == "main@c")
    return s.stored_len, s.pages, s.released


def test_a_chunk_must_be_whole_pages() -> None:
    with pytest.raises(InvalidConfigError, match="multiple of page_size"):
        KVConfig(num_layers=2, num_kv_heads=1, head_dim=4, max_seq_len=64, max_num_pages=8,
                 page_size=4, num_qo_heads=1,
                 groups=(AttentionGroup("full", (0,)), AttentionGroup("c", (1,),
                                                                      ChunkedAttention(6))))
    with pytest.raises(InvalidConfigError):
        ChunkedAttention(0)


def test_groups_for_names_a_chunked_type() -> None:
    chunk = ChunkedAttention(8192)
    groups = groups_for([chunk, chunk, chunk, None])  # Llama 4: 3:1
    assert [(g.name, g.layers, g.retention) for g in groups] == [
        ("full", (3,), None), ("c8192.0", (0,), chunk), ("c8192.1", (1,), chunk),
        ("c8192.2", (2,), chunk)]


def test_a_commit_releases_the_pages_before_the_chunk_blank() -> None:
    m = _mgr()
    m.ingest_request("a")
    m.follow_tokens("a", list(range(20)))
    _step(m, "a", 3)  # chunk [0, 4)
    assert _chunk(m, "a")[2] == 0 and len(_chunk(m, "a")[1]) == 2
    _step(m, "a", 4)  # 7 tokens: chunk [4, 8), slots 0 and 1 go
    n, pages, released = _chunk(m, "a")
    assert (n, released, len(pages)) == (7, 4, 2)
    _step(m, "a", 1)  # 8: the chunk [8, 12) holds nothing yet; [4, 8)'s pages go too
    assert _chunk(m, "a")[2] == 8
    obs = m.observe()
    assert all(p.key is None for p in obs.pages if p.state is PageState.BLANK)  # H3
    # the full group keeps every token
    assert m.stored_len("a") == 8 and m.read_stream("a", "main").shape[1] == 8


def test_a_hit_needs_only_its_chunks_pages() -> None:
    m = _mgr()
    ids = list(range(12))
    m.ingest_request("a")
    _step(m, "a", 7)  # chunk [4, 8): slot 2 full, slot 3 part
    assert m.cache_prefix("a", "main", ids[:7]) == 3 + 1  # full: 3 pages, the chunk's: 1
    m.ingest_request("b")
    # at most 6 tokens (whole pages, the last token computed): the chunk of 6
    # is [4, 8), whose page [4, 6) a holds
    assert m.match_prefix("b", "main", ids[:7]) == 6
    n, pages, released = _chunk(m, "b")
    assert (n, released) == (6, 4) and pages == _chunk(m, "a")[1][:1]
    _step(m, "b", 1)
    # the chunk group reads its chunk [4, 7): token 6 is its third, written by layer 1
    assert float(m.read_stream("b", "main@c")[0, 2, 0, 0, 0]) == 26.0


def test_no_hit_where_the_chunks_page_went_back_blank() -> None:
    """a went on to 9 tokens: the page [4, 6) that a hit at 6 reads went back
    blank at the boundary, and a hit at 4 (a chunk of its own) is the most."""
    m = _mgr()
    ids = list(range(12))
    m.ingest_request("a")
    m.follow_tokens("a", ids)
    _step(m, "a", 9)
    m.ingest_request("b")
    assert m.match_prefix("b", "main", ids[:7]) == 4
    assert _chunk(m, "b") == (4, (), 4)  # the chunk from 4 holds nothing yet


def test_truncate_stays_within_the_chunk() -> None:
    m = _mgr()
    m.ingest_request("a")
    _step(m, "a", 9)  # released 8
    before = m.observe()
    with pytest.raises(ReleasedPrefixError):
        m.truncate("a", "main", 7)  # the chunk of 7 starts at 4: released
    assert m.observe() == before
    m.truncate("a", "main", 8)
    assert _chunk(m, "a")[0] == 8


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, chunk: int
           ) -> torch.Tensor:
    """Query rows at absolute positions start.. over keys 0..; each reads
    its chunk (chunk 0: every key before it)."""
    out = []
    for i in range(q.shape[0]):
        p = start + i
        lo = p // chunk * chunk if chunk else 0
        s = (k[lo:p + 1] @ q[i]) / math.sqrt(q.shape[-1])
        out.append(torch.softmax(s, 0) @ v[lo:p + 1])
    return torch.stack(out)


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
def test_attention_over_the_groups_tables_reads_each_tokens_chunk(backend: str) -> None:
    """Prefills that cross chunk boundaries, then decode steps: each layer's
    attention over its group's table (the chunked one with ``chunk=C``)
    equals dense attention over every token written, masked per chunk."""
    torch.manual_seed(0)
    m = _mgr(pages=40)
    m.ingest_request("a")
    hist = [torch.empty(0, HEAD), torch.empty(0, HEAD)]  # per layer: K (= V here, scaled)
    attn = {0: PagedAttention.from_config(m.config, backend=backend),
            1: PagedAttention.from_config(m.config, backend=backend, chunk=C)}
    for span in (3, 6, 1, 1, 5, 1, 1, 1):
        start = m.stored_len("a")
        st = KVStep(segments=[Segment("a", "main", span)])
        ctx = StepContext(padded_request_ids=["a"])
        assert m.admit(st, ctx).ok
        plan = m.plan(st, ctx)
        for layer, label in ((0, "main"), (1, "main@c")):
            k = torch.randn(span, HEAD)
            v = 2 * k + 1
            m.write_kv(k[:, None], v[:, None], layer_idx=layer, label="main")
            hist[layer] = torch.cat((hist[layer], k))
            q = torch.randn(span, 1, HEAD)
            attn[layer].plan(plan[label])
            got = attn[layer].run(q, m.layer_view(layer))
            kk = hist[layer]
            want = _dense(q[:, 0], kk, 2 * kk + 1, start, C if layer else 0)
            torch.testing.assert_close(got[:, 0], want, rtol=1e-4, atol=1e-4)
        m.commit(st, ctx)
    assert _chunk(m, "a")[2] == 16  # 19 tokens: the chunk from 16


def test_flashinfer_is_given_only_tables_of_one_chunk() -> None:
    """FlashInfer has no chunk mask: a table whose request reads past a
    chunk is refused (its check runs before any kernel; decode tables pass)."""
    m = _mgr()
    attn = PagedAttention.from_config(m.config, backend="flashinfer", chunk=C)
    for rid, span, ok in (("a", 1, True), ("b", 2, False)):  # to 4 tokens (one chunk), to 5
        m.ingest_request(rid)
        _step(m, rid, 3)
        st = KVStep(segments=[Segment(rid, "main", span)])
        ctx = StepContext(padded_request_ids=[rid])
        assert m.admit(st, ctx).ok
        attn.plan(m.plan(st, ctx)["main@c"])
        if ok:
            attn._check_one_chunk()
        else:
            with pytest.raises(ValueError, match="no chunk mask"):
                attn._check_one_chunk()
        m.commit(st, ctx)
