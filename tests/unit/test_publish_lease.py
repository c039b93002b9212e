"""publish is a lease (R33, R34); stale publications fail latched (R35); publish
answers typed refusals (R36); admit_retrieve routes without a graph (R37)."""

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
    snapshot,
)

from kvref import (
    AdmitOutcome,
    AdmitRuntimeError,
    KVConfig,
    KVManager,
    PublishedKVInfo,
    PublishLeasedError,
    PublishRefused,
    RequestOffloading,
    RetentionPolicy,
    RetrieveInProgress,
    RetrieveStale,
    TransferEngineInfo,
    UnknownRequest,
)
from kvref.core.config import DEFAULT_PUBLISH_LEASE_S, KVReqConfig
from kvref.core.errors import (
    InvalidArgumentError,
    InvalidConfigError,
    PublishedInfoError,
    UnknownRequestError,
)
from kvref.stepping.step import PublishLeased
from kvref.testing.manual_runtime import ManualRuntime
from kvref.transfer.engine import StaleSourceError
from kvref.transfer.lease import LeaseTable

LEASE_S = 30.0


def manager(runtime: ManualRuntime, lease_s: float | None = None, cpu_pages: int = 0
            ) -> KVManager:
    cfg = dataclasses.replace(make_cfg(pages=16, page_size=4, cpu_pages=cpu_pages),
                              publish_lease_s=lease_s)
    return KVManager(cfg, "kv", None, TransferEngineInfo(), "cpu", dtype=torch.float32,
                     runtime=runtime)


@pytest.fixture
def rt() -> ManualRuntime:
    return ManualRuntime()


@pytest.fixture
def src(rt: ManualRuntime) -> Iterator[tuple[KVManager, Driver]]:
    mgr = manager(rt, LEASE_S, cpu_pages=8)
    drv = Driver(mgr)
    drv.ingest("r")
    fill(drv, "r", 10)
    fill(drv, "r", 3, "cfg")
    yield mgr, drv
    mgr.cleanup()


@pytest.fixture
def dst(rt: ManualRuntime) -> Iterator[KVManager]:
    mgr = manager(rt)
    yield mgr
    rt.complete_all()
    mgr.cleanup()


def published(mgr: KVManager, rid: str) -> PublishedKVInfo:
    info = mgr.publish(rid)
    assert isinstance(info, PublishedKVInfo), info
    return info


# -- R33: the lease pins -----------------------------------------------------------------


def test_lease_refuses_offload_reset_remove_and_changes_nothing(src) -> None:  # type: ignore[no-untyped-def]
    mgr, _ = src
    published(mgr, "r")
    before = snapshot(mgr)
    assert mgr.begin_offload("r") is None
    assert mgr.offload("r") == 0
    for call in (lambda: mgr.reset_request("r"), lambda: mgr.reset_request("r", free=True),
                 lambda: mgr.remove_request("r")):
        with pytest.raises(PublishLeasedError, match=r"'r'.*release_published"):
            call()
    assert_same(before, snapshot(mgr))
    check_conservation(mgr)


def test_release_ends_the_lease(src) -> None:  # type: ignore[no-untyped-def]
    mgr, _ = src
    published(mgr, "r")
    mgr.release_published("r")
    mgr.release_published("r")  # idempotent
    assert mgr.offload("r") > 0
    assert mgr.reload("r")
    mgr.remove_request("r")
    mgr.release_published("r")  # gone: still a no-op, the consumer cannot tell
    assert not mgr.has_request("r")


def test_lease_expires_on_the_runtime_clock(src, rt) -> None:  # type: ignore[no-untyped-def]
    mgr, _ = src
    published(mgr, "r")
    rt.advance(LEASE_S - 1)
    with pytest.raises(PublishLeasedError):
        mgr.remove_request("r")
    rt.advance(1)
    mgr.remove_request("r")
    assert not mgr.has_request("r")


def test_republish_renews_one_lease_and_is_idempotent(src, rt) -> None:  # type: ignore[no-untyped-def]
    mgr, _ = src
    first = published(mgr, "r")
    rt.advance(LEASE_S - 1)
    again = published(mgr, "r")  # unchanged request: the same info, deadline moved
    assert again.get(0) == first.get(0) and again.request_id == first.request_id == "r"
    rt.advance(LEASE_S - 1)
    with pytest.raises(PublishLeasedError):
        mgr.reset_request("r")
    mgr.release_published("r")  # one release ends it, however many publishes
    mgr.reset_request("r")


def test_no_timeout_when_none_is_given(rt) -> None:  # type: ignore[no-untyped-def]
    mgr = manager(rt)  # publish_lease_s=None, explicitly
    assert mgr.config.publish_lease_s is None
    mgr.ingest_request("r")
    published(mgr, "r")
    rt.advance(1e9)
    with pytest.raises(PublishLeasedError):
        mgr.remove_request("r")


def test_default_lease_expires_after_480_s(rt) -> None:  # type: ignore[no-untyped-def]
    """R49: a config that says nothing about the lease gets vLLM's producer
    timeout (VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s): a consumer that died
    pins the publisher's pages for 8 minutes, not forever."""
    cfg = make_cfg(pages=16, page_size=4, cpu_pages=8)
    assert cfg.publish_lease_s == DEFAULT_PUBLISH_LEASE_S == 480.0
    mgr = KVManager(cfg, "kv", None, TransferEngineInfo(), "cpu", dtype=torch.float32,
                    runtime=rt)
    drv = Driver(mgr)
    drv.ingest("r")
    fill(drv, "r", 5)
    published(mgr, "r")
    rt.advance(DEFAULT_PUBLISH_LEASE_S - 1)
    assert mgr.offload("r") == 0  # still leased: pinned (R33)
    with pytest.raises(PublishLeasedError):
        mgr.remove_request("r")
    rt.advance(1)  # the consumer never released: the lease ends on its own
    assert mgr.offload("r") == 2
    assert mgr.reload("r")
    mgr.remove_request("r")
    check_conservation(mgr)
    mgr.cleanup()


@pytest.mark.parametrize("bad", [0, -1.0, True, "5"])
def test_lease_timeout_config_checked(bad: object) -> None:
    with pytest.raises(InvalidConfigError, match="publish_lease_s"):
        dataclasses.replace(make_cfg(), publish_lease_s=bad)


def test_steps_still_run_on_a_leased_request(src) -> None:  # type: ignore[no-untyped-def]
    mgr, drv = src
    info = published(mgr, "r")
    fill(drv, "r", 2)  # a decode on the publisher: allowed, and bumps the generation
    drv.check("r")
    assert mgr._streams["r"]["main"].generation != info.get(0)["main"].generation


# -- R35: stale publications ------------------------------------------------------------


def test_stale_publication_is_refused_and_latched(src, dst) -> None:  # type: ignore[no-untyped-def]
    mgr, _ = src
    info = published(mgr, "r")
    mgr.release_published("r")
    mgr.reset_request("r")  # the pages the info names are free for reuse now
    dst.ingest_request("r")
    free = dst.num_free_pages
    out = dst.admit_retrieve("r", published=info)
    assert not out.ok and isinstance(out.reason, RetrieveStale)
    assert isinstance(out.reason, AdmitRuntimeError)  # terminal, as every latched failure
    assert dst.num_free_pages == free and dst.stored_len("r") == 0  # nothing taken, copied
    # latched (I11): every later readiness check says so, until reset
    later = dst.admit_retrieve("r")
    assert not later.ok and isinstance(later.reason, AdmitRuntimeError)
    dst.reset_request("r")
    assert dst.admit_retrieve("r") == AdmitOutcome(ok=True, ready=True)


def test_removed_publisher_stream_is_stale(src, dst) -> None:  # type: ignore[no-untyped-def]
    mgr, _ = src
    info = published(mgr, "r")
    mgr.release_published("r")
    mgr.remove_request("r")
    dst.ingest_request("r")
    out = dst.admit_retrieve("r", published=info)
    assert not out.ok and isinstance(out.reason, RetrieveStale)


def test_publisher_change_during_the_copy_fails_it_latched(src, dst, rt) -> None:  # type: ignore[no-untyped-def]
    mgr, drv = src
    info = published(mgr, "r")
    dst.ingest_request("r")
    out = dst.admit_retrieve("r", "n", "w", info)
    assert out.ok and not out.ready  # the copy is queued on the runtime
    fill(drv, "r", 1)  # the publisher's stream moves before the copy runs
    rt.complete_all()
    later = dst.admit_retrieve("r", "n", "w", info)
    assert not later.ok and isinstance(later.reason, AdmitRuntimeError)
    assert isinstance(dst._streams["r"]["main"].read_error, StaleSourceError)


def test_fresh_publication_copies(src, dst, rt) -> None:  # type: ignore[no-untyped-def]
    mgr, drv = src
    dst.ingest_request("r")
    out = dst.admit_retrieve("r", published=published(mgr, "r"))
    assert out.ok and not out.ready
    rt.complete_all()
    assert dst.admit_retrieve("r").ready
    assert torch.equal(dst.read_stream("r"), drv.expected("r"))
    assert torch.equal(dst.read_stream("r", "cfg"), drv.expected("r", "cfg"))
    mgr.release_published("r")
    mgr.remove_request("r")


def test_hand_built_info_is_unchecked(src, dst, rt) -> None:  # type: ignore[no-untyped-def]
    """No generation, no request id: nothing to check against, as before R35."""
    mgr, drv = src
    info = published(mgr, "r")
    main = dataclasses.replace(info.get(0)["main"], generation=None)
    bare = PublishedKVInfo(info={0: {"main": main}})
    dst.ingest_request("r")
    assert dst.admit_retrieve("r", published=bare).ok
    rt.complete_all()
    assert torch.equal(dst.read_stream("r"), drv.expected("r"))


# -- R36: typed publish answers -------------------------------------------------------------


def test_publish_of_an_offloaded_request_is_a_typed_refusal(src, dst) -> None:  # type: ignore[no-untyped-def]
    mgr, _ = src
    assert mgr.offload("r") > 0
    before = snapshot(mgr)
    got = mgr.publish("r")
    assert isinstance(got, PublishRefused) and isinstance(got.reason, RequestOffloading)
    assert not got and got.reason.request_id == "r"
    assert_same(before, snapshot(mgr))
    mgr.remove_request("r")  # a refused publish took no lease
    dst.ingest_request("r")
    with pytest.raises(PublishedInfoError, match=r"publish was refused.*RequestOffloading"):
        dst.admit_retrieve("r", published=got)  # type: ignore[arg-type]
    assert dst.stored_len("r") == 0


def test_publish_while_receiving_or_failed(src, dst, rt) -> None:  # type: ignore[no-untyped-def]
    mgr, _ = src
    dst.ingest_request("r")
    dst.admit_retrieve("r", published=published(mgr, "r"))
    got = dst.publish("r")
    assert isinstance(got, PublishRefused) and isinstance(got.reason, RetrieveInProgress)
    for fut in [s.read_future for s in dst._streams["r"].values() if s.read_future]:
        rt.complete(fut, ok=False)
    got = dst.publish("r")
    assert isinstance(got, PublishRefused) and isinstance(got.reason, AdmitRuntimeError)


def test_publish_unknown_request_is_a_typed_refusal(dst) -> None:  # type: ignore[no-untyped-def]
    """R48: never ingested: a falsy PublishRefused naming the request, no lease."""
    before = snapshot(dst)
    got = dst.publish("nope")
    assert isinstance(got, PublishRefused) and isinstance(got.reason, UnknownRequest)
    assert not got and got.reason.request_id == "nope" and "removed" in got.reason.message
    assert_same(before, snapshot(dst))
    assert dst._table.leases.leased() == []


def test_publish_after_another_thread_removed_the_request(src, dst) -> None:  # type: ignore[no-untyped-def]
    """R48, the reference's race: remove_request pops the streams (another
    thread) between the engine's forward and its publish. The engine gets a
    value to plan around, as for an offloaded request, and a consumer handed
    it retrieves nothing."""
    mgr, _ = src
    mgr.remove_request("r")
    got = mgr.publish("r")
    assert isinstance(got, PublishRefused) and isinstance(got.reason, UnknownRequest)
    assert mgr._table.leases.leased() == []  # nothing leased: nothing to release
    mgr.release_published("r")  # and a release anyway is the usual no-op
    mgr.ingest_request("r")  # a re-ingested request is not pinned by it
    mgr.remove_request("r")
    dst.ingest_request("r")
    with pytest.raises(PublishedInfoError, match=r"publish was refused.*UnknownRequest"):
        dst.admit_retrieve("r", published=got)  # type: ignore[arg-type]
    assert dst.stored_len("r") == 0
    with pytest.raises(UnknownRequestError):  # retrieve into an unknown request still raises
        dst.admit_retrieve("gone", published=None)


# -- R37: routes ------------------------------------------------------------------------------


def test_no_route_retrieves_every_published_label(src, dst, rt) -> None:  # type: ignore[no-untyped-def]
    """The forked request arrives with cfg too, and is ready only once both landed."""
    mgr, drv = src
    info = published(mgr, "r")
    dst.ingest_request("r")  # default routing: main only, which a route would keep to
    out = dst.admit_retrieve("r", published=info)
    assert out.ok and not out.ready
    assert sorted(dst.labels("r")) == ["cfg", "main"]
    futs = {label: s.read_future for label, s in dst._streams["r"].items()}
    assert all(f is not None for f in futs.values())
    rt.complete(futs["main"])  # type: ignore[arg-type]
    assert not dst.admit_retrieve("r").ready  # cfg still copying
    rt.complete(futs["cfg"])  # type: ignore[arg-type]
    assert dst.admit_retrieve("r").ready
    assert torch.equal(dst.read_stream("r", "cfg"), drv.expected("r", "cfg"))


def test_a_route_still_routes(src, dst, rt) -> None:  # type: ignore[no-untyped-def]
    mgr, _ = src
    dst.ingest_request("r", KVReqConfig(labels={("n", "w"): ("main",)}))
    out = dst.admit_retrieve("r", "n", "w", published(mgr, "r"))  # positional, as the reference
    assert out.ok and dst.labels("r") == ["main"]


def test_half_a_route_raises(dst) -> None:  # type: ignore[no-untyped-def]
    dst.ingest_request("r")
    with pytest.raises(InvalidArgumentError, match="graph_walk"):
        dst.admit_retrieve("r", "n")


def test_config_default_is_finite() -> None:
    """R49: 480 s unless given; None only when the engine says so."""
    shape = dict(num_layers=1, num_kv_heads=1, head_dim=1, max_seq_len=8, max_num_pages=2,
                 page_size=1, num_qo_heads=1)
    assert KVConfig(**shape).publish_lease_s == 480.0  # type: ignore[arg-type]
    assert KVConfig(**shape, publish_lease_s=None).publish_lease_s is None  # type: ignore[arg-type]


def test_a_refused_reset_does_not_drain(src, dst, rt) -> None:  # type: ignore[no-untyped-def]
    """A leased request that is also receiving a retrieve: the refused reset
    and remove leave the retrieve running (a misuse changes nothing, I10)."""
    mgr, _ = src
    dst.ingest_request("r")
    published(dst, "r")  # dst leases its (empty) request to a third manager
    assert dst.admit_retrieve("r", published=published(mgr, "r")).ok  # then receives
    for call in (lambda: dst.reset_request("r"), lambda: dst.remove_request("r")):
        with pytest.raises(PublishLeasedError):
            call()
    assert rt.pending and rt.deferred == 0


# -- the lease table itself ---------------------------------------------------


class _Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


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


# -- R71: a retrieve into a leased request gives back no page it names ------------------


def test_a_retrieve_into_a_leased_window_is_refused_and_changes_nothing(rt) -> None:  # type: ignore[no-untyped-def]
    """b holds r (a window of 4 tokens) and published it: the lease is held.
    A retrieve of a's longer publication of r would release b's slot 0 (W16),
    a page b's publication names; it is refused until the lease ends."""
    def windowed(name: str) -> KVManager:
        cfg = dataclasses.replace(make_cfg(pages=16, page_size=4, retention={
            "main": RetentionPolicy(context_budget=4)}), publish_lease_s=LEASE_S)
        return KVManager(cfg, name, None, TransferEngineInfo(), "cpu", dtype=torch.float32,
                         runtime=rt)

    a, b = windowed("a"), windowed("b")
    da, db = Driver(a), Driver(b)
    da.ingest("r")
    fill(da, "r", 12)  # a released slots 0 and 1
    db.ingest("r")
    fill(db, "r", 4)
    published(b, "r")  # a third manager is still copying it
    before = snapshot(b)
    out = b.admit_retrieve("r", published=published(a, "r"))
    assert not out.ok and isinstance(out.reason, PublishLeased), out
    assert out.reason.request_id == "r" and out.reason.label == "main"
    assert "release_published" in out.reason.message
    assert_same(before, snapshot(b))
    check_conservation(b)
    b.release_published("r")
    out = b.admit_retrieve("r", published=published(a, "r"))
    assert out.ok and not out.ready, out
    rt.complete_all()
    assert b.admit_retrieve("r").ready
    assert b._streams["r"]["main"].stored_len == 12
    a.cleanup()
    b.cleanup()
