"""kvref under the cooperative scheduler, checked against the model.

A run: a fresh manager on a `CoopRuntime`, a sequential set-up, then two to
four thread programs (`Program`) under one schedule. Every kvref call the
programs make is split into the model's actions (`Linearizer.subop`); an
action's linearization point is the moment its thread takes the lock that
guards it (the manager's lock; the host pool's for an offload's copy), or
its return if it took none (a refusal read before any lock, `write_kv`). A
background task's completion is `RetrieveComplete`, logged atomically with
the future being set.

The log, in that order, is replayed on the model: each action's result must
be the model's; at every switch point where no runtime lock is held and no
logged action is still inside its critical section, kvref's state read back
by the conformance driver must equal the model's, page ownership (I1, I2,
I6) and host lengths must check, and the model's invariants must hold. At
the end the cache bytes are checked (I7).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

from kvref import KVManager, KVRefError, Offload, PublishedKVInfo
from kvref.testing import trace
from kvref.testing.driver import (
    Driver,
    DriverConfig,
    label_name,
    outcome,
    retrieve_state,
    rid_name,
)
from kvref_model import core as m
from kvref_model import coverage
from kvref_model.invariants import violations
from tests.support.lockset import Detector
from tests.support.scheduler import (
    CoopLock,
    CoopRuntime,
    Replay,
    ScheduleFailure,
    Scheduler,
    Strategy,
)

# kvref as it ships (KVConfig's defaults: the prefix cache on): labels 0 and 1
# full attention, so a fork between them shares pages copy-on-write, and
# label 2 windowed (W=2) with a rollback margin of 1
SHIPPED_SCOPE = m.Scope(requests=3, labels=3, device_pages=8, host_pages=4, page_size=2,
                        max_span=3, sharing=True, windows=(None, None, 2), margins=(0, 0, 1))
# the second configuration: the prefix cache off, no window
PLAIN_SCOPE = m.Scope(requests=3, labels=3, device_pages=8, host_pages=4, page_size=2,
                      max_span=3)
SCOPE = SHIPPED_SCOPE
SCOPES = {"shipped": SHIPPED_SCOPE, "plain": PLAIN_SCOPE}


@dataclass(frozen=True)
class PublisherMoves:
    """The environment's event: the publisher of (rid, label)'s retrieve
    releases its lease and resets the request (a reuse of its pages would do
    the same). Not the model's: the model holds no publisher, so the event
    changes nothing there; it decides whether a later retrieve's start is
    stale and whether a running copy's publisher moved (R35)."""

    rid: int
    label: int


@dataclass(frozen=True)
class CachePrefixIds:
    """`cache_prefixes` of one stream, naming the ``n`` ids it held when the
    set-up ended (a program's call races the calls that shorten it, so the
    engine may name ids past the committed ones by the time it runs): the
    model's `CachePrefix` with those past its length as drafts, a misuse."""

    rid: int
    label: int
    n: int


class ConcurrentModel(m.Model):
    """The model plus the answers kvref gives to calls on a request another
    thread removed. A sequential engine never makes them (the protocol only
    issues actions on ingested requests); a concurrent one does, and kvref
    documents its answer for each."""

    def step(self, s: m.State, a: m.Action) -> tuple[m.Result, m.State]:
        if isinstance(a, PublisherMoves):
            return m.Ok(), s
        if isinstance(a, CachePrefixIds):
            v = s.stream_map().get((a.rid, a.label))
            drafts = max(0, a.n - (v.stored_len if v is not None else 0))
            a = m.CachePrefix(a.rid, a.label, drafts)
        gone = self.gone(s, a)
        if gone is not None:
            return gone, s
        return super().step(s, a)

    @staticmethod
    def gone(s: m.State, a: m.Action) -> m.Result | None:
        have = s.requests()
        if isinstance(a, m.Admit):
            if s.staged is not None and not a.preplan:
                return None  # the staged step's own admit: answered before any lookup
            rids = {g.rid for g in a.step.segments} | set(a.step.padded)
            return m.Misuse("UnknownRequestError") if rids - have else None
        rid = getattr(a, "rid", None)
        if isinstance(a, (m.OffloadCopy, m.OffloadCommit, m.OffloadAbandon)) and (
                s.offload_of(a.rid) is None):
            # the request was removed under the offload, which kvref cancels:
            # later copies copy nothing, the commit frees nothing
            cancelled: dict[type, m.Result] = {
                m.OffloadCopy: m.Flag(False), m.OffloadCommit: m.Freed(0),
                m.OffloadAbandon: m.Ok()}
            return cancelled[type(a)]
        if rid is None or rid in have:
            return None
        if isinstance(a, (m.RetrieveStart, m.Reset)):
            return m.Misuse("UnknownRequestError")
        if isinstance(a, m.Remove):
            return m.Ok()  # idempotent
        if isinstance(a, m.Reload):
            return m.Flag(False)
        if isinstance(a, m.OffloadClaim):
            return m.Claimed(())
        return None


# -- the log ----------------------------------------------------------------------------


@dataclass
class Entry:
    actor: str
    action: m.Action
    result: m.Result | None = None
    done: bool = False
    # log length when the action's critical section ended (completions logged
    # before it happened inside the section)
    section_end: int | None = None
    watch: str | None = None  # the lock whose section linearized it
    # its effects all happen in that one section (else: settled only when done)
    one_section: bool = True
    want: m.Result | None = None


@dataclass
class SubOp:
    action: m.Action
    # the locks whose first section linearizes it: ("manager",); () linearizes
    # it at its return
    watch: tuple[str, ...]
    always: bool  # logged even if it took no lock (else: only if it did)
    # effects after its linearizing section (a copy's record): settled only when done
    split: bool = False
    # linearized at its last manager section, not its first (reset and remove
    # retry when a retrieve started between their drain and their lock: the
    # earlier sections only looked)
    last: bool = False
    entry: Entry | None = None
    result: m.Result | None = None


class Linearizer:
    """Records the order critical sections ran in, and checks it on the model."""

    def __init__(self, model: m.Model, driver: Driver, sched: Scheduler) -> None:
        self.model = model
        self.driver = driver
        self.sched = sched
        self.log: list[Entry] = []
        self.local = threading.local()
        self.lock_role: dict[int, str] = {}
        self.state = model.init()
        self.pos = 0  # entries replayed on the model
        self.checks = 0
        self.stray: list[str] = []
        # the checks' reads are not kvref's accesses
        self.quiet: Callable[[], AbstractContextManager[None]] = nullcontext
        # set while the checks run: `KVManager.observe` takes the manager's and
        # the host pool's locks, in the thread of the actor at the switch point;
        # those sections are the check's, not that actor's (nor stray ones)
        self.checking = False

    # -- the runtime's hooks -----------------------------------------------------------

    def _sub(self) -> SubOp | None:
        return getattr(self.local, "sub", None)

    def _who(self) -> str:
        me = self.sched.me()
        return me.name if me is not None and self.sched.running else "setup"

    def on_acquire(self, lock: CoopLock) -> None:
        if self.checking:
            return  # the check's own section, in whichever actor's thread it runs
        role = self.lock_role.get(id(lock))
        sub = self._sub()
        if sub is not None and sub.last and sub.entry is not None and role == "manager":
            # a retry: this later section is the one that counts
            i = self.log.index(sub.entry)
            del self.log[i]
            for later in self.log[i:]:
                # log lengths counted with the moved entry in front of them
                if later.section_end is not None and later.section_end > i:
                    later.section_end -= 1
            sub.entry.section_end = None
            self._append(sub.entry)
            return
        if sub is not None and sub.entry is None and role is not None and role in sub.watch:
            if isinstance(sub.action, m.RetrieveStart) and self.moves_since(
                    sub.action.rid, sub.action.label, -1):
                # its publisher moved before this section: the start's check sees it
                sub.action = replace(sub.action, stale=True)
            sub.entry = self._append(Entry(self._who(), sub.action, watch=role,
                                           one_section=sub.watch == ("manager",)
                                           and not sub.split and not sub.last))
        elif role == "manager" and sub is None:
            self.stray.append(f"{self._who()} took the manager lock outside any modelled action")

    def on_release(self, lock: CoopLock) -> None:
        if self.checking:
            return
        sub = self._sub()
        role = self.lock_role.get(id(lock))
        if sub is not None and sub.entry is not None and sub.entry.section_end is None \
                and role == sub.entry.watch and role is not None:
            sub.entry.section_end = len(self.log)

    def on_submit(self) -> Any:
        sub = self._sub()
        if sub is None or not isinstance(sub.action, m.RetrieveStart):
            self.stray.append(f"a task submitted outside a retrieve ({sub})")
            return None
        return (sub.action.rid, sub.action.label)

    def on_task_done(self, tag: Any, ok: bool) -> None:
        if tag is None:
            return
        rid, label = tag
        start = max(i for i, e in enumerate(self.log) if isinstance(e.action, m.RetrieveStart)
                    and (e.action.rid, e.action.label) == (rid, label))
        # a publisher that moved after the start's check moved under the copy:
        # the model says latched whatever the copy answered (R35)
        moved = self.moves_since(rid, label, start)
        e = Entry(self._who(), m.RetrieveComplete(rid, label, ok or moved, moved), m.Ok(),
                  done=True)
        e.section_end = len(self.log) + 1
        self._append(e)

    def moves_since(self, rid: int, label: int, after: int) -> bool:
        """Whether the log holds a move of (rid, label)'s publisher past ``after``."""
        return any(isinstance(e.action, PublisherMoves) and (e.action.rid, e.action.label)
                   == (rid, label) for e in self.log[after + 1:])

    def _append(self, e: Entry) -> Entry:
        self.log.append(e)
        return e

    def at_point(self, sched: Scheduler) -> None:
        with self.quiet():
            if self.quiescent():
                self.check()

    # -- actions ------------------------------------------------------------------------

    @contextmanager
    def subop(self, action: m.Action, watch: tuple[str, ...] = ("manager",),
              always: bool = True, split: bool = False,
              last: bool = False) -> Iterator[SubOp | None]:
        """One model action; nested ones are part of the outer action."""
        if self._sub() is not None:
            yield None
            return
        sub = SubOp(action, watch, always, split=split, last=last)
        self.local.sub = sub
        try:
            yield sub
        finally:
            self.local.sub = None
            if sub.entry is None and always:
                sub.entry = self._append(Entry(self._who(), action))
            if sub.entry is not None:
                if sub.entry.section_end is None:
                    sub.entry.section_end = len(self.log)
                sub.entry.result = sub.result
                sub.entry.done = True

    def call(self, action: m.Action, fn: Callable[[], m.Result],
             watch: tuple[str, ...] = ("manager",), always: bool = True,
             last: bool = False) -> m.Result:
        with self.subop(action, watch, always, last=last) as sub:
            try:
                result = fn()
            except KVRefError as err:
                result = m.Misuse(type(err).__name__)
            if sub is not None:
                sub.result = result
        return result

    # -- the check ------------------------------------------------------------------------

    def settled(self, e: Entry) -> bool:
        # a manager-lock action's effects are all inside its section; a copy's
        # are not (it records the host copy in a second pool section)
        return e.done or (e.one_section and e.section_end is not None)

    def quiescent(self) -> bool:
        return not self.sched.locks_held() and all(
            self.settled(e) for e in self.log[self.pos:])

    def replay(self) -> None:
        """Advance the model over every settled entry; compare finished results."""
        while self.pos < len(self.log) and self.settled(self.log[self.pos]):
            e = self.log[self.pos]
            try:
                want, nxt = self.model.step(self.state, e.action)
            except m.ProtocolError as err:
                raise AssertionError(
                    f"kvref ran {e.action} ({e.actor}) where the model's protocol forbids it: "
                    f"{err}\n{self.render()}") from None
            coverage.note(self.model, self.state, e.action, want, nxt)
            e.want = self.observed(e, want)
            broken = violations(self.model, nxt, e.action, want, self.state)
            if broken:
                raise AssertionError(f"model invariant after {e.action}: {broken}\n"
                                     + self.render())
            self.state = nxt
            self.pos += 1
        for e in self.log[: self.pos]:
            if e.done and e.want is not None and e.result != e.want:
                raise AssertionError(
                    f"{e.actor}: {e.action}: kvref answered {e.result}, the model "
                    f"{e.want}\n{self.render()}")

    def observed(self, e: Entry, want: m.Result) -> m.Result:
        """admit_retrieve reads readiness at the end of its section: a transfer
        that completed inside the section is already visible to it."""
        if not isinstance(e.action, m.RetrieveStart) or want != m.NotReady():
            return want
        i = self.log.index(e)
        end = e.section_end if e.section_end is not None else len(self.log)
        for later in self.log[i + 1: end]:
            a = later.action
            if isinstance(a, m.RetrieveComplete) and (a.rid, a.label) == (
                    e.action.rid, e.action.label):
                return m.Ok() if a.ok else m.Refused("AdmitRuntimeError")
        return want

    def check(self, final: bool = False) -> None:
        self.replay()
        if self.pos < len(self.log):
            return  # an action still inside its section: not a quiescent point
        self.checks += 1
        assert not self.stray, self.stray
        self.checking = True
        try:
            self.compare(final)
        finally:
            self.checking = False

    def compare(self, final: bool) -> None:
        d = self.driver
        got = d.abstract(self.state)
        if got != m.project(self.state):  # the model's page ids: not read back
            raise AssertionError(f"kvref state\n  {got}\nmodel state\n  {self.state}\n"
                                 + self.render())
        d.check_pages()
        d.check_observed(self.state)  # preplan, configs, positions, keyed ids
        # page ids by structure: holders and keys (sharing on), released slots
        d.check_page_map(self.state)
        d.check_host_lengths(self.state)
        if final:
            d.check_bytes(self.state)

    def render(self) -> str:
        lines = ["linearization:"]
        for i, e in enumerate(self.log):
            mark = ">" if i == self.pos else " "
            lines.append(f" {mark}{i:3} {e.actor:>10}  {e.action}  -> {e.result}"
                         + (f"  (model {e.want})" if e.want not in (None, e.result) else ""))
        return "\n".join(lines)


# -- programs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepOp:
    """The engine thread: admit, plan, write, commit one step (or preplan it)."""

    step: m.Step
    mode: str = "run"  # run | preplan (then promote and run) | clear (preplan, then abandon)


@dataclass(frozen=True)
class Op:
    """Any other thread's call: offload / reload / reset / remove / ingest / retrieve /
    publish / release (release_published) / move (the publisher of the retrieve
    with the same rid, label and n moves: `PublisherMoves`); with the prefix
    cache on, match (match_prefix of n of the label's tokens) / resetcache
    (reset_prefix_cache) / cacheprefixes (cache_prefixes of the ids the
    stream held after the set-up: `CachePrefixIds`); truncate (to n tokens);
    reclaimable."""

    kind: str
    rid: int
    label: int = 0
    n: int = 0  # retrieve length; reset: 1 frees
    fail: bool = False  # retrieve: the transfer fails


AnyOp = StepOp | Op


@dataclass
class Program:
    name: str
    ops: Sequence[AnyOp]


@dataclass(frozen=True)
class Setup:
    """Sequential, before the threads: request -> main length; offloaded requests."""

    lengths: tuple[tuple[int, int], ...] = ((0, 3), (1, 2), (2, 2))
    offloaded: tuple[int, ...] = (1,)
    # then these model actions, in order (a CachePrefix keys what the
    # stream committed, as the model states it)
    calls: tuple[m.Action, ...] = ()


class Harness:
    """One manager, one schedule: `run` raises `ScheduleFailure` on any disagreement.

    ``lockset``: record every access and fail the run on a data race the
    detector reports (off: the instrumented containers only add switch points).
    ``access_points``: the scheduler also switches at accesses made holding
    no lock (the detector's instrumented containers are used either way).
    """

    def __init__(self, strategy: Strategy, scope: m.Scope = SCOPE,
                 config: DriverConfig | None = None, max_steps: int = 4000,
                 model: m.Model | None = None, lockset: bool = True,
                 access_points: bool = True) -> None:
        self.scope = scope
        self.sched = Scheduler(strategy, max_steps=max_steps)
        # what a replay rebuilds the harness with (`keep`)
        self.options = {"max_steps": max_steps, "lockset": lockset,
                        "access_points": access_points}
        self.detector = Detector(record=lockset)
        # and every access to the manager's state inside a kvref call holds
        # its lock, whichever thread runs (the lock discipline)
        self.detector.guard(lockset)
        self.lockset = lockset
        self.runtime = CoopRuntime(self.sched, self.detector, access_points)
        base = config or DriverConfig()
        self.base_config = base
        self.recording = True  # off in a replay
        runtime = self.runtime

        def factory(**kwargs: Any) -> KVManager:
            kwargs["runtime"] = runtime
            return base.factory(**kwargs)

        # requests keep their ids: the programs name kvref's requests by
        # `rid_name` themselves (the lockstep's id reuse is not theirs)
        self.driver = Driver(scope, DriverConfig(base.device, base.dtype, factory,
                                                 reuse_ids=False))
        self.kv = self.driver.kv
        self.model = model or ConcurrentModel(scope)
        self.lin = Linearizer(self.model, self.driver, self.sched)
        self.lin.quiet = self.detector.ignoring
        self.sched.observer = self.lin
        kv = self.kv
        self.detector.watch_manager(kv)
        self.detector.watch_tables(kv)
        assert kv._cpu_pool is not None
        for lk, role in ((kv._lock, "manager"), (kv._cpu_pool._lock, "pool"),
                         (kv._transfer._lock, "transfer")):
            assert isinstance(lk, CoopLock)
            lk.name = role
            self.lin.lock_role[id(lk)] = role
        for lk, name in ((kv._pages._lock, "device pages"),
                         (kv._cpu_pool._allocator._lock, "host allocator")):
            assert isinstance(lk, CoopLock)
            lk.name = name
            lk.switch = False
        self._instrument()
        self.published: dict[tuple[int, int, int], PublishedKVInfo] = {}
        self.setup_state = self.lin.state
        self.publishers: dict[tuple[int, int, int], KVManager] = {}

    # -- offload's phases are model actions ---------------------------------------------

    def _instrument(self) -> None:
        kv, lin = self.kv, self.lin
        begin = kv.begin_offload

        def begin_offload(rid: str) -> Offload | None:
            r = int(rid[1:])
            box: list[Offload | None] = [None]

            def claim() -> m.Result:
                box[0] = off = begin(rid)
                if off is None:
                    return m.Claimed(())
                # a label is claimed where any of its groups is (H1)
                return m.Claimed(tuple(sorted({m.LABEL_NAMES.index(self.driver.groups.user(n))
                                               for n in off.labels})))

            lin.call(m.OffloadClaim(r), claim)
            if box[0] is not None:
                self._instrument_offload(box[0], r)
            return box[0]

        kv.begin_offload = begin_offload  # type: ignore[method-assign]

    def _instrument_offload(self, off: Offload, r: int) -> None:
        lin = self.lin
        copy, commit, abandon = off.copy, off.commit, off.abandon

        groups = self.driver.groups

        def copy_(label: str) -> bool:
            # a hybrid label's offload copies each group's stream in its own
            # sections, so each group's copy is its own model action (the
            # model's copy of one group, H1): another thread runs between
            # them and sees the host pool with one group's copy in it
            internal = groups.internal(label)
            group = None if groups.g == 1 else internal % groups.g
            ok = [False]

            def run() -> m.Result:
                ok[0] = copy(label)
                return m.Flag(ok[0])

            # decided in its first manager section (stale? room?), recorded
            # in a second
            with lin.subop(m.OffloadCopy(r, internal // groups.g, group=group),
                           split=True) as sub:
                res = run()
                if sub is not None:
                    sub.result = res
            return ok[0]

        def commit_() -> int:
            freed = [0]

            def run() -> m.Result:
                freed[0] = commit()
                return m.Freed(freed[0])

            lin.call(m.OffloadCommit(r), run)
            return freed[0]

        def abandon_() -> None:
            lin.call(m.OffloadAbandon(r), lambda: (abandon(), m.Ok())[1], always=False)

        off.copy = copy_  # type: ignore[method-assign]
        off.commit = commit_  # type: ignore[method-assign]
        off.abandon = abandon_  # type: ignore[method-assign]

    # -- set-up -----------------------------------------------------------------------------

    def setup(self, setup: Setup, programs: Sequence[Program]) -> None:
        """Requests with tokens, some offloaded; every retrieve's publisher made
        now (outside the run: a publisher is another manager, on real locks)."""
        lin, d = self.lin, self.driver
        for rid, n in setup.lengths:
            lin.call(m.Ingest(rid), lambda rid=rid: d.apply(m.Ingest(rid)))  # type: ignore[misc]
            if n:
                self.run_step(StepOp(m.Step((m.Seg(rid, 0, n),), padded=(rid,))))
        for rid in setup.offloaded:
            self.kv.offload(rid_name(rid))
        for a in setup.calls:
            lin.replay()  # the model's state after every call so far
            state = lin.state
            lin.call(a, lambda a=a, state=state: d.apply(a, state))  # type: ignore[misc]
        for p in programs:
            for op in p.ops:
                if isinstance(op, Op) and op.kind == "retrieve":
                    key = (op.rid, op.label, op.n)
                    if key not in self.published:
                        src = d.publisher(op.rid, op.label, op.n)
                        info = src.publish(rid_name(op.rid))
                        assert isinstance(info, PublishedKVInfo), info
                        self.published[key] = info
                        self.publishers[key] = src
        with self.detector.ignoring():
            lin.check()
        self.setup_state = lin.state  # what the engine knows of its tokens
        # the set-up ran before the threads started: it happens-before them
        self.detector.forget()

    # -- what the threads do ----------------------------------------------------------------

    def ready(self, step: m.Step) -> bool:
        """The engine admits only requests whose retrieves landed (the model's
        protocol). Only the engine thread starts retrieves, so none can start
        between this read and the admit."""
        rids = {rid_name(g.rid) for g in step.segments} | {rid_name(r) for r in step.padded}
        # the engine's own bookkeeping in a real engine, so not kvref's access
        with self.detector.ignoring():
            return all(retrieve_state(s) == m.IDLE
                       for r in rids for s in self.kv._streams.get(r, {}).values())

    def run_step(self, op: StepOp) -> None:
        lin, d = self.lin, self.driver
        if not self.ready(op.step):
            return
        if op.mode == "run":
            if lin.call(m.Admit(op.step), lambda: d.apply(m.Admit(op.step))) != m.Ok():
                return
        else:
            got = lin.call(m.Admit(op.step, preplan=True),
                           lambda: d.apply(m.Admit(op.step, preplan=True)))
            if got != m.Ok():
                return
            lin.call(m.Plan(preplan=True), lambda: d.apply(m.Plan(preplan=True)))
            if op.mode == "clear":
                lin.call(m.ClearPreplan(), lambda: d.apply(m.ClearPreplan()))
                return
            lin.call(m.Admit(op.step), lambda: d.apply(m.Admit(op.step)))
        lin.call(m.Plan(), lambda: d.apply(m.Plan()))
        if any(g.span for g in op.step.segments):
            lin.call(m.Write(), lambda: d.apply(m.Write()), watch=())
        lin.call(m.Commit(), lambda: d.apply(m.Commit()))

    def run_op(self, op: AnyOp) -> None:
        self.sched.point(f"call {op}")
        if isinstance(op, StepOp):
            self.run_step(op)
            return
        lin, d, kv = self.lin, self.driver, self.kv
        name = rid_name(op.rid)
        if op.kind == "offload":
            kv.offload(name)
        elif op.kind == "reload":
            lin.call(m.Reload(op.rid), lambda: m.Flag(kv.reload(name)))
        elif op.kind == "reset":
            a = m.Reset(op.rid, free=bool(op.n))
            lin.call(a, lambda: d.apply(a), last=True)
        elif op.kind == "remove":
            lin.call(m.Remove(op.rid), lambda: d.apply(m.Remove(op.rid)), last=True)
        elif op.kind == "ingest":
            lin.call(m.Ingest(op.rid), lambda: d.apply(m.Ingest(op.rid)))
        elif op.kind == "publish":
            # at its last manager section: one today; a publish that leased in a
            # second section would be seen at the lease, where it takes effect
            lin.call(m.Publish(op.rid), lambda: d.apply(m.Publish(op.rid)), last=True)
        elif op.kind == "release":
            a_rel = m.ReleasePublished(op.rid)
            lin.call(a_rel, lambda: d.apply(a_rel))
        elif op.kind == "move":
            # under the manager's lock, only so that the event has one place in
            # the order of its sections; the copy's reads take no manager lock
            src = self.publishers[(op.rid, op.label, op.n)]

            def move() -> m.Result:
                with kv._lock:
                    src.release_published(name)
                    src.reset_request(name)
                return m.Ok()

            lin.call(PublisherMoves(op.rid, op.label), move)
        elif op.kind == "match":
            a_match = m.MatchPrefix(op.rid, op.label, op.n)
            lin.call(a_match, lambda: d.apply(a_match))
        elif op.kind == "resetcache":
            lin.call(m.ResetPrefixCache(), lambda: d.apply(m.ResetPrefixCache()))
        elif op.kind == "reclaimable":
            a_count = m.Reclaimable(op.rid)
            lin.call(a_count, lambda: d.apply(a_count))
        elif op.kind == "cacheprefixes":
            ids = d.engine_ids(self.setup_state, (op.rid, op.label * d.groups.g))
            calls = [(name, label_name(op.label), ids, 0)]
            lin.call(CachePrefixIds(op.rid, op.label, len(ids)),
                     lambda: m.Count(kv.cache_prefixes(calls)[0]))
        elif op.kind == "truncate":
            a_cut = m.Truncate(op.rid, op.label, op.n)
            lin.call(a_cut, lambda: d.apply(a_cut))
        elif op.kind == "retrieve":
            info = self.published[(op.rid, op.label, op.n)]

            def retrieve() -> m.Result:
                if op.fail:
                    kv._transfer.fail_next = 1
                try:
                    return outcome(kv.admit_retrieve(name, "node", label_name(op.label), info))
                finally:
                    kv._transfer.fail_next = 0

            lin.call(m.RetrieveStart(op.rid, op.label, op.n), retrieve)
        else:
            raise ValueError(op.kind)

    def drain(self) -> None:
        """After the threads: every lease released and every request removed,
        each checked on the model; then no device page may be left held or
        missing (a leak), and no host page."""
        lin, d = self.lin, self.driver
        for rid in range(self.scope.requests):
            for a in (m.ReleasePublished(rid), m.Remove(rid)):
                lin.call(a, lambda a=a: d.apply(a))  # type: ignore[misc]
        with self.detector.ignoring():
            lin.check(final=True)
            seen = self.kv.observe()
        held = [pg for pg in seen.pages if pg.holders]
        if held or self.kv.num_free_pages != self.scope.device_pages:
            raise AssertionError(
                f"leak: every request removed, {self.kv.num_free_pages} of "
                f"{self.scope.device_pages} pages free, held: {held}")
        if seen.host is not None and seen.host.copies:
            raise AssertionError(f"leak: host copies left {seen.host.copies}")

    def run(self, programs: Sequence[Program], setup: Setup | None = None,
            drain: bool = False) -> None:
        self.setup(setup or Setup(), programs)

        def body(p: Program) -> Callable[[], None]:
            def go() -> None:
                for op in p.ops:
                    self.run_op(op)
            return go

        failure: ScheduleFailure | None = None
        try:
            self.sched.run([(p.name, body(p)) for p in programs])
            with self.detector.ignoring():
                self.lin.check(final=True)
            if drain:
                self.drain()
        except ScheduleFailure as err:
            failure = ScheduleFailure(f"{err}\n{self.races()}{describe(programs)}",
                                      err.schedule)
        except AssertionError as err:
            failure = ScheduleFailure(
                f"{err}\n{describe(programs)}\nschedule={self.sched.schedule}",
                list(self.sched.schedule))
        if failure is None and self.lockset and (self.detector.reports
                                                 or self.detector.unguarded):
            failure = ScheduleFailure(
                f"{self.races()}{describe(programs)}\nschedule={self.sched.schedule}",
                list(self.sched.schedule))
        if failure is not None:
            self.keep(failure, programs, setup or Setup(), drain)
            raise failure from None

    def keep(self, failure: ScheduleFailure, programs: Sequence[Program], setup: Setup,
             drain: bool) -> None:
        """Write the failure's trace file: the programs, the set-up and the
        schedule replay it (`kvref.testing.replay`, from a source tree)."""
        if not self.recording or not trace.final_example():
            return
        trace.keep(failure, lambda: trace.build(
            "sched", self.scope, [e.action for e in self.lin.log], failure,
            self.base_config, programs=list(programs), setup=setup,
            schedule=list(failure.schedule), drain=drain, options=self.options,
            model=type(self.model).__name__))

    def races(self) -> str:
        if not self.lockset:
            return ""
        out = ""
        # the first few of each kind: races, then accesses without the manager's lock
        for reports in (self.detector.reports, self.detector.unguarded):
            out += "".join(f"{r}\n" for r in reports[:3]) + (
                f"(and {len(reports) - 3} more)\n" if len(reports) > 3 else "")
        return out


def describe(programs: Sequence[Program]) -> str:
    return "programs:\n" + "\n".join(f"  {p.name}: {list(p.ops)}" for p in programs)


def run_once(programs: Sequence[Program], strategy: Strategy, setup: Setup | None = None,
             drain: bool = False, **kwargs: Any) -> Harness:
    h = Harness(strategy, **kwargs)
    h.run(programs, setup, drain)
    return h


def replay(programs: Sequence[Program], schedule: Sequence[int],
           setup: Setup | None = None) -> Harness:
    """Rerun a failure exactly: the schedule its message printed."""
    return run_once(programs, Replay(schedule), setup)


@dataclass
class Stats:
    runs: int = 0
    seconds: float = 0.0
    found_at: int | None = None
    failure: str = ""
    schedules: list[list[int]] = field(default_factory=list)


# the programs and events a trace file names
trace.register(Program, StepOp, Op, Setup, PublisherMoves, CachePrefixIds)

__all__ = [
    "PLAIN_SCOPE", "SCOPE", "SCOPES", "SHIPPED_SCOPE", "CachePrefixIds", "ConcurrentModel",
    "Harness",
    "Linearizer", "Op", "Program", "Setup", "StepOp", "describe", "replay", "retrieve_state",
    "run_once",
]
