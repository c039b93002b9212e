"""Known races, patched back into kvref, and the programs that expose them.

Each planted race is a context manager that monkeypatches `KVManager` into
the reference's (or a plausible regression's) behaviour, plus the smallest
thread programs in which the race can happen. `detect` runs a strategy until
the harness reports a failure and says how many schedules it took:
`python -m tests.concurrency.measure` prints them per strategy
(`docs/verification/concurrency.md`).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from kvref import KVManager
from kvref.core.allocator import PageAllocator
from kvref.core.streams import ClaimedStream
from kvref.lifecycle import RequestLifecycle
from kvref.offload.calls import EvictionCalls
from kvref.offload.handle import Offload
from kvref.offload.outcomes import OffloadOutcome
from kvref.offload.phases import HostOffload
from kvref.prefix import cache as prefix_cache
from kvref.stepping import truncation
from kvref_model import core as m
from tests.support.lockset import Detector
from tests.support.sched_harness import Op, Program, StepOp, run_once
from tests.support.scheduler import (
    PCT,
    CoopLock,
    CoopRuntime,
    Prefix,
    RandomWalk,
    ScheduleFailure,
    Scheduler,
    Strategy,
    next_dfs_prefix,
)


@contextmanager
def claim_ignores_marks() -> Iterator[None]:
    """R4 gone: an offload claims a request whose step is in flight."""
    orig = KVManager.begin_offload

    def racy(self: KVManager, rid: str) -> Any:
        with self._lock:
            marked = [s for s in self._streams.get(rid, {}).values() if s.step_in_flight]
            for s in marked:
                s.step_in_flight = False
            try:
                return orig(self, rid)
            finally:
                for s in marked:
                    s.step_in_flight = True

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KVManager, "begin_offload", racy)
        yield


@contextmanager
def commit_ignores_guard() -> Iterator[None]:
    """The offload commit trusts its claims: no generation guard, so a stream
    reset (or reloaded) between copy and commit loses its pages."""
    orig = HostOffload.commit

    def racy(self: HostOffload, offload: Offload, claims: Mapping[str, ClaimedStream],
             copied: Sequence[str]) -> OffloadOutcome:
        with self.table.lock:
            streams = self.table.streams.get(offload.request_id, {})
            claims = {label: dataclasses.replace(c, generation=streams[label].generation)
                      if label in streams else c for label, c in claims.items()}
            return orig(self, offload, claims, copied)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HostOffload, "commit", racy)
        yield


@contextmanager
def reset_skips_drain() -> Iterator[None]:
    """reset/remove no longer wait for in-flight retrieves before reusing pages."""
    # the raw staticmethod: read through the class it is a plain function,
    # and putting that back would make it an instance method
    drain, pending = RequestLifecycle.drain_reads, RequestLifecycle.__dict__["reads_pending"]
    RequestLifecycle.drain_reads = lambda self, rid: None  # type: ignore[method-assign]
    RequestLifecycle.reads_pending = staticmethod(  # type: ignore[method-assign]
        lambda streams: False)
    try:
        yield
    finally:
        RequestLifecycle.drain_reads = drain  # type: ignore[method-assign]
        RequestLifecycle.reads_pending = pending  # type: ignore[method-assign]


_skip = threading.local()


@contextmanager
def lock_removed(cls: type, methods: tuple[str, ...],
                 lock_of: Callable[[Any], Any]) -> Iterator[None]:
    """``cls.<method>`` runs as if its ``with <lock>:`` were deleted: inside it,
    the calling thread's acquires and releases of ``lock_of(self)`` do nothing
    (other threads still take that lock as written)."""
    origs = {name: cls.__dict__[name] for name in methods}
    acquire, release = CoopLock.acquire, CoopLock.release

    def skipped(lock: CoopLock) -> bool:
        return id(lock) in getattr(_skip, "ids", ())

    def acquire_(lock: CoopLock) -> None:
        if not skipped(lock):
            acquire(lock)

    def release_(lock: CoopLock) -> None:
        if not skipped(lock):
            release(lock)

    def unlocked(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def racy(self: Any, *args: Any, **kwargs: Any) -> Any:
            before: frozenset[int] = getattr(_skip, "ids", frozenset())
            _skip.ids = before | {id(lock_of(self))}
            try:
                return fn(self, *args, **kwargs)
            finally:
                _skip.ids = before
        return racy

    CoopLock.acquire = acquire_  # type: ignore[method-assign,assignment]
    CoopLock.release = release_  # type: ignore[method-assign,assignment]
    for name, fn in origs.items():
        setattr(cls, name, unlocked(fn))
    try:
        yield
    finally:
        CoopLock.acquire = acquire  # type: ignore[method-assign]
        CoopLock.release = release  # type: ignore[method-assign]
        for name, fn in origs.items():
            setattr(cls, name, fn)


def commit_without_lock() -> AbstractContextManager[None]:
    """`commit` with its ``with self._lock`` deleted."""
    return lock_removed(KVManager, ("commit",), lambda kv: kv._lock)


def allocate_without_lock() -> AbstractContextManager[None]:
    """`PageAllocator.try_allocate` with its lock dropped around the
    check-then-pop: today's main (issue 9)."""
    return lock_removed(PageAllocator, ("try_allocate",), lambda a: a._lock)


def streams_read_outside_lock() -> AbstractContextManager[None]:
    """reset/remove read the request's streams (in-flight check, futures to
    drain) without the lock: today's main (issue 9, R32)."""
    return lock_removed(RequestLifecycle, ("refuse_if_in_flight", "drain_reads"),
                        lambda life: life._lock)


@contextmanager
def reclaimable_reads_pool_unlocked() -> Iterator[None]:
    """`reclaimable` takes the request's page lists under the manager's lock and
    counts them in the pool after releasing it: a reset, truncate or admit
    in between changes the lists (or the holders) it counts."""
    def racy(self: KVManager, rid: str) -> int:
        with self._lock:
            going = {(rid, label): s.page_indices
                     for label, s in self._table.request(rid).items()}
        return self._table.pages.reclaimable(going)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EvictionCalls, "reclaimable", racy)
        yield


@contextmanager
def truncate_unlocked() -> Iterator[None]:
    """`truncate` with its ``with self._lock`` deleted: its refusals read the
    stream, then it cuts, while an admit or an offload claim runs between."""
    def racy(self: KVManager, rid: str, label: str, new_len: int) -> int:
        return truncation.truncate(self._table, rid, label, new_len)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KVManager, "truncate", racy)
        yield


@contextmanager
def cache_prefixes_registers_unlocked() -> Iterator[None]:
    """`cache_prefixes` checks its batch under the manager's lock and registers
    it after releasing it: a removal, reset, truncate or offload commit in
    between, and pages that left the stream are keyed."""
    def racy(self: KVManager, calls: Sequence[tuple[str, str, Any, int]]) -> list[int]:
        with self._lock:
            todo = [prefix_cache._checked(self._table, *call) for call in calls]
        return [0 if t is None else prefix_cache._register(self._table, t) for t in todo]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KVManager, "cache_prefixes", racy)
        yield


@contextmanager
def nothing() -> Iterator[None]:
    yield


Runner = Callable[[Strategy, bool, bool], Scheduler]


@dataclass(frozen=True)
class Race:
    name: str
    patch: Callable[[], AbstractContextManager[None]]
    programs: tuple[Program, ...] = ()
    # a run on something other than a whole manager (the allocator alone)
    runner: Runner | None = None


def run_race(race: Race, strategy: Strategy, lockset: bool = True,
             access_points: bool = True) -> Scheduler:
    """One schedule of ``race`` (patch already applied); raises `ScheduleFailure`."""
    if race.runner is not None:
        return race.runner(strategy, lockset, access_points)
    return run_once(race.programs, strategy, lockset=lockset,
                    access_points=access_points).sched


def allocator_users(strategy: Strategy, lockset: bool = True,
                    access_points: bool = True) -> Scheduler:
    """Two threads each allocate two of three pages and free them; at the end
    every page must be free exactly once, and (``lockset``) no race reported."""
    sched = Scheduler(strategy)
    det = Detector()
    alloc = PageAllocator(3, CoopRuntime(sched, det, access_points), name="pages")

    def user() -> None:
        pages = alloc.try_allocate(2)
        if pages is not None:
            alloc.free(pages)

    sched.run([("a", user), ("b", user)])
    free = alloc.free_pages()
    if sorted(free) != [0, 1, 2]:
        raise ScheduleFailure(f"pages lost or doubled: free list {free}\n"
                              f"schedule={sched.schedule}", list(sched.schedule))
    if lockset and det.reports:
        raise ScheduleFailure(f"{det.report_text()}\nschedule={sched.schedule}",
                              list(sched.schedule))
    return sched


STEP0 = StepOp(m.Step((m.Seg(0, 0, 1),), padded=(0,)))

RACES = (
    Race("claim ignores in-flight marks", claim_ignores_marks,
         (Program("engine", [STEP0]), Program("worker", [Op("offload", 0)]))),
    Race("offload commit skips the generation guard", commit_ignores_guard,
         (Program("worker", [Op("offload", 0)]), Program("life", [Op("reset", 0, n=1)]))),
    Race("reset reuses pages under a retrieve", reset_skips_drain,
         (Program("engine", [Op("retrieve", 2, 0, 5)]),
          Program("life", [Op("reset", 2, n=1)]))),
)

STEP_NEW_LABEL = StepOp(m.Step((m.Seg(0, 1, 1),), padded=(0,)))  # creates r0/cfg

# the data races of issue 9: each a lock deleted around unlocked-visible state
DATA_RACES = (
    Race("commit without its lock", commit_without_lock,
         (Program("engine", [STEP0]), Program("worker", [Op("offload", 0)]))),
    Race("allocator check-then-pop without its lock", allocate_without_lock,
         runner=allocator_users),
    Race("reset reads streams outside the lock", streams_read_outside_lock,
         (Program("engine", [STEP_NEW_LABEL]), Program("life", [Op("reset", 0)]))),
)

# issue 44: public calls whose work moved outside the manager's lock (no
# program called them before), each paired with a call it conflicts with. The
# lock discipline reports each on one thread (a tour of every public call,
# tests/concurrency/test_lock_discipline.py) and on the run-to-completion
# schedule of its program; bounded DFS finds each from a wrong result alone
LOCK_RACES = (
    Race("reclaimable reads the pool outside the lock", reclaimable_reads_pool_unlocked,
         (Program("query", [Op("reclaimable", 0)]), Program("life", [Op("remove", 0)]))),
    Race("truncate outside the lock", truncate_unlocked,
         (Program("engine", [STEP0]), Program("life", [Op("truncate", 0, 0, 1)]))),
    Race("cache_prefixes registers after the lock", cache_prefixes_registers_unlocked,
         (Program("life", [Op("cacheprefixes", 0)]), Program("life2", [Op("remove", 0)]))),
)
UNLOCKED_CALLS: dict[str, Callable[[], AbstractContextManager[None]]] = {
    r.name: r.patch for r in LOCK_RACES}

# the same program, unpatched: kvref's reset drains, then takes its lock, and a
# retrieve that starts in between still runs under the reset (test_known_races)
KNOWN = Race("kvref as is: a retrieve starts between reset's drain and its lock", nothing,
             RACES[2].programs)


@dataclass
class Detection:
    schedules: int | None  # None: not found within the budget
    seconds: float
    schedule: list[int] | None = None
    message: str = ""


def detect(race: Race, strategies: Iterator[Strategy], budget: int,
           lockset: bool = True, access_points: bool = True) -> Detection:
    """Run fresh strategies until one schedule fails; count the schedules.
    ``lockset=False``: only a wrong result or state counts (no race report)."""
    t0 = time.perf_counter()
    with race.patch():
        for n, strategy in enumerate(strategies, 1):
            if n > budget:
                break
            try:
                run_race(race, strategy, lockset, access_points)
            except ScheduleFailure as err:
                return Detection(n, time.perf_counter() - t0, err.schedule, str(err))
    return Detection(None, time.perf_counter() - t0)


def pct(seed: int, depth: int, steps: int = 60) -> Iterator[Strategy]:
    i = 0
    while True:
        yield PCT(seed * 100_003 + i, depth, steps)
        i += 1


def random_walk(seed: int) -> Iterator[Strategy]:
    i = 0
    while True:
        yield RandomWalk(seed * 100_003 + i)
        i += 1


def dfs(race: Race, bound: int, budget: int, lockset: bool = True) -> Detection:
    """Depth-first over every schedule with at most ``bound`` preemptions."""
    t0 = time.perf_counter()
    prefix: list[int] | None = []
    n = 0
    with race.patch():
        while prefix is not None and n < budget:
            n += 1
            strategy = Prefix(prefix)
            try:
                sched = run_race(race, strategy, lockset)
            except ScheduleFailure as err:
                return Detection(n, time.perf_counter() - t0, err.schedule, str(err))
            prefix = next_dfs_prefix(sched.trace, bound)
    return Detection(None, time.perf_counter() - t0, message=f"{n} schedules, none failed")


def dfs_count(programs: Sequence[Program], bound: int, budget: int,
              scope: m.Scope | None = None) -> int:
    """How many schedules DFS visits (all pass, or the first failure raises)."""
    prefix: list[int] | None = []
    n = 0
    while prefix is not None and n < budget:
        n += 1
        h = run_once(programs, Prefix(prefix), **({"scope": scope} if scope else {}))
        prefix = next_dfs_prefix(h.sched.trace, bound)
    return n
