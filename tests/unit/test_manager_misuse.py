"""Misuse raises a KVRefError subclass naming the request and label, and changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _manager_fixtures import Driver, assert_same, fill, make_manager, snapshot

from kvref.core.errors import (
    InvalidStepError,
    KVRefError,
    KVShapeError,
    StepInFlightError,
    StepNotAdmittedError,
    UnknownRequestError,
)
from kvref.manager import KVManager
from kvref.stepping.step import KVStep, Segment, StepContext


@pytest.fixture
def mgr() -> KVManager:
    m = make_manager(pages=16, page_size=4, cpu_pages=8)
    drv = Driver(m)
    drv.ingest("a", "b")
    fill(drv, "a", 5)
    fill(drv, "b", 2)
    return m


def _raises(mgr: KVManager, exc: type[KVRefError], fn: Callable[[], Any],
            *names: str) -> KVRefError:
    before = snapshot(mgr)
    with pytest.raises(exc) as info:
        fn()
    assert isinstance(info.value, KVRefError)
    msg = str(info.value)
    for name in names:
        assert repr(name) in msg, (name, msg)
    assert_same(before, snapshot(mgr))
    return info.value


UNKNOWN = KVStep([Segment("a", "main", 1), Segment("zz", "draft", 2)])


def test_unknown_request_admit(mgr: KVManager) -> None:
    err = _raises(mgr, UnknownRequestError, lambda: mgr.admit(UNKNOWN, StepContext(("a", "zz"))),
                  "zz")
    assert err.request_id == "zz"


def test_unknown_request_admit_names_label(mgr: KVManager) -> None:
    """DESIGN: every misuse names the request *and label*; the segment has one."""
    _raises(mgr, UnknownRequestError, lambda: mgr.admit(UNKNOWN, StepContext(("a", "zz"))),
            "zz", "draft")


def test_unknown_request_in_padded_fork_ids(mgr: KVManager) -> None:
    step = KVStep([Segment("a", "main", 1)], pre_forks=[("main", "cfg")])
    _raises(mgr, UnknownRequestError, lambda: mgr.admit(step, StepContext(("a", "zz"))), "zz")


def test_unknown_request_plan_and_commit(mgr: KVManager) -> None:
    ctx = StepContext(("zz",))
    step = KVStep([Segment("zz", "main", 1)])
    with pytest.raises(KVRefError) as e1:
        mgr.plan(step, ctx)
    assert isinstance(e1.value, (UnknownRequestError, StepNotAdmittedError))
    assert "'zz'" in str(e1.value)
    _raises(mgr, KVRefError, lambda: mgr.commit(step, ctx), "zz", "main")


def test_unknown_request_reset_and_retrieve(mgr: KVManager) -> None:
    _raises(mgr, UnknownRequestError, lambda: mgr.reset_request("zz"), "zz")
    other = make_manager()
    d = Driver(other)
    d.ingest("zz")
    fill(d, "zz", 3)
    pub = other.publish("zz")
    _raises(mgr, UnknownRequestError, lambda: mgr.admit_retrieve("zz", "n", "w", pub), "zz")
    other.cleanup()
    # removal of an unknown request is idempotent, not an error
    before = snapshot(mgr)
    mgr.remove_request("zz")
    assert_same(before, snapshot(mgr))
    with pytest.raises(UnknownRequestError, match="'zz'"):
        mgr.stored_len("zz")
    with pytest.raises(UnknownRequestError, match="'nolabel'"):
        mgr.stored_len("a", "nolabel")


def test_negative_span(mgr: KVManager) -> None:
    step = KVStep([Segment("b", "main", 2), Segment("a", "cfg", -1)])
    err = _raises(mgr, InvalidStepError, lambda: mgr.admit(step, StepContext(("a", "b"))),
                  "a", "cfg")
    assert (err.request_id, err.label) == ("a", "cfg")


def test_duplicate_stream(mgr: KVManager) -> None:
    step = KVStep([Segment("a", "main", 2), Segment("b", "main", 1), Segment("a", "main", 1)])
    _raises(mgr, InvalidStepError, lambda: mgr.admit(step, StepContext(("a", "b"))),
            "a", "main")


def test_fork_onto_itself(mgr: KVManager) -> None:
    step = KVStep([Segment("a", "main", 1)], pre_forks=[("main", "main")])
    _raises(mgr, InvalidStepError, lambda: mgr.admit(step, StepContext(("a",))), "main")


def test_commit_never_admitted(mgr: KVManager) -> None:
    step = KVStep([Segment("b", "main", 1), Segment("a", "main", 3)])
    _raises(mgr, StepNotAdmittedError, lambda: mgr.commit(step, StepContext(("a", "b"))),
            "b", "main")


def test_commit_partly_admitted_undoes_itself(mgr: KVManager) -> None:
    """a is in flight, b is not: the commit must not add a's span before refusing."""
    admitted = KVStep([Segment("a", "main", 1)])
    ctx = StepContext(("a",))
    assert mgr.admit(admitted, ctx).ok
    mgr.plan(admitted, ctx)
    wrong = KVStep([Segment("a", "main", 1), Segment("b", "main", 1)])
    _raises(mgr, StepNotAdmittedError, lambda: mgr.commit(wrong, StepContext(("a", "b"))),
            "b", "main")
    mgr.commit(admitted, ctx)
    assert mgr.stored_len("a") == 6


def test_double_commit(mgr: KVManager) -> None:
    step = KVStep([Segment("a", "main", 1)])
    ctx = StepContext(("a",))
    assert mgr.admit(step, ctx).ok
    mgr.plan(step, ctx)
    mgr.commit(step, ctx)
    _raises(mgr, StepNotAdmittedError, lambda: mgr.commit(step, ctx), "a", "main")
    assert mgr.stored_len("a") == 6


def test_plan_before_admit(mgr: KVManager) -> None:
    step = KVStep([Segment("a", "main", 1)])
    _raises(mgr, StepNotAdmittedError, lambda: mgr.plan(step, StepContext(("a",))),
            "a", "main")


def test_write_before_any_plan(mgr: KVManager) -> None:
    fresh = make_manager()
    k = torch.zeros(1, 2, 4)
    _raises(fresh, StepNotAdmittedError, lambda: fresh.write_kv(k, k), "main")
    with pytest.raises(StepNotAdmittedError):
        fresh.read_kv()


@pytest.fixture
def planned(mgr: KVManager) -> KVManager:
    step = KVStep([Segment("a", "main", 3), Segment("b", "main", 1)])
    assert mgr.admit(step, StepContext(("a", "b"))).ok
    mgr.plan(step, StepContext(("a", "b")))
    return mgr


@pytest.mark.parametrize(
    "shape,dtype",
    [((3, 2, 4), torch.float32),   # too few tokens
     ((5, 2, 4), torch.float32),   # too many
     ((4, 4, 2), torch.float32),   # wrong head shape, same numel
     ((4, 2, 4, 1), torch.float32),
     ((4, 2, 4), torch.float64),
     ((4, 2, 4), torch.bfloat16)],
)
def test_write_kv_wrong_shape_or_dtype(planned: KVManager, shape: tuple[int, ...],
                                       dtype: torch.dtype) -> None:
    mgr = planned
    good = torch.ones(4, 2, 4)
    bad = torch.ones(shape, dtype=dtype)
    for k, v in ((bad, good), (good, bad)):
        err = _raises(mgr, KVShapeError, lambda k=k, v=v: mgr.write_kv(k, v, layer_idx=0))
        assert err.label == "main"
        assert str(tuple(shape)) in str(err) and "(4, 2, 4)" in str(err)
    _raises(mgr, StepNotAdmittedError, lambda: mgr.write_kv(good, good, label="cfg"), "cfg")
    mgr.write_kv(good, good, layer_idx=0)  # the right one still works


def test_reset_remove_while_in_flight(planned: KVManager) -> None:
    """R5."""
    mgr = planned
    for fn in (lambda: mgr.reset_request("a"), lambda: mgr.reset_request("a", free=True),
               lambda: mgr.remove_request("a")):
        _raises(mgr, StepInFlightError, fn, "a", "main")
    assert mgr.has_request("a")
    step = KVStep([Segment("a", "main", 3), Segment("b", "main", 1)])
    mgr.commit(step, StepContext(("a", "b")))
    mgr.reset_request("a")
    mgr.remove_request("a")
    assert not mgr.has_request("a")


def test_reset_in_flight_fork_source_only(mgr: KVManager) -> None:
    """R2 + R5: b is named only as a padded pre-fork source, and is in flight."""
    step = KVStep([Segment("a", "main", 1)], pre_forks=[("main", "cfg")])
    ctx = StepContext(("a", "b"))
    assert mgr.admit(step, ctx).ok
    _raises(mgr, StepInFlightError, lambda: mgr.reset_request("b"), "b")
    _raises(mgr, StepInFlightError, lambda: mgr.remove_request("b"), "b")
    mgr.plan(step, ctx)
    mgr.commit(step, ctx)
    mgr.remove_request("b")


def test_write_kv_error_message_names_plan_label(planned: KVManager) -> None:
    """A write_kv error carries label='main' but its message does not say so:
    errors.KVRefError only prefixes ``label`` when ``request_id`` is set."""
    bad = torch.ones(3, 2, 4)
    with pytest.raises(KVShapeError) as info:
        planned.write_kv(bad, bad, layer_idx=0)
    assert "'main'" in str(info.value)
