"""A cooperative scheduler behind `kvref.core.runtime`: real threads, one at a time.

Every actor (a test thread, or a background task the manager submitted) is a
real `threading.Thread`, but only the actor the scheduler picked runs; the
others sit in `Event.wait`. At every switch point -- a lock acquire and
release, a wait on futures, a named checkpoint, the start of a test op -- the
running actor asks the strategy who runs next. So an interleaving is a list
of choices: it can be drawn by Hypothesis (and shrunk), searched (PCT, DFS up
to a preemption bound) and replayed exactly.

A choice is an index into the runnable actors, ordered with the actor that is
running now first (if it can go on) and then by creation order. Choice 0 is
therefore "no preemption", a list of zeros is the run-to-completion order,
and shrinking a choice list towards zeros removes preemptions.

Deadlock (no actor can run, some not finished) and livelock (the step budget
ran out) are failures that report where every actor waits.
"""

from __future__ import annotations

import random
import threading
import traceback
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Abort(BaseException):
    """Unwinds an actor once the run has failed (BaseException: kvref's
    ``except Exception`` handlers must not swallow it)."""


class ScheduleFailure(AssertionError):
    """A failed run; ``schedule`` replays it with `Replay`."""

    def __init__(self, message: str, schedule: list[int]) -> None:
        super().__init__(message)
        self.schedule = schedule


@dataclass(eq=False)
class Actor:
    aid: int
    name: str
    fn: Callable[[], None]
    event: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    done: bool = False
    # what the actor will do when next resumed, and whether it can do it now
    where: str = "not started"
    ready: Callable[[], bool] | None = None
    held: list[CoopLock] = field(default_factory=list)

    def runnable(self) -> bool:
        return not self.done and (self.ready is None or self.ready())


class Strategy(Protocol):
    def choose(self, step: int, runnable: Sequence[Actor], current_runs: bool) -> int:
        """Index into ``runnable`` (the running actor first when ``current_runs``)."""
        ...


class Observer(Protocol):
    """What the linearizer hears from the runtime."""

    def on_acquire(self, lock: CoopLock) -> None: ...
    def on_release(self, lock: CoopLock) -> None: ...
    def on_submit(self) -> Any: ...
    def on_task_done(self, tag: Any, ok: bool) -> None: ...
    def at_point(self, sched: Scheduler) -> None:
        """Called at every switch point before the choice: checks when quiescent."""
        ...


class _NullObserver:
    def on_acquire(self, lock: CoopLock) -> None: ...
    def on_release(self, lock: CoopLock) -> None: ...
    def on_submit(self) -> Any:
        return None
    def on_task_done(self, tag: Any, ok: bool) -> None: ...
    def at_point(self, sched: Scheduler) -> None: ...


# -- strategies -------------------------------------------------------------------


class Replay:
    """Follow a list of choices, then choice 0 (no preemption). Also how a
    Hypothesis-drawn schedule runs: any list is valid, taken modulo."""

    def __init__(self, choices: Sequence[int]) -> None:
        self.choices = list(choices)

    def choose(self, step: int, runnable: Sequence[Actor], current_runs: bool) -> int:
        return self.choices[step] % len(runnable) if step < len(self.choices) else 0


class RandomWalk:
    """Uniform over the runnable actors at every switch point."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def choose(self, step: int, runnable: Sequence[Actor], current_runs: bool) -> int:
        return self.rng.randrange(len(runnable))


class PCT:
    """Probabilistic concurrency testing (Burckhardt et al., ASPLOS 2010).

    Each actor gets a random priority when it appears; the highest-priority
    runnable actor runs; at ``depth - 1`` random steps out of ``steps`` the
    running actor drops below everyone. A bug of depth d is found with
    probability at least 1 / (n * k^(d-1)) per run.
    """

    def __init__(self, seed: int, depth: int, steps: int) -> None:
        self.rng = random.Random(seed)
        self.depth = depth
        self.change = set(self.rng.sample(range(max(steps, depth)), depth - 1))
        self.prio: dict[int, float] = {}
        self.low = 0.0

    def choose(self, step: int, runnable: Sequence[Actor], current_runs: bool) -> int:
        for a in runnable:
            if a.aid not in self.prio:
                # above every change-point priority (those are <= 0)
                self.prio[a.aid] = 1.0 + self.rng.random()
        if step in self.change and current_runs:
            self.low -= 1.0
            self.prio[runnable[0].aid] = self.low
        best = max(range(len(runnable)), key=lambda i: self.prio[runnable[i].aid])
        return best


class Prefix:
    """DFS's driver: a fixed prefix, then no preemption."""

    def __init__(self, prefix: Sequence[int]) -> None:
        self.prefix = list(prefix)

    def choose(self, step: int, runnable: Sequence[Actor], current_runs: bool) -> int:
        return self.prefix[step] if step < len(self.prefix) else 0


def next_dfs_prefix(trace: Sequence[tuple[int, int, bool]], bound: int) -> list[int] | None:
    """The next schedule, depth first, with at most ``bound`` preemptions.

    ``trace`` is the last run's (options, chosen, running actor could go on)
    per switch point. Determinism makes the prefix tree a tree: each
    schedule is visited once.
    """
    before, used = [], 0
    for _n, idx, runs in trace:
        before.append(used)
        used += int(idx > 0 and runs)
    for i in range(len(trace) - 1, -1, -1):
        n, idx, runs = trace[i]
        j = idx + 1
        if j < n and before[i] + int(runs) <= bound:
            return [t[1] for t in trace[:i]] + [j]
    return None


# -- the scheduler ----------------------------------------------------------------


class Scheduler:
    def __init__(
        self,
        strategy: Strategy,
        observer: Observer | None = None,
        max_steps: int = 4000,
        timeout: float = 60.0,
    ) -> None:
        self.strategy = strategy
        self.observer: Observer = observer if observer is not None else _NullObserver()
        self.max_steps = max_steps
        self.timeout = timeout
        self.actors: list[Actor] = []
        self.by_thread: dict[int, Actor] = {}
        self.schedule: list[int] = []
        self.trace: list[tuple[int, int, bool]] = []
        self.preemptions: list[str] = []
        self.failure: BaseException | None = None
        self.failure_text = ""
        self.aborted = False
        self.running = False
        self.locks: list[CoopLock] = []
        # the race detector, told of every outermost acquire and release
        self.detector: Any = None
        self._checking = False
        self._finished = threading.Event()
        self._meta = threading.Lock()  # actor creation vs. thread start-up only

    # -- actors ---------------------------------------------------------------------

    def me(self) -> Actor | None:
        return self.by_thread.get(threading.get_ident())

    def spawn(self, name: str, fn: Callable[[], None]) -> Actor:
        actor = Actor(len(self.actors), name, fn)
        self.actors.append(actor)
        thread = threading.Thread(target=self._body, args=(actor,), name=name, daemon=True)
        actor.thread = thread
        with self._meta:
            thread.start()
            # registered before the actor can be chosen: `me()` must find it
        return actor

    def _body(self, actor: Actor) -> None:
        with self._meta:
            self.by_thread[threading.get_ident()] = actor
        actor.event.wait()
        actor.event.clear()
        try:
            if not self.aborted:
                actor.where = "running"
                actor.fn()
        except Abort:
            pass
        except BaseException as err:
            self._fail(f"{actor.name} raised {type(err).__name__}: {err}", err)
        finally:
            actor.done = True
            actor.where = "finished"
            actor.ready = None
            if not self.aborted:
                self._pass_on(None)

    # -- running ----------------------------------------------------------------------

    def run(self, programs: Sequence[tuple[str, Callable[[], None]]]) -> None:
        """Run every program as an actor until all actors (tasks too) finish."""
        self.running = True
        self._finished.clear()
        for name, fn in programs:
            actor = self.spawn(name, fn)
            actor.where = "start"
        while not all(a.thread is not None and a.thread.ident in self.by_thread
                      for a in self.actors):
            threading.Event().wait(0.0001)
        self._pass_on(None)
        if not self._finished.wait(self.timeout):
            stacks = "".join("".join(traceback.format_stack(f)) for f in _frames(self.actors))
            self._fail(f"hang: no progress in {self.timeout}s (a real lock outside the "
                       f"runtime?)\n{stacks}", None)
        for a in self.actors:
            if a.thread is not None:
                a.thread.join(5.0)
        self.running = False
        if self.failure is not None or self.failure_text:
            where = "".join(f"\n  {p}" for p in self.preemptions)
            raise ScheduleFailure(
                f"{self.failure_text}\npreemptions:{where or ' none'}"
                f"\nschedule={compact(self.schedule)}", list(self.schedule)
            ) from self.failure

    def point(self, where: str, ready: Callable[[], bool] | None = None) -> None:
        """A switch point of the calling actor (a no-op outside a run)."""
        me = self.me()
        if me is None or not self.running or self._checking:
            # (a check's own lock acquires, e.g. the allocator's, are no switch points)
            return
        if self.aborted:
            raise Abort
        me.where, me.ready = where, ready
        if len(self.schedule) >= self.max_steps:
            self._fail(f"livelock: step budget of {self.max_steps} exhausted", None)
            raise Abort
        self._checking = True
        try:
            self.observer.at_point(self)
        except BaseException as err:
            self._fail(f"check failed before {me.name} {where}: {err}", err)
            raise Abort from None
        finally:
            self._checking = False
        nxt = self._pick(me)
        if nxt is None:
            raise Abort
        if nxt is not me:
            nxt.event.set()
            me.event.wait()
            me.event.clear()
            if self.aborted:
                raise Abort
        me.where, me.ready = "running", None

    def _pick(self, me: Actor | None) -> Actor | None:
        runs = me is not None and me.runnable()
        others = [a for a in self.actors if a is not me and a.runnable()]
        runnable = ([me] if runs and me is not None else []) + others
        if not runnable:
            if all(a.done or a is me for a in self.actors) and (me is None or me.done):
                self._finished.set()
                return None
            self._fail("deadlock: no actor can run", None)
            return None
        idx = self.strategy.choose(len(self.schedule), runnable, runs)
        self.schedule.append(idx)
        self.trace.append((len(runnable), idx, runs))
        if idx and runs and me is not None:
            # a preemption: the failure message names where (an access, a lock...)
            self.preemptions.append(
                f"step {len(self.schedule) - 1}: {me.name} preempted before {me.where}, "
                f"{runnable[idx].name} runs")
        return runnable[idx]

    def _pass_on(self, me: Actor | None) -> None:
        nxt = self._pick(me)
        if nxt is not None:
            nxt.event.set()

    def _fail(self, text: str, err: BaseException | None) -> None:
        if self.aborted:
            return
        self.aborted = True
        self.failure = err
        self.failure_text = text + "\n" + self.where_report()
        for a in self.actors:
            a.event.set()
        self._finished.set()

    def where_report(self) -> str:
        lines = ["actors:"]
        for a in self.actors:
            held = ", ".join(lk.name for lk in a.held)
            lines.append(f"  {a.name}: {a.where}" + (f" (holds {held})" if held else ""))
        return "\n".join(lines)

    def locks_held(self) -> bool:
        return any(lk.owner is not None for lk in self.locks)


def _frames(actors: Iterable[Actor]) -> list[Any]:
    import sys

    frames = sys._current_frames()
    return [frames[a.thread.ident] for a in actors
            if a.thread is not None and a.thread.ident in frames]


def compact(schedule: Sequence[int]) -> list[int]:
    """The schedule without its trailing zeros (they are the default)."""
    out = list(schedule)
    while out and out[-1] == 0:
        out.pop()
    return out


# -- the runtime kvref sees -----------------------------------------------------------


class CoopLock(AbstractContextManager["CoopLock"]):
    """A reentrant lock whose outermost acquire and release are switch points."""

    def __init__(self, sched: Scheduler, name: str) -> None:
        self.sched = sched
        self.name = name
        self.owner: Actor | int | None = None
        self.depth = 0
        # False for a leaf lock (an allocator's): taken inside another lock's
        # section it is no switch point, since no other thread that needs the
        # outer lock can run there; taken on its own it still is
        self.switch = True

    def __enter__(self) -> CoopLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        sched = self.sched
        me = sched.me()
        key: Actor | int = me if me is not None and sched.running else threading.get_ident()
        if self.owner == key:  # an Actor compares by identity; a thread id by value
            self.depth += 1
            return
        if isinstance(key, Actor):
            if sched.aborted:
                raise Abort
            if self.switch or not key.held or self.owner is not None:
                sched.point(f"acquire {self.name}", lambda: self.owner is None)
            key.held.append(self)
        else:
            # outside a run (test set-up, teardown): one thread, no scheduling
            assert self.owner is None, f"{self.name} held by {self.owner} outside a run"
        self.owner, self.depth = key, 1
        if sched.detector is not None:
            sched.detector.acquired(self)
        sched.observer.on_acquire(self)

    def release(self) -> None:
        self.depth -= 1
        if self.depth:
            return
        owner, self.owner = self.owner, None
        if self.sched.detector is not None:
            self.sched.detector.released(self)
        self.sched.observer.on_release(self)
        if isinstance(owner, Actor):
            if self in owner.held:
                owner.held.remove(self)
            if not self.sched.aborted and (self.switch or not owner.held):
                self.sched.point(f"released {self.name}")


class CoopRuntime:
    """`kvref.core.runtime.Runtime` over a `Scheduler`: a submitted task is an actor
    of its own, so a retrieve can complete at any switch point.

    With a ``detector`` (`tests.support.lockset.Detector`) the containers kvref
    asks for are instrumented, and with ``access_points`` every access made
    holding no lock is a switch point too: interleavings inside unlocked
    code are explored, and a failing schedule's steps name the accesses.
    """

    def __init__(self, sched: Scheduler, detector: Any = None,
                 access_points: bool = True) -> None:
        self.sched = sched
        self.names: list[str] = []  # lock names, in creation order
        self.tasks = 0
        self.detector = detector
        if detector is not None:
            sched.detector = detector
            if access_points:
                detector.preempt = lambda where: sched.point(f"access {where}")

    def shared(self, value: T, name: str) -> T:
        if self.detector is None:
            return value
        return self.detector.wrap(value, name)  # type: ignore[no-any-return]

    def lock(self) -> CoopLock:
        lk = CoopLock(self.sched, f"lock{len(self.sched.locks)}")
        self.sched.locks.append(lk)
        return lk

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        fut: Future[T] = Future()
        tag = self.sched.observer.on_submit()
        sched = self.sched

        def task() -> None:
            try:
                fut.set_result(fn(*args))
                ok = True
            except Abort:
                raise
            except BaseException as err:  # the manager latches it
                fut.set_exception(err)
                ok = False
            # the completion and its log entry are one atomic step (no switch)
            sched.observer.on_task_done(tag, ok)

        self.tasks += 1
        if sched.me() is None or not sched.running:
            task()  # set-up outside a run: complete inline
        else:
            sched.spawn(f"task{self.tasks}", task)
        return fut

    def wait(self, futures: Iterable[Future[Any]]) -> None:
        futs = list(futures)
        sched = self.sched
        if sched.me() is None or not sched.running:
            assert all(f.done() for f in futs), "wait outside a run on a pending task"
            return
        sched.point(f"wait {len(futs)} future(s)", lambda: all(f.done() for f in futs))

    def checkpoint(self, name: str) -> None:
        self.sched.point(f"checkpoint {name}")
