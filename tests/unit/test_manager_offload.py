"""Offload to host (claim, copy, commit/abandon), reload, and the rules R2-R6, R8, R12, R13."""

from __future__ import annotations

from typing import Any

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

from kvref.core.config import KVLayout
from kvref.core.errors import OffloadCopyError, OffloadStateError, StreamUnavailableError
from kvref.manager import KVManager
from kvref.stepping.step import KVStep, RequestOffloading, Segment, StepContext


def _setup(cpu_pages: int = 16, pages: int = 16, **kw) -> tuple[KVManager, Driver]:  # type: ignore[no-untyped-def]
    mgr = make_manager(pages=pages, page_size=4, cpu_pages=cpu_pages, **kw)
    drv = Driver(mgr)
    drv.ingest("a", "b")
    fill(drv, "a", 9)          # 3 pages
    fill(drv, "a", 5, "cfg")   # 2 pages
    fill(drv, "b", 2)          # 1 page
    return mgr, drv


@pytest.mark.parametrize("layout", [KVLayout.NHD, KVLayout.HND])
def test_offload_frees_pages_and_reload_restores_bytes(layout: KVLayout) -> None:
    mgr, drv = _setup(layout=layout)
    assert mgr.supports_eviction
    free = mgr.num_free_pages
    assert mgr.reclaimable("a") == 5
    assert mgr.offload("a") == 5
    assert mgr.num_free_pages == free + 5
    assert mgr.is_offloaded("a") and not mgr.is_offloaded("b")
    assert mgr.reclaimable("a") == 0
    assert mgr._cpu_pool is not None and mgr._cpu_pool.num_free == 16 - 5
    assert mgr.stored_len("a") == 9  # the length stays with the host copy
    check_conservation(mgr)
    # someone else takes the freed pages and writes over them
    fill(drv, "b", 20)
    assert mgr.reload("a")
    assert not mgr.is_offloaded("a")
    assert mgr._cpu_pool.num_free == 16
    drv.check("a")
    drv.check("a", "cfg")
    drv.check("b")
    drv.step([("a", "main", 1), ("a", "cfg", 1)])
    drv.check("a")
    check_conservation(mgr)


def test_offload_copies_only_pages_holding_tokens() -> None:
    mgr, drv = _setup()
    drv.step([("a", "main", 8)], commit=False)  # main now holds 5 pages for 9 tokens
    assert len(mgr._streams["a"]["main"].page_indices) == 5
    assert mgr.offload("a") == 7  # every device page is released
    assert mgr._cpu_pool is not None and mgr._cpu_pool.num_free == 16 - 5  # 3 + 2 travel
    assert mgr.reload("a")
    drv.check("a")


def test_claim_refused_while_in_flight() -> None:
    """R4, and R2: a stream the step names only as a fork source counts."""
    mgr, _drv = _setup()
    step = KVStep([Segment("a", "cfg", 1)])
    ctx = StepContext(("a",))
    assert mgr.admit(step, ctx).ok
    before = snapshot(mgr)
    assert mgr.begin_offload("a") is None  # main is not in the step, cfg is
    assert mgr.offload("a") == 0
    assert_same(before, snapshot(mgr))
    mgr.plan(step, ctx)
    assert mgr.offload("a") == 0
    mgr.commit(step, ctx)
    # b has no segment; it is named only as the pre-fork source of a padded request
    step = KVStep([Segment("a", "main", 1)], pre_forks=[("main", "cfg")])
    ctx = StepContext(("a", "b"))
    assert mgr.admit(step, ctx).ok
    assert mgr._streams["b"]["main"].step_in_flight
    assert mgr.offload("b") == 0
    mgr.plan(step, ctx)
    assert mgr.offload("b") == 0
    mgr.commit(step, ctx)
    assert mgr.offload("b") == 2  # main and the cfg the fork gave it


def test_begin_copy_commit_phases() -> None:
    mgr, drv = _setup()
    pool = mgr._cpu_pool
    assert pool is not None
    off = mgr.begin_offload("a")
    assert off is not None and sorted(off.labels) == ["cfg", "main"]
    # claimed: already "offloaded" for admission, pages still held
    assert mgr.is_offloaded("a") and mgr.reclaimable("a") == 5
    assert mgr.begin_offload("a") is None  # one offload at a time
    out = mgr.admit(KVStep([Segment("a", "main", 1)]), StepContext(("a",)))
    assert not out.ok and isinstance(out.reason, RequestOffloading)
    assert not mgr.reload("a")  # R6
    assert not mgr.publish("a")  # R13 while claimed (a falsy PublishRefused, R36)
    assert off.copy("main")
    assert not mgr.reload("a")  # R6, with a host copy already made
    with pytest.raises(OffloadStateError):
        off.copy("main")
    with pytest.raises(OffloadStateError):
        off.copy("draft")
    assert off.copy("cfg")
    assert pool.num_free == 16 - 5
    assert off.commit() == 5
    with pytest.raises(OffloadStateError):
        off.commit()
    assert mgr.reclaimable("a") == 0
    assert not mgr.publish("a")  # R13 once offloaded
    assert mgr.reload("a")
    drv.check("a")
    drv.check("a", "cfg")
    assert mgr.publish("a")


def test_abandon_discards_host_copies() -> None:
    mgr, drv = _setup()
    before = snapshot(mgr)
    off = mgr.begin_offload("a")
    assert off is not None
    off.copy("main")
    off.abandon()
    off.abandon()  # idempotent
    assert_same(before, snapshot(mgr))
    assert not mgr.is_offloaded("a")
    drv.step([("a", "main", 1)])
    drv.check("a")


def test_host_full_partial_offload() -> None:
    mgr, drv = _setup(cpu_pages=4)  # main (3 pages) fits, cfg (2) does not after it
    free = mgr.num_free_pages
    assert mgr.offload("a") == 3
    assert mgr.num_free_pages == free + 3
    streams = mgr._streams["a"]
    assert streams["main"].offloaded and streams["main"].page_indices == []
    assert not streams["cfg"].offloaded and len(streams["cfg"].page_indices) == 2
    drv.check("a", "cfg")
    assert mgr.is_offloaded("a")
    check_conservation(mgr)
    assert mgr.reload("a")
    drv.check("a")
    drv.check("a", "cfg")
    assert mgr._cpu_pool is not None and mgr._cpu_pool.num_free == 4


def test_host_full_offloads_nothing() -> None:
    mgr, _drv = _setup(cpu_pages=1)
    before = snapshot(mgr)
    assert mgr.offload("a") == 0
    assert_same(before, snapshot(mgr))
    assert not mgr.is_offloaded("a")


def _second_copy_raises(monkeypatch: pytest.MonkeyPatch, pool: Any,
                        fault: BaseException) -> Any:
    """The host pool's second stream copy raises ``fault`` (the first stream is
    on the host by then); returns the real copy, to put back."""
    real = pool._copy_out
    calls = []

    def second_fails(*args: Any) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise fault
        real(*args)

    monkeypatch.setattr(pool, "_copy_out", second_fails)
    return real


def test_copy_raising_abandons_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """R8."""
    mgr, drv = _setup()
    pool = mgr._cpu_pool
    assert pool is not None
    before = snapshot(mgr)
    real = _second_copy_raises(monkeypatch, pool, RuntimeError("DMA fault"))
    with pytest.raises(OffloadCopyError) as err:
        mgr.offload("a")
    assert "'a'" in str(err.value)
    assert pool.num_free == 16
    assert not pool.is_offloaded("a")
    assert_same(before, snapshot(mgr))
    assert not mgr.is_offloaded("a")
    monkeypatch.setattr(pool, "_copy_out", real)
    assert mgr.offload("a") == 5
    assert mgr.reload("a")
    drv.check("a")
    drv.check("a", "cfg")


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("through", ["handle", "offload"])
def test_copy_interrupted_abandons_and_propagates_unwrapped(
        monkeypatch: pytest.MonkeyPatch, stop: type[BaseException], through: str) -> None:
    """R8: a BaseException that is not an Exception is not wrapped as
    OffloadCopyError, and leaves nothing claimed: the claims are abandoned
    (host copies made before it discarded, marks undone) on the way out."""
    mgr, drv = _setup()
    pool = mgr._cpu_pool
    assert pool is not None
    before = snapshot(mgr)
    real = _second_copy_raises(monkeypatch, pool, stop())
    handle = mgr.begin_offload("a") if through == "handle" else None
    with pytest.raises(stop) as err:
        if handle is not None:
            handle.copy_all()
        else:
            mgr.offload("a")
    assert type(err.value) is stop and not isinstance(err.value, OffloadCopyError)
    if handle is not None:
        assert not handle.is_open
    assert "a" not in mgr._offloads  # nothing claimed
    assert pool.num_free == 16 and not pool.is_offloaded("a")
    assert_same(before, snapshot(mgr))
    monkeypatch.setattr(pool, "_copy_out", real)
    assert mgr.offload("a") == 5  # claimable again at once
    assert mgr.reload("a")
    drv.check("a")
    drv.check("a", "cfg")


@pytest.mark.parametrize("free", [False, True])
def test_generation_guard_reset_between_claim_and_commit(free: bool) -> None:
    mgr, drv = _setup()
    pool = mgr._cpu_pool
    assert pool is not None
    off = mgr.begin_offload("a")
    assert off is not None
    off.copy_all()
    mgr.reset_request("a", free=free)
    n_free = mgr.num_free_pages
    assert off.commit() == 0
    assert pool.num_free == 16
    assert not mgr.is_offloaded("a")
    assert mgr.stored_len("a") == 0 and mgr.stored_len("a", "cfg") == 0
    assert mgr.num_free_pages == n_free
    assert not mgr.reload("a")
    check_conservation(mgr)
    drv.model[("a", "main")] = []
    drv.model[("a", "cfg")] = []
    drv.step([("a", "main", 2)])
    drv.check("a")


def test_reload_all_or_nothing_when_device_short() -> None:
    mgr, drv = _setup(pages=9)  # 8 usable: a holds 5, b 1
    assert mgr.offload("a") == 5
    fill(drv, "b", 14)  # b now holds 4 pages: 2 free
    before = snapshot(mgr)
    assert not mgr.reload("a")  # needs 5
    assert_same(before, snapshot(mgr))
    assert mgr.is_offloaded("a")
    mgr.remove_request("b")
    assert mgr.reload("a")
    drv.check("a")
    drv.check("a", "cfg")


def test_reset_of_offloaded_request_forgets_host_copy() -> None:
    """R12."""
    mgr, drv = _setup()
    assert mgr.offload("a") == 5
    mgr.reset_request("a")
    assert mgr._cpu_pool is not None and mgr._cpu_pool.num_free == 16
    assert not mgr.is_offloaded("a")
    assert mgr.stored_len("a") == 0
    assert not mgr.reload("a")
    drv.model[("a", "main")] = []
    drv.model[("a", "cfg")] = []
    drv.step([("a", "main", 3)])
    drv.check("a")
    check_conservation(mgr)


def test_remove_offloaded_request_empties_host_pool() -> None:
    mgr, _drv = _setup()
    assert mgr.offload("a") == 5
    mgr.remove_request("a")
    assert mgr._cpu_pool is not None and mgr._cpu_pool.num_free == 16
    mgr.remove_request("b")
    assert mgr.num_free_pages == 15  # I12


def test_no_pool_no_eviction() -> None:
    mgr = make_manager()
    drv = Driver(mgr)
    drv.ingest("a")
    fill(drv, "a", 3)
    assert not mgr.supports_eviction
    assert mgr.offload("a") == 0 and mgr.begin_offload("a") is None
    assert not mgr.reload("a") and not mgr.is_offloaded("a")


def test_offload_priority_and_unknown() -> None:
    mgr, drv = _setup()
    assert mgr.get_offload_priority("a") > mgr.get_offload_priority("b")
    assert mgr.offload("nope") == 0
    assert not mgr.reload("nope")
    assert mgr.read_stream("a").shape[1] == 9
    mgr.offload("a")
    with pytest.raises(StreamUnavailableError, match="offloaded"):
        mgr.read_stream("a")
    assert torch.equal(drv.expected("b"), mgr.read_stream("b"))
