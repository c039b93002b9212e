"""Lifecycle edge cases, one test each: a padded request without a fork's
source, a failed reload, a write after commit, bad published info, an admit
over a retrieve, pre-forks at a commit without a plan, a failing post-fork,
a second step, and the generation a preplan's views carry.

Each was a defect on main at 81ea7d0 (issue 8, 1-8) and is pinned in the
exact scenario it was found in; the rule each one led to is named.
The suites that now catch the class (lockstep rules, planted bugs) are in
tests/conformance; these pin the exact scenarios the defects were found in.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from kvref import (
    ForkCopyError,
    KVReqConfig,
    KVStep,
    PublishedInfoError,
    ReloadCopyError,
    RetrieveInProgress,
    Segment,
    StepContext,
    StepInFlightError,
    StepNotAdmittedError,
)
from kvref.manager import KVManager
from kvref.stepping.step import AdmitRuntimeError
from kvref.testing.manual_runtime import ManualRuntime
from tests.unit._manager_fixtures import (
    Driver,
    assert_same,
    failing_page_copy,
    fill,
    make_cfg,
    make_manager,
    snapshot,
)


def _manager(**kw: Any) -> tuple[KVManager, Driver]:
    mgr = make_manager(**kw)
    return mgr, Driver(mgr)


def _kv(mgr: KVManager, n: int, value: float = 1.0) -> torch.Tensor:
    cfg = mgr.config
    return torch.full((n, cfg.num_kv_heads, cfg.head_dim), value)


# 1. A fork wiped a padded request's target when it lacked the source (R20)

@pytest.mark.parametrize("kind", ["pre", "post"])
def test_padded_request_without_the_source_keeps_its_target(kind: str) -> None:
    mgr, drv = _manager()
    drv.ingest("a", "b")
    fill(drv, "a", 3, label="draft")
    fill(drv, "b", 5, label="cfg")  # b has no draft
    forks = {"pre_forks" if kind == "pre" else "post_forks": [("draft", "cfg")]}
    drv.step([("a", "draft", 1)], padded=["a", "b"], **forks)
    assert mgr.stored_len("b", "cfg") == 5
    drv.check("b", "cfg")


# 2. A failed reload leaked its pages and could leave a request half reloaded (R26)

def test_failed_reload_moves_nothing_and_leaks_nothing() -> None:
    mgr, drv = _manager(pages=8, page_size=2, cpu_pages=8)
    drv.ingest("a")
    fill(drv, "a", 4)
    fill(drv, "a", 3, label="cfg")
    assert mgr.offload("a") > 0
    pool = mgr._cpu_pool
    assert pool is not None
    real = pool._copy_in
    calls = {"n": 0}

    def second_fails(*args: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the second label's copy
            raise OSError("host-to-device copy failed (injected)")
        real(*args)

    pool._copy_in = second_fails  # type: ignore[method-assign]
    free = mgr.num_free_pages
    with pytest.raises(ReloadCopyError):
        mgr.reload("a")
    del pool._copy_in
    assert mgr.num_free_pages == free  # the pages taken went back
    assert all(s.offloaded and not s.page_indices for s in mgr._streams["a"].values())
    assert mgr.reload("a")  # the host copies were kept: it can try again
    drv.check("a")
    drv.check("a", "cfg")
    mgr.remove_request("a")
    assert mgr.num_free_pages == mgr.config.max_num_pages - 1  # all but the sink


# 3. Late write addressing: after commit, write_kv used the last plan (R27)

def test_write_after_commit_raises_and_moves_no_byte() -> None:
    mgr, drv = _manager()
    drv.ingest("a", "b")
    step, ctx = KVStep([Segment("a", "main", 2)]), StepContext(["a"])
    assert mgr.admit(step, ctx).ok
    mgr.plan(step, ctx)
    mgr.write_kv(_kv(mgr, 2), _kv(mgr, 2), layer_idx=0)
    mgr.commit(step, ctx)
    mgr.remove_request("a")
    fill(drv, "b", 2)  # b may now own a's old pages
    before = mgr.kv_cache.tensor.clone()
    with pytest.raises(StepNotAdmittedError):
        mgr.write_kv(_kv(mgr, 2, 9.0), _kv(mgr, 2, 9.0), layer_idx=0)
    with pytest.raises(StepNotAdmittedError):
        mgr.read_kv(layer_idx=0)
    assert torch.equal(mgr.kv_cache.tensor, before)
    drv.check("b")


# 4. admit_retrieve took pages (and started a copy) before refusing bad info

BOTH = KVReqConfig(labels={("node", "walk"): ("main", "cfg")})


def _publisher(heads: int = 2) -> KVManager:
    other = make_manager(heads=heads)
    od = Driver(other)
    od.ingest("a")
    fill(od, "a", 6)
    fill(od, "a", 3, label="cfg")
    return other


@pytest.mark.parametrize("bad", ["another head count", "second label's pages"])
def test_bad_published_info_is_refused_before_anything_moves(bad: str) -> None:
    mgr, _ = _manager()
    mgr.ingest_request("a", BOTH)
    pub = _publisher(heads=4 if bad == "another head count" else 2).publish("a")
    assert pub is not None
    if bad == "second label's pages":
        cfg = pub.get(0)["cfg"]
        pub.get(0)["cfg"] = replace(cfg, page_indices=[10_000] * len(cfg.page_indices))
    before = snapshot(mgr)
    with pytest.raises(PublishedInfoError):
        mgr.admit_retrieve("a", "node", "walk", pub)
    assert_same(snapshot(mgr), before)
    assert mgr.labels("a") == ["main"]
    assert all(s.read_future is None for s in mgr._streams["a"].values())


# 5. admit and plan ignored a retrieve still copying, or failed (R22)

def test_admit_waits_for_the_retrieve_and_refuses_a_failed_one() -> None:
    rt = ManualRuntime()
    mgr = KVManager(make_cfg(), "kv", None, None, "cpu", torch.float32, runtime=rt)
    other = make_manager()
    od = Driver(other)
    od.ingest("a")
    fill(od, "a", 5)
    mgr.ingest_request("a")
    pub = other.publish("a")
    out = mgr.admit_retrieve("a", "node", "main", pub)
    assert out.ok and not out.ready
    step, ctx = KVStep([Segment("a", "main", 1)]), StepContext(["a"])
    refused = mgr.admit(step, ctx)
    assert not refused.ok and isinstance(refused.reason, RetrieveInProgress)
    stream = mgr._streams["a"]["main"]
    assert stream.read_future is not None
    rt.complete(stream.read_future, ok=False)
    failed = mgr.admit(step, ctx)
    assert not failed.ok and isinstance(failed.reason, AdmitRuntimeError)
    assert not stream.step_in_flight


# 6. commit did not know whether the step was planned (R24, R26)

def test_commit_of_an_unplanned_step_runs_its_pre_forks() -> None:
    mgr, drv = _manager()
    drv.ingest("a")
    fill(drv, "a", 5)
    step = KVStep([Segment("a", "cfg", 1)], pre_forks=[("main", "cfg")])
    ctx = StepContext(["a"])
    assert mgr.admit(step, ctx).ok
    mgr.commit(step, ctx)
    assert mgr.stored_len("a", "cfg") == 6


def test_a_post_fork_that_fails_in_commit_leaves_the_step_committed() -> None:
    mgr, drv = _manager()
    drv.ingest("a")
    fill(drv, "a", 5)
    fill(drv, "a", 2, label="cfg")
    step = KVStep([Segment("a", "main", 1)], post_forks=[("main", "cfg")])
    ctx = StepContext(["a"])
    assert mgr.admit(step, ctx).ok
    mgr.plan(step, ctx)
    with failing_page_copy(mgr), pytest.raises(ForkCopyError):
        mgr.commit(step, ctx)
    assert mgr.stored_len("a") == 6  # the span landed
    assert mgr.stored_len("a", "cfg") == 0  # the target emptied, never torn
    assert not any(s.step_in_flight for s in mgr._streams["a"].values())
    assert mgr.admit(KVStep([Segment("a", "main", 1)]), ctx).ok  # nothing left running


# 7. A second, different step on streams in flight was accepted (R23)

def test_a_second_step_is_refused_and_the_same_one_is_a_no_op() -> None:
    mgr, drv = _manager()
    drv.ingest("a")
    step, ctx = KVStep([Segment("a", "main", 1)]), StepContext(["a"])
    assert mgr.admit(step, ctx).ok
    free = mgr.num_free_pages
    assert mgr.admit(step, ctx).ok and mgr.num_free_pages == free
    with pytest.raises(StepInFlightError):
        mgr.admit(KVStep([Segment("a", "main", 2)]), ctx)


# 8. A promoted preplan reported the pre-fork generation (R28)

def test_preplan_views_carry_the_generation_the_step_runs_against() -> None:
    gens = []
    for preplan in (False, True):
        mgr, drv = _manager(sharing=False)  # preplanned pre-forks copy (S23)
        drv.ingest("a")
        fill(drv, "a", 5)
        step = KVStep([Segment("a", "cfg", 1)], pre_forks=[("main", "cfg")])
        if preplan:
            pctx = StepContext(["a"], is_preplan=True)
            assert mgr.admit(step, pctx).ok
            mgr.plan(step, pctx)
        ctx = StepContext(["a"])
        assert mgr.admit(step, ctx).ok
        out = mgr.plan(step, ctx)
        view = out["cfg"].views[0]
        assert view.generation == mgr._streams["a"]["cfg"].generation
        gens.append(view.generation)
    assert gens[0] == gens[1]
