"""Pre- and post-forks, the CFG pattern (R9), preplan promotion (R11) and abandon."""

from __future__ import annotations

import pytest
from _manager_fixtures import (
    Driver,
    assert_same,
    check_conservation,
    fill,
    make_manager,
    snapshot,
)

from kvref.stepping.step import AllocationFailed, KVStep, Segment, StepContext


def test_pre_fork_copies_at_plan() -> None:
    mgr = make_manager(sharing=False, pages=32, page_size=4)
    drv = Driver(mgr)
    drv.ingest("a")
    fill(drv, "a", 6)
    step = KVStep([Segment("a", "main", 1)], pre_forks=[("main", "cfg")])
    ctx = StepContext(("a",))
    assert mgr.admit(step, ctx).ok
    cfg = mgr._streams["a"]["cfg"]
    assert cfg.stored_len == 0 and len(cfg.page_indices) == 2  # reserved, not copied
    assert mgr._streams["a"]["cfg"].step_in_flight  # R2: fork target marked
    outs = mgr.plan(step, ctx)
    drv.apply_pre_forks(step, ctx)
    assert mgr.stored_len("a", "cfg") == 6
    drv.check("a", "cfg")
    rows = drv.write_planned(outs)
    mgr.commit(step, ctx)
    drv.apply_commit(step, ctx, rows)
    assert (mgr.stored_len("a"), mgr.stored_len("a", "cfg")) == (7, 6)
    drv.check("a")
    drv.check("a", "cfg")
    # the copy is independent: growing main leaves cfg's bytes alone
    drv.step([("a", "main", 3)])
    drv.check("a", "cfg")


def test_post_fork_copies_at_commit_after_spans() -> None:
    mgr = make_manager(sharing=False, pages=32, page_size=4)
    drv = Driver(mgr)
    drv.ingest("a")
    fill(drv, "a", 3)
    step = KVStep([Segment("a", "main", 2)], post_forks=[("main", "draft")])
    ctx = StepContext(("a",))
    assert mgr.admit(step, ctx).ok
    # reserved for source + this step's span: 5 tokens, 2 pages
    assert len(mgr._streams["a"]["draft"].page_indices) == 2
    outs = mgr.plan(step, ctx)
    assert mgr.stored_len("a", "draft") == 0  # not at plan
    rows = drv.write_planned(outs)
    mgr.commit(step, ctx)
    drv.apply_commit(step, ctx, rows)
    assert mgr.stored_len("a", "draft") == 5
    drv.check("a", "draft")  # includes the two tokens this step wrote


def test_fork_target_over_reserved_copies_only_source_pages() -> None:
    mgr = make_manager(sharing=False, pages=32, page_size=4)
    drv = Driver(mgr)
    drv.ingest("a")
    fill(drv, "a", 5)
    fill(drv, "a", 14, label="cfg")  # cfg holds 4 pages, more than main needs
    cfg_pages = list(mgr._streams["a"]["cfg"].page_indices)
    tail = mgr.kv_cache.tensor[:, cfg_pages[2:]].clone()
    drv.step([("a", "main", 1)], pre_forks=[("main", "cfg")])
    assert mgr._streams["a"]["cfg"].page_indices == cfg_pages  # no new pages
    assert mgr.stored_len("a", "cfg") == 5
    drv.check("a", "cfg")
    # pages past the source's length were not written by the copy
    assert (mgr.kv_cache.tensor[:, cfg_pages[2:]] == tail).all()


def test_fork_target_left_by_refused_admit() -> None:
    mgr = make_manager(pages=8, page_size=2)  # 7 usable
    drv = Driver(mgr)
    drv.ingest("a", "b")
    fill(drv, "a", 3)  # 2 pages
    fill(drv, "a", 7, label="cfg")  # 4 pages; 1 free
    out = mgr.admit(KVStep([Segment("b", "main", 4)]), StepContext(("b",)))
    assert isinstance(out.reason, AllocationFailed) and out.reason.pages_short == 1
    drv.step([("a", "main", 1)], pre_forks=[("main", "cfg")])
    drv.check("a", "cfg")
    assert mgr.stored_len("a", "cfg") == 3
    check_conservation(mgr)


def test_post_fork_from_source_this_step_creates() -> None:
    mgr = make_manager(sharing=False, pages=32, page_size=4)
    drv = Driver(mgr)
    drv.ingest("a")
    fill(drv, "a", 2)
    # 'draft' does not exist yet: this step creates it with 6 tokens and forks it
    step = KVStep([Segment("a", "draft", 6)], post_forks=[("draft", "spec")])
    ctx = StepContext(("a",))
    free = mgr.num_free_pages
    assert mgr.admit(step, ctx).ok
    assert len(mgr._streams["a"]["spec"].page_indices) == 2  # target reserved
    assert mgr.num_free_pages == free - 4
    outs = mgr.plan(step, ctx)
    rows = drv.write_planned(outs)
    mgr.commit(step, ctx)
    drv.apply_commit(step, ctx, rows)
    assert mgr.stored_len("a", "spec") == 6
    drv.check("a", "spec")
    check_conservation(mgr)


@pytest.mark.parametrize("main_len", [4, 8, 7])
def test_cfg_pattern_fork_then_grow(main_len: int) -> None:
    """R9: pre-fork main->cfg and a segment of 1 on both in the same step."""
    mgr = make_manager(pages=32, page_size=4)
    drv = Driver(mgr)
    drv.ingest("a", "b")
    fill(drv, "a", main_len)
    fill(drv, "b", 4)
    outs = drv.step([("a", "main", 1), ("a", "cfg", 1), ("b", "main", 1), ("b", "cfg", 1)],
                    pre_forks=[("main", "cfg")], combined=[("main", "cfg")])
    views = outs["main"].views
    assert [v.length for v in views] == [main_len + 1, 5, main_len + 1, 5]
    for rid, n in (("a", main_len), ("b", 4)):
        assert mgr.stored_len(rid) == mgr.stored_len(rid, "cfg") == n + 1
        drv.check(rid)
        drv.check(rid, "cfg")
    # the two streams diverged at the last token
    assert drv.model[("a", "main")][-1] != drv.model[("a", "cfg")][-1]
    check_conservation(mgr)


# -- preplan -------------------------------------------------------------------


def _tables(outs):  # type: ignore[no-untyped-def]
    return {
        k: (o.cpu_indptrs.qo_indptr.tolist(), o.cpu_indptrs.paged_kv_indptr.tolist(),
            o.cpu_indptrs.paged_kv_indices.tolist(), o.cpu_indptrs.paged_kv_last_page_len.tolist(),
            [(v.request_id, v.label, v.length, v.to_compute) for v in o.views])
        for k, o in outs.items()
    }


def test_preplan_then_real_admit_and_plan_promotes_with_forks() -> None:
    mgr = make_manager(pages=32, page_size=4)
    drv = Driver(mgr)
    drv.ingest("a")
    fill(drv, "a", 8)
    step = KVStep([Segment("a", "main", 1), Segment("a", "cfg", 1)],
                  pre_forks=[("main", "cfg")], combined_labels=[("main", "cfg")])
    pre = StepContext(("a",), is_preplan=True)
    assert mgr.admit(step, pre).ok
    staged = mgr.plan(step, pre)
    # R11: nothing copied yet, but the table is built from the forked length
    assert mgr.stored_len("a", "cfg") == 0
    assert [v.length for v in staged["main"].views] == [9, 9]
    real = StepContext(("a",))
    free = mgr.num_free_pages
    out = mgr.admit(step, real)
    assert out.ok and out.ready
    assert mgr.num_free_pages == free
    outs = mgr.plan(step, real)
    assert _tables(outs) == _tables(staged)
    assert mgr.stored_len("a", "cfg") == 8  # fork applied at promotion
    drv.apply_pre_forks(step, real)
    drv.check("a", "cfg")
    rows = drv.write_planned(outs)
    mgr.commit(step, real)
    drv.apply_commit(step, real, rows)
    drv.check("a")
    drv.check("a", "cfg")
    # the next step is a fresh admit: it allocates again
    drv.step([("a", "main", 4)])
    check_conservation(mgr)


def test_clear_preplan_undoes_admit() -> None:
    mgr = make_manager(pages=32, page_size=4)
    drv = Driver(mgr)
    drv.ingest("a", "b")
    fill(drv, "a", 5)
    fill(drv, "b", 3)
    before = snapshot(mgr)
    gens = {k: v[2] for k, v in before.streams.items()}
    step = KVStep([Segment("a", "main", 6), Segment("b", "draft", 3)],
                  pre_forks=[("main", "cfg")])
    pre = StepContext(("a", "b"), is_preplan=True)
    assert mgr.admit(step, pre).ok
    assert mgr.plan(step, pre)
    assert "cfg" in mgr.labels("a") and "draft" in mgr.labels("b")
    mgr.clear_preplan()
    after = snapshot(mgr)
    assert mgr.labels("a") == ["main"] and mgr.labels("b") == ["main"]
    assert after.streams.keys() == before.streams.keys()
    for k, (pages, length, gen, in_flight, *_rest) in after.streams.items():
        assert length == before.streams[k][1]
        assert gen >= gens[k]  # I14: never backwards
        assert not in_flight
        assert pages[: len(before.streams[k][0])] == before.streams[k][0]
    for k in before.contents:
        assert (after.contents[k] == before.contents[k]).all()
    # invented labels' pages are back; a's main may keep its high-water pages
    a_extra = len(after.streams[("a", "main")][0]) - len(before.streams[("a", "main")][0])
    assert mgr.num_free_pages == before.free - a_extra
    check_conservation(mgr)
    drv.check("a")
    drv.check("b")
    # evictable again, and a fresh step runs
    drv.step([("a", "main", 1)])
    drv.check("a")


def test_clear_preplan_twice_and_without_preplan_is_noop() -> None:
    mgr = make_manager()
    drv = Driver(mgr)
    drv.ingest("a")
    fill(drv, "a", 2)
    before = snapshot(mgr)
    mgr.clear_preplan()
    mgr.clear_preplan()
    assert_same(before, snapshot(mgr))


# -- forks whose source only this step creates, with nothing in it yet ----------


def _run(mgr, step, ctx):  # type: ignore[no-untyped-def]
    assert mgr.admit(step, ctx).ok
    mgr.plan(step, ctx)
    mgr.commit(step, ctx)


def test_post_fork_from_created_source_with_commit_false() -> None:
    """The step creates 'draft' and keeps no tokens: the post-fork copies nothing.

    admit reserves no target (the source will be empty), and commit then
    looks the target up and raises KeyError after clearing the marks.
    """
    mgr = make_manager()
    mgr.ingest_request("a")
    step = KVStep([Segment("a", "draft", 3)], commit=False, post_forks=[("draft", "spec")])
    _run(mgr, step, StepContext(("a",)))
    assert mgr.stored_len("a", "draft") == 0
    assert "spec" not in mgr.labels("a") or mgr.stored_len("a", "spec") == 0
    check_conservation(mgr)


def test_pre_fork_from_source_this_step_creates() -> None:
    """A pre-fork from a label only this step's segment creates forks an empty stream.

    admit skips the target (source absent, no growth for a pre-fork), but at
    plan the source exists, so _apply_fork looks up the missing target:
    KeyError, and the step is left in flight.
    """
    mgr = make_manager()
    mgr.ingest_request("a")
    step = KVStep([Segment("a", "draft", 3)], pre_forks=[("draft", "spec")])
    _run(mgr, step, StepContext(("a",)))
    assert mgr.stored_len("a", "draft") == 3
    assert "spec" not in mgr.labels("a") or mgr.stored_len("a", "spec") == 0
    assert not any(s.step_in_flight for s in mgr._streams["a"].values())
    check_conservation(mgr)
