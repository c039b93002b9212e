"""A padded request the manager does not know raises on every path (R40).

``ctx.padded_request_ids`` names the batch's requests; forks apply to each.
An id among them that was never ingested (or was removed) is the engine's
bookkeeping gone wrong with or without forks: `UnknownRequestError` naming
it, from admit (the plain decode path, a combined step, a forked step, a
preplan, a re-admit), `pages_needed`, plan (of the running step, of a
preplan, at promotion) and commit, and nothing changes. Plan and commit
first identify the step (a step that was not admitted is
`StepNotAdmittedError` whatever its context names), as admit's R23 checks
come first; the model (`kvref_model.core.Model._misused`) ranks them so too.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from _manager_fixtures import Driver, assert_same, fill, make_manager, snapshot

from kvref.core.errors import StepNotAdmittedError, UnknownRequestError
from kvref.manager import KVManager
from kvref.stepping.step import KVStep, Segment, StepContext

DECODE = KVStep([Segment("a", "main", 1)])
COMBINED = KVStep([Segment("a", "main", 1), Segment("a", "cfg", 1)],
                  combined_labels=[("main", "cfg")])
FORKED = KVStep([Segment("a", "main", 1)], post_forks=[("main", "cfg")])


@pytest.fixture
def drv() -> Driver:
    d = Driver(make_manager(pages=16, page_size=4))
    d.ingest("a", "b")
    fill(d, "a", 5)
    fill(d, "b", 3)
    return d


def _refused(mgr: KVManager, call: Callable[[], object], rid: str = "zz") -> None:
    before = snapshot(mgr)
    with pytest.raises(UnknownRequestError, match=f"'{rid}'") as err:
        call()
    assert err.value.request_id == rid
    assert_same(before, snapshot(mgr))


@pytest.mark.parametrize("step", [DECODE, COMBINED, FORKED], ids=["plain", "combined", "forked"])
@pytest.mark.parametrize("preplan", [False, True], ids=["admit", "preplan"])
def test_admit_raises_on_every_path(drv: Driver, step: KVStep, preplan: bool) -> None:
    """The plain decode step was accepted silently; the fork path raised."""
    ctx = StepContext(["a", "zz"], is_preplan=preplan)
    _refused(drv.mgr, lambda: drv.mgr.admit(step, ctx))
    # the same step padded to known requests runs
    assert drv.mgr.admit(step, StepContext(["a", "b"], is_preplan=preplan)).ok


def test_preplan_over_the_running_step_raises(drv: Driver) -> None:
    assert drv.mgr.admit(DECODE, StepContext(["a"])).ok
    _refused(drv.mgr, lambda: drv.mgr.admit(DECODE, StepContext(["a", "zz"], is_preplan=True)))


@pytest.mark.parametrize("step", [DECODE, COMBINED, FORKED], ids=["plain", "combined", "forked"])
def test_pages_needed_raises(drv: Driver, step: KVStep) -> None:
    _refused(drv.mgr, lambda: drv.mgr.pages_needed(step, StepContext(["zz"])))
    assert drv.mgr.pages_needed(step, StepContext(["a"])) >= 0


def test_a_removed_padded_request_raises_at_readmit_plan_and_commit(drv: Driver) -> None:
    """A padded request with no segment and no fork holds no mark, so another
    thread may remove it between admit and commit: the context now names an
    unknown request, and each call under it raises before changing anything."""
    ctx = StepContext(["a", "b"])
    assert drv.mgr.admit(DECODE, ctx).ok
    drv.mgr.remove_request("b")
    _refused(drv.mgr, lambda: drv.mgr.admit(DECODE, ctx), "b")  # re-admit: no longer a no-op
    _refused(drv.mgr, lambda: drv.mgr.plan(DECODE, ctx), "b")
    assert drv.mgr._running is not None and not drv.mgr._running.planned
    outputs = drv.mgr.plan(DECODE, StepContext(["a"]))  # the engine drops it from the batch
    rows = drv.write_planned(outputs)
    _refused(drv.mgr, lambda: drv.mgr.commit(DECODE, ctx), "b")
    drv.mgr.commit(DECODE, StepContext(["a"]))
    drv.apply_commit(DECODE, StepContext(["a"]), rows)
    assert drv.mgr.stored_len("a") == 6
    drv.check("a")


def test_plan_of_a_preplan_and_its_promotion_raise(drv: Driver) -> None:
    ctx = StepContext(["a", "b"], is_preplan=True)
    assert drv.mgr.admit(DECODE, ctx).ok
    drv.mgr.remove_request("b")
    _refused(drv.mgr, lambda: drv.mgr.plan(DECODE, ctx), "b")  # the preplan's own plan
    real = StepContext(["a", "b"])
    _refused(drv.mgr, lambda: drv.mgr.admit(DECODE, real), "b")  # its real admit
    _refused(drv.mgr, lambda: drv.mgr.plan(DECODE, real), "b")  # promotion: nothing promoted
    assert drv.mgr._preplan is not None and drv.mgr._running is None


def test_the_step_is_identified_first(drv: Driver) -> None:
    """Nothing admitted: plan and commit answer StepNotAdmittedError, whatever
    the context names (the lockstep driver's stray plan relies on it)."""
    for call in (drv.mgr.plan, drv.mgr.commit):
        with pytest.raises(StepNotAdmittedError):
            call(DECODE, StepContext(["zz"]))
