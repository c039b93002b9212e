"""Ingest, admit, plan, write, commit, reset, remove: lengths, bytes and pages."""

from __future__ import annotations

import pytest
import torch
from _manager_fixtures import (
    Driver,
    assert_same,
    check_conservation,
    fill,
    make_manager,
    snapshot,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvref.core.config import KVLayout
from kvref.stepping.step import (
    AllocationFailed,
    KVStep,
    RequestOffloading,
    Segment,
    StepContext,
)


def test_ingest_twice_keeps_lengths() -> None:
    mgr = make_manager()
    drv = Driver(mgr)
    drv.ingest("a")
    fill(drv, "a", 7)
    drv.step([("a", "cfg", 2)])
    mgr.ingest_request("a")
    assert mgr.stored_len("a") == 7
    assert mgr.stored_len("a", "cfg") == 2
    assert sorted(mgr.labels("a")) == ["cfg", "main"]
    drv.check("a")
    drv.check("a", "cfg")


@pytest.mark.parametrize("layout", [KVLayout.NHD, KVLayout.HND])
@pytest.mark.parametrize("page_size", [1, 3, 4])
def test_admit_plan_write_commit_roundtrip(layout: KVLayout, page_size: int) -> None:
    mgr = make_manager(pages=64, page_size=page_size, layout=layout)
    drv = Driver(mgr)
    drv.ingest("a", "b")
    drv.step([("a", "main", 5), ("b", "main", 3)])
    assert (mgr.stored_len("a"), mgr.stored_len("b")) == (5, 3)
    for _ in range(4):  # decode fast path
        outs = drv.step([("a", "main", 1), ("b", "main", 1)])
        assert outs["main"].is_decode
    drv.step([("b", "main", 6), ("a", "main", 1)])  # chunked prefill mixed with decode
    assert (mgr.stored_len("a"), mgr.stored_len("b")) == (10, 13)
    drv.check("a")
    drv.check("b")
    check_conservation(mgr)


def test_read_kv_returns_this_steps_slots() -> None:
    mgr = make_manager()
    drv = Driver(mgr)
    drv.ingest("a")
    fill(drv, "a", 3)
    step = KVStep([Segment("a", "main", 2)])
    ctx = StepContext(("a",))
    assert mgr.admit(step, ctx).ok
    outs = mgr.plan(step, ctx)
    drv.write_planned(outs)
    got = mgr.read_kv(layer_idx=1)
    want = torch.stack([drv.expected("a")[1, 0]] * 2)  # shape only
    assert got.shape == want.shape
    mgr.commit(step, ctx)
    tag = drv.tag(("a", "main"))
    drv.apply_commit(step, ctx, {"main": [(("a", "main"), tag, p) for p in (3, 4)]})
    assert torch.equal(mgr.read_stream("a")[1, 3:5], got)


def test_commit_false_clears_marks_keeps_no_tokens() -> None:
    mgr = make_manager()
    drv = Driver(mgr)
    drv.ingest("a")
    fill(drv, "a", 4)
    gen = mgr._streams["a"]["main"].generation
    drv.step([("a", "main", 3), ("a", "draft", 2)], commit=False)
    assert mgr.stored_len("a") == 4
    assert mgr.stored_len("a", "draft") == 0
    for s in mgr._streams["a"].values():
        assert not s.step_in_flight
    assert mgr._streams["a"]["main"].generation >= gen
    drv.check("a")
    # and the request is evictable again (nothing in flight): reset works
    mgr.reset_request("a")
    assert mgr.stored_len("a") == 0


def test_refused_admit_allocation_changes_nothing() -> None:
    mgr = make_manager(pages=8, page_size=4, cpu_pages=8, sharing=False)  # 7 usable; forks copy
    drv = Driver(mgr)
    drv.ingest("a", "b")
    fill(drv, "a", 9)  # 3 pages
    before = snapshot(mgr)
    labels_before = mgr.labels("b")
    # b needs 3 new pages for main, 2 for draft, 3 for a fork target: 8 > 4 free
    step = KVStep([Segment("b", "main", 10), Segment("b", "draft", 5), Segment("a", "main", 1)],
                  pre_forks=[("main", "cfg")])
    ctx = StepContext(("a", "b"))
    out = mgr.admit(step, ctx)
    assert not out.ok
    assert isinstance(out.reason, AllocationFailed)
    # cfg of a takes 3 (a's 9 tokens), a main +1 page (10 tokens: 3 pages: 0 new),
    # b main 3, b draft 2: 8 new pages, 4 free
    assert out.reason.pages_short == 8 - 4
    assert_same(before, snapshot(mgr))
    assert mgr.labels("b") == labels_before
    assert "cfg" not in mgr.labels("a")
    assert not mgr.is_offloaded("a")
    check_conservation(mgr)
    # nothing marked: an offload can still claim a
    assert mgr.offload("a") == 3
    assert mgr.reload("a")
    drv.check("a")


def test_refused_admit_request_offloading_changes_nothing() -> None:
    mgr = make_manager(pages=16, page_size=4, cpu_pages=16)
    drv = Driver(mgr)
    drv.ingest("a", "b")
    fill(drv, "a", 5)
    fill(drv, "b", 5)
    assert mgr.offload("a") == 2
    before = snapshot(mgr)
    # would also be short of pages: RequestOffloading is reported first (R1)
    step = KVStep([Segment("b", "main", 100), Segment("a", "main", 1)])
    out = mgr.admit(step, StepContext(("a", "b")))
    assert not out.ok and isinstance(out.reason, RequestOffloading)
    assert out.reason.request_id == "a"
    assert_same(before, snapshot(mgr))
    # zero-span segment on an offloaded stream is refused too (R3)
    out = mgr.admit(KVStep([Segment("a", "main", 0)]), StepContext(("a",)))
    assert not out.ok and isinstance(out.reason, RequestOffloading)
    # fork source offloaded
    out = mgr.admit(KVStep([Segment("b", "main", 1)], pre_forks=[("main", "cfg")]),
                    StepContext(("a", "b")))
    assert not out.ok and isinstance(out.reason, RequestOffloading)
    assert_same(before, snapshot(mgr))
    assert mgr.reload("a")
    drv.check("a")
    drv.check("b")


def test_refused_admit_then_retry_after_eviction() -> None:
    mgr = make_manager(pages=6, page_size=2)  # 5 usable
    drv = Driver(mgr)
    drv.ingest("a", "b")
    fill(drv, "a", 6)
    step = KVStep([Segment("b", "main", 5)])
    out = mgr.admit(step, StepContext(("b",)))
    assert isinstance(out.reason, AllocationFailed) and out.reason.pages_short == 1
    assert out.reason.request_id == "b" and out.reason.label == "main"
    mgr.remove_request("a")
    drv.step([("b", "main", 5)])
    drv.check("b")


def test_reset_keep_and_free() -> None:
    mgr = make_manager(pages=16, page_size=4)
    drv = Driver(mgr)
    drv.ingest("a")
    fill(drv, "a", 10)
    free = mgr.num_free_pages
    gen = mgr._streams["a"]["main"].generation
    mgr.reset_request("a")
    assert mgr.stored_len("a") == 0 and mgr.num_free_pages == free
    assert mgr._streams["a"]["main"].generation > gen
    mgr.reset_request("a", free=True)
    assert mgr.num_free_pages == free + 3
    check_conservation(mgr)


def test_remove_frees_everything_and_is_idempotent() -> None:
    mgr = make_manager(pages=16, page_size=4)
    drv = Driver(mgr)
    drv.ingest("a", "b")
    fill(drv, "a", 10)
    drv.step([("a", "cfg", 3), ("b", "main", 1)])
    mgr.remove_request("a")
    mgr.remove_request("a")
    assert not mgr.has_request("a")
    assert mgr.num_free_pages == 15 - 1
    mgr.remove_request("b")
    assert mgr.num_free_pages == 15  # I12
    check_conservation(mgr)


# -- conservation under random simple ops --------------------------------------

RIDS = ("r0", "r1", "r2")
LABELS = ("main", "cfg")
ops = st.one_of(
    st.tuples(st.just("ingest"), st.sampled_from(RIDS)),
    st.tuples(st.just("step"), st.lists(st.tuples(st.sampled_from(RIDS), st.sampled_from(LABELS),
                                                  st.integers(0, 9)),
                                        min_size=1, max_size=3, unique_by=lambda t: t[:2]),
              st.booleans(), st.booleans()),
    st.tuples(st.just("reset"), st.sampled_from(RIDS), st.booleans()),
    st.tuples(st.just("remove"), st.sampled_from(RIDS)),
    st.tuples(st.just("offload"), st.sampled_from(RIDS)),
    st.tuples(st.just("reload"), st.sampled_from(RIDS)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, min_size=1, max_size=25))
def test_page_conservation_random_ops(seq: list[tuple]) -> None:  # type: ignore[type-arg]
    mgr = make_manager(pages=12, page_size=3, layers=1, heads=1, head_dim=2, cpu_pages=6)
    drv = Driver(mgr)
    for op in seq:
        kind = op[0]
        if kind == "ingest":
            drv.ingest(op[1])
        elif kind == "step":
            segs, commit, fork = op[1], op[2], op[3]
            segs = [s for s in segs if mgr.has_request(s[0])]
            if not segs:
                continue
            step = KVStep([Segment(*s) for s in segs], commit=commit,
                          pre_forks=[("main", "cfg")] if fork else ())
            ctx = StepContext(tuple(sorted({s[0] for s in segs})))
            before = snapshot(mgr)
            out = mgr.admit(step, ctx)
            if not out.ok:
                assert isinstance(out.reason, (AllocationFailed, RequestOffloading))
                assert_same(before, snapshot(mgr))
            else:
                outs = mgr.plan(step, ctx)
                drv.apply_pre_forks(step, ctx)
                rows = drv.write_planned(outs)
                mgr.commit(step, ctx)
                drv.apply_commit(step, ctx, rows)
        elif kind == "reset":
            if mgr.has_request(op[1]):
                mgr.reset_request(op[1], free=op[2])
                for k in list(drv.model):
                    if k[0] == op[1]:
                        drv.model[k] = []
        elif kind == "remove":
            mgr.remove_request(op[1])
            for k in list(drv.model):
                if k[0] == op[1]:
                    del drv.model[k]
        elif kind == "offload":
            mgr.offload(op[1])
        elif kind == "reload":
            mgr.reload(op[1])
        check_conservation(mgr)
        for rid, labels in mgr._streams.items():
            for label, s in labels.items():
                assert not s.step_in_flight
                if not s.offloaded:
                    assert len(s.page_indices) * 3 >= s.stored_len  # I3
                    drv.check(rid, label)
    for rid in RIDS:
        mgr.remove_request(rid)
    assert mgr.num_free_pages == 11
    assert mgr._cpu_pool is not None and mgr._cpu_pool.num_free == 6
