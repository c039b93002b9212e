"""Shared pages in the manager (issue 18): copy-on-write forks, the prefix
cache, and every mechanism over a page more than one stream holds.

Each test reads every holder back through `read_stream` (the bytes), and
checks the device-page invariant (`check_device_pages`: reference counts
equal the tables naming a page, spare pages private) after each call.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvref import (
    AllocationFailed,
    InvalidStepError,
    KVManager,
    KVStep,
    PreplanRefused,
    PublishLeasedError,
    ResetRefused,
    Segment,
    StepContext,
    StepInFlightError,
)
from kvref.core.config import KVReqConfig
from kvref.core.errors import InvalidArgumentError, StreamUnavailableError
from kvref.testing.page_checks import check_device_pages
from tests.unit._manager_fixtures import Driver, make_manager

PS = 4


def _mgr(**kw: Any) -> tuple[KVManager, Driver]:
    kw.setdefault("pages", 64)
    mgr = make_manager(page_size=PS, **kw)
    return mgr, Driver(mgr)


def _fill(drv: Driver, rid: str, n: int, label: str = "main") -> None:
    drv.step([(rid, label, n)])


def _copies(mgr: KVManager, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Pages each device copy moves, as `KVCache.copy_pages` is called."""
    moved: list[int] = []
    orig = mgr.kv_cache.copy_pages

    def counting(src: list[int], dst: list[int]) -> None:
        moved.append(len(src))
        orig(src, dst)

    monkeypatch.setattr(mgr.kv_cache, "copy_pages", counting)
    return moved


# -- copy-on-write forks (R51) ------------------------------------------------


@pytest.mark.parametrize("length", [16, 18])
def test_a_fork_shares_full_pages_and_copies_at_most_one(
        length: int, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr, drv = _mgr()
    drv.ingest("a")
    _fill(drv, "a", length)
    moved = _copies(mgr, monkeypatch)
    free = mgr.num_free_pages
    drv.step([("a", "main", 0)], pre_forks=[("main", "cfg")])
    full = length // PS
    assert sum(moved) == (1 if length % PS else 0)  # only the partial page is copied
    main, cfg = mgr._streams["a"]["main"], mgr._streams["a"]["cfg"]
    assert cfg.page_indices[:full] == main.page_indices[:full]
    # the target holds only its partial page of its own
    assert mgr.num_free_pages == free - (1 if length % PS else 0)
    drv.check("a", "main")
    drv.check("a", "cfg")
    check_device_pages(mgr)


def test_writes_after_a_fork_stay_with_their_stream() -> None:
    mgr, drv = _mgr()
    drv.ingest("a")
    _fill(drv, "a", 9)
    drv.step([("a", "main", 0)], pre_forks=[("main", "s1"), ("main", "s2")])
    for _ in range(6):  # each sample decodes its own tokens over the shared prompt
        drv.step([("a", "s1", 1), ("a", "s2", 1)])
        check_device_pages(mgr)
    for label in ("main", "s1", "s2"):
        drv.check("a", label)


def test_the_same_fork_on_copying_and_sharing_caches_reads_back_alike() -> None:
    reads = []
    for sharing in (False, True):
        mgr, drv = _mgr(sharing=sharing)
        drv.ingest("a")
        _fill(drv, "a", 11)
        drv.step([("a", "x", 2)], pre_forks=[("main", "x")], post_forks=[("x", "y")])
        drv.step([("a", "y", 3), ("a", "main", 1)], pre_forks=[("y", "main")])
        reads.append([mgr.read_stream("a", lb).clone() for lb in ("main", "x", "y")])
        check_device_pages(mgr)
    assert all(torch.equal(p, q) for p, q in zip(*reads, strict=True))


def test_a_fork_cycle_over_shared_pages_reads_back_and_leaks_nothing() -> None:
    mgr, drv = _mgr()
    drv.ingest("a")
    _fill(drv, "a", 9)
    _fill(drv, "a", 6, label="b")
    step = KVStep([Segment("a", "main", 1)], pre_forks=[("main", "b"), ("b", "main")])
    ctx = StepContext(("a",))
    need = mgr.pages_needed(step, ctx)
    free = mgr.num_free_pages
    drv.step([("a", "main", 1)], pre_forks=[("main", "b"), ("b", "main")])
    assert free - mgr.num_free_pages <= need  # never more than admit reserved
    drv.check("a", "main")
    drv.check("a", "b")
    check_device_pages(mgr)
    mgr.remove_request("a")
    assert mgr.num_free_pages == mgr.config.max_num_pages - 1
    check_device_pages(mgr)


def test_a_truncate_into_a_shared_page_copies_it_before_the_next_write(
        monkeypatch: pytest.MonkeyPatch) -> None:
    mgr, drv = _mgr()
    drv.ingest("a")
    _fill(drv, "a", 8)
    drv.step([("a", "main", 0)], pre_forks=[("main", "cfg")])
    shared = mgr._streams["a"]["cfg"].page_indices[1]
    assert mgr.truncate("a", "cfg", 6) == 0  # the cut page stays: main holds it
    drv.model[("a", "cfg")] = drv.model[("a", "cfg")][:6]
    moved = _copies(mgr, monkeypatch)
    drv.step([("a", "cfg", 3)])
    assert moved == [1]  # the partial page, copied once at admit (R52)
    assert mgr._streams["a"]["cfg"].page_indices[1] != shared
    drv.check("a", "main")  # the source's page was not written
    drv.check("a", "cfg")
    check_device_pages(mgr)


def test_fork_misuse_is_still_refused_before_anything_moves() -> None:
    mgr, drv = _mgr()
    drv.ingest("a")
    _fill(drv, "a", 5)
    with pytest.raises(InvalidStepError):
        mgr.admit(KVStep([], pre_forks=[("main", "main")]), StepContext(("a",)))
    check_device_pages(mgr)


# -- the prefix cache ---------------------------------------------------------


PROMPT = list(range(100, 118))  # 18 tokens: 4 full pages and a partial one


def _cached_prompt(mgr: KVManager, drv: Driver, rid: str = "a", n: int = 18) -> None:
    drv.ingest(rid)
    _fill(drv, rid, n)
    assert mgr.cache_prefix(rid, "main", PROMPT[:n]) == n // PS


def test_a_hit_attaches_whole_pages_that_read_back_as_computed() -> None:
    mgr, drv = _mgr()
    _cached_prompt(mgr, drv)
    drv.ingest("b")
    assert mgr.match_prefix("b", "main", PROMPT) == 16
    a, b = mgr._streams["a"]["main"], mgr._streams["b"]["main"]
    assert b.page_indices[:4] == a.page_indices[:4]
    assert torch.equal(mgr.read_stream("b"), mgr.read_stream("a")[:, :16])
    drv.model[("b", "main")] = drv.model[("a", "main")][:16]
    _fill(drv, "b", 2)  # the rest is computed into b's own pages
    drv.check("b")
    drv.check("a")
    check_device_pages(mgr)


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    mgr, drv = _mgr()
    _cached_prompt(mgr, drv, n=16)
    drv.ingest("b")
    assert mgr.match_prefix("b", "main", PROMPT[:16]) == 12  # not 16 (S8)


def test_the_cache_outlives_the_request_until_its_pages_are_needed() -> None:
    mgr, drv = _mgr(pages=12)  # 11 usable
    _cached_prompt(mgr, drv)
    mgr.remove_request("a")
    assert mgr.num_cached_pages == 4 and mgr.num_free_pages == 11
    drv.ingest("b")
    _fill(drv, "b", 4 * 7 + 1)  # 8 pages: 7 blank and the oldest cached one
    assert mgr.num_cached_pages == 3
    drv.ingest("c")
    # a's pages were let go tail first, so its last full page was the least
    # recently used: the prefix is evicted after its own suffix (S6), and the
    # evicted page's key left the index with it (vLLM PR 4761)
    assert mgr.match_prefix("c", "main", PROMPT) == 12
    drv.model[("c", "main")] = drv.model[("a", "main")][:12]
    assert mgr.num_free_pages == 0  # the hit took the last three free pages
    drv.check("c")
    drv.check("b")  # the page b took from the cache holds b's tokens, not the prompt's
    check_device_pages(mgr)


def test_another_salt_never_hits() -> None:
    mgr, drv = _mgr()
    mgr.ingest_request("a", KVReqConfig(cache_salt="tenant-1"))
    drv.model[("a", "main")] = []
    _fill(drv, "a", 18)
    assert mgr.cache_prefix("a", "main", PROMPT) == 4
    mgr.ingest_request("b", KVReqConfig(cache_salt="tenant-2"))
    mgr.ingest_request("c")
    mgr.ingest_request("d", KVReqConfig(cache_salt="tenant-1"))
    assert mgr.match_prefix("b", "main", PROMPT) == 0
    assert mgr.match_prefix("c", "main", PROMPT) == 0
    assert mgr.match_prefix("d", "main", PROMPT) == 16


def test_careless_calls_are_refused_and_change_nothing() -> None:
    mgr, drv = _mgr()
    _cached_prompt(mgr, drv, n=8)
    before = (mgr.num_free_pages, mgr.num_cached_pages, list(mgr._streams["a"]["main"].keys))
    with pytest.raises(InvalidArgumentError, match="committed 8"):
        mgr.cache_prefix("a", "main", PROMPT[:12])  # tokens not committed yet
    with pytest.raises(InvalidArgumentError, match="otherwise"):
        mgr.cache_prefix("a", "main", [7] * 8)  # ids that disagree with the keyed pages
    with pytest.raises(InvalidArgumentError, match="empty stream"):
        mgr.match_prefix("a", "main", PROMPT)  # a hit onto a stream that holds tokens
    with pytest.raises(InvalidArgumentError):
        mgr.match_prefix("a", "x", ["t"] * 8)  # type: ignore[list-item]
    assert (mgr.num_free_pages, mgr.num_cached_pages,
            list(mgr._streams["a"]["main"].keys)) == before
    check_device_pages(mgr)


def test_a_hit_onto_a_stream_a_step_names_is_refused() -> None:
    mgr, drv = _mgr()
    _cached_prompt(mgr, drv)
    drv.ingest("b")
    step, ctx = KVStep([Segment("b", "main", 3)]), StepContext(("b",))
    assert mgr.admit(step, ctx).ok
    with pytest.raises(StepInFlightError):
        mgr.match_prefix("b", "main", PROMPT)
    mgr.commit(step, ctx)


def test_a_leased_request_takes_no_hit() -> None:
    mgr, drv = _mgr()
    _cached_prompt(mgr, drv)
    drv.ingest("b")
    _fill(drv, "b", 1)
    mgr.publish("b")
    with pytest.raises(PublishLeasedError):
        mgr.match_prefix("b", "other", PROMPT)
    mgr.release_published("b")


def test_a_speculative_draft_is_cached_only_once_kept() -> None:
    mgr, drv = _mgr()
    drv.ingest("a")
    _fill(drv, "a", 8)
    assert mgr.cache_prefix("a", "main", PROMPT[:8]) == 2
    _fill(drv, "a", 4)  # four drafted tokens, committed for the verify step
    mgr.truncate("a", "main", 10)  # two were kept
    drv.model[("a", "main")] = drv.model[("a", "main")][:10]
    with pytest.raises(InvalidArgumentError):
        mgr.cache_prefix("a", "main", PROMPT[:12])  # the rejected drafts are gone
    assert mgr.cache_prefix("a", "main", PROMPT[:10]) == 0  # no third full page yet
    _fill(drv, "a", 2)
    assert mgr.cache_prefix("a", "main", PROMPT[:12]) == 1
    check_device_pages(mgr)


def test_reset_prefix_cache_waits_for_every_page_to_be_let_go() -> None:
    mgr, drv = _mgr()
    _cached_prompt(mgr, drv)
    got = mgr.reset_prefix_cache()
    assert isinstance(got, ResetRefused) and got.pages_held == 5
    assert mgr.num_cached_pages == 0  # the prompt's pages are held, not free-cached
    mgr.remove_request("a")
    assert mgr.num_cached_pages == 4
    assert mgr.reset_prefix_cache() == 4
    assert mgr.num_cached_pages == 0 and mgr.num_free_pages == mgr.config.max_num_pages - 1
    drv.ingest("b")
    assert mgr.match_prefix("b", "main", PROMPT) == 0
    check_device_pages(mgr)


def test_with_the_cache_off_nothing_is_shared_or_found() -> None:
    mgr, drv = _mgr(sharing=False)
    _cached_prompt_off = PROMPT[:18]
    drv.ingest("a")
    _fill(drv, "a", 18)
    assert mgr.cache_prefix("a", "main", _cached_prompt_off) == 0
    drv.ingest("b")
    assert mgr.match_prefix("b", "main", PROMPT) == 0
    drv.step([("a", "main", 0)], pre_forks=[("main", "cfg")])
    a, cfg = mgr._streams["a"]["main"], mgr._streams["a"]["cfg"]
    assert not set(a.page_indices) & set(cfg.page_indices)


# -- every mechanism over shared pages ------------------------------------------


def test_reclaimable_and_priority_count_only_pages_whose_last_holder_goes() -> None:
    mgr, drv = _mgr(cpu_pages=16)
    _cached_prompt(mgr, drv)
    drv.ingest("b")
    assert mgr.match_prefix("b", "main", PROMPT) == 16
    drv.model[("b", "main")] = drv.model[("a", "main")][:16]
    _fill(drv, "b", 3)
    # b holds 4 pages a holds too, and 1 of its own; a 4 shared and 1 own
    assert mgr.reclaimable("b") == 1
    assert mgr.get_offload_priority("b") == 1.0
    drv.step([("a", "main", 0)], pre_forks=[("main", "cfg")])
    assert mgr.reclaimable("a") == 2  # the partial pages; its prefix is b's too


def test_an_offload_frees_only_unshared_pages_and_reloads_the_tokens() -> None:
    mgr, drv = _mgr(cpu_pages=16)
    _cached_prompt(mgr, drv)
    drv.ingest("b")
    assert mgr.match_prefix("b", "main", PROMPT) == 16
    drv.model[("b", "main")] = drv.model[("a", "main")][:16]
    _fill(drv, "b", 3)
    free = mgr.num_free_pages
    out = mgr.offload_outcome("b")
    assert out.pages_freed == 1 and mgr.num_free_pages == free + 1
    check_device_pages(mgr)
    drv.check("a")  # the shared pages stayed with a
    assert mgr.reload("b")
    drv.check("b")  # the host copy held b's tokens, all 19
    check_device_pages(mgr)


def test_reset_keeping_pages_keeps_only_private_ones() -> None:
    mgr, drv = _mgr()
    _cached_prompt(mgr, drv)
    drv.ingest("b")
    mgr.match_prefix("b", "main", PROMPT)
    drv.model[("b", "main")] = drv.model[("a", "main")][:16]
    _fill(drv, "b", 3)
    mgr.reset_request("b", free=False)
    drv.model[("b", "main")] = []
    assert len(mgr._streams["b"]["main"].page_indices) == 1  # its own page, spare
    check_device_pages(mgr)
    _fill(drv, "b", 5)  # written into its own pages, not a's
    drv.check("a")
    drv.check("b")


def test_truncate_returns_what_it_freed_not_what_it_let_go() -> None:
    mgr, drv = _mgr()
    drv.ingest("a")
    _fill(drv, "a", 12)
    drv.step([("a", "main", 0)], pre_forks=[("main", "cfg")])
    assert mgr.truncate("a", "cfg", 4) == 0  # the two cut pages are main's too
    assert mgr.truncate("a", "main", 4) == 2  # now their last holder lets go
    check_device_pages(mgr)


def test_an_allocation_short_counts_cached_pages_as_free() -> None:
    mgr, drv = _mgr(pages=8)  # 7 usable
    _cached_prompt(mgr, drv, n=16)
    mgr.remove_request("a")
    drv.ingest("b")
    out = mgr.admit(KVStep([Segment("b", "main", 32)]), StepContext(("b",)))
    assert isinstance(out.reason, AllocationFailed) and out.reason.pages_short == 1
    assert mgr.num_cached_pages == 4  # a refusal evicts nothing


def test_a_stream_offloaded_or_unknown_is_refused_by_the_cache_calls() -> None:
    mgr, drv = _mgr(cpu_pages=16)
    _cached_prompt(mgr, drv)
    mgr.offload_outcome("a")
    with pytest.raises(StreamUnavailableError):
        mgr.cache_prefix("a", "main", PROMPT)
    with pytest.raises(StreamUnavailableError):
        mgr.match_prefix("a", "main", PROMPT)


def test_a_fork_under_memory_pressure_takes_one_page_not_its_length() -> None:
    mgr, drv = _mgr(pages=8)  # 7 usable
    drv.ingest("a")
    _fill(drv, "a", 22)  # 6 pages: 5 full and a partial one
    assert mgr.num_free_pages == 1
    step, ctx = KVStep([Segment("a", "main", 0)], pre_forks=[("main", "s1")]), StepContext(("a",))
    assert mgr.pages_needed(step, ctx) == 1  # the partial page's copy
    drv.step([("a", "main", 0)], pre_forks=[("main", "s1")])
    assert mgr.num_free_pages == 0
    drv.check("a", "s1")
    # and with the cache off, the same fork needs the whole length
    off, offdrv = _mgr(pages=8, sharing=False)
    offdrv.ingest("a")
    _fill(offdrv, "a", 22)
    out = off.admit(step, ctx)
    assert isinstance(out.reason, AllocationFailed) and out.reason.pages_short == 5


def _retrieved(monkeypatch: pytest.MonkeyPatch | None = None) -> tuple[KVManager, KVManager]:
    """``dst`` holds request ``r``'s 10 tokens, copied from ``src`` by a retrieve."""
    src, dst, _ = _received(0)
    return src, dst


def _received(own: int) -> tuple[KVManager, KVManager, Driver]:
    """``dst``'s request ``r`` computed ``own`` tokens of its own, then a
    retrieve from ``src`` brought it to 10 tokens; with ``dst``'s driver."""
    src, drv = _mgr(pages=16)
    drv.ingest("r")
    _fill(drv, "r", 10)
    dst, dd = _mgr(pages=16)
    dd.ingest("r")
    if own:
        _fill(dd, "r", own)
    pub = src.publish("r")
    assert dst.admit_retrieve("r", None, None, pub).ok
    for s in dst._streams["r"].values():
        if s.read_future is not None:
            s.read_future.result(timeout=10)
    assert dst.admit_retrieve("r", None, None, pub).ready
    src.release_published("r")
    return src, dst, dd


def test_retrieved_kv_is_never_cached() -> None:
    """R55 (vllm-ascend PR 2083: blocks received over P/D were registered)."""
    src, dst = _retrieved()
    ids = list(range(10))
    assert dst.cache_prefix("r", "main", ids) == 0
    assert dst.num_cached_pages == 0 and not dst._streams["r"]["main"].keys
    dst.remove_request("r")
    dst.ingest_request("q")
    assert dst.match_prefix("q", "main", [*ids, 1]) == 0
    src.cleanup()
    dst.cleanup()


def test_the_retrieved_guard_is_what_keeps_peer_kv_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plant: without the guard the peer's pages are registered, and the
    test above would fail on its first assertion."""
    src, dst = _retrieved()
    dst._streams["r"]["main"].received_at = None  # the guard, removed
    assert dst.cache_prefix("r", "main", list(range(10))) == 2
    src.cleanup()
    dst.cleanup()


def _write_planned(mgr: KVManager, outs: Any, seed: int) -> None:
    """Write seeded K/V into every planned row (the same on every manager)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = mgr.config
    for plan_label in outs:
        n = mgr._current_plan_states[plan_label].write_len
        for layer in range(cfg.num_layers):
            k = torch.randn(n, cfg.num_kv_heads, cfg.head_dim, generator=gen)
            mgr.write_kv(k, -k, layer_idx=layer, label=plan_label)


def _overlapped_fork(mgr: KVManager) -> dict[str, torch.Tensor]:
    """A prompt, a sample forked from it, then step N decoding the prompt while
    step N+1, preplanned over it, forks the prompt onto the sample again."""
    mgr.ingest_request("a")
    seed = 0
    for step in (KVStep([Segment("a", "main", 9)]),
                 KVStep([Segment("a", "main", 0)], pre_forks=[("main", "s1")])):
        ctx = StepContext(("a",))
        assert mgr.admit(step, ctx).ok
        _write_planned(mgr, mgr.plan(step, ctx), seed := seed + 1)
        mgr.commit(step, ctx)
    run, ctx = KVStep([Segment("a", "main", 1)]), StepContext(("a",))
    assert mgr.admit(run, ctx).ok
    outs = mgr.plan(run, ctx)
    nxt = KVStep([Segment("a", "s1", 2)], pre_forks=[("main", "s1")])
    pre = StepContext(("a",), is_preplan=True)
    out = mgr.admit(nxt, pre)
    assert out.ok, out.reason
    mgr.plan(nxt, pre)
    _write_planned(mgr, outs, 10)
    mgr.commit(run, ctx)
    assert mgr.admit(nxt, ctx).ok
    _write_planned(mgr, mgr.plan(nxt, ctx), 11)
    mgr.commit(nxt, ctx)
    check_device_pages(mgr)
    return {lb: mgr.read_stream("a", lb).clone() for lb in ("main", "s1")}


def test_a_preplanned_fork_over_shared_pages_reads_back_as_a_copying_one() -> None:
    """R57: the preplan's views name the target's pages, so its fork copies
    into them; the shared pages it held were copied into its own at admit."""
    shared, _ = _mgr(pages=32)
    copying, _ = _mgr(pages=32, sharing=False)
    got, want = _overlapped_fork(shared), _overlapped_fork(copying)
    assert got.keys() == want.keys()
    for lb in got:
        assert torch.equal(got[lb], want[lb]), lb
    assert got["s1"].shape[1] == 12  # 10 forked + 2 decoded


def test_a_preplanned_fork_target_is_not_cached_before_its_fork() -> None:
    mgr, drv = _mgr(pages=32)
    drv.ingest("a")
    _fill(drv, "a", 9)
    drv.step([("a", "main", 0)], pre_forks=[("main", "s1")])
    run, ctx = KVStep([Segment("a", "main", 1)]), StepContext(("a",))
    assert mgr.admit(run, ctx).ok
    nxt = KVStep([Segment("a", "s1", 1)], pre_forks=[("main", "s1")])
    assert mgr.admit(nxt, StepContext(("a",), is_preplan=True)).ok
    with pytest.raises(StepInFlightError):
        mgr.cache_prefix("a", "s1", list(range(8)))
    mgr.commit(run, ctx)
    mgr.clear_preplan()
    check_device_pages(mgr)


def test_a_preplan_whose_fork_ends_the_running_step_names_is_refused() -> None:
    mgr, drv = _mgr(pages=32)
    drv.ingest("a")
    _fill(drv, "a", 9)
    drv.step([("a", "main", 0)], pre_forks=[("main", "s1")])
    run, ctx = KVStep([Segment("a", "s1", 1)]), StepContext(("a",))
    assert mgr.admit(run, ctx).ok
    before = mgr.num_free_pages
    out = mgr.admit(KVStep([Segment("a", "main", 1)], pre_forks=[("main", "s1")]),
                    StepContext(("a",), is_preplan=True))
    assert isinstance(out.reason, PreplanRefused) and mgr.num_free_pages == before
    mgr.commit(run, ctx)


def test_reset_prefix_cache_is_refused_while_a_request_is_offloaded() -> None:
    """Issue 27, defect 3 (S30): prefill A, offload it, reset. The reset was
    accepted (it answered 0), then a reload and a cache_prefix of A let a new
    request's match find 8 tokens computed before the reset. Now it is
    refused, changing nothing, and KV from before it is never found after."""
    mgr, drv = _mgr(cpu_pages=16)
    drv.ingest("a")
    _fill(drv, "a", 10)
    assert mgr.offload_outcome("a").reason is None
    assert mgr.num_free_pages == mgr.config.max_num_pages - 1  # no device page held
    got = mgr.reset_prefix_cache()
    assert isinstance(got, ResetRefused), got
    assert (got.pages_held, got.streams_offloaded) == (0, 1) and "offloaded" in got.message
    assert mgr.is_offloaded("a")  # the refusal changed nothing
    assert mgr.reload_outcome("a").reason is None
    assert mgr.cache_prefix("a", "main", PROMPT[:10]) == 2
    # A's pages are held now: refused as S14 says, until A is let go
    assert isinstance(mgr.reset_prefix_cache(), ResetRefused)
    mgr.remove_request("a")
    assert mgr.reset_prefix_cache() == 2
    drv.ingest("b")
    assert mgr.match_prefix("b", "main", PROMPT[:10]) == 0  # nothing from before the reset
    check_device_pages(mgr)


def test_reset_prefix_cache_is_refused_while_an_offload_claims_a_request() -> None:
    """Between an offload's claim and its commit the stream is on its way to
    the host: refused too, and once the claim is abandoned the reset waits
    only for the pages (S14)."""
    mgr, drv = _mgr(cpu_pages=16)
    drv.ingest("a")
    _fill(drv, "a", 10)
    off = mgr.begin_offload("a")
    assert off is not None
    got = mgr.reset_prefix_cache()
    assert isinstance(got, ResetRefused) and got.streams_offloaded == 1, got
    assert got.pages_held == 3
    off.abandon()
    got = mgr.reset_prefix_cache()
    assert isinstance(got, ResetRefused) and got.streams_offloaded == 0, got
    mgr.remove_request("a")
    assert mgr.reset_prefix_cache() == 0
    check_device_pages(mgr)
