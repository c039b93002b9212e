"""Attention groups over one pool (issue 40; H1-H5 of specs/retention.md).

A hybrid config's label is one stream per group: admission reserves in
every group or none, a hit attaches the same tokens in every group, a
window group keys its pages and hits from the pages its window reads, what
a window passes goes back blank (H3) and a window lets go head first (H4).
"""

from __future__ import annotations

import pytest
import torch

from kvref import KVConfig, KVManager, KVStep, Segment, StepContext, TransferEngineInfo
from kvref.core.config import RetentionPolicy
from kvref.core.errors import InvalidArgumentError, InvalidConfigError, ReleasedPrefixError
from kvref.core.groups import AttentionGroup, groups_for
from kvref.observation import PageState

W = 3  # the window group's context budget: with pages of 2, two pages before a hit


def _cfg(pages: int = 16, margin: int = 0, **kw: object) -> KVConfig:
    return KVConfig(num_layers=2, num_kv_heads=1, head_dim=4, max_seq_len=64,
                    max_num_pages=pages, page_size=2, num_qo_heads=1,
                    groups=(AttentionGroup("full", (0,)),
                            AttentionGroup("w", (1,), RetentionPolicy(W, margin))),
                    **kw)  # type: ignore[arg-type]


def _mgr(pages: int = 16, margin: int = 0) -> KVManager:
    return KVManager(_cfg(pages, margin), "kv", None, TransferEngineInfo(),
                     torch.device("cpu"), dtype=torch.float32)


def _step(m: KVManager, rid: str, n: int) -> None:
    """One step of ``n`` tokens on main: every layer writes its layer's value."""
    st = KVStep(segments=[Segment(rid, "main", n)])
    ctx = StepContext(padded_request_ids=[rid])
    assert m.admit(st, ctx).ok
    m.plan(st, ctx)
    for layer in range(2):
        kv = torch.full((n, 1, 4), float(10 * (layer + 1) + m.stored_len(rid)))
        m.write_kv(kv, kv, layer_idx=layer, label="main")
    m.commit(st, ctx)


def _streams(m: KVManager, rid: str) -> dict[str, tuple[int, tuple[int, ...], int]]:
    return {s.label: (s.stored_len, s.pages, s.released) for s in m.observe().streams()
            if s.request_id == rid}


def test_a_label_is_one_stream_per_group_and_each_layer_writes_its_own() -> None:
    m = _mgr()
    m.ingest_request("a")
    _step(m, "a", 7)
    got = _streams(m, "a")
    assert set(got) == {"main", "main@w"} and m.labels("a") == ["main"]
    assert got["main"][0] == got["main@w"][0] == 7
    assert len(got["main"][1]) == 4  # every token
    assert got["main@w"][2] == 4 and len(got["main@w"][1]) == 2  # W2: the window's pages
    full, window = m.read_stream("a", "main"), m.read_stream("a", "main@w")
    assert full.shape[:2] == (1, 7) and window.shape[:2] == (1, W)
    assert float(full[0, 0, 0, 0, 0]) == 10.0 and float(window[0, -1, 0, 0, 0]) == 20.0


def test_a_refused_admit_changes_no_group() -> None:
    """H1, R1: the full group could reserve, the window group could not."""
    m = _mgr(pages=6)  # five usable pages
    m.ingest_request("a")
    before = m.observe()
    st = KVStep(segments=[Segment("a", "main", 6)])  # 3 pages in each group: 6 > 5
    out = m.admit(st, StepContext(padded_request_ids=["a"]))
    assert not out.ok and out.reason.pages_short == 1  # type: ignore[union-attr]
    assert m.observe() == before
    assert m.pages_needed(st, StepContext(padded_request_ids=["a"])) == 6


def test_a_hit_is_served_by_every_group() -> None:
    """H2: the window group attaches only what its window reads at the hit
    point; the same 6 tokens in both groups."""
    m = _mgr()
    ids = list(range(9))
    m.ingest_request("a")
    _step(m, "a", 6)
    assert m.cache_prefix("a", "main", ids[:6]) == 5  # 3 full pages + the window's 2
    m.ingest_request("b")
    assert m.match_prefix("b", "main", ids) == 6
    got = _streams(m, "b")
    assert got["main"] == (6, _streams(m, "a")["main"][1], 0)
    assert got["main@w"] == (6, _streams(m, "a")["main@w"][1], 2)
    _step(m, "b", 1)  # computes past the hit in both groups
    assert float(m.read_stream("b", "main")[0, 6, 0, 0, 0]) == 16.0


def test_no_hit_where_the_window_group_cannot_serve() -> None:
    """H2, H3: past the cached prompt's window the full group could serve 6
    tokens, but the window's page at the hit point went back blank."""
    m = _mgr()
    ids = list(range(9))
    m.ingest_request("a")
    _step(m, "a", 8)  # the window passed the pages a hit at 6 would read
    m.cache_prefix("a", "main", ids[:8])
    m.ingest_request("b")
    assert m.match_prefix("b", "main", ids[:7]) == 0
    assert _streams(m, "b") == {"main": (0, (), 0), "main@w": (0, (), 0)}


def test_what_a_window_passes_goes_back_blank() -> None:
    """H3: the pages a commit's window release frees are blank, never cached."""
    m = _mgr()
    m.ingest_request("a")
    m.follow_tokens("a", list(range(12)))
    _step(m, "a", 4)
    _step(m, "a", 4)  # the window releases its first pages, keyed before
    obs = m.observe()
    assert obs.cached_pages == 0
    assert all(p.key is None for p in obs.pages if p.state is PageState.BLANK)


def test_a_window_lets_go_head_first() -> None:
    """H4: removing the request leaves the window's tail last in the LRU."""
    m = _mgr()
    ids = list(range(9))
    m.ingest_request("a")
    _step(m, "a", 6)
    m.cache_prefix("a", "main", ids[:6])
    window_pages = _streams(m, "a")["main@w"][1]
    m.remove_request("a")
    lru = m.observe().free_cached
    assert [p for p in lru if p in window_pages] == list(window_pages)


def test_truncate_checks_every_group_first() -> None:
    """H1: a cut the window group refuses (W6) cuts no group; one within
    its rollback margin cuts both."""
    m = _mgr(margin=2)
    m.ingest_request("a")
    _step(m, "a", 7)
    before = m.observe()
    with pytest.raises(ReleasedPrefixError):
        m.truncate("a", "main", 2)
    assert m.observe() == before
    assert m.truncate("a", "main", 6) >= 1
    assert {k: v[0] for k, v in _streams(m, "a").items()} == {"main": 6, "main@w": 6}


def test_cache_prefixes_sums_each_call_over_its_groups() -> None:
    m = _mgr()
    ids = list(range(6))
    for rid in ("a", "b"):
        m.ingest_request(rid)
        _step(m, rid, 6)
    assert m.cache_prefixes([("a", "main", ids, 0), ("b", "main", [9, *ids[1:]], 0)]) == [5, 5]


def test_a_group_label_is_not_a_label() -> None:
    m = _mgr()
    m.ingest_request("a")
    with pytest.raises(InvalidArgumentError):
        m.match_prefix("a", "main@w", [1, 2, 3])


def test_groups_are_checked_at_config() -> None:
    with pytest.raises(InvalidConfigError, match="same number of layers"):
        KVConfig(num_layers=3, num_kv_heads=1, head_dim=4, max_seq_len=8, max_num_pages=4,
                 page_size=2, num_qo_heads=1,
                 groups=(AttentionGroup("f", (0,)), AttentionGroup("w", (1, 2))))
    with pytest.raises(InvalidConfigError, match="each layer"):
        KVConfig(num_layers=3, num_kv_heads=1, head_dim=4, max_seq_len=8, max_num_pages=4,
                 page_size=2, num_qo_heads=1,
                 groups=(AttentionGroup("f", (0,)), AttentionGroup("w", (0,))))
    with pytest.raises(InvalidConfigError, match="retention"):
        _cfg(retention={"main": RetentionPolicy(4)})
    with pytest.raises(InvalidConfigError):
        AttentionGroup("a@b", (0,))


def test_groups_for_splits_types_into_equal_groups() -> None:
    """Gemma 3's 5:1 as vLLM splits it: every group of one size."""
    sw = RetentionPolicy(1024)
    layers = [sw, sw, sw, sw, sw, None] * 2
    groups = groups_for(layers)
    assert [g.name for g in groups] == ["full", "w1024.0", "w1024.1", "w1024.2", "w1024.3",
                                        "w1024.4"]
    assert {len(g.layers) for g in groups} == {2}
    assert groups[0].layers == (5, 11) and groups[0].retention is None


def test_a_failed_fork_copy_empties_the_target_in_every_group() -> None:
    """H1, R26: the first group's copy of a fork fails; the fork's target is
    emptied in every group, not left forked in the window group (the
    label's groups would hold different lengths)."""
    from kvref.core.errors import ForkCopyError
    from kvref.testing.manual_runtime import ManualRuntime

    rt = ManualRuntime()
    m = KVManager(_cfg(), "kv", None, TransferEngineInfo(), torch.device("cpu"),
                  dtype=torch.float32, runtime=rt)
    m.ingest_request("a")
    _step(m, "a", 3)  # a part page: the fork copies it
    st = KVStep(segments=[Segment("a", "cfg", 1)], pre_forks=[("main", "cfg")])
    ctx = StepContext(padded_request_ids=["a"])
    assert m.admit(st, ctx).ok
    with rt.failing("fork.copy", once=True), pytest.raises(ForkCopyError):
        m.plan(st, ctx)
    got = _streams(m, "a")
    assert got["cfg"][0] == got["cfg@w"][0] == 0
    assert got["main"][0] == got["main@w"][0] == 3
    assert not m.check()


def test_a_later_group_start_fault_latches_every_group() -> None:
    """H1, R26: the transfer engine raises starting the window group's copy
    after the full group's copy started. The started copy cannot be called
    back, so the label's every group is latched failed (not refused with
    the full group still copying, as before), every later call reports it,
    and a reset drains the copy and leaves the groups alike."""
    from kvref import RetrieveAborted
    from kvref.testing.manual_runtime import ManualRuntime
    from kvref.transfer.published import PublishedKVInfo

    rt = ManualRuntime()
    src, dst = (KVManager(_cfg(), name, None, TransferEngineInfo(), torch.device("cpu"),
                          dtype=torch.float32, runtime=rt) for name in ("src", "dst"))
    src.ingest_request("a")
    _step(src, "a", 5)
    pub = src.publish("a")
    assert isinstance(pub, PublishedKVInfo)
    dst.ingest_request("a")
    free = dst.num_free_pages
    with rt.failing("retrieve.start", once=True, after=1):
        out = dst.admit_retrieve("a", None, None, pub)
    assert not out.ok and isinstance(out.reason, RetrieveAborted), out
    assert len(rt.pending) == 1  # the full group's copy runs on
    got = _streams(dst, "a")  # the window group took its pages as a failed copy would
    assert got["main"][0] == got["main@w"][0] == 5
    # every group failed, not only the one whose copy never started
    for stream in dst._streams["a"].values():
        assert stream.read_error is not None
    again = dst.admit_retrieve("a", None, None, pub)
    assert not again.ok and again.reason is not None
    assert not dst.check()
    src.release_published("a")
    dst.reset_request("a", free=True)  # drains the running copy first
    assert not rt.pending or all(t.future.done() for t in rt.pending)
    got = _streams(dst, "a")
    assert got["main"] == got["main@w"] == (0, (), 0)
    assert dst.num_free_pages == free
    assert not dst.check()
