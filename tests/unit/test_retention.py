"""Sliding-window retention in KVManager (issue 19; specs/retention.md W1-W14,
rules R63-R68): each mechanism on a windowed label, with the bytes read
back. The lockstep against the one model (windows in its scope) is
kvref.testing.lockstep's SHIPPED_SCOPE."""

from __future__ import annotations

import math

import pytest
import torch

from kvref import (
    KVConfig,
    KVStep,
    ReleasedPrefixError,
    RetentionPolicy,
    Segment,
    StepContext,
)
from kvref.attention.paged import paged_attention_reference
from kvref.attention.sdpa import paged_attention_sdpa
from kvref.core.config import KVLayout
from kvref.core.errors import InvalidArgumentError, InvalidConfigError
from kvref.manager import KVManager
from tests.unit._manager_fixtures import check_conservation, make_cfg, make_manager

PS, W = 4, 8
HEADS, DIM, LAYERS = 2, 4, 2


def windowed(**kw: object) -> KVManager:
    kw.setdefault("retention", {"w": RetentionPolicy(W)})
    kw.setdefault("pages", 16)
    return make_manager(page_size=PS, heads=HEADS, head_dim=DIM, layers=LAYERS,
                        **kw)


def kv_of(pos: int, layer: int) -> float:
    return float(pos * 8 + layer)


def step(kv: KVManager, rid: str, label: str, n: int,
         pre_forks: tuple[tuple[str, str], ...] = ()) -> None:
    """admit, plan, write K = V = kv_of(position), commit; positions from the view."""
    if not kv.has_request(rid):
        kv.ingest_request(rid)
    s = KVStep([Segment(rid, label, n)], pre_forks=pre_forks)
    ctx = StepContext((rid,))
    out = kv.admit(s, ctx)
    assert out.ok, out.reason
    plans = kv.plan(s, ctx)
    if n:
        (view,) = [v for o in plans.values() for v in o.views]
        start = view.offset + view.length - view.to_compute
        for layer in range(LAYERS):
            k = torch.tensor([kv_of(start + i, layer) for i in range(n)])
            k = k.view(-1, 1, 1).expand(n, HEADS, DIM).contiguous()
            kv.write_kv(k, k.clone(), layer_idx=layer, label=label)
    kv.commit(s, ctx)
    check_conservation(kv)


def window_reads_right(kv: KVManager, rid: str, label: str, window: int | None = W) -> None:
    n = kv.stored_len(rid, label)
    first = 0 if window is None else max(0, n - window)
    got = kv.read_stream(rid, label)
    assert got.shape[1] == n - first
    want = torch.tensor([[kv_of(p, layer) for p in range(first, n)] for layer in range(LAYERS)])
    assert torch.equal(got[:, :, 0, 0, 0], want)
    assert torch.equal(got[:, :, 1, 0, 0], want)


def stream(kv: KVManager, rid: str, label: str):  # type: ignore[no-untyped-def]
    return kv._streams[rid][label]


# -- config ---------------------------------------------------------------


def test_config_validates_and_copies_the_retention() -> None:
    with pytest.raises(InvalidConfigError):
        RetentionPolicy(0)
    with pytest.raises(InvalidConfigError):
        RetentionPolicy(True)  # type: ignore[arg-type]
    with pytest.raises(InvalidConfigError):
        make_cfg(retention={"w": 8})  # type: ignore[dict-item]
    cfg = make_cfg(retention={"w": RetentionPolicy(8)})
    dup = cfg.copy()
    assert dup.retention == cfg.retention and dup.retention is not cfg.retention
    assert cfg.window("w") == 8 and cfg.window("main") is None
    assert RetentionPolicy(8).window_left == 7
    assert KVConfig(num_layers=1, num_kv_heads=1, head_dim=1, max_seq_len=8,
                    max_num_pages=4, page_size=2, num_qo_heads=1).retention == {}


# -- release at commit, the bound, the counters ---------------------------


def test_decode_holds_the_bound_and_reads_back_its_window() -> None:
    kv = windowed()
    bound = math.ceil(W / PS) + 1
    for i in range(100):
        step(kv, "r", "w", 1)
        s = stream(kv, "r", "w")
        n = i + 1
        assert s.stored_len == s.position == n  # W4
        assert s.released == (max(0, n - W) // PS) * PS  # W2: whole pages only
        assert len(s.page_indices) <= bound  # W3
        window_reads_right(kv, "r", "w")
    assert kv.num_free_pages == 15 - len(stream(kv, "r", "w").page_indices)


def test_prefill_past_the_window_releases_at_commit() -> None:
    kv = windowed()
    step(kv, "r", "w", 13)  # f = 5: page 0 goes, page 1 (tokens 4..7) holds token 5
    s = stream(kv, "r", "w")
    assert s.released == 4 and len(s.page_indices) == 3
    window_reads_right(kv, "r", "w")


def test_a_full_label_beside_a_windowed_one_keeps_everything() -> None:
    kv = windowed()
    for _ in range(5):
        step(kv, "r", "main", 5)
        step(kv, "r", "w", 5)
    assert stream(kv, "r", "main").released == 0
    assert len(stream(kv, "r", "main").page_indices) == math.ceil(25 / PS)
    window_reads_right(kv, "r", "main", None)
    window_reads_right(kv, "r", "w")


def test_the_view_starts_at_the_first_retained_page() -> None:
    kv = windowed()
    step(kv, "r", "w", 13)
    s = KVStep([Segment("r", "w", 1)])
    ctx = StepContext(("r",))
    assert kv.admit(s, ctx).ok
    (view,) = [v for o in kv.plan(s, ctx).values() for v in o.views]
    st = stream(kv, "r", "w")
    assert view.offset == st.released == 4
    assert view.length == 14 - 4 and view.page_idxs == st.page_indices[:3]
    kv.commit(s, ctx)


# -- truncate, forks, offload, prefix cache -------------------------------


def test_truncate_into_the_released_prefix_is_refused() -> None:
    kv = windowed()
    step(kv, "r", "w", 20)  # f = 12, released 12
    before = (list(stream(kv, "r", "w").page_indices), kv.num_free_pages)
    with pytest.raises(ReleasedPrefixError):
        kv.truncate("r", "w", 19)  # window would start at 11 < 12
    assert (list(stream(kv, "r", "w").page_indices), kv.num_free_pages) == before
    assert kv.truncate("r", "w", 20) == 0
    step(kv, "r", "w", 2)  # 22: f = 14, released still 12
    assert kv.truncate("r", "w", 21) == 0
    s = stream(kv, "r", "w")
    assert s.stored_len == s.position == 21 and s.released == 12
    window_reads_right(kv, "r", "w")
    step(kv, "r", "w", 3)
    window_reads_right(kv, "r", "w")


def test_fork_inherits_the_window_and_shares_retained_pages() -> None:
    kv = windowed(retention={"w": RetentionPolicy(W), "w2": RetentionPolicy(W)})
    step(kv, "r", "w", 14)  # released 4, slots 1..3
    step(kv, "r", "w", 0, pre_forks=(("w", "w2"),))
    src, dst = stream(kv, "r", "w"), stream(kv, "r", "w2")
    assert dst.released == src.released == 4 and dst.position == 14
    assert dst.page_indices[:2] == src.page_indices[:2]  # the full retained pages
    assert dst.page_indices[2] != src.page_indices[2]  # the part page, copied
    window_reads_right(kv, "r", "w2")
    for _ in range(10):
        step(kv, "r", "w2", 1)
        window_reads_right(kv, "r", "w2")
        window_reads_right(kv, "r", "w")
    kv.remove_request("r")
    assert kv.num_free_pages == 15


def test_fork_between_different_windows_is_refused() -> None:
    kv = windowed()
    step(kv, "r", "w", 5)
    s = KVStep([Segment("r", "w", 0)], pre_forks=(("w", "main"),))
    with pytest.raises(InvalidArgumentError):
        kv.admit(s, StepContext(("r",)))
    check_conservation(kv)


def test_offload_and_reload_move_only_the_retained_pages() -> None:
    kv = windowed(cpu_pages=16)
    step(kv, "r", "w", 22)  # released 12: slots 3..5 retained
    held = list(stream(kv, "r", "w").page_indices)
    free = kv.num_free_pages
    out = kv.offload_outcome("r")
    assert out.pages_freed == len(held) == 3
    assert kv.num_free_pages == free + 3
    back = kv.reload_outcome("r")
    assert back.pages_taken == 3
    s = stream(kv, "r", "w")
    assert s.released == 12 and len(s.page_indices) == 3 and s.position == 22
    window_reads_right(kv, "r", "w")
    step(kv, "r", "w", 3)
    window_reads_right(kv, "r", "w")


def test_prefix_cache_never_registers_nor_hits_a_windowed_label() -> None:
    kv = windowed()
    step(kv, "r", "w", 6)
    assert kv.cache_prefix("r", "w", list(range(6))) == 0  # W9
    assert kv.num_cached_pages == 0
    kv.ingest_request("q")
    assert kv.match_prefix("q", "w", list(range(6))) == 0  # W10
    assert stream(kv, "q", "w").page_indices == []
    step(kv, "r", "main", 6)
    assert kv.cache_prefix("r", "main", list(range(6))) == 1  # full attention caches


# a preplan over windows is planned now (R67): tests/unit/test_retention_preplan.py;
# publish and retrieve over windows (R69): tests/unit/test_retention_transfer.py


# -- attention masks to the window ----------------------------------------


@pytest.mark.parametrize("chunk", [1, 5])
def test_attention_reads_only_the_window(chunk: int) -> None:
    torch.manual_seed(0)
    kv = windowed(layout=KVLayout.NHD)
    kv.ingest_request("r")
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    ref = sdpa = None
    for _ in range(4):
        s = KVStep([Segment("r", "w", chunk)])
        ctx = StepContext(("r",))
        assert kv.admit(s, ctx).ok
        (plans,) = kv.plan(s, ctx).values()
        k = torch.randn(chunk, HEADS, DIM)
        v = torch.randn(chunk, HEADS, DIM)
        for layer in range(LAYERS):
            kv.write_kv(k, v, layer_idx=layer, label="w")
        ks.append(k)
        vs.append(v)
        q = torch.randn(chunk, HEADS, DIM)
        layer_kv = kv.kv_cache.layer_view(0)
        ref = paged_attention_reference(q, layer_kv, plans.cpu_indptrs, "NHD",
                                        window_left=W - 1)
        sdpa = paged_attention_sdpa(q, layer_kv, plans.cpu_indptrs, KVLayout.NHD, PS,
                                    window_left=W - 1)
        kv.commit(s, ctx)
        # dense: each query at absolute position p reads keys max(0, p - W + 1) .. p
        allk, allv = torch.cat(ks), torch.cat(vs)
        n = allk.shape[0]
        want = torch.empty_like(q)
        for j in range(chunk):
            p = n - chunk + j
            lo = max(0, p - (W - 1))
            sc = torch.einsum("hd,khd->hk", q[j], allk[lo:p + 1]) / math.sqrt(DIM)
            want[j] = torch.einsum("hk,khd->hd", torch.softmax(sc, -1), allv[lo:p + 1])
        torch.testing.assert_close(ref, want)
        torch.testing.assert_close(sdpa, want)
    assert ref is not None and sdpa is not None
