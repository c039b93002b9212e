"""Breadth-first search over any model, on fingerprints, across processes.

Generic: a `Spec` gives the model (`init()`, `step(state, action) ->
(result, state)`), the enabled actions, the state and transition checks, the
coverage predicates and the canonical encoding (symmetry).  Nothing here
knows the shape of a state.

- The visited set holds 64-bit fingerprints of canonical encodings
  (kvref_model.fingerprint), not states.
- Each state keeps a parent id and the index of the action (in `enabled`
  order) that reached it; a trace is rebuilt by replaying those from
  `init()`, which gives back the very concrete states the search expanded.
- Each level of the BFS lives on disk (kvref_model.frontier) and is cut into
  fixed chunks; workers expand chunks, the main process merges their
  results in chunk order.  So the counts, the states and the traces do not
  depend on the number of workers.
- A transition whose next state is the very object it left (a refusal, a
  misuse, a no-op: most of them) has no successor to compare, encode or
  check; a spec's `observe` may also skip, per transition, the checks and
  coverage predicates that cannot fail or hold there (kvref_model.check does).
- A successor is encoded once per chunk, and its state checks run only if
  its fingerprint is new to the chunk and to what the worker knows the
  merge took (each task carries the fingerprints accepted since that
  worker's last one): about once per new state.
- A checkpoint (taken between chunks) holds everything needed to go on.
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
from array import array
from collections import Counter, deque
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from kvref_model.fingerprint import BITS, FingerprintSet, collision_odds, fingerprint
from kvref_model.frontier import Entry, LevelReader, LevelWriter, level_from
from kvref_model.memory import peak_rss, rss

NO_ACTION = 0xFFFF  # the root's action index
CHECKPOINT_VERSION = 2  # 2: the report counts unchanged transitions and checks

Check = tuple[str, str]  # (invariant ID, what is wrong)
Trace = tuple[tuple[Any, Any], ...]  # ((action, result), ...)


@dataclass(frozen=True)
class Spec:
    """What to search.  Functions take the model first, as kvref_model.invariants does."""

    model: Any
    enabled: Callable[[Any, Any], Iterable[Any]]
    state_checks: Callable[[Any, Any], list[Check]]
    # (model, state before, action, result, state after)
    transition_checks: Callable[[Any, Any, Any, Any, Any], list[Check]]
    interesting: Mapping[str, Callable[[Any, Any, Any, Any, Any], bool]]
    key: Callable[[Any], bytes]  # canonical encoding: equal exactly within a symmetry class
    depth: int = 0  # 0: until no new state
    identity: str = ""  # what a checkpoint must match to be resumed
    # instead of `interesting` and `transition_checks`, one call per transition
    # that does both: (model, state before, action, result, state after, the
    # interesting cases' counts to add to) -> the transition checks' failures,
    # the same as `transition_checks` gives (a spec can then skip, per
    # transition, what cannot hold or fail there)
    observe: Callable[[Any, Any, Any, Any, Any, Counter[str]], Sequence[Check]] | None = None
    # what the spec's checks did since the last call (say, how many transitions
    # each transition check ran on), drained after each chunk into the report
    check_stats: Callable[[], Mapping[str, int]] | None = None


@dataclass
class Report:
    states: int = 0
    transitions: int = 0
    depth: int = 0
    seconds: float = 0.0
    fired: Counter[str] = field(default_factory=Counter)
    interesting: Counter[str] = field(default_factory=Counter)
    # first (shortest) violation per invariant ID
    violations: dict[str, tuple[str, Trace]] = field(default_factory=dict)
    workers: int = 1
    # transitions whose next state is the very state they left (a refusal, a
    # misuse, a no-op): no successor to encode, and only the transition checks
    # that can fail there run (Spec.check_stats counts what ran)
    unchanged: int = 0
    checks: Counter[str] = field(default_factory=Counter)  # Spec.check_stats, summed
    complete: bool = False  # False: stopped at a violation or interrupted
    peak_rss: int = 0  # bytes, the main process
    peak_rss_workers: int = 0  # bytes, all worker processes together
    visited_bytes: int = 0

    @property
    def collision_odds(self) -> float:
        return collision_odds(self.states)

    @property
    def fingerprint_bits(self) -> int:
        return BITS


class CheckpointMismatch(Exception):
    """A checkpoint written by a search of another model, scope or option."""


# ------------------------------------------------------- state transport

_FIELDS: dict[type, tuple[str, ...]] = {}


def dumps(state: Any) -> bytes:
    """A state as bytes.  A dataclass state travels as (class, field values):
    whatever it caches in its __dict__ stays behind (State caches its
    hash, salted per process: a resumed run must not inherit it)."""
    cls = type(state)
    names = _FIELDS.get(cls)
    if names is None:
        if not is_dataclass(cls) or not all(f.init for f in fields(cls)):
            return pickle.dumps((None, state), pickle.HIGHEST_PROTOCOL)
        names = _FIELDS[cls] = tuple(f.name for f in fields(cls))
    return pickle.dumps((cls, tuple(getattr(state, n) for n in names)),
                        pickle.HIGHEST_PROTOCOL)


_PLAIN: dict[type, tuple[str, ...] | None] = {}


def loads(data: bytes) -> Any:
    cls, payload = pickle.loads(data)
    if cls is None:
        return payload
    names = _PLAIN.get(cls, ())
    if names == ():
        # a dataclass whose __init__ only sets its fields: filled in directly,
        # as its __init__ would (a frozen one's costs a call per field)
        plain = (not hasattr(cls, "__post_init__") and not hasattr(cls, "__slots__")
                 and all(f.init for f in fields(cls)))
        names = _PLAIN[cls] = tuple(f.name for f in fields(cls)) if plain else None
    if names is None:
        return cls(*payload)
    state = object.__new__(cls)
    state.__dict__.update(zip(names, payload, strict=True))
    return state


# ----------------------------------------------------------- the workers

# (fingerprint, parent id, action index, pickled state, its state checks)
Found = tuple[int, int, int, bytes, list[Check]]
# (invariant ID, message, state id, action index or -1 for a state check)
Violation = tuple[str, str, int, int]


@dataclass
class ChunkResult:
    transitions: int = 0
    unchanged: int = 0
    fired: Counter[str] = field(default_factory=Counter)
    interesting: Counter[str] = field(default_factory=Counter)
    checks: Counter[str] = field(default_factory=Counter)
    # in transition order: a Found, or a Violation of a transition check
    events: list[tuple[str, Any]] = field(default_factory=list)


def _observer(spec: Spec
              ) -> Callable[[Any, Any, Any, Any, Any, Counter[str]], Sequence[Check]]:
    """`spec.observe`, or the plain one: every interesting predicate and the
    transition checks, on every transition."""
    if spec.observe is not None:
        return spec.observe
    preds, tchecks = tuple(spec.interesting.items()), spec.transition_checks

    def observe(m: Any, s: Any, a: Any, r: Any, n: Any, counts: Counter[str]) -> list[Check]:
        for iid, pred in preds:
            if pred(m, s, a, r, n):
                counts[iid] += 1
        return tchecks(m, s, a, r, n)
    return observe


def expand_chunk(spec: Spec, chunk: list[Entry], expand: bool,
                 leaves: bool = False, known: Any = None, defer: bool = False) -> ChunkResult:
    """Every enabled action of every state in `chunk`: counts, coverage,
    transition checks, and each successor new to this chunk (with its state
    checks; whether it is new to the search only the merge knows).  With
    `leaves` the successors are the last level: nobody expands or reads
    them, so they travel without their bytes.  A successor whose fingerprint
    is in `known` (states the merge will have taken before this chunk's
    results, so it would drop it) is not reported: no state checks, no bytes.
    With `defer` each successor's event holds the state itself and nothing is
    encoded or checked: `finish_chunk` does that once the caller has learnt
    which of them are known (a visited set held elsewhere, asked in one batch).

    A transition whose next state is the state object it left (every
    refusal and misuse of the model, about 3 in 4 transitions) has no
    successor: nothing to compare, encode, fingerprint or check as a state;
    it still counts, fires, and goes through the interesting predicates
    and the transition checks (which skip what cannot fail there)."""
    out = ChunkResult()
    if not expand:
        return out
    # the model's values hold no reference cycles, so the cyclic collector
    # would only scan the millions of objects a chunk makes (a tenth of the
    # time); off for the chunk, and whatever cycle a chunk leaves is still
    # collected once it is back on
    collecting = gc.isenabled()
    gc.disable()
    try:
        _expand(spec, chunk, leaves, known, out, defer)
    finally:
        if collecting:
            gc.enable()
    return out


def _expand(spec: Spec, chunk: list[Entry], leaves: bool, known: Any,
            out: ChunkResult, defer: bool = False) -> None:
    if known is None:
        known = frozenset()
    m, step, enabled, key = spec.model, spec.model.step, spec.enabled, spec.key
    observe, schecks = _observer(spec), spec.state_checks
    interesting, events = out.interesting, out.events
    # successors already taken in this chunk, and its states: by value first
    # (a cheap hash), then by fingerprint (canonicalising is the dear part)
    seen: set[Any] = set()
    local: set[int] = set()
    unchanged = 0
    # transitions per action type, counted a state at a time by Counter's C
    # loop; names once, at the end
    types: Counter[type] = Counter()
    for sid, data in chunk:
        s = loads(data)
        seen.add(s)  # a successor equal to the state it left is none
        acts = list(enabled(m, s))
        types.update(map(type, acts))
        for idx, a in enumerate(acts):
            r, n = step(s, a)
            if n is s:
                unchanged += 1
            elif n not in seen:
                seen.add(n)
                fp = fingerprint(key(n))
                if fp not in local and fp not in known:
                    local.add(fp)
                    if defer:
                        events.append(("n", (fp, sid, idx, n, None)))
                    else:
                        events.append(("n", (fp, sid, idx, b"" if leaves else dumps(n),
                                             schecks(m, n))))
            bad = observe(m, s, a, r, n, interesting)
            if bad:
                for iid, msg in bad:
                    events.append(("v", (iid, msg, sid, idx)))
    for t, k in types.items():
        out.transitions += k
        out.fired[t.__name__] += k
    out.unchanged = unchanged
    if spec.check_stats is not None:
        out.checks.update(spec.check_stats())


def successors(res: ChunkResult) -> list[int]:
    """The fingerprints of a chunk's reported successors, in event order."""
    return [ev[0] for kind, ev in res.events if kind == "n"]


def finish_chunk(spec: Spec, res: ChunkResult, leaves: bool, known: Any) -> ChunkResult:
    """A chunk expanded with `defer`: drop the successors whose fingerprint is
    in `known`, encode and state-check the rest, as `expand_chunk` would have."""
    m, schecks = spec.model, spec.state_checks
    events: list[tuple[str, Any]] = []
    for kind, ev in res.events:
        if kind == "n":
            fp, sid, idx, n, _ = ev
            if fp in known:
                continue
            ev = (fp, sid, idx, b"" if leaves else dumps(n), schecks(m, n))
        events.append((kind, ev))
    res.events = events
    return res


def _serve(conn: Any, spec: Spec) -> None:
    """A worker process: expand each chunk it is sent, in order."""
    # it must die on SIGTERM (also when sent to the whole process group) and
    # leave Ctrl-C to the parent, which stops the workers
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # what the merge has taken (sent with each task: the states it accepted
    # since this worker's last one) and what this worker reported itself: its
    # chunks come in order and are merged in order, so each chunk's results
    # are merged after every earlier one of its own
    known = FingerprintSet()
    # results go out from a thread, so this loop keeps reading tasks: a result
    # larger than the pipe's buffer, sent while the parent is itself blocked
    # sending this worker its next task, would otherwise hang both (seen once
    # states carried page ids)
    out: queue.SimpleQueue[ChunkResult | None] = queue.SimpleQueue()

    def send() -> None:
        while (res := out.get()) is not None:
            conn.send(res)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    while (task := conn.recv()) is not None:
        chunk, expand, leaves, taken = task
        for fp in array("Q", taken):
            known.add(fp)
        res = expand_chunk(spec, chunk, expand, leaves, known)
        for kind, ev in res.events:
            if kind == "n":
                known.add(ev[0])
        out.put(res)
    out.put(None)
    sender.join()


class Workers:
    """N processes, each with its own pipe; chunk i goes to worker i mod N,
    so results come back in chunk order without any lock shared between
    processes (a worker killed while holding one, as multiprocessing.Pool's
    queues have, would hang the rest)."""

    def __init__(self, n: int, spec: Spec) -> None:
        ctx = multiprocessing.get_context("fork")  # the spec is inherited, not pickled
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        self.sent = [0] * n  # per worker: how much of the accepted fingerprints it was sent
        self.trimmed = 0  # accepted fingerprints dropped from the front, all sent
        for _ in range(n):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(theirs, spec), daemon=True)
            p.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(p)

    def submit(self, i: int, task: tuple[list[Entry], bool, bool], taken: array[int]
               ) -> _Result:
        """Chunk i, with the fingerprints merged since that worker's last
        chunk (`taken`, every state the merge accepted: each worker gets its
        own cursor into it)."""
        w = i % len(self.conns)
        self.sent[w], since = len(taken) + self.trimmed, self.sent[w] - self.trimmed
        self.conns[w].send((*task, taken[since:].tobytes()))
        return _Result(self.conns[w])

    def trim(self, taken: array[int]) -> None:
        """Drop what every worker has been sent."""
        done = min(self.sent) - self.trimmed
        if done > 1 << 16:
            del taken[:done]
            self.trimmed += done

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid]

    def memory(self) -> int:
        """Bytes resident in the workers now."""
        return sum(rss(pid) for pid in self.pids())

    def peaks(self) -> list[int]:
        """Each worker's peak resident bytes so far."""
        return [peak_rss(pid) for pid in self.pids()]

    def stop(self) -> None:
        for p in self.procs:
            p.kill()  # nothing they hold is shared: killing is safe
        for p in self.procs:
            p.join()
        for c in self.conns:
            c.close()


class _Result:
    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def get(self) -> ChunkResult:
        got: ChunkResult = self.conn.recv()
        return got


class _Done:
    """A chunk expanded in this process: the same interface as a _Result."""

    def __init__(self, value: ChunkResult) -> None:
        self.value = value

    def get(self) -> ChunkResult:
        return self.value


# ------------------------------------------------------------ the search


class Search:
    """`for sid, data in Search(spec).run(): ...` yields every new state
    (id, pickled) as it is accepted; `report` fills in as it goes."""

    def __init__(self, spec: Spec, *, workers: int = 1, keep_going: bool = False,
                 progress: bool = False, checkpoint: str | None = None,
                 checkpoint_every: float = 60.0, resume: str | None = None,
                 stop_after_chunks: int | None = None, report: Report | None = None,
                 progress_every: float = 2.0, want_states: bool = True) -> None:
        self.spec = spec
        self.workers = max(1, workers)
        self.keep_going = keep_going
        self.progress = progress
        self.progress_every = progress_every
        # False: run() may yield the last level's states without their bytes
        self.want_states = want_states
        self.leaf_states = 0
        self._left = 0
        self.checkpoint_path = checkpoint
        self.checkpoint_every = checkpoint_every
        self.resume_path = resume
        # for tests of resume: stop (with a checkpoint) after this many chunks
        self.stop_after_chunks = stop_after_chunks
        self.report = report if report is not None else Report()
        self.report.workers = self.workers
        self.visited = FingerprintSet()
        self._taken = array("Q")  # fingerprints accepted, not yet sent to every worker
        self.parents = array("I")
        self.actions = array("H")
        self.level = 0
        self._elapsed_before = 0.0
        self.worker_peaks: list[int] = []  # each worker's peak resident bytes, at the end
        # whether the workers keep what the merge took (sent with each task)
        self._share_taken = self.workers > 1

    # ------------------------------------------------------------ traces

    def path(self, sid: int) -> list[int]:
        out = []
        while self.actions[sid] != NO_ACTION:
            out.append(self.actions[sid])
            sid = self.parents[sid]
        return out[::-1]

    def trace(self, sid: int, then: int = -1) -> Trace:
        """The shortest trace to state `sid` (then its action `then`), by replay."""
        m = self.spec.model
        s = m.init()
        out = []
        for i in [*self.path(sid), *([then] if then >= 0 else [])]:
            a = next(itertools.islice(self.spec.enabled(m, s), i, None))
            r, s = m.step(s, a)
            out.append((a, r))
        return tuple(out)

    def state(self, sid: int) -> Any:
        m = self.spec.model
        s = m.init()
        for i in self.path(sid):
            s = m.step(s, next(itertools.islice(self.spec.enabled(m, s), i, None)))[1]
        return s

    # ------------------------------------------------------------ the loop

    def run(self) -> Iterator[tuple[int, bytes]]:
        workdir = tempfile.mkdtemp(prefix="model-check-")
        pool: Workers | None = None
        try:
            if self.resume_path:
                cur, nxt, offset = self._load(self.resume_path, workdir)
            else:
                cur, nxt, offset = yield from self._start(workdir)
            pool = self._open_pool()
            yield from self._levels(cur, nxt, offset, workdir, pool)
        finally:
            if pool is not None:
                self.worker_peaks = pool.peaks()
                self.report.peak_rss_workers = sum(self.worker_peaks)
                pool.stop()
            self.report.peak_rss = peak_rss()
            self.report.states = self._visited_count()
            self.report.visited_bytes = (self.visited.nbytes + self.parents.itemsize
                                         * len(self.parents) + 2 * len(self.actions))
            shutil.rmtree(workdir, ignore_errors=True)

    def _open_pool(self) -> Any:
        """The worker pool (None: chunks are expanded in this process)."""
        return Workers(self.workers, self.spec) if self.workers > 1 else None

    def _accepting(self, res: ChunkResult) -> Callable[[int], bool]:
        """For a chunk's results: whether each successor's fingerprint is new
        (and from then on visited), asked in event order."""
        return self.visited.add

    def _visited_count(self) -> int:
        return len(self.visited)

    def _start(self, workdir: str
               ) -> Generator[tuple[int, bytes], None, tuple[LevelReader, LevelWriter, int]]:
        m, rep = self.spec.model, self.report
        s0 = m.init()
        data = dumps(s0)
        self.visited.add(fingerprint(self.spec.key(s0)))
        self.parents.append(0)
        self.actions.append(NO_ACTION)
        for iid, msg in self.spec.state_checks(m, s0):
            rep.violations.setdefault(iid, (msg, ()))
        first = LevelWriter(workdir)
        first.append((0, data))
        yield 0, data
        return first.close(), LevelWriter(workdir), 0

    def _levels(self, cur: LevelReader, nxt: LevelWriter, offset: int, workdir: str,
                pool: Workers | None) -> Generator[tuple[int, bytes], None, None]:
        rep, spec = self.report, self.spec
        t0 = time.monotonic() - self._elapsed_before
        last_progress = last_checkpoint = time.monotonic()
        merged = 0
        # two chunks a worker in flight: one expanding, one waiting
        window = 2 * self.workers if pool is not None else 1
        submitted = 0
        while True:
            rep.depth = max(rep.depth, self.level)
            expand = spec.depth == 0 or self.level < spec.depth
            leaves = not self.want_states and self.level + 1 == spec.depth
            chunks = cur.chunks()
            pending: deque[tuple[int, int, Any]] = deque()
            self._left = cur.count  # states of this level not merged yet
            more = True
            while True:
                while more and len(pending) < window:
                    got = next(chunks, None)
                    if got is None:
                        more = False
                        break
                    at, chunk = got
                    if pool is not None:
                        pending.append((at, len(chunk), pool.submit(
                            submitted, (chunk, expand, leaves), self._taken)))
                        pool.trim(self._taken)
                        submitted += 1
                    else:  # merged before the next: the visited set is what is known
                        pending.append((at, len(chunk), _Done(
                            expand_chunk(spec, chunk, expand, leaves, self.visited))))
                if not pending:
                    break
                _, size, handle = pending.popleft()
                self._left -= size
                stopped = yield from self._merge(handle.get(), nxt)
                merged += 1
                offset = pending[0][0] if pending else cur.position()
                now = time.monotonic()
                rep.seconds = now - t0
                if stopped:
                    if self.checkpoint_path:
                        self._save(cur, offset, nxt)
                    return
                if self.progress and now - last_progress >= self.progress_every:
                    last_progress = now
                    self._show_progress(cur, nxt, pool)
                if self.checkpoint_path and (now - last_checkpoint >= self.checkpoint_every
                                             or merged == self.stop_after_chunks):
                    last_checkpoint = now
                    self._save(cur, offset, nxt)
                if merged == self.stop_after_chunks:
                    return
            if leaves and self.leaf_states:
                rep.depth = self.level + 1
            if nxt.count == 0:
                rep.complete = True
                rep.seconds = time.monotonic() - t0
                if self.checkpoint_path:  # resuming it gives this report back
                    self._save(cur, cur.position(), nxt)
                cur.close()
                return
            cur.close()
            cur, nxt, offset = nxt.close(), LevelWriter(workdir), 0
            self.level += 1

    def _merge(self, res: ChunkResult, nxt: LevelWriter
               ) -> Generator[tuple[int, bytes], None, bool]:
        """Take a chunk's results in order; True when the search must stop."""
        rep = self.report
        rep.transitions += res.transitions
        rep.unchanged += res.unchanged
        rep.fired.update(res.fired)
        rep.interesting.update(res.interesting)
        rep.checks.update(res.checks)
        stop_at: tuple[int, int] | None = None  # the violating transition
        accept = self._accepting(res)
        for kind, ev in res.events:
            where = (ev[1], ev[2]) if kind == "n" else (ev[2], ev[3])
            if stop_at is not None and where != stop_at:
                break  # the rest of the violating transition is taken, as before it
            if kind == "n":
                fp, parent, idx, data, checks = ev
                if not accept(fp):
                    continue
                if self._share_taken:
                    self._taken.append(fp)
                sid = len(self.parents)
                self.parents.append(parent)
                self.actions.append(idx)
                if data:
                    nxt.append((sid, data))
                else:
                    self.leaf_states += 1
                for iid, msg in checks:
                    if iid not in rep.violations:
                        rep.violations[iid] = (msg, self.trace(sid))
                if checks and not self.keep_going:
                    stop_at = where
                yield sid, data
            else:
                iid, msg, sid, idx = ev
                if iid not in rep.violations:
                    rep.violations[iid] = (msg, self.trace(sid, idx))
                if not self.keep_going:
                    stop_at = where
        rep.states = self._visited_count()
        return stop_at is not None

    # ------------------------------------------------------------ progress

    def _show_progress(self, cur: LevelReader, nxt: LevelWriter,
                       pool: Workers | None) -> None:
        rep = self.report
        mem = rss() + (pool.memory() if pool else 0)
        print(f"  ... {rep.states:,} states, {rep.transitions:,} transitions, depth "
              f"{self.level}, {rep.states / max(rep.seconds, 1e-9):,.0f} states/s, queue "
              f"{self._left + nxt.count:,}, memory {mem / 2**20:,.0f} MiB", file=sys.stderr,
              flush=True)

    # ------------------------------------------------------------ checkpoints

    def _save(self, cur: LevelReader, offset: int, nxt: LevelWriter) -> None:
        """A small pickled header, then the visited table, the parent
        pointers and the two levels' files, streamed (never whole in memory)."""
        assert self.checkpoint_path is not None
        head = {
            "version": CHECKPOINT_VERSION, "identity": self.spec.identity,
            "level": self.level, "report": self.report,
            "visited_slots": self.visited.nbytes // 8, "states": len(self.parents),
            "current_bytes": cur.size_from(offset), "current_count": self._left,
            "next_bytes": nxt.size(), "next_buffer": nxt.buffer, "next_count": nxt.count,
        }
        tmp = self.checkpoint_path + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump(head, f, protocol=pickle.HIGHEST_PROTOCOL)
            self.visited.to_file(f)
            self.parents.tofile(f)
            self.actions.tofile(f)
            cur.copy_from(offset, f)
            nxt.copy_to(f)
        os.replace(tmp, self.checkpoint_path)  # a crash mid-write keeps the last one

    def _load(self, path: str, workdir: str) -> tuple[LevelReader, LevelWriter, int]:
        with open(path, "rb") as f:
            try:
                head = pickle.load(f)
            except Exception as err:
                raise CheckpointMismatch(f"{path}: not a checkpoint ({err})") from None
            if not isinstance(head, dict) or head.get("version") != CHECKPOINT_VERSION:
                raise CheckpointMismatch(f"{path}: not a checkpoint of this checker version")
            if head["identity"] != self.spec.identity:
                raise CheckpointMismatch(f"{path} is of another search: {head['identity']}")
            self.level = head["level"]
            old: Report = head["report"]
            for name in [f.name for f in fields(Report)]:  # into the caller's report object
                setattr(self.report, name, getattr(old, name))
            self.report.workers = self.workers
            self._elapsed_before = old.seconds
            self.visited = FingerprintSet.from_file(f, head["visited_slots"])
            self.parents = array("I")
            self.parents.fromfile(f, head["states"])
            self.actions = array("H")
            self.actions.fromfile(f, head["states"])
            cur = level_from(workdir, f, head["current_bytes"], head["current_count"])
            nxt = LevelWriter(workdir)
            nxt.restore(f, head["next_bytes"], head["next_buffer"], head["next_count"])
        return cur, nxt, 0
