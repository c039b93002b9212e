"""Behavioural checks that kill mutants of the split modules the unit suite let survive.

The modules are `kvref.stepping.admission`, `kvref.stepping.admit_plan_commit`,
`kvref.stepping.forks`, `kvref.offload.phases`, `kvref.transfer.retrieval`,
`kvref.transfer.lease` and `kvref.stepping.truncation` (issue 17, part 6).
Each test asserts one observable property; specs/mutation.md maps every
surviving mutant to the test here that kills it, or to the argument that it
is equivalent.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _manager_fixtures import (
    Driver,
    assert_same,
    check_conservation,
    fill,
    make_cfg,
    make_manager,
    snapshot,
)

from kvref import validate
from kvref.core.config import KVReqConfig
from kvref.core.errors import (
    ForkCopyError,
    InvalidArgumentError,
    InvalidStepError,
    KVRefError,
    PreplanPendingError,
    PublishedInfoError,
    PublishLeasedError,
    ReloadCopyError,
    StepInFlightError,
    StepNotAdmittedError,
    StepOrderError,
    StreamUnavailableError,
    UnknownRequestError,
)
from kvref.core.streams import CacheStream, OffloadState
from kvref.manager import KVManager
from kvref.offload.handle import Offload
from kvref.offload.outcomes import OffloadReason
from kvref.stepping.forks import Forks
from kvref.stepping.plan import group_by_plan_label
from kvref.stepping.step import (
    AdmitOutcome,
    AdmitRuntimeError,
    AllocationFailed,
    ForkPending,
    KVStep,
    PreplanStale,
    PublishLeased,
    RequestOffloading,
    RetrieveInProgress,
    Segment,
    StepContext,
)
from kvref.testing.manual_runtime import ManualRuntime
from kvref.transfer.engine import StaleSourceError, TransferEngineInfo
from kvref.transfer.lease import LeaseTable
from kvref.transfer.published import PublishedKVInfo, PublishRefused, RetrieveStale, UnknownRequest


class _Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- kvref.transfer.lease -------------------------------------------------------------


def test_leased_lists_exactly_the_requests_whose_lease_is_live() -> None:
    clock = _Clock()
    leases = LeaseTable(10.0, clock)
    leases.take("a")
    clock.now += 5.0
    leases.take("b")
    assert sorted(leases.leased()) == ["a", "b"]
    clock.now += 5.0  # a's deadline: expired, b still has 5 s
    assert leases.leased() == ["b"]
    leases.release("b")
    assert leases.leased() == []


def test_a_leased_refusal_names_the_call_and_the_remedy() -> None:
    leases = LeaseTable(None, _Clock())
    leases.take("r")
    with pytest.raises(PublishLeasedError) as info:
        leases.refuse("r", "truncate")
    assert str(info.value) == (
        "request 'r': truncate while its publication is leased to a peer; "
        "release_published it first (or let the lease expire)")
    assert info.value.request_id == "r"
    leases.refuse("s", "truncate")  # no lease: no refusal


# --- kvref.stepping.truncation --------------------------------------------------------
# KVRefError's contract (kvref/core/errors.py): a refusal changes nothing and its
# message names the request and label, so the log line alone says which call
# was wrong. Each refusal of truncate is pinned whole: text, request and label.


def _truncate_refused(mgr: KVManager, err: type[KVRefError], label: str, new_len: int,
                      message: str) -> None:
    before = snapshot(mgr)
    with pytest.raises(err) as info:
        mgr.truncate("r", label, new_len)
    assert str(info.value) == f"request 'r' label {label!r}: {message}"
    assert (info.value.request_id, info.value.label) == ("r", label)
    assert_same(before, snapshot(mgr))


@pytest.fixture
def drv() -> Driver:
    d = Driver(make_manager(pages=16, page_size=4, cpu_pages=8))
    d.ingest("r")
    return d


def test_truncate_in_flight_names_the_stream_and_the_remedy(drv: Driver) -> None:
    fill(drv, "r", 6)
    fill(drv, "r", 3, "cfg")
    step = KVStep([Segment("r", "cfg", 2)])
    ctx = StepContext(["r"])
    assert drv.mgr.admit(step, ctx).ok
    _truncate_refused(drv.mgr, StepInFlightError, "cfg", 1,
                      "truncate while a step names the stream; commit it first")


def test_truncate_of_an_offloaded_stream_names_it_and_the_remedy(drv: Driver) -> None:
    fill(drv, "r", 6)
    fill(drv, "r", 3, "cfg")
    assert drv.mgr.offload("r") > 0
    _truncate_refused(drv.mgr, StreamUnavailableError, "cfg", 1,
                      "truncate of a stream an offload claims or holds; reload it first")


def test_truncate_past_the_end_names_the_stream_and_both_lengths(drv: Driver) -> None:
    fill(drv, "r", 6)
    fill(drv, "r", 3, "cfg")
    _truncate_refused(drv.mgr, InvalidArgumentError, "cfg", 4,
                      "truncate to 4 tokens; the stream holds 3")


def test_truncate_of_a_leased_stream_is_refused_until_released() -> None:
    # R33: a peer may still be copying the pages a truncate would free
    rt = ManualRuntime()
    cfg = dataclasses.replace(make_cfg(pages=16, page_size=4), publish_lease_s=None)
    mgr = KVManager(cfg, "kv", None, TransferEngineInfo(), "cpu", dtype=torch.float32,
                    runtime=rt)
    d = Driver(mgr)
    d.ingest("r")
    fill(d, "r", 6)
    fill(d, "r", 3, "cfg")
    assert isinstance(mgr.publish("r"), PublishedKVInfo)
    before = snapshot(mgr)
    with pytest.raises(PublishLeasedError) as info:
        mgr.truncate("r", "cfg", 1)
    assert str(info.value) == (
        "request 'r': truncate while its publication is leased to a peer; "
        "release_published it first (or let the lease expire)")
    assert info.value.request_id == "r"
    assert_same(before, snapshot(mgr))
    mgr.release_published("r")
    assert mgr.truncate("r", "cfg", 1) == 0
    assert mgr.stored_len("r", "cfg") == 1


@pytest.fixture
def retrieving() -> Iterator[tuple[KVManager, ManualRuntime]]:
    """A manager with a retrieve of ``r/cfg`` (5 tokens) still copying."""
    src = make_manager(pages=8, page_size=4)
    d = Driver(src)
    d.ingest("r")
    fill(d, "r", 5, "cfg")
    rt = ManualRuntime()
    dst = KVManager(make_cfg(pages=8, page_size=4), "kv", None, TransferEngineInfo(), "cpu",
                    dtype=torch.float32, runtime=rt)
    dst.ingest_request("r", KVReqConfig(default_labels=("cfg",)))
    pub = src.publish("r")
    assert isinstance(pub, PublishedKVInfo)
    out = dst.admit_retrieve("r", "n", "w", pub)
    assert out.ok and not out.ready
    yield dst, rt
    dst.cleanup()
    src.cleanup()


def test_truncate_during_and_after_a_failed_retrieve_names_the_stream(
        retrieving: tuple[KVManager, ManualRuntime]) -> None:
    dst, rt = retrieving
    _truncate_refused(dst, StreamUnavailableError, "cfg", 2,
                      "truncate while a retrieve is copying into the stream")
    fut = dst._streams["r"]["cfg"].read_future
    assert fut is not None
    rt.complete(fut, ok=False)
    # a readiness check reads the failure off the future and latches it (I11)
    assert not dst.admit_retrieve("r", "n", "w", None).ok
    _truncate_refused(dst, StreamUnavailableError, "cfg", 2,
                      "truncate of a stream whose retrieve failed; reset or remove the request")


# --- kvref.stepping.forks -------------------------------------------------------------


def _forked_request() -> Driver:
    """Request ``a``: ``main`` 6 tokens (2 pages), ``cfg`` 3 tokens over three
    steps; forks copy (the copying fork's defences are what these kill)."""
    d = Driver(make_manager(sharing=False, pages=32, page_size=4))
    d.ingest("a")
    fill(d, "a", 6)
    fill(d, "a", 3, "cfg", chunk=1)
    return d


def test_a_failed_fork_copy_names_its_cause_and_chains_it() -> None:
    d = _forked_request()
    mgr = d.mgr
    step = KVStep([Segment("a", "main", 1)], post_forks=[("main", "cfg")])
    ctx = StepContext(("a",))
    assert mgr.admit(step, ctx).ok
    mgr.plan(step, ctx)
    fault = RuntimeError("injected copy fault")

    def broken(src: list[int], dst: list[int]) -> None:
        raise fault

    mgr.kv_cache.copy_pages = broken  # type: ignore[method-assign]
    with pytest.raises(ForkCopyError) as info:
        mgr.commit(step, ctx)
    assert str(info.value) == (
        "request 'a' label 'cfg': fork copy failed (RuntimeError: injected copy fault); "
        "the target was left empty (1 target(s) in this call)")
    assert info.value.__cause__ is fault


def test_a_fork_moves_its_targets_generation_forward() -> None:
    # I14: a change of length or pages bumps the generation; it never goes back
    d = _forked_request()
    mgr = d.mgr
    gen = mgr._streams["a"]["cfg"].generation
    assert gen >= 2  # three commits: a reset to 1 would be a step back
    d.step([("a", "main", 1)], post_forks=[("main", "cfg")])
    assert mgr.stored_len("a", "cfg") == 7
    assert mgr._streams["a"]["cfg"].generation > gen


def test_a_fork_onto_a_target_without_its_pages_is_refused_by_name() -> None:
    # the defence behind admit (which reserves every fork target's pages):
    # driven directly, a target short of pages is refused, and nothing is copied
    d = _forked_request()
    mgr = d.mgr
    forks = Forks(mgr._table, mgr.kv_cache)
    before = snapshot(mgr)
    assert len(mgr._streams["a"]["cfg"].page_indices) == 1
    with pytest.raises(KVRefError) as info:
        forks.apply("a", "main", "cfg", set())
    assert str(info.value) == (
        "request 'a' label 'cfg': fork target holds 1 pages, source 'main' needs 2: "
        "the step was not admitted with this fork")
    assert (info.value.request_id, info.value.label) == ("a", "cfg")
    assert_same(before, snapshot(mgr))


# --- kvref.offload.phases ----------------------------------------------------


def _offloadable(pages: int = 32, cpu_pages: int = 16,
                 runtime: ManualRuntime | None = None) -> Driver:
    """Request ``a``: ``main`` 6 tokens over three steps (generation >= 2)."""
    mgr = KVManager(make_cfg(pages=pages, page_size=4, cpu_pages=cpu_pages), "kv", None,
                    TransferEngineInfo(), "cpu", dtype=torch.float32, runtime=runtime)
    d = Driver(mgr)
    d.ingest("a")
    fill(d, "a", 6, chunk=2)
    return d


def test_no_offload_priority_while_an_offload_of_the_request_is_open() -> None:
    # R6/R45: a second claim is refused while one is open, so its priority is 0,
    # even once a step gave the request a new label's pages behind the claim
    d = _offloadable()
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
    d = _offloadable()
    assert d.mgr.get_offload_priority("a") == 2.0
    assert isinstance(d.mgr.publish("a"), PublishedKVInfo)
    assert d.mgr.get_offload_priority("a") == 0.0
    d.mgr.release_published("a")
    assert d.mgr.get_offload_priority("a") == 2.0


def test_an_offload_names_its_checkpoints_in_order() -> None:
    rt = ManualRuntime()
    d = _offloadable(runtime=rt)
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
    d = _offloadable()
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
    d = _offloadable()
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
    d = _offloadable()
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
    d = _offloadable()
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
    d = _offloadable()
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
    d = _offloadable()
    gen = d.mgr._streams["a"]["main"].generation
    assert gen >= 2  # a reset to 1 would be a step back
    assert d.mgr.offload("a") == 2
    offloaded = d.mgr._streams["a"]["main"].generation
    assert offloaded > gen
    assert d.mgr.reload("a")
    assert d.mgr._streams["a"]["main"].generation > offloaded
    d.check("a")


def test_a_reload_that_needs_every_free_page_runs() -> None:
    d = _offloadable(pages=8, cpu_pages=8)  # 7 usable device pages
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
    d = _offloadable()
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


# --- kvref.transfer.retrieval ---------------------------------------------------------
# An admit outcome and its reason are frozen dataclasses: each refusal is
# pinned whole (ok, ready, the reason's type, message, request and label).


def _publisher(pages: int = 16, page_size: int = 4, cpu_pages: int = 0) -> Driver:
    """``r``: ``main`` 10 tokens (3 pages), ``cfg`` 3 tokens (1 page)."""
    d = Driver(make_manager(pages=pages, page_size=page_size, cpu_pages=cpu_pages))
    d.ingest("r")
    fill(d, "r", 10)
    fill(d, "r", 3, "cfg")
    return d


def _consumer(rt: ManualRuntime, pages: int = 16, cpu_pages: int = 0,
              labels: tuple[str, ...] = ("main", "cfg")) -> KVManager:
    dst = KVManager(make_cfg(pages=pages, page_size=4, cpu_pages=cpu_pages), "kv", None,
                    TransferEngineInfo(), "cpu", dtype=torch.float32, runtime=rt)
    dst.ingest_request("r", KVReqConfig(default_labels=labels))
    return dst


def _pub(d: Driver) -> PublishedKVInfo:
    pub = d.mgr.publish("r")
    assert isinstance(pub, PublishedKVInfo)
    return pub


def test_publish_refusals_name_the_request_label_and_remedy() -> None:
    src = _publisher(cpu_pages=8)
    rt = ManualRuntime()
    dst = _consumer(rt, labels=("main",))
    # R48: unknown
    assert dst.publish("nobody") == PublishRefused(UnknownRequest(
        message="unknown request (never ingested, or removed): nothing to publish",
        request_id="nobody"))
    # R36: still receiving a retrieve
    assert dst.admit_retrieve("r", "n", "w", _pub(src)) == AdmitOutcome(ok=True, ready=False)
    assert dst.publish("r") == PublishRefused(RetrieveInProgress(
        message="still receiving a retrieve", request_id="r", label="main"))
    # R36: a failed retrieve, latched
    fut = dst._streams["r"]["main"].read_future
    assert fut is not None
    rt.complete(fut, ok=False)
    assert dst.publish("r") == PublishRefused(AdmitRuntimeError(
        "its retrieve failed (latched)", request_id="r", label="main"))
    # R36: offloaded
    src.mgr.release_published("r")
    assert src.mgr.offload("r") == 4
    assert src.mgr.publish("r") == PublishRefused(RequestOffloading(
        message="offloaded: reload it, then publish", request_id="r", label="main"))


def test_a_retrieve_across_world_sizes_is_refused_whole() -> None:
    src = _publisher()
    dst = _consumer(ManualRuntime())
    pub = _pub(src)
    pub.world_size = 2
    assert dst.admit_retrieve("r", "n", "w", pub) == AdmitOutcome(
        ok=False, ready=False, reason=AdmitRuntimeError(
            "KV transfer across tensor-parallel world sizes is not supported "
            "(published 2, local 1)", request_id="r"))


def test_a_running_retrieve_reads_admitted_not_ready_then_ready() -> None:
    src = _publisher()
    rt = ManualRuntime()
    dst = _consumer(rt)
    pub = _pub(src)
    assert dst.admit_retrieve("r", "n", "w", pub) == AdmitOutcome(ok=True, ready=False)
    # asked again while it copies: the offered label is not ready yet
    assert dst.admit_retrieve("r", "n", "w", pub) == AdmitOutcome(ok=True, ready=False)
    rt.complete_all()
    assert dst.admit_retrieve("r", "n", "w", pub) == AdmitOutcome(ok=True, ready=True)
    assert torch.equal(dst.read_stream("r"), src.expected("r"))
    assert torch.equal(dst.read_stream("r", "cfg"), src.expected("r", "cfg"))


def test_a_failed_retrieve_answers_the_same_terminal_outcome_every_time() -> None:
    src = _publisher()
    rt = ManualRuntime()
    dst = _consumer(rt, labels=("main",))
    pub = _pub(src)
    assert dst.admit_retrieve("r", "n", "w", pub).ok
    fut = dst._streams["r"]["main"].read_future
    assert fut is not None
    rt.complete(fut, ok=False)
    want = AdmitOutcome(ok=False, ready=False, reason=AdmitRuntimeError(
        "KV retrieve failed: InjectedRetrieveFailure: retrieve failed (injected)",
        request_id="r", label="main"))
    # a readiness check (R29), then with the publication offered again (I11)
    assert dst.admit_retrieve("r", "n", "w", None) == want
    assert dst.admit_retrieve("r", "n", "w", pub) == want
    assert dst.admit_retrieve("r", None, None, None) == want


def test_a_retrieve_into_a_stream_with_a_step_in_flight_is_misuse() -> None:
    src = _publisher()
    dst = _consumer(ManualRuntime(), labels=("main",))
    step = KVStep([Segment("r", "main", 2)])
    ctx = StepContext(("r",))
    assert dst.admit(step, ctx).ok
    with pytest.raises(StepInFlightError) as info:
        dst.admit_retrieve("r", "n", "w", _pub(src))
    assert str(info.value) == ("request 'r' label 'main': retrieve into a stream with a "
                               "step in flight; commit it first")
    assert (info.value.request_id, info.value.label) == ("r", "main")


def test_a_retrieve_into_an_offloaded_stream_is_refused_as_offloading() -> None:
    src = _publisher()
    d = Driver(_consumer(ManualRuntime(), cpu_pages=8, labels=("main",)))
    d.model[("r", "main")] = []
    fill(d, "r", 2)
    assert d.mgr.offload("r") == 1
    assert d.mgr.admit_retrieve("r", "n", "w", _pub(src)) == AdmitOutcome(
        ok=False, reason=RequestOffloading(
            message="request 'r' label 'main' is offloaded or being offloaded; "
                    "retry once it is reloaded", request_id="r", label="main"))


def _short_consumer(rt: ManualRuntime, free: int) -> Driver:
    """A consumer whose ``r/cfg`` holds 5 tokens in 2 pages (one spare),
    ``r/main`` nothing, and ``free`` free pages."""
    d = Driver(_consumer(rt, pages=12))
    fill(d, "r", 5, "cfg")
    d.step([("r", "cfg", 3)], commit=False)  # a spare (high-water) page
    assert len(d.mgr._streams["r"]["cfg"].page_indices) == 2
    d.ingest("x")
    fill(d, "x", 4 * (d.mgr.num_free_pages - free))
    assert d.mgr.num_free_pages == free
    return d


def test_a_retrieve_counts_new_pages_over_what_each_stream_holds() -> None:
    # main: 10 tokens published, nothing held: 3 new pages; cfg: 7 tokens
    # published, 2 pages held: none new. 3 in all, the last label's 0
    src = Driver(make_manager(pages=16, page_size=4))
    src.ingest("r")
    fill(src, "r", 10)
    fill(src, "r", 7, "cfg")
    rt = ManualRuntime()
    short = _short_consumer(rt, free=2)
    assert short.mgr.admit_retrieve("r", "n", "w", _pub(src)) == AdmitOutcome(
        ok=False, reason=AllocationFailed(
            pages_short=1, request_id="r", label="main",
            message="retrieve needs 3 new pages, 2 free"))
    fits = _short_consumer(rt, free=3)
    src.mgr.release_published("r")
    assert fits.mgr.admit_retrieve("r", "n", "w", _pub(src)) == AdmitOutcome(
        ok=True, ready=False)
    assert fits.mgr.num_free_pages == 0
    rt.complete_all()
    assert torch.equal(fits.mgr.read_stream("r"), src.expected("r"))
    # cfg: its own 5 tokens, then the 2 it was missing
    assert torch.equal(fits.mgr.read_stream("r", "cfg")[:, 5:],
                       src.expected("r", "cfg")[:, 5:])


def test_a_landed_retrieve_offered_again_changes_nothing() -> None:
    src = _publisher()
    rt = ManualRuntime()
    dst = _consumer(rt)
    pub = _pub(src)
    assert dst.admit_retrieve("r", "n", "w", pub).ok
    rt.complete_all()
    # a readiness check reads the landed copies off their futures (I11)
    assert dst.admit_retrieve("r", "n", "w", None) == AdmitOutcome(ok=True, ready=True)
    before = snapshot(dst)
    assert dst.admit_retrieve("r", "n", "w", pub) == AdmitOutcome(ok=True, ready=True)
    assert_same(before, snapshot(dst))  # the generation too: nothing was started


def test_a_label_already_held_at_the_published_length_does_not_stop_the_others() -> None:
    src = _publisher()
    rt = ManualRuntime()
    d = Driver(_consumer(rt))
    d.model[("r", "main")] = []
    fill(d, "r", 10)  # main: as long as published, so nothing to copy
    assert d.mgr.admit_retrieve("r", "n", "w", _pub(src)) == AdmitOutcome(
        ok=True, ready=False)
    rt.complete_all()
    assert torch.equal(d.mgr.read_stream("r", "cfg"), src.expected("r", "cfg"))
    d.check("r")  # main kept its own tokens


def test_a_longer_publication_waits_for_the_retrieve_still_copying() -> None:
    src = _publisher()
    rt = ManualRuntime()
    dst = _consumer(rt, labels=("main",))
    assert dst.admit_retrieve("r", "n", "w", _pub(src)).ok
    fut = dst._streams["r"]["main"].read_future
    fill(src, "r", 5)  # the publisher grew: a later publication is longer
    before = snapshot(dst)
    assert dst.admit_retrieve("r", "n", "w", _pub(src)) == AdmitOutcome(
        ok=True, ready=False)
    assert_same(before, snapshot(dst))
    assert dst._streams["r"]["main"].read_future is fut
    rt.complete_all()
    # and a failed one answers its failure, not a second copy
    dst.reset_request("r")
    assert dst.admit_retrieve("r", "n", "w", _pub(src)).ok
    fut = dst._streams["r"]["main"].read_future
    assert fut is not None
    rt.complete(fut, ok=False)
    fill(src, "r", 1)
    free = dst.num_free_pages
    out = dst.admit_retrieve("r", "n", "w", _pub(src))
    assert not out.ok and isinstance(out.reason, AdmitRuntimeError)
    assert dst.num_free_pages == free and rt.pending == []


def test_a_retrieve_routes_by_an_empty_node_and_walk_name() -> None:
    # "" is a node (and a walk) like any other: its route is looked up as given
    src = _publisher()
    rt = ManualRuntime()
    dst = KVManager(make_cfg(pages=16, page_size=4), "kv", None, TransferEngineInfo(), "cpu",
                    dtype=torch.float32, runtime=rt)
    dst.ingest_request("r", KVReqConfig(labels={("", ""): ("cfg",)}))
    assert dst.admit_retrieve("r", "", "", _pub(src)) == AdmitOutcome(ok=True, ready=False)
    rt.complete_all()
    assert dst.labels("r") == ["main", "cfg"]
    assert dst.stored_len("r") == 0 and dst.stored_len("r", "cfg") == 3


def test_a_stale_publication_is_latched_without_touching_what_the_stream_holds() -> None:
    src = _publisher()
    rt = ManualRuntime()
    d = Driver(_consumer(rt))
    d.model[("r", "main")] = []
    fill(d, "r", 2)
    pub = _pub(src)
    fill(src, "r", 1)  # main moves on after publish
    fill(src, "r", 1, "cfg")  # and cfg
    pages = list(d.mgr._streams["r"]["main"].page_indices)
    free = d.mgr.num_free_pages
    assert d.mgr.admit_retrieve("r", "n", "w", pub) == AdmitOutcome(
        ok=False, ready=False, reason=RetrieveStale(
            "published pages of ['main', 'cfg'] changed since publish; reset the request "
            "and retrieve a fresh publication", request_id="r", label="main"))
    main = d.mgr._streams["r"]["main"]
    assert main.page_indices == pages and main.stored_len == 2
    assert d.mgr.num_free_pages == free
    for label in ("main", "cfg"):
        err = d.mgr._streams["r"][label].read_error
        assert isinstance(err, StaleSourceError)
        assert str(err) == "the publisher's stream changed generation since it published"


def test_a_retrieve_that_cannot_start_gives_back_what_it_took(
        monkeypatch: pytest.MonkeyPatch) -> None:
    src = _publisher()
    rt = ManualRuntime()
    d = Driver(_consumer(rt, labels=("main",)))
    d.model[("r", "main")] = []
    fill(d, "r", 2)  # 1 page held; the retrieve takes 2 more
    before = snapshot(d.mgr)
    fault = RuntimeError("boom")

    def refuse(**kwargs: Any) -> None:
        raise fault

    monkeypatch.setattr(d.mgr._transfer, "start_async_retrieve", refuse)
    assert d.mgr.admit_retrieve("r", "n", "w", _pub(src)) == AdmitOutcome(
        ok=False, ready=False, reason=AdmitRuntimeError(
            "KV retrieve could not start: RuntimeError: boom", request_id="r",
            label="main"))
    assert_same(before, snapshot(d.mgr))
    check_conservation(d.mgr)


def test_a_retrieve_into_a_new_label_that_cannot_start_leaves_no_stream(
        monkeypatch: pytest.MonkeyPatch) -> None:
    src = _publisher()
    d = Driver(_consumer(ManualRuntime(), labels=("main",)))
    d.model[("r", "main")] = []
    fill(d, "r", 10)  # main holds as much as published: only cfg, a new label, copies
    before = snapshot(d.mgr)

    def refuse(**kwargs: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(d.mgr._transfer, "start_async_retrieve", refuse)
    out = d.mgr.admit_retrieve("r", None, None, _pub(src))  # every published label
    assert not out.ok and out.reason is not None and out.reason.label == "cfg"
    assert d.mgr.labels("r") == ["main"]
    assert_same(before, snapshot(d.mgr))


def test_a_retrieve_moves_the_streams_generation_forward() -> None:
    src = _publisher()
    rt = ManualRuntime()
    d = Driver(_consumer(rt, labels=("main",)))
    d.model[("r", "main")] = []
    fill(d, "r", 2, chunk=1)
    gen = d.mgr._streams["r"]["main"].generation
    assert gen >= 2
    assert d.mgr.admit_retrieve("r", "n", "w", _pub(src)).ok
    assert d.mgr._streams["r"]["main"].generation > gen


def test_a_publication_with_another_page_size_is_misuse_by_name() -> None:
    src = _publisher(page_size=8)
    dst = _consumer(ManualRuntime())
    before = snapshot(dst)
    with pytest.raises(PublishedInfoError) as info:
        dst.admit_retrieve("r", "n", "w", _pub(src))
    assert str(info.value) == "request 'r' label 'main': published page size 8, local 4"
    assert (info.value.request_id, info.value.label) == ("r", "main")
    assert_same(before, snapshot(dst))


@pytest.mark.parametrize(("pages", "shown"), [
    ([1, 2, 16], "[16]"),
    ([16, 17, 18, 19, 20], "[16, 17, 18, 19]"),
])
def test_published_pages_past_the_publishers_cache_are_named(
        pages: list[int], shown: str) -> None:
    src = _publisher()
    dst = _consumer(ManualRuntime())
    pub = _pub(src)
    pub.info[0]["main"] = dataclasses.replace(pub.info[0]["main"], page_indices=pages)
    with pytest.raises(PublishedInfoError) as info:
        dst.admit_retrieve("r", "n", "w", pub)
    assert str(info.value) == (
        f"request 'r' label 'main': published page indices {shown} are outside [1, 16)")
    assert (info.value.request_id, info.value.label) == ("r", "main")


def test_a_publication_without_a_transfer_descriptor_is_misuse_by_name() -> None:
    src = _publisher()
    dst = _consumer(ManualRuntime())
    pub = _pub(src)
    pub.info[0]["main"] = dataclasses.replace(pub.info[0]["main"],
                                              latest_kv_transfer_info=object())
    before = snapshot(dst)
    with pytest.raises(PublishedInfoError) as info:
        dst.admit_retrieve("r", "n", "w", pub)
    assert str(info.value) == ("request 'r' label 'main': kv_transfer_info must be a "
                               "KVTransferInfo, got object")
    assert_same(before, snapshot(dst))


def test_a_publication_the_transfer_engine_refuses_is_named_with_its_cause() -> None:
    src = _publisher()
    dst = KVManager(make_cfg(pages=16, page_size=4, heads=4), "kv", None,
                    TransferEngineInfo(), "cpu", dtype=torch.float32, runtime=ManualRuntime())
    dst.ingest_request("r", KVReqConfig(default_labels=("main",)))
    with pytest.raises(PublishedInfoError) as info:
        dst.admit_retrieve("r", "n", "w", _pub(src))
    cause = info.value.__cause__
    assert isinstance(cause, KVRefError)
    assert str(info.value) == f"request 'r' label 'main': {cause}"
    assert (info.value.request_id, info.value.label) == ("r", "main")


def test_a_self_retrieve_is_skipped_and_logged_by_name(
        caplog: pytest.LogCaptureFixture) -> None:
    src = _publisher()
    pub = _pub(src)
    src.mgr.release_published("r")
    src.mgr.reset_request("r")  # shorter than published: a real retrieve would copy
    with caplog.at_level(logging.WARNING, logger="kvref.transfer.retrieval"):
        # no graph: every published label (R37), each skipped and logged
        assert src.mgr.admit_retrieve("r", None, None, pub) == AdmitOutcome(
            ok=True, ready=True)
    assert [r.getMessage() for r in caplog.records if r.name == "kvref.transfer.retrieval"] == [
        "KV kv: skipping self-retrieve for 'r' label 'main' (published 10, held 0)",
        "KV kv: skipping self-retrieve for 'r' label 'cfg' (published 3, held 0)",
    ]


def test_publish_waits_for_a_step_that_still_forks_onto_the_request() -> None:
    # R50: a running step with a post-fork onto r would overwrite what a peer copies
    src = _publisher()
    mgr = src.mgr
    step = KVStep([Segment("r", "main", 1)], post_forks=[("main", "cfg")])
    ctx = StepContext(("r",))
    assert mgr.admit(step, ctx).ok
    assert mgr.publish("r") == PublishRefused(ForkPending(
        message="a running or staged step still forks onto this request: "
                "publish once it committed", request_id="r"))
    mgr.plan(step, ctx)
    mgr.commit(step, ctx)
    assert isinstance(mgr.publish("r"), PublishedKVInfo)


def test_a_new_label_holds_no_pages_when_a_retrieve_counts_them() -> None:
    src = _publisher()
    d = Driver(_consumer(ManualRuntime(), pages=12, labels=("main",)))
    d.model[("r", "main")] = []
    fill(d, "r", 10)  # main holds as much as published: only cfg (a new label) copies
    d.ingest("x")
    fill(d, "x", 4 * d.mgr.num_free_pages)
    assert d.mgr.num_free_pages == 0
    before = snapshot(d.mgr)
    assert d.mgr.admit_retrieve("r", None, None, _pub(src)) == AdmitOutcome(
        ok=False, reason=AllocationFailed(
            pages_short=1, request_id="r", label="cfg",
            message="retrieve needs 1 new pages, 0 free"))
    assert_same(before, snapshot(d.mgr))


# --- kvref.stepping.admission ---------------------------------------------------------
# `validate.step_streams` is pure (a step and the stream table to an error or
# nothing); the manager's own validation runs first at every entry and
# catches most of the same misuse, so it is checked here directly.


def _table() -> dict[str, dict[str, CacheStream]]:
    stream = CacheStream()
    stream.stored_len = 3
    return {"r": {"main": stream}}


@pytest.mark.parametrize(("step", "padded", "err", "where", "message"), [
    (KVStep([Segment("q", "main", 1)]), (), UnknownRequestError, ("q", "main"),
     "unknown request (never ingested, or removed)"),
    (KVStep([Segment("r", "cfg", -2)]), (), InvalidStepError, ("r", "cfg"),
     "negative span -2"),
    (KVStep([Segment("r", "main", 1), Segment("r", "main", 2)]), (), InvalidStepError,
     ("r", "main"), "stream appears twice in one step"),
    (KVStep([Segment("r", "main", 1)], post_forks=[("main", "cfg")]), (), InvalidStepError,
     None, "a step with forks names no padded_request_ids to apply them to"),
    (KVStep([Segment("r", "main", 1)], pre_forks=[("cfg", "cfg")]), ("r",), InvalidStepError,
     None, "fork of label 'cfg' onto itself"),
])
def test_admission_names_each_misuse_of_a_step(
        step: KVStep, padded: tuple[str, ...], err: type[KVRefError],
        where: tuple[str, str] | None, message: str) -> None:
    with pytest.raises(err) as info:
        validate.step_streams(_table(), step, padded)
    if where is None:
        assert str(info.value) == message
        assert (info.value.request_id, info.value.label) == (None, None)
    else:
        assert str(info.value) == f"request {where[0]!r} label {where[1]!r}: {message}"
        assert (info.value.request_id, info.value.label) == where


def test_admission_refuses_a_bad_combined_group_with_its_reason() -> None:
    step = KVStep([Segment("r", "main", 1)], combined_labels=(("main", "cfg"), ("cfg", "x")))
    with pytest.raises(ValueError) as plan_err:
        group_by_plan_label((), step.combined_labels)
    with pytest.raises(InvalidStepError) as info:
        validate.step_streams(_table(), step, ())
    assert str(info.value) == str(plan_err.value) != ""
    assert info.value.__cause__ is None


def _retrieving_consumer(rt: ManualRuntime, cpu_pages: int = 0) -> tuple[Driver, KVManager]:
    src = _publisher()
    dst = _consumer(rt, cpu_pages=cpu_pages, labels=("main",))
    assert dst.admit_retrieve("r", "n", "w", _pub(src)) == AdmitOutcome(ok=True, ready=False)
    return src, dst


@pytest.mark.parametrize("forks", [False, True])
def test_an_admit_over_a_retrieve_is_refused_by_name(forks: bool) -> None:
    # both admit paths: the plain one and the general one (a step with forks)
    rt = ManualRuntime()
    _src, dst = _retrieving_consumer(rt)
    dst.ingest_request("s")
    step = KVStep([Segment("s", "main", 1), Segment("r", "main", 1)],
                  post_forks=[("main", "cfg")] if forks else ())
    ctx = StepContext(("s", "r"))
    assert dst.admit(step, ctx) == AdmitOutcome(ok=False, reason=RetrieveInProgress(
        message="request 'r' label 'main' is still receiving retrieved KV; retry once "
                "admit_retrieve reports it ready", request_id="r", label="main"))
    fut = dst._streams["r"]["main"].read_future
    assert fut is not None
    rt.complete(fut, ok=False)
    assert dst.admit(step, ctx) == AdmitOutcome(ok=False, reason=AdmitRuntimeError(
        "KV retrieve failed: InjectedRetrieveFailure: retrieve failed (injected); reset or "
        "remove the request", request_id="r", label="main"))


@pytest.mark.parametrize("forks", [False, True])
def test_an_admit_over_an_offloaded_stream_is_refused_by_name(forks: bool) -> None:
    d = _offloadable()
    d.ingest("s")
    fill(d, "s", 1)
    assert d.mgr.offload("a") == 2
    step = KVStep([Segment("s", "main", 1), Segment("a", "main", 1)],
                  post_forks=[("main", "cfg")] if forks else ())
    assert d.mgr.admit(step, StepContext(("s", "a"))) == AdmitOutcome(
        ok=False, reason=RequestOffloading(
            message="request 'a' label 'main' is offloaded or being offloaded; retry once "
                    "it is reloaded", request_id="a", label="main"))


def test_a_fork_onto_a_leased_request_waits_for_the_lease() -> None:
    # R50: the fork would overwrite, in place, pages a peer may be copying
    d = _offloadable()
    fill(d, "a", 3, "cfg")
    step = KVStep([Segment("a", "main", 1)], post_forks=[("main", "cfg")])
    ctx = StepContext(("a",))
    assert isinstance(d.mgr.publish("a"), PublishedKVInfo)
    before = snapshot(d.mgr)
    refused = AdmitOutcome(ok=False, reason=PublishLeased(
        message="a fork over 'a', whose publication a peer still holds: retry after "
                "release_published or the lease's end", request_id="a"))
    assert d.mgr.admit(step, ctx) == refused
    assert_same(before, snapshot(d.mgr))
    # onto a label the request does not hold yet too: the target is written
    # in place once created, and a fork fault would empty it
    new = KVStep([Segment("a", "main", 1)], post_forks=[("main", "new")])
    assert d.mgr.admit(new, ctx) == refused
    assert_same(before, snapshot(d.mgr))
    # a step without forks runs under the lease
    plain = KVStep([Segment("a", "main", 1)])
    assert d.mgr.admit(plain, ctx).ok
    d.mgr.plan(plain, ctx)
    d.mgr.commit(plain, ctx)
    d.mgr.release_published("a")
    assert d.mgr.admit(step, ctx).ok


def test_a_plain_admit_short_of_pages_names_the_first_stream_short() -> None:
    # s's step fits its last page; r's needs a new one
    d = Driver(make_manager(pages=5, page_size=4))
    d.ingest("s", "r")
    fill(d, "s", 2)
    fill(d, "r", 8)
    d.ingest("x")
    fill(d, "x", 4)
    assert d.mgr.num_free_pages == 0
    step = KVStep([Segment("s", "main", 1), Segment("r", "main", 1)])
    assert d.mgr.admit(step, StepContext(("s", "r"))) == AdmitOutcome(
        ok=False, reason=AllocationFailed(
            pages_short=1, request_id="r", label="main",
            message="not enough free pages: step needs 1 new, 0 free "
                    "(first short: request 'r' label 'main')"))


def test_a_forked_admit_short_of_pages_names_the_first_stream_short() -> None:
    # the pre-fork target (reserved first) already holds its 2 pages; main needs a 3rd
    d = Driver(make_manager(pages=8, page_size=4))
    d.ingest("r")
    fill(d, "r", 8)
    fill(d, "r", 8, "cfg")
    fill(d, "r", 5, "draft")
    d.ingest("x")
    fill(d, "x", 4)
    assert d.mgr.num_free_pages == 0
    step = KVStep([Segment("r", "main", 1)], pre_forks=[("cfg", "draft")])
    before = snapshot(d.mgr)
    assert d.mgr.admit(step, StepContext(("r",))) == AdmitOutcome(
        ok=False, reason=AllocationFailed(
            pages_short=1, request_id="r", label="main",
            message="not enough free pages: step needs 1 new, 0 free "
                    "(first short: request 'r' label 'main')"))
    assert_same(before, snapshot(d.mgr))


def test_a_fork_target_reserves_the_most_it_reaches_in_the_step() -> None:
    # cfg: 10 tokens from the pre-fork, +2 from its segment (3 pages), then a
    # post-fork from a 1-token draft: its reservation must stay 3 pages
    d = Driver(make_manager(pages=32, page_size=4))
    d.ingest("r")
    fill(d, "r", 10)
    fill(d, "r", 1, "draft")
    d.step([("r", "cfg", 2)], pre_forks=[("main", "cfg")], post_forks=[("draft", "cfg")])
    d.model[("r", "cfg")] = list(d.model[("r", "draft")])
    assert d.mgr.stored_len("r", "cfg") == 1
    d.check("r", "cfg")
    check_conservation(d.mgr)


def test_an_absent_fork_source_reserves_exactly_what_the_step_needs() -> None:
    # R20: q lacks the source, so its target keeps its 8 tokens (2 pages) and
    # its segment needs one more page; r's fork copies 4 tokens (1 page)
    d = Driver(make_manager(sharing=False, pages=32, page_size=4))
    d.ingest("q", "r")
    fill(d, "q", 8, "cfg")
    fill(d, "r", 4, "src")
    free = d.mgr.num_free_pages
    step = KVStep([Segment("q", "cfg", 4)], pre_forks=[("src", "cfg")])
    ctx = StepContext(("q", "r"))
    assert d.mgr.admit(step, ctx).ok
    assert d.mgr.num_free_pages == free - 2  # q/cfg: 1, r/cfg: 1, q/src (made empty): 0
    d.mgr.clear_preplan()


def test_a_fork_chain_through_an_empty_stream_reserves_no_spare_page() -> None:
    # r/a exists but is empty: a->b empties b, b->c empties c, and c's segment
    # then needs 1 page, which c already holds: no new page
    d = Driver(make_manager(pages=32, page_size=4))
    d.ingest("r")
    fill(d, "r", 8, "c")
    d.mgr.admit(KVStep([Segment("r", "a", 0)]), StepContext(("r",)))
    d.mgr.plan(KVStep([Segment("r", "a", 0)]), StepContext(("r",)))
    d.mgr.commit(KVStep([Segment("r", "a", 0)]), StepContext(("r",)))
    assert d.mgr.stored_len("r", "a") == 0
    free = d.mgr.num_free_pages
    step = KVStep([Segment("r", "c", 4)], pre_forks=[("a", "b"), ("b", "c")])
    assert d.mgr.admit(step, StepContext(("r",))).ok
    assert d.mgr.num_free_pages == free


# --- kvref.stepping.admit_plan_commit ----------------------------------------------------------


def _publishes(mgr: KVManager, rid: str) -> bool:
    """Whether ``publish`` publishes now (then releases the lease it took)."""
    pub = mgr.publish(rid)
    if isinstance(pub, PublishedKVInfo):
        mgr.release_published(rid)
        return True
    assert pub == PublishRefused(ForkPending(
        message="a running or staged step still forks onto this request: "
                "publish once it committed", request_id=rid))
    return False


def test_publish_waits_exactly_for_forks_still_to_apply_to_the_request() -> None:
    # R50, over every state of a step: pre-forks until the plan ran them,
    # post-forks until the commit, a staged preplan's forks until it is cleared,
    # and only for the requests the step pads
    d = Driver(make_manager(pages=32, page_size=4))
    d.ingest("a", "b")
    fill(d, "a", 3)
    fill(d, "b", 3)
    mgr = d.mgr
    assert _publishes(mgr, "a") and _publishes(mgr, "b")
    pre = KVStep([Segment("a", "main", 1)], pre_forks=[("main", "cfg")])
    ctx = StepContext(("a",))
    assert mgr.admit(pre, ctx).ok
    assert not _publishes(mgr, "a")
    assert _publishes(mgr, "b")  # not padded by the step
    mgr.plan(pre, ctx)  # the pre-fork ran
    assert _publishes(mgr, "a")
    mgr.commit(pre, ctx)
    plain = KVStep([Segment("a", "main", 1)])
    assert mgr.admit(plain, ctx).ok
    assert _publishes(mgr, "a")  # a step without forks overwrites nothing
    staged = KVStep([Segment("b", "main", 1)], post_forks=[("main", "cfg")])
    assert mgr.admit(staged, StepContext(("b",), is_preplan=True)).ok
    assert not _publishes(mgr, "b") and _publishes(mgr, "a")
    mgr.clear_preplan()
    staged_plain = KVStep([Segment("b", "main", 1)])
    assert mgr.admit(staged_plain, StepContext(("b",), is_preplan=True)).ok
    assert _publishes(mgr, "b")
    mgr.clear_preplan()
    mgr.plan(plain, ctx)
    mgr.commit(plain, ctx)
    assert _publishes(mgr, "a") and _publishes(mgr, "b")


def test_a_plan_reports_the_steps_forks() -> None:
    d = Driver(make_manager(pages=32, page_size=4))
    d.ingest("a")
    fill(d, "a", 3)
    step = KVStep([Segment("a", "main", 1)], pre_forks=[("main", "cfg")],
                  post_forks=[("main", "draft")])
    ctx = StepContext(("a",))
    assert d.mgr.admit(step, ctx).ok
    out = d.mgr.plan(step, ctx)
    assert out.pre_forks == (("main", "cfg"),)
    assert out.post_forks == (("main", "draft"),)


def test_commit_of_a_step_not_admitted_names_why() -> None:
    d = Driver(make_manager(pages=32, page_size=4))
    d.ingest("a")
    fill(d, "a", 3)
    step = KVStep([Segment("a", "cfg", 1)])
    pre = StepContext(("a",), is_preplan=True)
    with pytest.raises(StepNotAdmittedError) as info:
        d.mgr.commit(step, StepContext(("a",)))
    assert str(info.value) == ("request 'a' label 'cfg': commit of a step that was not "
                               "admitted (or was changed in place since)")
    assert d.mgr.admit(step, pre).ok
    with pytest.raises(StepNotAdmittedError) as info:
        d.mgr.commit(step, StepContext(("a",)))
    assert str(info.value) == "request 'a' label 'cfg': commit of a step that is only preplanned"
    assert (info.value.request_id, info.value.label) == ("a", "cfg")


def test_a_pre_fork_that_fails_at_a_commit_without_a_plan_is_raised() -> None:
    # R24: a commit without a plan runs the pre-forks; a failed copy is raised
    # (R26) after the rest of the commit, and empties its target
    d = Driver(make_manager(pages=32, page_size=4))
    d.ingest("a")
    fill(d, "a", 3)
    fill(d, "a", 6, "cfg")
    mgr = d.mgr
    step = KVStep([Segment("a", "main", 1)], pre_forks=[("main", "cfg")], commit=False)
    ctx = StepContext(("a",))
    assert mgr.admit(step, ctx).ok
    fault = OSError("page copy failed (injected)")

    def broken(src: list[int], dst: list[int]) -> None:
        raise fault

    mgr.kv_cache.copy_pages = broken  # type: ignore[method-assign]
    with pytest.raises(ForkCopyError) as info:
        mgr.commit(step, ctx)
    assert info.value.__cause__ is fault
    assert mgr.stored_len("a", "cfg") == 0
    assert not any(s.step_in_flight for s in mgr._streams["a"].values())


def test_clear_preplan_over_a_running_step_with_forks_keeps_the_running_marks() -> None:
    # R43: the running step's marks (over its forks' streams too) stay
    d = Driver(make_manager(sharing=False, pages=32, page_size=4))
    d.ingest("a")
    fill(d, "a", 3)
    mgr = d.mgr
    step = KVStep([Segment("a", "main", 1)], post_forks=[("main", "cfg")])
    ctx = StepContext(("a",))
    assert mgr.admit(step, ctx).ok
    nxt = KVStep([Segment("a", "cfg", 1)], post_forks=[("cfg", "draft")])
    assert mgr.admit(nxt, StepContext(("a",), is_preplan=True)).ok
    mgr.clear_preplan()
    marks = {label: s.step_in_flight for label, s in mgr._streams["a"].items()}
    assert marks == {"main": True, "cfg": True}
    mgr.plan(step, ctx)
    mgr.commit(step, ctx)
    assert mgr.stored_len("a", "cfg") == 4


def test_a_span_committed_onto_a_stream_offloaded_mid_step_is_dropped_loudly(
        caplog: pytest.LogCaptureFixture) -> None:
    # the last defence behind R2-R5 (unreachable through the API): driven by
    # marking the stream offloaded by hand between plan and commit
    d = Driver(make_manager(sharing=False, pages=32, page_size=4))
    d.ingest("a", "b")
    fill(d, "a", 3)
    fill(d, "b", 3)
    mgr = d.mgr
    step = KVStep([Segment("a", "main", 2), Segment("b", "main", 1)])
    ctx = StepContext(("a", "b"))
    assert mgr.admit(step, ctx).ok
    mgr.plan(step, ctx)
    stream = mgr._streams["a"]["main"]
    stream.offload, stream.offloaded = OffloadState.CLAIMED, True  # by hand: past R2-R5
    gen = mgr._streams["b"]["main"].generation
    with caplog.at_level(logging.ERROR, logger="kvref.stepping.admit_plan_commit"):
        mgr.commit(step, ctx)
    logged = [r.getMessage() for r in caplog.records
              if r.name == "kvref.stepping.admit_plan_commit"]
    assert logged == [
        "KV kv: dropping 2 committed tokens for request 'a' label 'main'; the stream "
        "was offloaded mid-step"]
    assert mgr.stored_len("a") == 3
    assert mgr.stored_len("b") == 4  # the rest of the commit still lands
    assert mgr._streams["b"]["main"].generation > gen


def test_a_stale_preplan_names_both_lengths_and_the_remedy() -> None:
    # step N post-forks main onto cfg; N+1 is preplanned over cfg at 4 tokens;
    # N's fork copy fails and leaves cfg empty (R42)
    d = Driver(make_manager(sharing=False, pages=32, page_size=4))
    d.ingest("a")
    fill(d, "a", 3)
    mgr = d.mgr
    ctx = StepContext(("a",))
    step = KVStep([Segment("a", "main", 1)], post_forks=[("main", "cfg")])
    assert mgr.admit(step, ctx).ok
    nxt = KVStep([Segment("a", "main", 1), Segment("a", "cfg", 1)])
    assert mgr.admit(nxt, StepContext(("a",), is_preplan=True)).ok
    mgr.plan(step, ctx)

    def broken(src: list[int], dst: list[int]) -> None:
        raise OSError("page copy failed (injected)")

    mgr.kv_cache.copy_pages = broken  # type: ignore[method-assign]
    with pytest.raises(ForkCopyError):
        mgr.commit(step, ctx)
    assert mgr.admit(nxt, ctx) == AdmitOutcome(ok=False, reason=PreplanStale(
        message="the staged preplan was planned over length 4, but the stream holds 0: "
                "the step running under it committed otherwise; clear_preplan and admit "
                "afresh", request_id="a", label="cfg"))


def test_plan_out_of_order_names_why() -> None:
    d = Driver(make_manager(pages=32, page_size=4))
    d.ingest("a")
    fill(d, "a", 3)
    mgr = d.mgr
    step = KVStep([Segment("a", "cfg", 1)])
    pre = StepContext(("a",), is_preplan=True)
    with pytest.raises(StepNotAdmittedError) as info:
        mgr.plan(step, pre)
    assert str(info.value) == ("request 'a' label 'cfg': preplan of a step that was not "
                               "preplan-admitted")
    assert (info.value.request_id, info.value.label) == ("a", "cfg")
    with pytest.raises(StepNotAdmittedError) as info:
        mgr.plan(step, StepContext(("a",)))
    assert str(info.value) == ("request 'a' label 'cfg': plan of a step that was not "
                               "admitted (or was changed in place since)")
    assert mgr.admit(step, pre).ok
    mgr.plan(step, pre)
    with pytest.raises(PreplanPendingError) as pending:
        mgr.plan(step, pre)
    assert str(pending.value) == "the staged preplan was already planned"


def test_admit_against_a_staged_preplan_names_why() -> None:
    d = Driver(make_manager(pages=32, page_size=4, max_seq_len=16))
    d.ingest("a")
    fill(d, "a", 3)
    mgr = d.mgr
    staged = KVStep([Segment("a", "main", 1)])
    pre = StepContext(("a",), is_preplan=True)
    assert mgr.admit(staged, pre).ok
    with pytest.raises(PreplanPendingError) as pending:
        mgr.admit(staged, pre)
    assert str(pending.value) == ("a preplan is already staged; clear_preplan before "
                                  "preplanning again")
    other = KVStep([Segment("a", "main", 2)])
    with pytest.raises(PreplanPendingError) as pending:
        mgr.admit(other, StepContext(("a",)))
    assert str(pending.value) == ("admit of a different step than the staged preplan; "
                                  "clear_preplan first")
    # malformed input first, whatever the lifecycle state
    too_long = KVStep([Segment("a", "main", 14)])
    with pytest.raises(InvalidStepError) as info:
        mgr.admit(too_long, StepContext(("a",)))
    assert str(info.value) == ("request 'a' label 'main': stream would reach 17 tokens "
                               "(3 stored + span 14), past KVConfig.max_seq_len 16")


def test_plan_of_another_or_an_already_planned_step_names_why() -> None:
    d = Driver(make_manager(pages=32, page_size=4))
    d.ingest("a")
    fill(d, "a", 3)
    mgr = d.mgr
    step = KVStep([Segment("a", "main", 1)])
    ctx = StepContext(("a",))
    assert mgr.admit(step, ctx).ok
    other = KVStep([Segment("a", "main", 1), Segment("a", "cfg", 1)])
    with pytest.raises(StepNotAdmittedError) as info:
        mgr.plan(other, ctx)
    assert str(info.value) == ("request 'a' label 'cfg': plan of a step other than the "
                               "admitted one (or the admitted step changed in place since "
                               "its admit)")
    assert (info.value.request_id, info.value.label) == ("a", "cfg")
    mgr.plan(step, ctx)
    with pytest.raises(StepOrderError) as order:
        mgr.plan(step, ctx)
    assert str(order.value) == ("request 'a' label 'main': the admitted step was already "
                                "planned; commit it")
    mgr.commit(step, ctx)


def test_a_promoted_preplan_cannot_be_planned_again() -> None:
    d = Driver(make_manager(pages=32, page_size=4))
    d.ingest("a")
    fill(d, "a", 3)
    mgr = d.mgr
    step = KVStep([Segment("a", "main", 1)])
    assert mgr.admit(step, StepContext(("a",), is_preplan=True)).ok
    mgr.plan(step, StepContext(("a",), is_preplan=True))
    ctx = StepContext(("a",))
    assert mgr.admit(step, ctx).ok
    mgr.plan(step, ctx)  # promotion
    with pytest.raises(StepOrderError):
        mgr.plan(step, ctx)
    mgr.commit(step, ctx)
    assert mgr.stored_len("a") == 4


def test_a_second_step_or_an_unknown_padded_request_is_misuse() -> None:
    d = Driver(make_manager(pages=32, page_size=4))
    d.ingest("a")
    fill(d, "a", 3)
    mgr = d.mgr
    # R40: a plain step's padded ids must be known too
    with pytest.raises(UnknownRequestError) as unknown:
        mgr.admit(KVStep([Segment("a", "main", 1)]), StepContext(("a", "ghost")))
    assert unknown.value.request_id == "ghost"
    step = KVStep([Segment("a", "main", 1)])
    ctx = StepContext(("a",))
    assert mgr.admit(step, ctx).ok
    with pytest.raises(StepInFlightError) as info:
        mgr.admit(KVStep([Segment("a", "cfg", 1)]), ctx)
    assert str(info.value) == "a step is already admitted; commit it before admitting another"


def test_a_step_that_takes_no_page_and_keeps_nothing_leaves_a_publication_fresh() -> None:
    # the generation moves with the pages or the length (I14), not with an
    # admit that changed neither: a peer's retrieve of the publication still runs
    src = _publisher()
    pub = _pub(src)
    step = KVStep([Segment("r", "main", 1)], commit=False)  # 11 tokens: page 3 holds it
    ctx = StepContext(("r",))
    assert src.mgr.admit(step, ctx).ok
    src.mgr.plan(step, ctx)
    src.mgr.commit(step, ctx)
    rt = ManualRuntime()
    dst = _consumer(rt, labels=("main",))
    assert dst.admit_retrieve("r", "n", "w", pub) == AdmitOutcome(ok=True, ready=False)
    rt.complete_all()
    assert torch.equal(dst.read_stream("r"), src.expected("r"))
