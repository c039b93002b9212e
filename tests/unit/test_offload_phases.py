"""Offload's phases (claim, copy, commit) and reload: the priority while a claim
is refused (R45), the checkpoints in order, a copy that waits for a retrieve,
`begin_offload` overrides, removals racing the copy, generations (I14) and
reload's all-or-nothing failure (R26).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _manager_fixtures import (
    Driver,
    assert_same,
    fill,
    make_cfg,
    make_manager,
    offloadable,
    snapshot,
)

from kvref.core.config import KVReqConfig
from kvref.core.errors import (
    ReloadCopyError,
)
from kvref.manager import KVManager
from kvref.offload.handle import Offload
from kvref.offload.outcomes import OffloadReason
from kvref.stepping.step import (
    KVStep,
    Segment,
    StepContext,
)
from kvref.testing.manual_runtime import ManualRuntime
from kvref.transfer.engine import TransferEngineInfo
from kvref.transfer.published import PublishedKVInfo


def test_no_offload_priority_while_an_offload_of_the_request_is_open() -> None:
    # R6/R45: a second claim is refused while one is open, so its priority is 0,
    # even once a step gave the request a new label's pages behind the claim
    d = offloadable()
    handle = d.mgr.begin_offload("a")
    assert handle is not None
    d.step([("a", "new", 2)])
    assert len(d.mgr._streams["a"]["new"].page_indices) == 1
    assert d.mgr.get_offload_priority("a") == 0.0
    assert d.mgr.offload_outcome("a").reason is OffloadReason.OFFLOAD_RUNNING
    handle.abandon()
    assert d.mgr.get_offload_priority("a") == 3.0


def test_no_offload_priority_while_the_publication_is_leased() -> None:
    # R33/R45: a leased request's claim is refused, so its priority is 0
    d = offloadable()
    assert d.mgr.get_offload_priority("a") == 2.0
    assert isinstance(d.mgr.publish("a"), PublishedKVInfo)
    assert d.mgr.get_offload_priority("a") == 0.0
    d.mgr.release_published("a")
    assert d.mgr.get_offload_priority("a") == 2.0


def test_an_offload_names_its_checkpoints_in_order() -> None:
    rt = ManualRuntime()
    d = offloadable(runtime=rt)
    rt.checkpoints.clear()
    assert d.mgr.offload("a") == 2
    assert rt.checkpoints == ["offload.claimed", "offload.copied"]


def test_an_offload_waits_for_a_retrieve_still_writing_its_pages() -> None:
    src = make_manager(pages=8, page_size=4)
    s = Driver(src)
    s.ingest("r")
    fill(s, "r", 5)
    rt = ManualRuntime()
    dst = KVManager(make_cfg(pages=8, page_size=4, cpu_pages=8), "kv", None,
                    TransferEngineInfo(), "cpu", dtype=torch.float32, runtime=rt)
    dst.ingest_request("r", KVReqConfig(default_labels=("main",)))
    pub = src.publish("r")
    assert isinstance(pub, PublishedKVInfo)
    out = dst.admit_retrieve("r", "n", "w", pub)
    assert out.ok and not out.ready
    outcome = dst.offload_outcome("r")
    assert outcome.moved == ("main",) and outcome.pages_freed == 2
    assert rt.deferred == 1  # the copy waited for the retrieve, which then ran
    assert dst.reload("r")
    assert torch.equal(dst.read_stream("r"), src.read_stream("r"))


class _RefusingBegin:
    """A `begin_offload` override that refuses without reaching the claim."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, rid: str) -> None:
        self.calls += 1
        return None


def test_an_override_refusing_a_claimable_request_is_tried_then_reported_changed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    d = offloadable()
    before = snapshot(d.mgr)
    begin = _RefusingBegin()
    monkeypatch.setattr(d.mgr, "begin_offload", begin)
    outcome = d.mgr.offload_outcome("a")
    assert outcome.reason is OffloadReason.REQUEST_CHANGED
    assert outcome.pages_freed == 0 and outcome.moved == ()
    assert begin.calls == 3  # claimable each time it was asked
    assert_same(before, snapshot(d.mgr))


def test_an_override_refusal_is_explained_by_the_claims_own_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    d = offloadable()
    begin = _RefusingBegin()
    monkeypatch.setattr(d.mgr, "begin_offload", begin)
    assert isinstance(d.mgr.publish("a"), PublishedKVInfo)
    assert d.mgr.offload_outcome("a").reason is OffloadReason.PUBLISH_LEASED
    assert begin.calls == 1
    d.mgr.release_published("a")
    monkeypatch.undo()
    handle = d.mgr.begin_offload("a")  # an offload of a is open
    assert handle is not None
    monkeypatch.setattr(d.mgr, "begin_offload", begin)
    assert d.mgr.offload_outcome("a").reason is OffloadReason.OFFLOAD_RUNNING
    assert begin.calls == 2
    handle.abandon()


def test_a_refused_claims_reason_is_the_claims_not_a_later_look(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # the claim refuses (a step in flight); by the time `offload` asks why,
    # the step has committed and the request is claimable: the answer is
    # still the claim's, and nothing is moved
    d = offloadable()
    mgr = d.mgr
    step = KVStep([Segment("a", "main", 1)])
    ctx = StepContext(("a",))
    assert mgr.admit(step, ctx).ok
    mgr.plan(step, ctx)
    real = mgr.begin_offload
    committed: list[bool] = []

    def begin_then_commit(rid: str) -> Offload | None:
        handle = real(rid)
        if not committed:
            mgr.commit(step, ctx)
            committed.append(True)
        return handle

    monkeypatch.setattr(mgr, "begin_offload", begin_then_commit)
    outcome = mgr.offload_outcome("a")
    assert outcome.reason is OffloadReason.STEP_IN_FLIGHT
    assert outcome.moved == () and not mgr.is_offloaded("a")


def test_a_copy_after_the_request_was_removed_reports_it_removed() -> None:
    d = offloadable()
    handle = d.mgr.begin_offload("a")
    assert handle is not None
    claimed = handle.claims["main"].generation
    d.mgr.remove_request("a")
    del d.model[("a", "main")]
    # the same id again, its stream at the claimed generation (set by hand:
    # a generation is only compared for equality): still a different request
    d.ingest("a")
    fill(d, "a", 2)
    d.mgr._streams["a"]["main"].generation = claimed
    pool = d.mgr._cpu_pool
    assert pool is not None
    free = pool.num_free
    assert handle.copy("main") is False
    assert handle.refusals == {"main": OffloadReason.REQUEST_REMOVED}
    assert pool.num_free == free


def test_a_removal_racing_the_host_copy_gives_its_host_pages_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    d = offloadable()
    pool = d.mgr._cpu_pool
    assert pool is not None
    free = pool.num_free
    real = pool._copy_out

    def copy_then_remove(*args: Any) -> None:
        real(*args)
        d.mgr.remove_request("a")  # under the copy: the lock is not held

    monkeypatch.setattr(pool, "_copy_out", copy_then_remove)
    outcome = d.mgr.offload_outcome("a")
    assert outcome.reason is OffloadReason.REQUEST_REMOVED
    assert pool.num_free == free
    assert not pool.is_offloaded("a")


def test_offload_and_reload_each_move_the_generation_forward() -> None:
    # I14: the pages changed each time; a generation never goes back
    d = offloadable()
    gen = d.mgr._streams["a"]["main"].generation
    assert gen >= 2  # a reset to 1 would be a step back
    assert d.mgr.offload("a") == 2
    offloaded = d.mgr._streams["a"]["main"].generation
    assert offloaded > gen
    assert d.mgr.reload("a")
    assert d.mgr._streams["a"]["main"].generation > offloaded
    d.check("a")


def test_a_reload_that_needs_every_free_page_runs() -> None:
    d = offloadable(pages=8, cpu_pages=8)  # 7 usable device pages
    assert d.mgr.offload("a") == 2
    d.ingest("b")
    fill(d, "b", 20)  # 5 pages: exactly 2 left
    assert d.mgr.num_free_pages == 2
    assert d.mgr.reload_pages_needed("a") == 2
    outcome = d.mgr.reload_outcome("a")
    assert outcome.reloaded and outcome.pages_taken == 2 and outcome.pages_short == 0
    assert d.mgr.num_free_pages == 0
    d.check("a")


def test_a_failed_reload_names_the_label_whose_copy_failed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    d = offloadable()
    fill(d, "a", 3, "cfg")
    fill(d, "a", 5, "draft")
    assert d.mgr.offload("a") == 5
    pool = d.mgr._cpu_pool
    assert pool is not None
    labels = list(pool.labels("a"))
    assert len(labels) == 3
    real = pool.copy_in
    fault = RuntimeError("injected")

    def third_fails(rid: str, label: str, *args: Any) -> None:
        if label == labels[2]:
            raise fault
        real(rid, label, *args)

    monkeypatch.setattr(pool, "copy_in", third_fails)
    free = d.mgr.num_free_pages
    with pytest.raises(ReloadCopyError) as info:
        d.mgr.reload("a")
    assert str(info.value) == (
        f"request 'a' label {labels[2]!r}: host-to-device copy failed "
        "(RuntimeError: injected); nothing was reloaded")
    assert (info.value.request_id, info.value.label) == ("a", labels[2])
    assert info.value.__cause__ is fault
    assert d.mgr.num_free_pages == free  # all or nothing (R26)
