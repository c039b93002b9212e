"""The lock discipline: every read and write of the manager's state (streams,
page lists, the page pool and its prefix index, offloads, the staged plan)
made inside a public call holds the manager's lock (`Detector.guard`).

One thread is enough: the check needs no second thread touching the same
datum, and no unlucky schedule. So a tour on one thread calls every public
method of `KVManager` and `Offload` (the test below fails when one is added
and not toured) over the seam traces' states and one more trace that reaches
the rest (a retrieve, publish and lease, an abandoned offload, a cleared
preplan): a call whose work moved outside its ``with self._lock`` is
reported at its first run, wherever it moved (issue 44: `reclaimable`,
`truncate` and `cache_prefixes`, each of which no scheduler program called,
and the page pool has a lock of its own, so the lockset check saw nothing
there even with two threads).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from types import CodeType, FrameType
from typing import Any

import pytest

from kvref import KVManager, Offload
from kvref.testing.driver import Driver, DriverConfig, default_factory, label_name
from kvref_model import core as m
from tests.support.lockset import Detector, TracedLock
from tests.support.sched_harness import SHIPPED_SCOPE
from tests.support.sched_planted import (
    LOCK_RACES,
    UNLOCKED_CALLS,
    detect,
    dfs,
    dfs_count,
    nothing,
)
from tests.support.scheduler import Replay
from tests.support.seam_traces import TRACES, run

# public names that touch no shared state, so the tour need not reach them
NOT_STATE = {
    "build": "a constructor",
    "supports_eviction": "a config flag",
    "supports_preplan": "a constant",
    "cleanup": "closes the transfer engine's handles",
    "build_cuda_graph_buffers": "the graph staging buffers: the engine thread's own",
    "post_warmup_validate": "needs a process group; reads the pool under its lock",
    "check": "the pool's own consistency, read under the pool's lock (`PagePool.problems`)",
}

# the rest of the API, past what the seam traces reach: a publish, a retrieve
# from a peer and the lease, a preplan cleared, an offload abandoned, a reset
# of the prefix cache, the queries
MORE: list[m.Action] = [
    m.Ingest(0), *run(0, 0, 4), m.CachePrefix(0, 0), m.Reclaimable(0), m.NumFree(),
    m.Ingest(1), m.MatchPrefix(1, 0, 5), m.Reclaimable(0), m.Reclaimable(1),
    m.Publish(0), m.ReleasePublished(0), m.Publish(1), m.LeaseTimeout(),
    m.Admit(m.Step((m.Seg(1, 0, 1),), padded=(1,)), preplan=True), m.Plan(preplan=True),
    m.ClearPreplan(), *run(1, 0, 1), m.Read(),
    m.OffloadClaim(1), m.OffloadAbandon(1), m.Truncate(1, 0, 3), m.CachePrefix(1, 0),
    m.Ingest(2), m.RetrieveStart(2, 1, 4), m.RetrieveComplete(2, 1, True), m.Reset(2, True),
    m.Remove(1), m.Remove(0), m.ResetPrefixCache(), m.Remove(2), m.NumFree(),
]


def public_calls() -> dict[CodeType, str]:
    """Code object -> name, for every public method and property of the API."""
    out: dict[CodeType, str] = {}
    for cls in (KVManager, Offload):
        for name in dir(cls):
            if name.startswith("_"):
                continue
            attr = inspect.getattr_static(cls, name)
            fn = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
            if inspect.isfunction(fn):
                out[fn.__code__] = name
    return out


@contextmanager
def entered(calls: dict[CodeType, str], seen: set[str]) -> Iterator[None]:
    """Record which public calls ran (a profile hook: wrapping them would
    change the frames the detector reads)."""
    def hook(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            name = calls.get(frame.f_code)
            if name is not None:
                seen.add(name)

    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(None)


def manager(d: Driver) -> KVManager:
    assert isinstance(d.kv, KVManager)
    return d.kv


class Tour:
    """A driver whose managers (the peer publishers too) take their locks and
    containers from the detector, checked against the model call by call."""

    def __init__(self, det: Detector) -> None:
        self.det = det
        self.cache_calls = 0

        def factory(**kwargs: Any) -> Any:
            rt = kwargs["runtime"]  # the driver's ManualRuntime, its peers' too
            rt.lock = lambda: TracedLock(det, "lock")
            rt.shared = det.wrap
            kv = default_factory(**kwargs)
            det.watch_tables(kv)
            return kv

        self.config = DriverConfig(factory=factory)

    def trace(self, scope: m.Scope, actions: list[m.Action]) -> None:
        model = m.Model(scope)
        d = Driver(scope, self.config)
        s = model.init()
        for i, a in enumerate(actions):
            want, nxt = model.step(s, a)
            got = self.apply(d, a, s, want)
            assert got == want, f"step {i} {a}: kvref {got}, model {want}"
            s = nxt
            self.queries(d, s)

    def apply(self, d: Driver, a: m.Action, s: m.State, want: m.Result) -> m.Result:
        if not (isinstance(a, m.CachePrefix) and a.drafts == 0):
            return d.apply(a, s)
        # every other CachePrefix through the batch call, by its one-page path
        # when the ids name just the page after the chain, else its general one
        self.cache_calls += 1
        if self.cache_calls % 2:
            return d.apply(a, s)
        rid, label, kv = d.name(a.rid), label_name(a.label), manager(d)
        ids = d.engine_ids(s, (a.rid, a.label))
        ps = d.scope.page_size
        start = kv.cached_tokens(rid, label)
        if len(ids) - start == ps:
            got = kv.cache_prefixes([(rid, label, ids[start:], start)])
        else:
            got = kv.cache_prefixes(((rid, label, ids, 0),))
        return m.Count(got[0])

    def queries(self, d: Driver, s: m.State) -> None:
        """Every query, on every request and label the model holds."""
        kv = manager(d)
        d.check_queries(s)
        kv.observe()
        kv.host_pool()
        _ = kv.num_free_pages, kv.num_cached_pages
        for rid in sorted(s.requests()):
            name = d.name(rid)
            kv.has_request(name)
            kv.is_offloaded(name)
            kv.reclaimable(name)
            for label in kv.labels(name):
                kv.stored_len(name, label)
                kv.cached_tokens(name, label)
                if not kv.is_offloaded(name):
                    kv.read_stream(name, label)

    def offload_calls(self) -> None:
        """The one-call offload and reload, and their outcomes (the traces
        drive an offload's phases through its handle)."""
        d = Driver(SHIPPED_SCOPE, self.config)
        kv = manager(d)
        for a in (m.Ingest(0), *run(0, 0, 3)):
            d.apply(a)
        name = d.name(0)
        assert kv.offload_outcome(name).pages_freed == 2
        assert kv.reload_outcome(name).reloaded
        assert kv.offload(name) == 2
        assert kv.reload(name)
        step, ctx = d.to_kvref(m.Step((m.Seg(0, 0, 2),), padded=(0,)))
        assert kv.pages_needed(step, ctx) == 1
        off = kv.begin_offload(name)
        assert off is not None and off.is_open
        kv.remove_request(name)  # cancels the offload
        off.copy_all()
        off.commit()
        # the layer cursors and views: the engine thread's own, no shared state
        kv.set_default_label("main")
        kv.set_layer_idx(1)
        kv.layer_view()
        kv.reset_default_cursors()

    def run(self, first: bool = False) -> None:
        """``first``: stop at the first trace that breaks the discipline."""
        for scope, actions in [*TRACES.values(), (SHIPPED_SCOPE, MORE)]:
            self.trace(scope, actions)
            if first and self.det.unguarded:
                return
        self.offload_calls()


def tour(plant: Callable[[], AbstractContextManager[None]] = nothing,
         seen: set[str] | None = None) -> Detector:
    det = Detector()
    det.guard()
    with plant(), entered(public_calls(), seen if seen is not None else set()):
        try:
            Tour(det).run(first=plant is not nothing)
        except AssertionError:
            # a plant's wrong answer: the reports made before it stand
            if plant is nothing:
                raise
    return det


def test_the_tour_calls_every_public_method() -> None:
    seen: set[str] = set()
    det = tour(seen=seen)
    assert not det.unguarded, det.report_text()
    missed = set(public_calls().values()) - seen - set(NOT_STATE)
    assert not missed, f"public calls the lock discipline never ran: {sorted(missed)}"


@pytest.mark.parametrize("name", sorted(UNLOCKED_CALLS))
def test_the_tour_finds_a_call_run_outside_the_lock(name: str) -> None:
    det = tour(UNLOCKED_CALLS[name])
    assert det.unguarded, f"{name}: not reported"
    assert "the manager's lock is not held" in det.report_text()


# -- the same plants in programs under the scheduler (tests.support.sched_planted) --

RACES = {r.name: r for r in LOCK_RACES}
# schedules, depth first up to two preemptions: the plant must be found within
# them from a wrong result alone, and the clean tree must pass them all
BUDGET = 10


@pytest.mark.parametrize("name", sorted(RACES))
def test_a_program_finds_it_on_the_run_to_completion_schedule(name: str) -> None:
    # no preemption: the discipline's report, or (cache_prefixes) the state
    # check at the quiescent point between its check and its registration,
    # where the model has keyed the pages and kvref not yet
    found = detect(RACES[name], iter([Replay([])]), budget=1, access_points=False)
    assert found.schedules == 1, found.message
    assert "unguarded access" in found.message or "kvref state" in found.message


@pytest.mark.parametrize("name", sorted(RACES))
def test_bounded_dfs_finds_it_from_a_wrong_result(name: str) -> None:
    race = RACES[name]
    found = dfs(race, bound=2, budget=BUDGET, lockset=False)
    assert found.schedules is not None, f"{name}: not found in {BUDGET} schedules"
    assert "unguarded access" not in found.message
    # the clean tree passes the same schedules, the discipline on
    assert dfs_count(race.programs, bound=2, budget=BUDGET) >= 1


@pytest.mark.nightly
@pytest.mark.parametrize("name", sorted(RACES))
def test_the_clean_program_passes_every_schedule(name: str) -> None:
    assert dfs_count(RACES[name].programs, bound=2, budget=5000) < 5000
