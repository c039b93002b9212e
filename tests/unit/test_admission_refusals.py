"""Admission: each misuse of a step and each refusal, named whole.

`validate.step_streams` is pure (a step and the stream table to an error or
nothing); the manager's own validation runs first at every entry and
catches most of the same misuse, so it is checked here directly. Refusals
(a retrieve or offload over a stream, a leased fork target, pages short) are
compared as whole outcomes.
"""

from __future__ import annotations

import pytest
from _manager_fixtures import (
    Driver,
    assert_same,
    consumer,
    fill,
    make_manager,
    offloadable,
    publish_now,
    publisher,
    snapshot,
)

from kvref import validate
from kvref.core.errors import (
    InvalidStepError,
    KVRefError,
    UnknownRequestError,
)
from kvref.core.streams import CacheStream
from kvref.manager import KVManager
from kvref.stepping.plan import group_by_plan_label
from kvref.stepping.step import (
    AdmitOutcome,
    AdmitRuntimeError,
    AllocationFailed,
    KVStep,
    PublishLeased,
    RequestOffloading,
    RetrieveInProgress,
    Segment,
    StepContext,
)
from kvref.testing.manual_runtime import ManualRuntime
from kvref.transfer.published import PublishedKVInfo


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
    src = publisher()
    dst = consumer(rt, cpu_pages=cpu_pages, labels=("main",))
    assert dst.admit_retrieve("r", "n", "w", publish_now(src)) == AdmitOutcome(ok=True, ready=False)
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
    d = offloadable()
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
    d = offloadable()
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
