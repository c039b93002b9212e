"""publish and admit_retrieve: every refusal and misuse pinned whole.

An admit outcome and its reason are frozen dataclasses, so each refusal is
compared whole (ok, ready, the reason's type, message, request and label);
each misuse by its error's text, and the state is checked unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
import torch
from _manager_fixtures import (
    Driver,
    assert_same,
    check_conservation,
    consumer,
    fill,
    make_cfg,
    make_manager,
    publish_now,
    publisher,
    snapshot,
)

from kvref.core.config import KVReqConfig
from kvref.core.errors import (
    KVRefError,
    PublishedInfoError,
    StepInFlightError,
)
from kvref.manager import KVManager
from kvref.stepping.step import (
    AdmitOutcome,
    AdmitRuntimeError,
    AllocationFailed,
    ForkPending,
    KVStep,
    RequestOffloading,
    RetrieveInProgress,
    Segment,
    StepContext,
)
from kvref.testing.manual_runtime import ManualRuntime
from kvref.transfer.engine import StaleSourceError, TransferEngineInfo
from kvref.transfer.published import PublishedKVInfo, PublishRefused, RetrieveStale, UnknownRequest


def test_publish_refusals_name_the_request_label_and_remedy() -> None:
    src = publisher(cpu_pages=8)
    rt = ManualRuntime()
    dst = consumer(rt, labels=("main",))
    # R48: unknown
    assert dst.publish("nobody") == PublishRefused(UnknownRequest(
        message="unknown request (never ingested, or removed): nothing to publish",
        request_id="nobody"))
    # R36: still receiving a retrieve
    assert dst.admit_retrieve("r", "n", "w", publish_now(src)) == AdmitOutcome(ok=True, ready=False)
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


def test_publish_waits_for_a_step_that_still_forks_onto_the_request() -> None:
    # R50: a running step with a post-fork onto r would overwrite what a peer copies
    src = publisher()
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


def test_a_step_that_takes_no_page_and_keeps_nothing_leaves_a_publication_fresh() -> None:
    # the generation moves with the pages or the length (I14), not with an
    # admit that changed neither: a peer's retrieve of the publication still runs
    src = publisher()
    pub = publish_now(src)
    step = KVStep([Segment("r", "main", 1)], commit=False)  # 11 tokens: page 3 holds it
    ctx = StepContext(("r",))
    assert src.mgr.admit(step, ctx).ok
    src.mgr.plan(step, ctx)
    src.mgr.commit(step, ctx)
    rt = ManualRuntime()
    dst = consumer(rt, labels=("main",))
    assert dst.admit_retrieve("r", "n", "w", pub) == AdmitOutcome(ok=True, ready=False)
    rt.complete_all()
    assert torch.equal(dst.read_stream("r"), src.expected("r"))


def test_a_retrieve_across_world_sizes_is_refused_whole() -> None:
    src = publisher()
    dst = consumer(ManualRuntime())
    pub = publish_now(src)
    pub.world_size = 2
    assert dst.admit_retrieve("r", "n", "w", pub) == AdmitOutcome(
        ok=False, ready=False, reason=AdmitRuntimeError(
            "KV transfer across tensor-parallel world sizes is not supported "
            "(published 2, local 1)", request_id="r"))


def test_a_running_retrieve_reads_admitted_not_ready_then_ready() -> None:
    src = publisher()
    rt = ManualRuntime()
    dst = consumer(rt)
    pub = publish_now(src)
    assert dst.admit_retrieve("r", "n", "w", pub) == AdmitOutcome(ok=True, ready=False)
    # asked again while it copies: the offered label is not ready yet
    assert dst.admit_retrieve("r", "n", "w", pub) == AdmitOutcome(ok=True, ready=False)
    rt.complete_all()
    assert dst.admit_retrieve("r", "n", "w", pub) == AdmitOutcome(ok=True, ready=True)
    assert torch.equal(dst.read_stream("r"), src.expected("r"))
    assert torch.equal(dst.read_stream("r", "cfg"), src.expected("r", "cfg"))


def test_a_failed_retrieve_answers_the_same_terminal_outcome_every_time() -> None:
    src = publisher()
    rt = ManualRuntime()
    dst = consumer(rt, labels=("main",))
    pub = publish_now(src)
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
    src = publisher()
    dst = consumer(ManualRuntime(), labels=("main",))
    step = KVStep([Segment("r", "main", 2)])
    ctx = StepContext(("r",))
    assert dst.admit(step, ctx).ok
    with pytest.raises(StepInFlightError) as info:
        dst.admit_retrieve("r", "n", "w", publish_now(src))
    assert str(info.value) == ("request 'r' label 'main': retrieve into a stream with a "
                               "step in flight; commit it first")
    assert (info.value.request_id, info.value.label) == ("r", "main")


def test_a_retrieve_into_an_offloaded_stream_is_refused_as_offloading() -> None:
    src = publisher()
    d = Driver(consumer(ManualRuntime(), cpu_pages=8, labels=("main",)))
    d.model[("r", "main")] = []
    fill(d, "r", 2)
    assert d.mgr.offload("r") == 1
    assert d.mgr.admit_retrieve("r", "n", "w", publish_now(src)) == AdmitOutcome(
        ok=False, reason=RequestOffloading(
            message="request 'r' label 'main' is offloaded or being offloaded; "
                    "retry once it is reloaded", request_id="r", label="main"))


def _short_consumer(rt: ManualRuntime, free: int) -> Driver:
    """A consumer whose ``r/cfg`` holds 5 tokens in 2 pages (one spare),
    ``r/main`` nothing, and ``free`` free pages."""
    d = Driver(consumer(rt, pages=12))
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
    assert short.mgr.admit_retrieve("r", "n", "w", publish_now(src)) == AdmitOutcome(
        ok=False, reason=AllocationFailed(
            pages_short=1, request_id="r", label="main",
            message="retrieve needs 3 new pages, 2 free"))
    fits = _short_consumer(rt, free=3)
    src.mgr.release_published("r")
    assert fits.mgr.admit_retrieve("r", "n", "w", publish_now(src)) == AdmitOutcome(
        ok=True, ready=False)
    assert fits.mgr.num_free_pages == 0
    rt.complete_all()
    assert torch.equal(fits.mgr.read_stream("r"), src.expected("r"))
    # cfg: its own 5 tokens, then the 2 it was missing
    assert torch.equal(fits.mgr.read_stream("r", "cfg")[:, 5:],
                       src.expected("r", "cfg")[:, 5:])


def test_a_new_label_holds_no_pages_when_a_retrieve_counts_them() -> None:
    src = publisher()
    d = Driver(consumer(ManualRuntime(), pages=12, labels=("main",)))
    d.model[("r", "main")] = []
    fill(d, "r", 10)  # main holds as much as published: only cfg (a new label) copies
    d.ingest("x")
    fill(d, "x", 4 * d.mgr.num_free_pages)
    assert d.mgr.num_free_pages == 0
    before = snapshot(d.mgr)
    assert d.mgr.admit_retrieve("r", None, None, publish_now(src)) == AdmitOutcome(
        ok=False, reason=AllocationFailed(
            pages_short=1, request_id="r", label="cfg",
            message="retrieve needs 1 new pages, 0 free"))
    assert_same(before, snapshot(d.mgr))


def test_a_landed_retrieve_offered_again_changes_nothing() -> None:
    src = publisher()
    rt = ManualRuntime()
    dst = consumer(rt)
    pub = publish_now(src)
    assert dst.admit_retrieve("r", "n", "w", pub).ok
    rt.complete_all()
    # a readiness check reads the landed copies off their futures (I11)
    assert dst.admit_retrieve("r", "n", "w", None) == AdmitOutcome(ok=True, ready=True)
    before = snapshot(dst)
    assert dst.admit_retrieve("r", "n", "w", pub) == AdmitOutcome(ok=True, ready=True)
    assert_same(before, snapshot(dst))  # the generation too: nothing was started


def test_a_label_already_held_at_the_published_length_does_not_stop_the_others() -> None:
    src = publisher()
    rt = ManualRuntime()
    d = Driver(consumer(rt))
    d.model[("r", "main")] = []
    fill(d, "r", 10)  # main: as long as published, so nothing to copy
    assert d.mgr.admit_retrieve("r", "n", "w", publish_now(src)) == AdmitOutcome(
        ok=True, ready=False)
    rt.complete_all()
    assert torch.equal(d.mgr.read_stream("r", "cfg"), src.expected("r", "cfg"))
    d.check("r")  # main kept its own tokens


def test_a_longer_publication_waits_for_the_retrieve_still_copying() -> None:
    src = publisher()
    rt = ManualRuntime()
    dst = consumer(rt, labels=("main",))
    assert dst.admit_retrieve("r", "n", "w", publish_now(src)).ok
    fut = dst._streams["r"]["main"].read_future
    fill(src, "r", 5)  # the publisher grew: a later publication is longer
    before = snapshot(dst)
    assert dst.admit_retrieve("r", "n", "w", publish_now(src)) == AdmitOutcome(
        ok=True, ready=False)
    assert_same(before, snapshot(dst))
    assert dst._streams["r"]["main"].read_future is fut
    rt.complete_all()
    # and a failed one answers its failure, not a second copy
    dst.reset_request("r")
    assert dst.admit_retrieve("r", "n", "w", publish_now(src)).ok
    fut = dst._streams["r"]["main"].read_future
    assert fut is not None
    rt.complete(fut, ok=False)
    fill(src, "r", 1)
    free = dst.num_free_pages
    out = dst.admit_retrieve("r", "n", "w", publish_now(src))
    assert not out.ok and isinstance(out.reason, AdmitRuntimeError)
    assert dst.num_free_pages == free and rt.pending == []


def test_a_retrieve_routes_by_an_empty_node_and_walk_name() -> None:
    # "" is a node (and a walk) like any other: its route is looked up as given
    src = publisher()
    rt = ManualRuntime()
    dst = KVManager(make_cfg(pages=16, page_size=4), "kv", None, TransferEngineInfo(), "cpu",
                    dtype=torch.float32, runtime=rt)
    dst.ingest_request("r", KVReqConfig(labels={("", ""): ("cfg",)}))
    assert dst.admit_retrieve("r", "", "", publish_now(src)) == AdmitOutcome(ok=True, ready=False)
    rt.complete_all()
    assert dst.labels("r") == ["main", "cfg"]
    assert dst.stored_len("r") == 0 and dst.stored_len("r", "cfg") == 3


def test_a_stale_publication_is_latched_without_touching_what_the_stream_holds() -> None:
    src = publisher()
    rt = ManualRuntime()
    d = Driver(consumer(rt))
    d.model[("r", "main")] = []
    fill(d, "r", 2)
    pub = publish_now(src)
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
    src = publisher()
    rt = ManualRuntime()
    d = Driver(consumer(rt, labels=("main",)))
    d.model[("r", "main")] = []
    fill(d, "r", 2)  # 1 page held; the retrieve takes 2 more
    before = snapshot(d.mgr)
    fault = RuntimeError("boom")

    def refuse(**kwargs: Any) -> None:
        raise fault

    monkeypatch.setattr(d.mgr._transfer, "start_async_retrieve", refuse)
    assert d.mgr.admit_retrieve("r", "n", "w", publish_now(src)) == AdmitOutcome(
        ok=False, ready=False, reason=AdmitRuntimeError(
            "KV retrieve could not start: RuntimeError: boom", request_id="r",
            label="main"))
    assert_same(before, snapshot(d.mgr))
    check_conservation(d.mgr)


def test_a_retrieve_into_a_new_label_that_cannot_start_leaves_no_stream(
        monkeypatch: pytest.MonkeyPatch) -> None:
    src = publisher()
    d = Driver(consumer(ManualRuntime(), labels=("main",)))
    d.model[("r", "main")] = []
    fill(d, "r", 10)  # main holds as much as published: only cfg, a new label, copies
    before = snapshot(d.mgr)

    def refuse(**kwargs: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(d.mgr._transfer, "start_async_retrieve", refuse)
    out = d.mgr.admit_retrieve("r", None, None, publish_now(src))  # every published label
    assert not out.ok and out.reason is not None and out.reason.label == "cfg"
    assert d.mgr.labels("r") == ["main"]
    assert_same(before, snapshot(d.mgr))


def test_a_retrieve_moves_the_streams_generation_forward() -> None:
    src = publisher()
    rt = ManualRuntime()
    d = Driver(consumer(rt, labels=("main",)))
    d.model[("r", "main")] = []
    fill(d, "r", 2, chunk=1)
    gen = d.mgr._streams["r"]["main"].generation
    assert gen >= 2
    assert d.mgr.admit_retrieve("r", "n", "w", publish_now(src)).ok
    assert d.mgr._streams["r"]["main"].generation > gen


def test_a_publication_with_another_page_size_is_misuse_by_name() -> None:
    src = publisher(page_size=8)
    dst = consumer(ManualRuntime())
    before = snapshot(dst)
    with pytest.raises(PublishedInfoError) as info:
        dst.admit_retrieve("r", "n", "w", publish_now(src))
    assert str(info.value) == "request 'r' label 'main': published page size 8, local 4"
    assert (info.value.request_id, info.value.label) == ("r", "main")
    assert_same(before, snapshot(dst))


@pytest.mark.parametrize(("pages", "shown"), [
    ([1, 2, 16], "[16]"),
    ([16, 17, 18, 19, 20], "[16, 17, 18, 19]"),
])
def test_published_pages_past_the_publishers_cache_are_named(
        pages: list[int], shown: str) -> None:
    src = publisher()
    dst = consumer(ManualRuntime())
    pub = publish_now(src)
    pub.info[0]["main"] = dataclasses.replace(pub.info[0]["main"], page_indices=pages)
    with pytest.raises(PublishedInfoError) as info:
        dst.admit_retrieve("r", "n", "w", pub)
    assert str(info.value) == (
        f"request 'r' label 'main': published page indices {shown} are outside [1, 16)")
    assert (info.value.request_id, info.value.label) == ("r", "main")


def test_a_publication_without_a_transfer_descriptor_is_misuse_by_name() -> None:
    src = publisher()
    dst = consumer(ManualRuntime())
    pub = publish_now(src)
    pub.info[0]["main"] = dataclasses.replace(pub.info[0]["main"],
                                              latest_kv_transfer_info=object())
    before = snapshot(dst)
    with pytest.raises(PublishedInfoError) as info:
        dst.admit_retrieve("r", "n", "w", pub)
    assert str(info.value) == ("request 'r' label 'main': kv_transfer_info must be a "
                               "KVTransferInfo, got object")
    assert_same(before, snapshot(dst))


def test_a_publication_the_transfer_engine_refuses_is_named_with_its_cause() -> None:
    src = publisher()
    dst = KVManager(make_cfg(pages=16, page_size=4, heads=4), "kv", None,
                    TransferEngineInfo(), "cpu", dtype=torch.float32, runtime=ManualRuntime())
    dst.ingest_request("r", KVReqConfig(default_labels=("main",)))
    with pytest.raises(PublishedInfoError) as info:
        dst.admit_retrieve("r", "n", "w", publish_now(src))
    cause = info.value.__cause__
    assert isinstance(cause, KVRefError)
    assert str(info.value) == f"request 'r' label 'main': {cause}"
    assert (info.value.request_id, info.value.label) == ("r", "main")


def test_a_self_retrieve_is_skipped_and_logged_by_name(
        caplog: pytest.LogCaptureFixture) -> None:
    src = publisher()
    pub = publish_now(src)
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
