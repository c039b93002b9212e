"""KVManager.truncate: a stream cut back to a prefix (speculative decoding).

Each test checks what truncate promises: the first ``new_len`` tokens read
back unchanged, the pages past ``ceil(new_len / page_size)`` go back to the
allocator, the generation is bumped (R39), and every refusal raises a typed
error and changes nothing (R38).
"""

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
    make_cfg,
    make_manager,
    snapshot,
)

from kvref.core.config import KVReqConfig
from kvref.core.errors import (
    InvalidArgumentError,
    KVRefError,
    PublishLeasedError,
    StepInFlightError,
    StreamUnavailableError,
    UnknownRequestError,
)
from kvref.manager import KVManager
from kvref.stepping.step import (
    KVStep,
    Segment,
    StepContext,
)
from kvref.testing.manual_runtime import ManualRuntime
from kvref.transfer.engine import TransferEngineInfo
from kvref.transfer.published import PublishedKVInfo


def _cut(drv: Driver, rid: str, label: str, new_len: int) -> int:
    """Truncate, and cut the driver's expected contents the same way."""
    freed = drv.mgr.truncate(rid, label, new_len)
    del drv.model[(rid, label)][new_len:]
    return freed


def _stream(mgr: KVManager, rid: str, label: str = "main"):  # type: ignore[no-untyped-def]
    return mgr._streams[rid][label]


@pytest.fixture
def drv() -> Driver:
    d = Driver(make_manager(pages=16, page_size=4, cpu_pages=8))
    d.ingest("r")
    return d


def test_speculative_verify_keeps_the_accepted_prefix(drv: Driver) -> None:
    fill(drv, "r", 9)  # 3 pages
    drv.step([("r", "main", 4)])  # verify: the last token and 3 drafts, 13 tokens in 4 pages
    free, gen = drv.mgr.num_free_pages, _stream(drv.mgr, "r").generation
    assert _cut(drv, "r", "main", 11) == 1  # 2 drafts accepted: 11 tokens need 3 pages
    assert drv.mgr.stored_len("r") == 11
    assert drv.mgr.num_free_pages == free + 1
    assert _stream(drv.mgr, "r").generation > gen
    drv.check("r")
    check_conservation(drv.mgr)
    # the next step writes from the new end, into the kept page
    drv.step([("r", "main", 2)])
    assert drv.mgr.stored_len("r") == 13
    drv.check("r")


def test_truncate_within_a_page_frees_nothing_but_bumps(drv: Driver) -> None:
    fill(drv, "r", 7)
    pages = list(_stream(drv.mgr, "r").page_indices)
    gen = _stream(drv.mgr, "r").generation
    assert _cut(drv, "r", "main", 5) == 0
    assert _stream(drv.mgr, "r").page_indices == pages
    assert _stream(drv.mgr, "r").generation > gen  # the length changed (I14)
    drv.check("r")


def test_truncate_to_zero_frees_every_page(drv: Driver) -> None:
    fill(drv, "r", 8)
    free = drv.mgr.num_free_pages
    assert _cut(drv, "r", "main", 0) == 2
    assert drv.mgr.num_free_pages == free + 2 and _stream(drv.mgr, "r").page_indices == []
    check_conservation(drv.mgr)
    drv.step([("r", "main", 3)])
    drv.check("r")


def test_truncate_to_the_current_length_changes_nothing(drv: Driver) -> None:
    fill(drv, "r", 5)
    # a step that kept none of its tokens leaves a spare (high-water) page
    drv.step([("r", "main", 4)], commit=False)
    assert len(_stream(drv.mgr, "r").page_indices) == 3
    before = snapshot(drv.mgr)
    assert drv.mgr.truncate("r", "main", 5) == 0
    assert_same(before, snapshot(drv.mgr))  # generation and spare page included


def test_truncate_frees_the_spare_pages_past_the_new_end(drv: Driver) -> None:
    fill(drv, "r", 5)
    drv.step([("r", "main", 4)], commit=False)  # 3 pages for 5 tokens
    assert _cut(drv, "r", "main", 4) == 2
    assert len(_stream(drv.mgr, "r").page_indices) == 1
    drv.check("r")


def test_other_streams_are_untouched(drv: Driver) -> None:
    drv.ingest("s")
    fill(drv, "r", 6)
    fill(drv, "r", 6, "cfg")
    fill(drv, "s", 6)
    before = snapshot(drv.mgr)
    _cut(drv, "r", "cfg", 2)
    after = snapshot(drv.mgr)
    for key in (("r", "main"), ("s", "main")):
        assert after.streams[key] == before.streams[key]
        assert torch.equal(after.contents[key], before.contents[key])
    for key in (("r", "main"), ("r", "cfg"), ("s", "main")):
        drv.check(*key)


def test_offload_and_reload_after_truncate_keep_the_new_length(drv: Driver) -> None:
    fill(drv, "r", 10)
    _cut(drv, "r", "main", 6)
    assert drv.mgr.offload("r") == 2
    assert drv.mgr.reload("r")
    assert drv.mgr.stored_len("r") == 6
    drv.check("r")


def test_a_preplan_after_truncate_plans_from_the_new_length(drv: Driver) -> None:
    fill(drv, "r", 10)
    _cut(drv, "r", "main", 6)
    step = KVStep([Segment("r", "main", 1)])
    ctx = StepContext(["r"], is_preplan=True)
    assert drv.mgr.admit(step, ctx).ok
    view, = drv.mgr.plan(step, ctx)["main"].views
    assert view.length == 7 and view.generation == _stream(drv.mgr, "r").generation


# -- refusals: typed, and nothing changes ---------------------------------------


def _refused(mgr: KVManager, err: type[Exception], rid: object, label: object,
             new_len: object) -> None:
    before = snapshot(mgr)
    with pytest.raises(err):
        mgr.truncate(rid, label, new_len)  # type: ignore[arg-type]
    assert_same(before, snapshot(mgr))


def test_refused_while_a_step_names_the_stream(drv: Driver) -> None:
    fill(drv, "r", 6)
    step = KVStep([Segment("r", "main", 2)])
    ctx = StepContext(["r"])
    assert drv.mgr.admit(step, ctx).ok
    _refused(drv.mgr, StepInFlightError, "r", "main", 2)
    drv.mgr.plan(step, ctx)
    _refused(drv.mgr, StepInFlightError, "r", "main", 6)  # also to its own length
    drv.mgr.commit(step, ctx)
    assert drv.mgr.truncate("r", "main", 2) == 1


def test_refused_while_a_staged_preplan_names_the_stream(drv: Driver) -> None:
    fill(drv, "r", 6)
    step = KVStep([Segment("r", "main", 1)])
    assert drv.mgr.admit(step, StepContext(["r"], is_preplan=True)).ok
    _refused(drv.mgr, StepInFlightError, "r", "main", 2)
    drv.mgr.clear_preplan()
    assert drv.mgr.truncate("r", "main", 2) == 1


def test_refused_while_an_offload_claims_or_holds_it(drv: Driver) -> None:
    fill(drv, "r", 6)
    off = drv.mgr.begin_offload("r")
    assert off is not None
    _refused(drv.mgr, StreamUnavailableError, "r", "main", 2)
    off.copy_all()
    _refused(drv.mgr, StreamUnavailableError, "r", "main", 2)
    assert off.commit() == 2
    _refused(drv.mgr, StreamUnavailableError, "r", "main", 2)
    assert drv.mgr.reload("r")
    assert _cut(drv, "r", "main", 2) == 1
    drv.check("r")


@pytest.mark.parametrize(("new_len", "err"), [
    (7, InvalidArgumentError), (-1, InvalidArgumentError), (True, InvalidArgumentError),
    (2.0, InvalidArgumentError), ("2", InvalidArgumentError),
])
def test_refused_lengths(drv: Driver, new_len: object, err: type[Exception]) -> None:
    fill(drv, "r", 6)
    _refused(drv.mgr, err, "r", "main", new_len)


def test_refused_unknown_request_or_label(drv: Driver) -> None:
    fill(drv, "r", 6)
    _refused(drv.mgr, UnknownRequestError, "nobody", "main", 0)
    _refused(drv.mgr, UnknownRequestError, "r", "cfg", 0)
    _refused(drv.mgr, InvalidArgumentError, 3, "main", 0)
    _refused(drv.mgr, InvalidArgumentError, "r", None, 0)


def _retrieving(label: str) -> Iterator[tuple[KVManager, ManualRuntime]]:
    """A manager with a retrieve of ``r/<label>`` (5 tokens) still copying."""
    src = make_manager(pages=8, page_size=4)
    d = Driver(src)
    d.ingest("r")
    fill(d, "r", 5, label)
    rt = ManualRuntime()
    dst = KVManager(make_cfg(pages=8, page_size=4), "kv", None, TransferEngineInfo(), "cpu",
                    dtype=torch.float32, runtime=rt)
    dst.ingest_request("r", KVReqConfig(default_labels=(label,)))
    pub = src.publish("r")
    assert isinstance(pub, PublishedKVInfo)
    out = dst.admit_retrieve("r", "n", "w", pub)
    assert out.ok and not out.ready
    yield dst, rt
    dst.cleanup()
    src.cleanup()


@pytest.fixture
def retrieving() -> Iterator[tuple[KVManager, ManualRuntime]]:
    yield from _retrieving("main")


def test_refused_while_a_retrieve_copies_or_after_it_failed(
        retrieving: tuple[KVManager, ManualRuntime]) -> None:
    dst, rt = retrieving
    _refused(dst, StreamUnavailableError, "r", "main", 2)
    fut = _stream(dst, "r").read_future
    assert fut is not None
    rt.complete(fut, ok=False)
    # a readiness check reads the failure off the future and latches it (I11)
    assert not dst.admit_retrieve("r", "n", "w", None).ok
    _refused(dst, StreamUnavailableError, "r", "main", 2)
    dst.reset_request("r")  # clears the latch (R7)
    assert dst.truncate("r", "main", 0) == 0


def test_allowed_once_the_retrieve_landed(retrieving: tuple[KVManager, ManualRuntime]) -> None:
    dst, rt = retrieving
    fut = _stream(dst, "r").read_future
    assert fut is not None
    rt.complete(fut, ok=True)
    want = dst.read_stream("r")[:, :3].clone()
    assert dst.truncate("r", "main", 3) == 1
    assert torch.equal(dst.read_stream("r"), want)


# -- each refusal pinned whole: text, request and label (KVRefError's contract)


def _truncate_refused(mgr: KVManager, err: type[KVRefError], label: str, new_len: int,
                      message: str) -> None:
    before = snapshot(mgr)
    with pytest.raises(err) as info:
        mgr.truncate("r", label, new_len)
    assert str(info.value) == f"request 'r' label {label!r}: {message}"
    assert (info.value.request_id, info.value.label) == ("r", label)
    assert_same(before, snapshot(mgr))


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
def retrieving_cfg() -> Iterator[tuple[KVManager, ManualRuntime]]:
    yield from _retrieving("cfg")


def test_truncate_during_and_after_a_failed_retrieve_names_the_stream(
        retrieving_cfg: tuple[KVManager, ManualRuntime]) -> None:
    dst, rt = retrieving_cfg
    _truncate_refused(dst, StreamUnavailableError, "cfg", 2,
                      "truncate while a retrieve is copying into the stream")
    fut = dst._streams["r"]["cfg"].read_future
    assert fut is not None
    rt.complete(fut, ok=False)
    # a readiness check reads the failure off the future and latches it (I11)
    assert not dst.admit_retrieve("r", "n", "w", None).ok
    _truncate_refused(dst, StreamUnavailableError, "cfg", 2,
                      "truncate of a stream whose retrieve failed; reset or remove the request")
