"""Typed offload and reload outcomes, the host-pool view, page-need queries and
the offload priority (R44-R46).

Each reason is produced by the scenario that causes it, the ``int``/``bool``
calls are checked to agree with the typed ones, and every query is checked
against what the call it predicts then does. The `test_plant_*` tests put a
realistic bug back and show that the same checks fail on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest
from _manager_fixtures import Driver, assert_same, check_conservation, fill, make_manager, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

import kvref.offload.calls
import kvref.offload.phases
from kvref import (
    HostPoolView,
    InvalidStepError,
    KVManager,
    KVStep,
    OffloadOutcome,
    OffloadReason,
    ReloadReason,
    Segment,
    StepContext,
    UnknownRequestError,
)
from kvref.core.errors import InvalidArgumentError
from kvref.offload.phases import HostOffload
from kvref.stepping.step import AllocationFailed
from kvref.testing.driver import DriverConfig
from kvref.testing.exhaustive import run_trace
from kvref_model import core as m

R = OffloadReason


def _setup(cpu_pages: int = 16, pages: int = 16) -> tuple[KVManager, Driver]:
    """``a``: main 9 tokens (3 pages), cfg 5 (2 pages); ``b``: main 2 (1 page)."""
    mgr = make_manager(sharing=False, pages=pages, page_size=4, cpu_pages=cpu_pages)
    drv = Driver(mgr)
    drv.ingest("a", "b")
    fill(drv, "a", 9)
    fill(drv, "a", 5, "cfg")
    fill(drv, "b", 2)
    return mgr, drv


def _admit(mgr: KVManager, rid: str, label: str = "main", span: int = 1) -> KVStep:
    step = KVStep([Segment(rid, label, span)])
    assert mgr.admit(step, StepContext([rid])).ok
    return step


# -- offload: every reason, from the scenario that causes it ----------------------------


def test_complete_offload_moves_everything_and_the_int_agrees() -> None:
    mgr, drv = _setup()
    out = mgr.offload_outcome("a")
    assert out == OffloadOutcome(5, ("main", "cfg"), (), None)
    assert out.complete and not out.partial
    drv.mgr.reload("a")
    assert mgr.offload("a") == 5  # the int is the outcome's pages
    check_conservation(mgr)


def _refused(mgr: KVManager, rid: str) -> OffloadOutcome:
    """The typed refusal, after checking it and the int call changed nothing."""
    before = snapshot(mgr)
    out = mgr.offload_outcome(rid)
    assert mgr.offload(rid) == 0
    assert_same(before, snapshot(mgr))
    assert out.pages_freed == 0 and not out.moved and not out.complete
    return out


def test_offload_refusals_say_why() -> None:
    mgr, _ = _setup()
    assert _refused(mgr, "nope").reason is R.UNKNOWN_REQUEST
    step = _admit(mgr, "a")
    assert _refused(mgr, "a").reason is R.STEP_IN_FLIGHT  # R4
    mgr.commit(step, StepContext(["a"]))
    handle = mgr.begin_offload("a")
    assert handle is not None
    assert _refused(mgr, "a").reason is R.OFFLOAD_RUNNING
    handle.abandon()
    mgr.ingest_request("empty")
    assert _refused(mgr, "empty").reason is R.NOTHING_ON_DEVICE
    assert mgr.offload("a") == 5  # main is 10 tokens now: still 3 pages
    assert _refused(mgr, "a").reason is R.NOTHING_ON_DEVICE  # already on the host


def test_no_host_pool() -> None:
    mgr = make_manager(sharing=False, pages=8, page_size=4)
    drv = Driver(mgr)
    drv.ingest("a")
    fill(drv, "a", 3)
    assert _refused(mgr, "a").reason is R.NO_HOST_POOL
    assert mgr.reload_outcome("a").reason is ReloadReason.NO_HOST_POOL
    assert mgr.host_pool() == HostPoolView(0, 0, 0)
    assert mgr.get_offload_priority("a") == 0 and mgr.reload_pages_needed("a") == 0


def test_partial_offload_host_pool_full() -> None:
    mgr, drv = _setup(cpu_pages=3)  # main's 3 pages fit, cfg's 2 do not
    free = mgr.num_free_pages
    out = mgr.offload_outcome("a")
    assert out == OffloadOutcome(3, ("main",), ("cfg",), R.HOST_POOL_FULL)
    assert out.partial
    assert mgr.num_free_pages == free + 3
    drv.check("a", "cfg")  # kept on device, intact
    # what is left can be offloaded once the host has room
    assert mgr.get_offload_priority("a") == 2
    assert mgr.reload("a")
    assert mgr.offload_outcome("a").reason is R.HOST_POOL_FULL


def test_nothing_fits_on_the_host() -> None:
    mgr, _ = _setup(cpu_pages=1)
    before = snapshot(mgr)
    out = mgr.offload_outcome("a")
    assert out == OffloadOutcome(0, (), ("main", "cfg"), R.HOST_POOL_FULL)
    assert not out.partial
    assert_same(before, snapshot(mgr))


def test_handle_outcomes_changed_removed_not_copied() -> None:
    mgr, drv = _setup()
    # reset between copy and commit: the generation guard voids the offload
    off = mgr.begin_offload("a")
    assert off is not None and off.outcome is None
    off.copy_all()
    mgr.reset_request("a")
    assert off.commit() == 0
    assert off.outcome == OffloadOutcome(0, (), ("main", "cfg"), R.REQUEST_CHANGED)
    # reset before the copy: the copy refuses and says why
    drv.ingest("c")
    fill(drv, "c", 4)
    off = mgr.begin_offload("c")
    assert off is not None
    mgr.reset_request("c")
    assert not off.copy("main") and off.refusals == {"main": R.REQUEST_CHANGED}
    off.commit()
    assert off.outcome is not None and off.outcome.reason is R.REQUEST_CHANGED
    # committed without a copy
    off = mgr.begin_offload("b")
    assert off is not None
    off.commit()
    assert off.outcome == OffloadOutcome(0, (), ("main",), R.NOT_COPIED)
    # removed during the offload
    off = mgr.begin_offload("b")
    assert off is not None
    off.copy_all()
    mgr.remove_request("b")
    assert off.commit() == 0
    assert off.outcome == OffloadOutcome(0, (), ("main",), R.REQUEST_REMOVED)
    check_conservation(mgr)
    assert mgr.host_pool().used == 0


# -- reload ---------------------------------------------------------------------------------


def test_reload_outcomes() -> None:
    mgr, drv = _setup(pages=9)  # 8 usable: a holds 5, b 1
    q = ReloadReason
    assert mgr.reload_outcome("nope").reason is q.UNKNOWN_REQUEST
    assert mgr.reload_outcome("a").reason is q.NOTHING_ON_HOST
    off = mgr.begin_offload("a")
    assert off is not None
    assert mgr.reload_outcome("a").reason is q.OFFLOAD_RUNNING  # R6, nothing copied yet
    off.copy_all()
    before = snapshot(mgr)
    assert mgr.reload_outcome("a").reason is q.OFFLOAD_RUNNING  # R6
    assert mgr.reload_pages_needed("a") == 0
    assert_same(before, snapshot(mgr))
    assert off.commit() == 5
    fill(drv, "b", 20)  # b grows to 22 tokens: 6 of the 8 pages, 2 free
    assert mgr.reload_pages_needed("a") == 5
    before = snapshot(mgr)
    out = mgr.reload_outcome("a")
    assert (out.reason, out.pages_short, out.pages_taken) == (q.DEVICE_FULL, 3, 0)
    assert not mgr.reload("a")
    assert_same(before, snapshot(mgr))
    mgr.remove_request("b")
    free = mgr.num_free_pages
    out = mgr.reload_outcome("a")
    assert out.reloaded and out.pages_taken == 5 and set(out.labels) == {"main", "cfg"}
    assert mgr.num_free_pages == free - 5
    drv.check("a")
    drv.check("a", "cfg")


# -- host pool view ------------------------------------------------------------------------


def test_host_pool_view_follows_offload_and_reload() -> None:
    mgr, _ = _setup(cpu_pages=10)
    assert mgr.host_pool() == HostPoolView(capacity=10, free=10, used=0)
    mgr.offload("a")
    assert mgr.host_pool() == HostPoolView(10, 5, 5)
    off = mgr.begin_offload("b")
    assert off is not None
    off.copy_all()
    assert mgr.host_pool() == HostPoolView(10, 4, 6)  # a copy not yet committed is used
    off.abandon()
    assert mgr.host_pool() == HostPoolView(10, 5, 5)
    mgr.reload("a")
    assert mgr.host_pool() == HostPoolView(10, 10, 0)


# -- offload priority --------------------------------------------------------------------------


def check_priority(mgr: KVManager, rid: str) -> None:
    """The priority is what a claim would take now, and 0 exactly when refused."""
    prio = mgr.get_offload_priority(rid)
    before = snapshot(mgr)
    off = mgr.begin_offload(rid) if mgr.supports_eviction else None
    if off is None:
        assert prio == 0, f"{rid}: priority {prio}, but a claim is refused"
        return
    taken = sum(len(c.pages) for c in off.claims.values())
    off.abandon()
    assert_same(before, snapshot(mgr))
    assert prio == taken > 0, f"{rid}: priority {prio}, a claim takes {taken}"


def priority_cases() -> Iterator[tuple[str, KVManager, str]]:
    mgr, _ = _setup()
    yield "resident", mgr, "a"
    yield "unknown", mgr, "nope"
    _admit(mgr, "b")
    yield "step in flight", mgr, "b"
    mgr, _ = _setup()
    mgr.ingest_request("c")
    yield "nothing on device", mgr, "c"
    mgr.offload("a")
    yield "offloaded", mgr, "a"
    mgr, _ = _setup(cpu_pages=3)
    mgr.offload("a")
    yield "partly offloaded", mgr, "a"
    mgr, _ = _setup()
    off = mgr.begin_offload("b")
    assert off is not None
    yield "claimed", mgr, "b"
    _admit(mgr, "a", "aux", 0)  # a step on a label the claim did not take
    yield "in flight beside a claim", mgr, "a"


def test_offload_priority() -> None:
    cases = list(priority_cases())
    for _, mgr, rid in cases:
        check_priority(mgr, rid)
    got = {name: mgr.get_offload_priority(rid) for name, mgr, rid in priority_cases()}
    assert got == {"resident": 5, "unknown": 0, "step in flight": 0, "nothing on device": 0,
                   "offloaded": 0, "partly offloaded": 2, "claimed": 0,
                   "in flight beside a claim": 0}
    mgr, _ = _setup()
    # higher first: the request whose offload frees more
    assert mgr.get_offload_priority("a") > mgr.get_offload_priority("b") > 0


# -- pages_needed ----------------------------------------------------------------------------


def check_pages_needed(mgr: KVManager, step: KVStep, ctx: StepContext) -> int:
    """pages_needed changes nothing and is what admit then takes (or is short of)."""
    before = snapshot(mgr)
    n = mgr.pages_needed(step, ctx)
    assert_same(before, snapshot(mgr))
    free = mgr.num_free_pages
    out = mgr.admit(step, ctx)
    if out.ok:
        assert free - mgr.num_free_pages == n, f"admit took {free - mgr.num_free_pages}, said {n}"
        assert mgr.pages_needed(step, ctx) == 0  # reserved now
    else:
        assert isinstance(out.reason, AllocationFailed), out
        assert out.reason.pages_short == n - free, (out.reason.pages_short, n, free)
    return n


def step_cases() -> Iterator[tuple[str, KVStep, StepContext]]:
    """Steps over ``_setup``'s requests (a: main 9, cfg 5; b: main 2; page size 4)."""
    ab = StepContext(["a", "b"])
    yield "decode", KVStep([Segment("a", "main", 1), Segment("b", "main", 1)]), ab
    yield "page boundary", KVStep([Segment("a", "main", 3)]), StepContext(["a"])
    yield "mixed", KVStep([Segment("a", "main", 1), Segment("b", "main", 9)]), ab
    yield "new label", KVStep([Segment("b", "cfg", 5)]), StepContext(["b"])
    yield "pre-fork", KVStep([Segment("a", "x", 1)], pre_forks=[("main", "x")]), ab
    yield "post-fork", KVStep([Segment("a", "main", 4)], post_forks=[("main", "y")]), ab
    yield "chain", KVStep([Segment("a", "main", 1)], pre_forks=[("main", "x"), ("x", "z")]), ab
    # b has no cfg: its fork copies nothing (R20); a's gives x cfg's 2 pages
    yield "absent source", KVStep([], pre_forks=[("cfg", "x")]), ab
    yield "combined", KVStep([Segment("a", "main", 1), Segment("a", "cfg", 4)],
                             combined_labels=[("main", "cfg")]), StepContext(["a"])
    yield "zero span", KVStep([Segment("a", "main", 0), Segment("b", "new", 0)]), ab
    yield "too big", KVStep([Segment("a", "main", 200)]), StepContext(["a"])


@pytest.mark.parametrize("name", [c[0] for c in step_cases()])
def test_pages_needed_is_what_admit_takes(name: str) -> None:
    step, ctx = next((s, c) for n, s, c in step_cases() if n == name)
    mgr, _ = _setup(pages=20)
    plain = mgr.pages_needed(replace(step, pre_forks=(), post_forks=()), ctx)
    n = check_pages_needed(mgr, step, ctx)
    if step.pre_forks or step.post_forks:
        assert n > plain, "a fork case whose forks take no pages tests nothing about them"


def test_pages_needed_ignores_lifecycle_refusals_and_raises_on_misuse() -> None:
    mgr, _ = _setup()
    step = _admit(mgr, "b")
    # a query while a step runs: the next step's need, from what the streams hold now
    assert mgr.pages_needed(KVStep([Segment("a", "main", 4)]), StepContext(["a"])) == 1
    mgr.commit(step, StepContext(["b"]))
    mgr.offload("a")
    # an offloaded stream counts from the pages it holds (none): the reload and the step
    assert mgr.pages_needed(KVStep([Segment("a", "main", 3)]), StepContext(["a"])) == 3
    assert mgr.reload_pages_needed("a") == 5
    before = snapshot(mgr)
    with pytest.raises(UnknownRequestError):
        mgr.pages_needed(KVStep([Segment("zz", "main", 1)]), StepContext(["zz"]))
    with pytest.raises(InvalidStepError):
        mgr.pages_needed(KVStep([Segment("b", "main", 1)] * 2), StepContext(["b"]))
    with pytest.raises(InvalidStepError):
        mgr.pages_needed(KVStep([], pre_forks=[("main", "x")]), StepContext([]))  # R25
    with pytest.raises(InvalidStepError):
        mgr.pages_needed("step", StepContext(["b"]))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        mgr.reload_pages_needed(5)  # type: ignore[arg-type]
    assert_same(before, snapshot(mgr))


LABELS = ("main", "cfg", "x")


@st.composite
def random_steps(draw: st.DrawFn) -> tuple[KVStep, StepContext]:
    rids = draw(st.lists(st.sampled_from(("a", "b")), min_size=1, max_size=2, unique=True))
    segs = draw(st.lists(st.tuples(st.sampled_from(rids), st.sampled_from(LABELS),
                                   st.integers(0, 9)),
                         max_size=4, unique_by=lambda t: t[:2]))
    pairs = st.tuples(st.sampled_from(LABELS), st.sampled_from(LABELS)).filter(
        lambda p: p[0] != p[1])
    pre = draw(st.lists(pairs, max_size=2))
    post = draw(st.lists(pairs, max_size=2))
    step = KVStep([Segment(*t) for t in segs], commit=draw(st.booleans()),
                  pre_forks=pre, post_forks=post)
    return step, StepContext(rids)


@settings(max_examples=60, deadline=None)
@given(random_steps(), st.integers(7, 20))  # _setup holds 6 pages + the sink
def test_pages_needed_matches_admit_on_random_steps(case: tuple[KVStep, StepContext],
                                                    pages: int) -> None:
    mgr, _ = _setup(pages=pages)
    check_pages_needed(mgr, *case)


# -- planted bugs: the checks above fail on each ------------------------------------------


@contextmanager
def planted(target: object, name: str, bad: Callable[..., object]) -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    mp.setattr(target, name, bad)
    try:
        yield
    finally:
        mp.undo()


def test_plant_wrong_reason_is_caught() -> None:
    """A reload that looks at the host before the offload table, so a claim
    with nothing copied yet answers NOTHING_ON_HOST instead of OFFLOAD_RUNNING."""
    orig = HostOffload._reload_refusal

    def bad(self: HostOffload, rid: str) -> tuple[ReloadReason | None, int]:
        if rid in self.table.streams and not self.pool.is_offloaded(rid):
            return ReloadReason.NOTHING_ON_HOST, 0
        return orig(self, rid)

    with planted(HostOffload, "_reload_refusal", bad), pytest.raises(AssertionError):
        test_reload_outcomes()
    test_reload_outcomes()  # and the clean tree passes


def test_plant_wrong_kept_reason_is_caught() -> None:
    """A stale copy reported as a full host pool."""
    def bad(self: HostOffload, offload: object, claim: object) -> OffloadReason | None:
        got = orig(self, offload, claim)
        return R.HOST_POOL_FULL if got is R.REQUEST_CHANGED else got

    orig = HostOffload.copy_to_host
    with planted(HostOffload, "copy_to_host", bad), pytest.raises(AssertionError):
        test_handle_outcomes_changed_removed_not_copied()


def test_plant_priority_of_in_flight_is_caught() -> None:
    """A priority that counts the pages whatever the claim would say."""
    def bad(self: HostOffload, rid: str) -> int:
        with self.table.lock:
            streams = self.table.streams.get(rid, {})
            return sum(len(s.page_indices) for _, s in kvref.offload.phases.claimable(streams))

    with planted(HostOffload, "priority", bad), pytest.raises(AssertionError, match="refused"):
        for _, mgr, rid in priority_cases():
            check_priority(mgr, rid)


def test_plant_pages_needed_without_forks_is_caught() -> None:
    """pages_needed counting only the segments, as a plain step's admit would."""
    orig = kvref.offload.calls.step_pages

    def bad(table: object, step: KVStep, ctx: StepContext, max_seq_len: int) -> int:
        return orig(table, replace(step, pre_forks=(), post_forks=()), ctx,  # type: ignore[arg-type]
                    max_seq_len)

    caught = []
    with planted(kvref.offload.calls, "step_pages", bad):
        for name, step, ctx in step_cases():
            try:
                check_pages_needed(_setup(pages=20)[0], step, ctx)
            except AssertionError:
                caught.append(name)
    assert {"pre-fork", "post-fork", "chain", "absent source"} <= set(caught), caught
    assert all("fork" in n or n in ("chain", "absent source") for n in caught), caught


# -- the lockstep driver's check (kvref.testing.driver.check_queries) finds them too -------


def _prefilled_then(*actions: m.Action) -> None:
    """A one-token prefill of r0, then ``actions``, replayed on the model and kvref."""
    step = m.Step((m.Seg(0, 0, 1),), padded=(0,))
    run_trace(m.Model(m.Scope()), [m.Ingest(0), m.Admit(step), m.Plan(), m.Write(),
                                   m.Commit(), *actions], DriverConfig())


def test_plants_caught_by_the_driver_check() -> None:
    orig = HostOffload._reload_refusal

    def host_first(self: HostOffload, rid: str) -> tuple[ReloadReason | None, int]:
        if rid in self.table.streams and not self.pool.is_offloaded(rid):
            return ReloadReason.NOTHING_ON_HOST, 0
        return orig(self, rid)

    def in_flight_priority(self: HostOffload, rid: str) -> int:
        with self.table.lock:
            streams = self.table.streams.get(rid, {})
            return sum(len(s.page_indices) for _, s in kvref.offload.phases.claimable(streams))

    # a reload mid-offload, then a step in flight
    trace = (m.OffloadClaim(0), m.Reload(0), m.OffloadAbandon(0),
             m.Admit(m.Step((m.Seg(0, 0, 1),), padded=(0,))))
    _prefilled_then(*trace)  # the clean tree passes
    with planted(HostOffload, "_reload_refusal", host_first), pytest.raises(
            AssertionError, match="R44"):
        _prefilled_then(*trace)
    with planted(HostOffload, "priority", in_flight_priority), pytest.raises(
            AssertionError, match="R45"):
        _prefilled_then(*trace)
