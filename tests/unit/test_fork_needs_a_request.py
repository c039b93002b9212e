"""A step with forks and no padded request is malformed (R25), at every step call (R40).

A fork applies to each request in ``ctx.padded_request_ids``; with none it
would do nothing, silently. `validate.step` raises `InvalidStepError` before
any lifecycle check, so the answer is the same whatever is admitted or
staged, and nothing changes.
"""

from __future__ import annotations

import pytest
from _manager_fixtures import Driver, assert_same, fill, make_manager, snapshot

from kvref.core.errors import InvalidStepError
from kvref.stepping.step import KVStep, Segment, StepContext

PRE = KVStep([Segment("r", "cfg", 1)], pre_forks=[("main", "cfg")])
POST = KVStep([Segment("r", "main", 1)], post_forks=[("main", "cfg")])


@pytest.fixture
def drv() -> Driver:
    d = Driver(make_manager(pages=16, page_size=4))
    d.ingest("r")
    fill(d, "r", 5)
    return d


@pytest.mark.parametrize("step", [PRE, POST], ids=["pre", "post"])
@pytest.mark.parametrize("preplan", [False, True])
def test_admit_with_no_padded_request_raises(drv: Driver, step: KVStep, preplan: bool) -> None:
    before = snapshot(drv.mgr)
    with pytest.raises(InvalidStepError, match="padded_request_ids"):
        drv.mgr.admit(step, StepContext([], is_preplan=preplan))
    assert_same(before, snapshot(drv.mgr))


def test_it_is_malformed_whatever_runs(drv: Driver) -> None:
    """Before any lifecycle check: not StepInFlightError with a step running,
    not PreplanPendingError with a preplan staged."""
    running = KVStep([Segment("r", "main", 1)])
    assert drv.mgr.admit(running, StepContext(["r"])).ok
    before = snapshot(drv.mgr)
    with pytest.raises(InvalidStepError):
        drv.mgr.admit(POST, StepContext([]))
    assert_same(before, snapshot(drv.mgr))
    drv.mgr.commit(running, StepContext(["r"]))
    assert drv.mgr.admit(running, StepContext(["r"], is_preplan=True)).ok
    before = snapshot(drv.mgr)
    with pytest.raises(InvalidStepError):
        drv.mgr.admit(PRE, StepContext([]))
    assert_same(before, snapshot(drv.mgr))


@pytest.mark.parametrize("step", [PRE, POST], ids=["pre", "post"])
def test_plan_and_commit_with_no_padded_request_raise(drv: Driver, step: KVStep) -> None:
    """The admitted step, planned or committed under a context that lost its
    padded requests: refused, and the step runs on under the right one."""
    ctx = StepContext(["r"])
    assert drv.mgr.admit(step, ctx).ok
    before = snapshot(drv.mgr)
    with pytest.raises(InvalidStepError):
        drv.mgr.plan(step, StepContext([]))
    assert_same(before, snapshot(drv.mgr))
    drv.mgr.plan(step, ctx)
    before = snapshot(drv.mgr)
    with pytest.raises(InvalidStepError):
        drv.mgr.commit(step, StepContext([]))
    assert_same(before, snapshot(drv.mgr))
    drv.mgr.commit(step, ctx)
    assert drv.mgr.stored_len("r", "cfg") == 6  # main (5) forked, plus the span
