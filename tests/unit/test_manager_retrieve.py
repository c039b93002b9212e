"""publish / admit_retrieve between two managers in one process (local engine)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

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

from kvref.core.config import KVReqConfig
from kvref.core.errors import PublishedInfoError, UnknownRequestError
from kvref.manager import KVManager
from kvref.stepping.step import AdmitOutcome, AdmitRuntimeError, AllocationFailed
from kvref.transfer.engine import InjectedTransferError
from kvref.transfer.published import PublishedKVInfo, PublishRefused, UnknownRequest


@pytest.fixture
def pair() -> Iterator[tuple[KVManager, Driver, KVManager]]:
    src = make_manager(pages=16, page_size=4)
    dst = make_manager(pages=16, page_size=4)
    drv = Driver(src)
    drv.ingest("r")
    fill(drv, "r", 10)
    fill(drv, "r", 3, "cfg")
    yield src, drv, dst
    dst.cleanup()
    src.cleanup()


def _wait_ready(dst: KVManager, rid: str, pub: PublishedKVInfo | None,
                node: str = "n", walk: str = "w") -> AdmitOutcome:
    out = dst.admit_retrieve(rid, node, walk, pub)
    for fut in [s.read_future for s in dst._streams[rid].values() if s.read_future]:
        fut.result(timeout=10)
    return dst.admit_retrieve(rid, node, walk, pub) if out.ok else out


def test_retrieve_bytes_equal(pair) -> None:  # type: ignore[no-untyped-def]
    src, drv, dst = pair
    pub = src.publish("r")
    assert pub is not None and pub.world_size == 1
    info = pub.get(0)
    assert info["main"].seq_len == 10 and len(info["main"].page_indices) == 3
    dst.ingest_request("r", KVReqConfig(default_labels=("main", "cfg")))
    first = dst.admit_retrieve("r", "n", "w", pub)
    assert first.ok
    out = _wait_ready(dst, "r", pub)
    assert out.ok and out.ready
    assert dst.stored_len("r") == 10 and dst.stored_len("r", "cfg") == 3
    assert torch.equal(dst.read_stream("r"), drv.expected("r"))
    assert torch.equal(dst.read_stream("r", "cfg"), drv.expected("r", "cfg"))
    check_conservation(dst)
    # idempotent once landed: nothing more to copy, nothing more allocated
    free = dst.num_free_pages
    assert dst.admit_retrieve("r", "n", "w", pub) == AdmitOutcome(ok=True, ready=True)
    assert dst.num_free_pages == free


def test_retrieve_only_needed_labels(pair) -> None:  # type: ignore[no-untyped-def]
    src, drv, dst = pair
    dst.ingest_request("r")  # default labels: main only
    out = _wait_ready(dst, "r", src.publish("r"))
    assert out.ok and out.ready
    assert dst.labels("r") == ["main"]
    assert torch.equal(dst.read_stream("r"), drv.expected("r"))


def test_retrieve_incremental(pair) -> None:  # type: ignore[no-untyped-def]
    src, drv, dst = pair
    dst.ingest_request("r")
    assert _wait_ready(dst, "r", src.publish("r")).ready
    fill(drv, "r", 5)
    assert _wait_ready(dst, "r", src.publish("r")).ready
    assert dst.stored_len("r") == 15
    assert torch.equal(dst.read_stream("r"), drv.expected("r"))


def test_world_size_mismatch_refused(pair) -> None:  # type: ignore[no-untyped-def]
    src, _drv, dst = pair
    dst.ingest_request("r")
    pub = src.publish("r")
    assert pub is not None
    pub.world_size = 2
    before = snapshot(dst)
    out = dst.admit_retrieve("r", "n", "w", pub)
    assert not out.ok and isinstance(out.reason, AdmitRuntimeError)
    assert out.reason.request_id == "r"
    assert_same(before, snapshot(dst))


def test_self_retrieve_skipped(pair) -> None:  # type: ignore[no-untyped-def]
    src, _drv, _dst = pair
    pub = src.publish("r")
    src.release_published("r")  # publish leased it (R33)
    src.reset_request("r")  # shorter than published: a real retrieve would copy
    before = snapshot(src)
    out = src.admit_retrieve("r", "n", "w", pub)
    assert out.ok and out.ready
    assert_same(before, snapshot(src))


def test_failed_retrieve_is_latched_until_reset(pair) -> None:  # type: ignore[no-untyped-def]
    src, drv, dst = pair
    dst.ingest_request("r")
    pub = src.publish("r")
    dst._transfer.fail_next = 1
    first = dst.admit_retrieve("r", "n", "w", pub)
    # admitted and copying, or (if the copy already failed) reported at once
    assert (first.ok and not first.ready) or isinstance(first.reason, AdmitRuntimeError)
    fut = dst._streams["r"]["main"].read_future
    if fut is not None:
        assert isinstance(fut.exception(timeout=10), InjectedTransferError)
    for _ in range(3):  # I11: every later check, not just the first
        out = dst.admit_retrieve("r", "n", "w", pub)
        assert not out.ok and isinstance(out.reason, AdmitRuntimeError)
        assert out.reason.request_id == "r" and out.reason.label == "main"
    dst.reset_request("r")  # R7
    out = _wait_ready(dst, "r", pub)
    assert out.ok and out.ready
    assert torch.equal(dst.read_stream("r"), drv.expected("r"))


def test_retrieve_short_of_pages_refused(pair) -> None:  # type: ignore[no-untyped-def]
    src, _drv, _ = pair
    dst = make_manager(pages=3, page_size=4)
    dst.ingest_request("r")
    before = snapshot(dst)
    out = dst.admit_retrieve("r", "n", "w", src.publish("r"))
    assert not out.ok and isinstance(out.reason, AllocationFailed)
    assert out.reason.pages_short == 1
    assert_same(before, snapshot(dst))
    dst.cleanup()


@pytest.mark.parametrize("bad", [[1, 2, 999], [0, 1, 2], [1, -3, 2], [1, 2]])
def test_out_of_range_published_pages(pair, bad: list[int]) -> None:  # type: ignore[no-untyped-def]
    src, _drv, dst = pair
    dst.ingest_request("r")
    pub = src.publish("r")
    assert pub is not None
    pub.info[0]["main"] = dataclasses.replace(pub.info[0]["main"], page_indices=bad)
    before = snapshot(dst)
    with pytest.raises(PublishedInfoError) as err:
        dst.admit_retrieve("r", "n", "w", pub)
    assert "'r'" in str(err.value) and "'main'" in str(err.value)
    assert_same(before, snapshot(dst))


def test_admit_retrieve_unknown_request(pair) -> None:  # type: ignore[no-untyped-def]
    src, _drv, dst = pair
    before = snapshot(dst)
    with pytest.raises(UnknownRequestError, match="'zz'"):
        dst.admit_retrieve("zz", "n", "w", src.publish("r"))
    assert_same(before, snapshot(dst))


def test_publish_unknown_and_none() -> None:
    mgr = make_manager()
    got = mgr.publish("nope")  # R48: a falsy PublishRefused, as the reference's None
    assert not got and isinstance(got, PublishRefused)
    assert isinstance(got.reason, UnknownRequest)
    mgr.ingest_request("a")
    assert mgr.admit_retrieve("a", "n", "w", None).ready  # R29: a readiness check


def test_retrieve_into_stream_with_step_in_flight(pair) -> None:  # type: ignore[no-untyped-def]
    """dst has 5 tokens and a decode step admitted and planned at position 5;
    a retrieve of 10 published tokens must not move that stream under the step
    (refuse, raise StepInFlightError, or leave it alone): moving it set
    stored_len to 10 over position 5, the commit then made it 11, the step's
    token was overwritten and position 10 never written.
    """
    from kvref.core.errors import StepInFlightError
    from kvref.stepping.step import KVStep, Segment, StepContext

    src, _drv, dst = pair
    ddrv = Driver(dst)
    ddrv.ingest("r")
    fill(ddrv, "r", 5)
    step = KVStep([Segment("r", "main", 1)])
    ctx = StepContext(("r",))
    assert dst.admit(step, ctx).ok
    outs = dst.plan(step, ctx)
    rows = ddrv.write_planned(outs)
    before = snapshot(dst)
    try:
        out = dst.admit_retrieve("r", "n", "w", src.publish("r"))
    except StepInFlightError:
        out = None
    if out is None or not out.ok:
        assert_same(before, snapshot(dst))
    for fut in [s.read_future for s in dst._streams["r"].values() if s.read_future]:
        fut.exception(timeout=10)
    dst.commit(step, ctx)
    ddrv.apply_commit(step, ctx, rows)
    assert dst.stored_len("r") == 6
    ddrv.check("r")
