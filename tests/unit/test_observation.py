"""`KVManager.observe`: the snapshot is immutable, shares nothing mutable
with the manager, stays as it was when the manager moves on, and agrees
with the public calls (issue 27, part 6)."""

from __future__ import annotations

import dataclasses
import enum
from concurrent.futures import Future
from types import MappingProxyType
from typing import Any

import pytest
import torch

import kvref.observation as observation
from kvref import (
    KVConfig,
    KVManager,
    KVObservation,
    KVStep,
    OffloadState,
    PageState,
    RetrieveState,
    Segment,
    StepContext,
    TransferEngineInfo,
)
from kvref.core.streams import CacheStream
from kvref.testing.manual_runtime import ManualRuntime
from kvref.testing.page_checks import check_device_pages

PS = 4


def manager(runtime: ManualRuntime | None = None, host: int = 8) -> KVManager:
    cfg = KVConfig(num_layers=1, num_kv_heads=1, head_dim=2, max_seq_len=64, max_num_pages=12,
                   page_size=PS, num_qo_heads=1, cpu_offload_pages=host)
    return KVManager(cfg, "kv", None, TransferEngineInfo(), "cpu", torch.float32,
                     runtime=runtime)


def step(kv: KVManager, rid: str, n: int, label: str = "main") -> None:
    s, ctx = KVStep([Segment(rid, label, n)]), StepContext([rid])
    assert kv.admit(s, ctx).ok
    kv.plan(s, ctx)
    kv.commit(s, ctx)


def busy(kv: KVManager) -> None:
    """Two requests sharing a cached page, a second label, a lease, an offload."""
    ids = list(range(9))
    for rid in ("a", "b", "c"):
        kv.ingest_request(rid)
    step(kv, "a", 9)
    assert kv.cache_prefix("a", "main", ids) == 2
    assert kv.match_prefix("b", "main", ids) == 8  # whole pages, the last token computed
    step(kv, "b", 1)
    step(kv, "c", 6)
    step(kv, "c", 2, label="draft")
    assert not isinstance(kv.publish("b"), type(None))


def immutable_parts(x: Any, seen: set[int]) -> list[str]:
    """What in ``x`` is not immutable (a path per offender)."""
    if id(x) in seen or x is None or isinstance(x, (bool, int, float, str, bytes, enum.Enum)):
        return []
    seen.add(id(x))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        if not type(x).__dataclass_params__.frozen:  # type: ignore[attr-defined]
            return [type(x).__name__]
        return [f"{type(x).__name__}.{f.name}/{bad}" for f in dataclasses.fields(x)
                for bad in immutable_parts(getattr(x, f.name), seen)]
    if isinstance(x, (tuple, frozenset)):
        return [bad for item in x for bad in immutable_parts(item, seen)]
    if isinstance(x, MappingProxyType):
        return [f"[{k!r}]/{bad}" for k, v in x.items()
                for bad in immutable_parts(k, seen) + immutable_parts(v, seen)]
    return [type(x).__name__]


def test_the_snapshot_types_are_frozen() -> None:
    types = [obj for obj in vars(observation).values()
             if isinstance(obj, type) and dataclasses.is_dataclass(obj)
             and obj.__module__ == observation.__name__]
    assert len(types) == 8, types
    for t in types:
        assert t.__dataclass_params__.frozen, t  # type: ignore[attr-defined]
    kv = manager()
    busy(kv)
    seen = kv.observe()
    with pytest.raises(dataclasses.FrozenInstanceError):
        seen.free_pages = 0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        seen.stream("a").stored_len = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        seen.requests["z"] = MappingProxyType({})  # type: ignore[index]
    with pytest.raises(TypeError):
        seen.requests["a"]["main"] = seen.stream("b")  # type: ignore[index]


def test_the_snapshot_holds_nothing_mutable() -> None:
    kv = manager()
    busy(kv)
    offload = kv.begin_offload("c")
    assert offload is not None and offload.copy("main")
    seen = kv.observe()
    assert immutable_parts(seen, set()) == []
    # and the check can fail: a list inside is found
    bad = dataclasses.replace(seen, free_blank=[1, 2])  # type: ignore[arg-type]
    assert immutable_parts(bad, set()) == ["KVObservation.free_blank/list"]


def test_an_old_snapshot_does_not_move_with_the_manager() -> None:
    kv = manager()
    busy(kv)
    old = kv.observe()
    before = repr(old)
    a_pages = old.stream("a").pages
    kv.release_published("b")
    step(kv, "a", 3)
    assert kv.offload("c") > 0
    kv.reset_request("b", free=True)
    kv.remove_request("a")
    new = kv.observe()
    assert repr(old) == before  # every field as it was
    assert old.stream("a").stored_len == 9 and old.stream("a").pages == a_pages
    assert "a" in old.requests and "a" not in new.requests
    assert old.leases == {"b"} and new.leases == frozenset()
    assert old.stream("c").offload is OffloadState.RESIDENT
    assert new.stream("c").offload is OffloadState.OFFLOADED
    assert old.free_pages != new.free_pages


def test_it_agrees_with_the_public_calls() -> None:
    kv = manager()
    busy(kv)
    offload = kv.begin_offload("c")
    assert offload is not None and offload.copy("main")
    seen = kv.observe()
    assert (seen.free_pages, seen.cached_pages) == (kv.num_free_pages, kv.num_cached_pages)
    assert (seen.page_size, seen.num_pages, seen.sharing) == (PS, 12, True)
    assert list(seen.requests) == ["a", "b", "c"]
    for rid, labels in seen.requests.items():
        assert kv.has_request(rid) and list(labels) == kv.labels(rid)
        for label, s in labels.items():
            assert (s.request_id, s.label) == (rid, label)
            assert s.stored_len == kv.stored_len(rid, label)
            assert s.keyed_pages * PS == kv.cached_tokens(rid, label)
            assert s.retrieve is RetrieveState.IDLE and not s.in_flight
    # a and b share a's first two pages, keyed; b's third is its own
    a, b = seen.stream("a"), seen.stream("b")
    assert a.pages[:2] == b.pages[:2] and a.pages[2] != b.pages[2]
    for p in a.pages[:2]:
        page = seen.page(p)
        assert page.holders == {("a", "main"), ("b", "main")}
        assert page.key is not None and page.state is PageState.HELD
    assert seen.page(b.pages[2]).holders == {("b", "main")}
    # the open offload: both of c's streams claimed, main copied
    assert dict(seen.offloads) == {"c": observation.OffloadObservation(
        "c", ("main", "draft"), ("main",))}
    assert {s.label: s.offload for s in seen.requests["c"].values()} == {
        "main": OffloadState.CLAIMED, "draft": OffloadState.CLAIMED}
    assert seen.leases == {"b"}
    view = kv.host_pool()
    assert seen.host is not None
    assert (seen.host.capacity, seen.host.free) == (view.capacity, view.free)
    copy = seen.host_copy("c", "main")
    assert copy is not None and copy.stored_len == 6 and len(copy.pages) == 2
    assert seen.host_copy("c", "draft") is None
    assert seen.host.used_by("c") == 2 and seen.host.used_by("a") == 0
    # every page exactly once: held, cached or blank; the free ones listed
    states = {s: [p.page for p in seen.pages if p.state is s] for s in PageState}
    assert states[PageState.LOST] == []
    assert sorted(states[PageState.BLANK]) == sorted(seen.free_blank)
    assert sorted(states[PageState.CACHED]) == sorted(seen.free_cached)
    assert len(states[PageState.HELD]) + seen.free_pages == 11  # all but the sink
    check_device_pages(kv, seen)
    offload.commit()
    done = kv.observe()
    assert kv.is_offloaded("c") and not done.offloads
    assert done.stream("c").offload is OffloadState.OFFLOADED
    assert done.stream("c").pages == ()


def test_a_window_release_is_observed() -> None:
    from kvref import RetentionPolicy

    cfg = KVConfig(num_layers=1, num_kv_heads=1, head_dim=2, max_seq_len=64, max_num_pages=12,
                   page_size=PS, num_qo_heads=1, retention={"main": RetentionPolicy(4)})
    kv = KVManager(cfg, "kv", None, TransferEngineInfo(), "cpu", torch.float32)
    kv.ingest_request("w")
    for _ in range(5):
        step(kv, "w", 4)
    s = kv.observe().stream("w")
    assert s.stored_len == 20 and s.released > 0 and s.released % PS == 0
    assert len(s.pages) == -(-(s.stored_len - s.released) // PS)
    assert kv.observe().host is None  # no host pool configured


def test_stream_retrieve_state_from_its_fields() -> None:
    """`CacheStream.retrieve` names the model's state (IDLE, PENDING,
    FAILED) from the future and the latched error, and latches nothing."""
    s = CacheStream()
    assert s.retrieve is RetrieveState.IDLE
    fut: Future[None] = Future()
    s.read_future = fut
    assert s.retrieve is RetrieveState.PENDING
    fut.set_result(None)
    assert s.retrieve is RetrieveState.IDLE
    failed: Future[None] = Future()
    failed.set_exception(RuntimeError("copy failed"))
    s.read_future = failed
    assert s.retrieve is RetrieveState.FAILED
    assert s.read_future is failed and s.read_error is None  # read, not latched
    s.read_future, s.read_error = None, RuntimeError("latched")
    assert s.retrieve is RetrieveState.FAILED


def test_retrieve_states() -> None:
    rt = ManualRuntime()
    src, dst = manager(rt), manager(rt)
    src.ingest_request("x")
    step(src, "x", 5)
    info = src.publish("x")
    dst.ingest_request("x")
    assert dst.admit_retrieve("x", published=info).ok  # type: ignore[arg-type]
    assert dst.observe().stream("x").retrieve is RetrieveState.PENDING
    rt.complete_all()
    assert dst.observe().stream("x").retrieve is RetrieveState.IDLE
    dst.reset_request("x")
    src.release_published("x")
    info = src.publish("x")
    assert dst.admit_retrieve("x", published=info).ok  # type: ignore[arg-type]
    (task,) = rt.pending
    rt.complete(task.future, ok=False)
    assert dst.observe().stream("x").retrieve is RetrieveState.FAILED
    assert isinstance(dst.observe(), KVObservation)


# -- what a harness or a probe outside used to read privately (issue 44, item 4) ----------


def test_request_configs_are_observed_and_go_with_the_request() -> None:
    from kvref import KVReqConfig, RequestConfigObservation

    kv = manager()
    kv.ingest_request("t", KVReqConfig(cache_salt="tenant-1",
                                       extra_keys=(("lora", "x"), ("mm", b"\x01"))))
    kv.ingest_request("u")
    seen = kv.observe()
    assert dict(seen.configs) == {
        "t": RequestConfigObservation("tenant-1", (("lora", "x"), ("mm", b"\x01"))),
        "u": RequestConfigObservation(None, ())}
    kv.remove_request("t")
    assert set(kv.observe().configs) == {"u"}  # a removed request's config is gone
    kv.ingest_request("t", KVReqConfig(cache_salt="tenant-2"))
    assert kv.observe().configs["t"] == RequestConfigObservation("tenant-2", ())
    assert seen.configs["t"].cache_salt == "tenant-1"  # the old snapshot stays


def test_positions_and_the_ids_keyed_pages_were_keyed_with() -> None:
    kv = manager()
    busy(kv)
    seen = kv.observe()
    for s in seen.streams():
        assert s.position == s.stored_len  # W4
        assert len(s.keyed_ids()) == s.keyed_pages * PS
    # a keyed its first two pages, b found them: both keyed with ids 0..7
    assert seen.stream("a").keyed_ids() == seen.stream("b").keyed_ids() == tuple(range(8))
    assert seen.stream("c").keyed_ids() == () and seen.stream("c").key_tokens == b""
    # ids are signed 64-bit: read back as given
    kv.ingest_request("n")
    step(kv, "n", 4)
    ids = [-5, 2**40, 0, 2**63 - 1]
    assert kv.cache_prefix("n", "main", ids) == 1
    assert kv.observe().stream("n").keyed_ids() == tuple(ids)
    kv.truncate("n", "main", 2)  # the cut page's key goes, and its ids with it
    cut = kv.observe().stream("n")
    assert (cut.position, cut.keyed_pages, cut.keyed_ids()) == (2, 0, ())


def test_the_staged_preplan_and_what_it_was_planned_against() -> None:
    kv = manager()
    kv.ingest_request("a")
    step(kv, "a", 5)
    running, ctx = KVStep([Segment("a", "main", 1)]), StepContext(["a"])
    assert kv.admit(running, ctx).ok
    kv.plan(running, ctx)
    assert kv.observe().preplan is None
    nxt = KVStep([Segment("a", "main", 1), Segment("a", "draft", 2)])
    pre = StepContext(["a"], is_preplan=True)
    assert kv.admit(nxt, pre).ok
    staged = kv.observe().preplan
    assert staged is not None and not staged.planned
    assert staged.segments == (Segment("a", "main", 1), Segment("a", "draft", 2))
    assert (staged.padded, staged.commit, staged.pre_forks, staged.post_forks) == (
        ("a",), True, (), ())
    # planned against main's length once the running step commits: 5 + 1
    assert dict(staged.basis) == {("a", "main"): 6} and dict(staged.released) == {}
    assert staged.created == (("a", "draft"),)
    kv.plan(nxt, pre)
    planned = kv.observe()
    assert planned.preplan is not None and planned.preplan.planned
    assert immutable_parts(planned, set()) == []
    kv.commit(running, ctx)
    kv.plan(nxt, StepContext(["a"]))  # promoted: staged no more
    assert kv.observe().preplan is None
    assert not staged.planned  # the old snapshot stays as it was
    kv.commit(nxt, StepContext(["a"]))
    # a cleared preplan is gone too
    assert kv.admit(running, ctx).ok
    assert kv.admit(running, StepContext(["a"], is_preplan=True)).ok
    assert kv.observe().preplan is not None
    kv.clear_preplan()
    assert kv.observe().preplan is None


def test_check_names_what_is_wrong_with_the_pool() -> None:
    kv = manager()
    busy(kv)
    assert kv.check() == []
    check_device_pages(kv)
    # break what observe() cannot show: the key index loses a page's entry
    pool = kv._pages
    key, page = next(iter(pool._index.items()))
    del pool._index[key]
    assert kv.check() == [f"page {page}'s key is not indexed to it"]
    with pytest.raises(AssertionError, match=r"KVManager\.check"):
        check_device_pages(kv)
    pool._index[key] = page
    assert kv.check() == []
