"""Overlap scheduling: step N+1 preplanned while step N runs (R41-R43).

The staged plan is built from the lengths N leaves once committed; its
promotion checks N committed as admitted and otherwise refuses (stale), with
nothing changed; clear_preplan over N's streams keeps N's marks.
"""

from __future__ import annotations

import pytest
from _manager_fixtures import (
    Driver,
    assert_same,
    check_conservation,
    failing_page_copy,
    fill,
    make_manager,
    snapshot,
)

from kvref import KVManager, KVPlanOutputs, PreplanStale, PreplanStaleError
from kvref.core.errors import ForkCopyError, InvalidStepError
from kvref.stepping.step import KVStep, Segment, StepContext


def decode(rids: list[str], label: str = "main", span: int = 1) -> KVStep:
    return KVStep([Segment(r, label, span) for r in rids])


def views(outputs: KVPlanOutputs) -> dict[tuple[str, str], tuple[int, int, list[int]]]:
    return {(v.request_id, v.label): (v.length, v.to_compute, list(v.page_idxs))
            for out in outputs.values() for v in out.views}


def test_decode_overlapped_matches_sequential_across_page_boundaries() -> None:
    """Eight decode steps of a batch, each N+1 preplanned (and planned) while N
    is in flight: the plans, once promoted, address exactly what a sequential
    run's plans address, and every token reads back."""
    rids = ["a", "b"]
    mgr, seq = make_manager(page_size=4), make_manager(page_size=4)
    drv, sdrv = Driver(mgr), Driver(seq)
    for d in (drv, sdrv):
        d.ingest(*rids)
        fill(d, "a", 3)
        fill(d, "b", 6)
    ctx, pre = StepContext(tuple(rids)), StepContext(tuple(rids), is_preplan=True)
    step = decode(rids)
    assert mgr.admit(step, ctx).ok
    outputs = mgr.plan(step, ctx)
    sdrv.step([(r, "main", 1) for r in rids])  # the sequential twin runs step 0
    for _ in range(8):
        nxt = decode(rids)
        assert mgr.admit(nxt, pre).ok  # over streams step N still has in flight
        staged = mgr.plan(nxt, pre)
        rows = drv.write_planned(outputs)
        mgr.commit(step, ctx)
        drv.apply_commit(step, ctx, rows)
        assert mgr.admit(nxt, ctx).ok  # the real admit: promotable
        # the twin plans N+1 only after N committed (its bytes are not
        # compared: the views' lengths and spans are)
        assert seq.admit(nxt, ctx).ok
        expected = views(seq.plan(nxt, ctx))
        seq.commit(nxt, ctx)
        outputs = mgr.plan(nxt, ctx)
        assert outputs is staged  # promotion hands back the staged plan
        got = views(outputs)
        assert {k: v[:2] for k, v in got.items()} == {k: v[:2] for k, v in expected.items()}
        for (rid, label), (length, _, pages) in got.items():
            stream = mgr._streams[rid][label]
            assert length == stream.stored_len + 1
            assert pages == stream.page_indices[: -(-length // 4)]
        step = nxt
        check_conservation(mgr)
    rows = drv.write_planned(outputs)
    mgr.commit(step, ctx)
    drv.apply_commit(step, ctx, rows)
    assert (mgr.stored_len("a"), mgr.stored_len("b")) == (12, 15)
    drv.check("a")
    drv.check("b")


def test_preplan_reserves_from_the_length_the_running_step_leaves() -> None:
    """The running step brings main to 4 tokens (a page boundary at page size
    4): the preplan's +1 needs a second page, which a reservation from the
    pre-commit length (3) would not take."""
    mgr = make_manager(page_size=4)
    drv = Driver(mgr)
    drv.ingest("a")
    fill(drv, "a", 3)
    ctx = StepContext(("a",))
    step = decode(["a"])
    assert mgr.admit(step, ctx).ok
    assert len(mgr._streams["a"]["main"].page_indices) == 1
    nxt = decode(["a"])
    assert mgr.admit(nxt, StepContext(("a",), is_preplan=True)).ok
    assert len(mgr._streams["a"]["main"].page_indices) == 2
    (length, span, pages), = views(mgr.plan(nxt, StepContext(("a",), is_preplan=True))).values()
    assert (length, span) == (5, 1) and len(pages) == 2
    assert mgr._preplan is not None and mgr._preplan.basis == {("a", "main"): 4}


def test_preplan_over_a_running_pre_fork_plans_from_the_forked_length() -> None:
    """Step N forks main onto cfg and decodes cfg; N+1 decodes cfg again,
    planned before N was even planned: from main's length + N's span."""
    mgr = make_manager(sharing=False, page_size=4)
    drv = Driver(mgr)
    drv.ingest("a")
    fill(drv, "a", 6)
    ctx = StepContext(("a",))
    step = KVStep([Segment("a", "cfg", 1)], pre_forks=[("main", "cfg")])
    assert mgr.admit(step, ctx).ok
    pre = StepContext(("a",), is_preplan=True)
    nxt = decode(["a"], "cfg")
    assert mgr.admit(nxt, pre).ok
    assert views(mgr.plan(nxt, pre))[("a", "cfg")][:2] == (8, 1)
    outputs = mgr.plan(step, ctx)
    drv.apply_pre_forks(step, ctx)
    rows = drv.write_planned(outputs)
    mgr.commit(step, ctx)
    drv.apply_commit(step, ctx, rows)
    assert mgr.admit(nxt, ctx).ok
    rows = drv.write_planned(mgr.plan(nxt, ctx))
    mgr.commit(nxt, ctx)
    drv.apply_commit(nxt, ctx, rows)
    assert mgr.stored_len("a", "cfg") == 8
    drv.check("a", "cfg")


def test_a_running_step_that_keeps_no_tokens_leaves_the_length_alone() -> None:
    mgr = make_manager(page_size=4)
    drv = Driver(mgr)
    drv.ingest("a")
    fill(drv, "a", 3)
    ctx = StepContext(("a",))
    step = KVStep([Segment("a", "main", 2)], commit=False)
    assert mgr.admit(step, ctx).ok
    nxt = decode(["a"])
    assert mgr.admit(nxt, StepContext(("a",), is_preplan=True)).ok
    mgr.plan(step, ctx)
    mgr.commit(step, ctx)
    assert mgr.admit(nxt, ctx).ok
    assert views(mgr.plan(nxt, ctx))[("a", "main")][:2] == (4, 1)


def _stale_preplan() -> tuple[KVManager, KVStep, StepContext]:
    """Step N decodes main and post-forks it onto cfg; N+1 (preplanned over
    both) decodes cfg; N's fork copy fails, leaving cfg empty, not at 4."""
    mgr = make_manager(sharing=False, page_size=4)
    drv = Driver(mgr)
    drv.ingest("a")
    fill(drv, "a", 3)
    ctx = StepContext(("a",))
    step = KVStep([Segment("a", "main", 1)], post_forks=[("main", "cfg")])
    assert mgr.admit(step, ctx).ok
    nxt = KVStep([Segment("a", "main", 1), Segment("a", "cfg", 1)])
    pre = StepContext(("a",), is_preplan=True)
    assert mgr.admit(nxt, pre).ok
    mgr.plan(nxt, pre)
    mgr.plan(step, ctx)
    with failing_page_copy(mgr), pytest.raises(ForkCopyError):
        mgr.commit(step, ctx)
    assert mgr.stored_len("a", "cfg") == 0 and mgr.stored_len("a") == 4
    return mgr, nxt, ctx


def test_promotion_refuses_a_preplan_the_running_step_did_not_leave() -> None:
    mgr, nxt, ctx = _stale_preplan()
    before = snapshot(mgr)
    out = mgr.admit(nxt, ctx)
    assert not out.ok and isinstance(out.reason, PreplanStale)
    assert (out.reason.request_id, out.reason.label) == ("a", "cfg")
    assert "4" in out.reason.message and "0" in out.reason.message
    with pytest.raises(PreplanStaleError) as err:
        mgr.plan(nxt, ctx)
    assert "'a'" in str(err.value) and "'cfg'" in str(err.value)
    assert_same(before, snapshot(mgr))  # refused: nothing promoted, nothing moved
    assert mgr._streams["a"]["cfg"].step_in_flight  # still the staged preplan's


def test_the_engine_replans_a_stale_preplan_and_loses_nothing() -> None:
    mgr, nxt, ctx = _stale_preplan()
    free = mgr.num_free_pages
    mgr.clear_preplan()
    assert not any(s.step_in_flight for s in mgr._streams["a"].values())
    assert mgr.num_free_pages == free  # the preplan's pages stay with their streams
    check_conservation(mgr)
    assert mgr.admit(nxt, ctx).ok
    assert views(mgr.plan(nxt, ctx)).keys() == {("a", "main"), ("a", "cfg")}
    mgr.commit(nxt, ctx)
    assert (mgr.stored_len("a"), mgr.stored_len("a", "cfg")) == (5, 1)
    mgr.remove_request("a")
    assert mgr.num_free_pages == mgr.config.max_num_pages - 1  # all but the sink


def _running_decode() -> tuple[KVManager, KVStep, StepContext]:
    """Step N, a decode of ``a`` (3 tokens), admitted and running."""
    mgr = make_manager(page_size=4, cpu_pages=8)
    drv = Driver(mgr)
    drv.ingest("a")
    fill(drv, "a", 3)
    ctx = StepContext(("a",))
    step = decode(["a"])
    assert mgr.admit(step, ctx).ok
    return mgr, step, ctx


def test_clear_preplan_over_the_running_step_keeps_its_marks() -> None:
    mgr, step, ctx = _running_decode()
    # the preplan also creates cfg: clear_preplan removes it, keeps main's mark
    nxt = KVStep([Segment("a", "main", 1), Segment("a", "cfg", 2)])
    assert mgr.admit(nxt, StepContext(("a",), is_preplan=True)).ok
    mgr.clear_preplan()
    assert mgr.labels("a") == ["main"]
    assert mgr._streams["a"]["main"].step_in_flight
    assert mgr.begin_offload("a") is None  # R4 still holds for step N
    mgr.plan(step, ctx)
    mgr.commit(step, ctx)
    assert not mgr._streams["a"]["main"].step_in_flight
    check_conservation(mgr)


def test_the_running_steps_commit_keeps_the_preplans_marks() -> None:
    mgr, step, ctx = _running_decode()
    nxt = decode(["a"])
    assert mgr.admit(nxt, StepContext(("a",), is_preplan=True)).ok
    mgr.plan(step, ctx)
    mgr.commit(step, ctx)
    assert mgr._streams["a"]["main"].step_in_flight
    assert mgr.begin_offload("a") is None
    with pytest.raises(Exception, match="in flight"):
        mgr.reset_request("a")


def test_max_seq_len_bounds_the_length_the_preplan_starts_from() -> None:
    """7 tokens, step N adds 1 (8 = max_seq_len): N+1's +1 would end at 9."""
    mgr = make_manager(page_size=4, max_seq_len=8)
    drv = Driver(mgr)
    drv.ingest("a")
    fill(drv, "a", 7)
    ctx = StepContext(("a",))
    step = decode(["a"])
    assert mgr.admit(step, ctx).ok
    before = snapshot(mgr)
    with pytest.raises(InvalidStepError, match="max_seq_len"):
        mgr.admit(decode(["a"]), StepContext(("a",), is_preplan=True))
    assert_same(before, snapshot(mgr))
