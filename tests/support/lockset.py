"""An Eraser-style lockset race detector for kvref's shared state (test only).

kvref asks its runtime for every container of shared state
(`kvref.core.runtime.shared`). The test runtimes (`CoopRuntime`, `TracedRuntime`)
answer with the instrumented containers below; every read and write made
through them records the thread, the locks it holds (the runtime's locks
report acquire and release here) and where it was made. Two threads touching
one datum with no lock in common, at least one of them writing, is a
`RaceReport` naming the datum with both stacks. The scheduler also uses the
access hook as a switch point (`Detector.preempt`): accesses made holding no
lock are where interleavings inside unlocked code happen.

The data watched, and how:
- the streams table (`streams`, a dict), each request's labels table
  (`streams[rid]`), each stream's fields (the object's class is swapped for a
  subclass with the same slots whose fields record) and its page list;
- an allocator's free list (`device pages.free`, `host pages.free`);
- the host pool's copies table and pending-free list;
- the offload table (`offloads`);
- the manager's staged preplan and the plan states `write_kv`/`read_kv` read
  (`watch_manager`: the two attributes become recording properties);
- the lease table and the request configs (`watch_tables`).

Besides the lockset, a discipline (`Detector.guard`): every access to the
manager's state (`GUARDED`) made inside a public call must hold that
manager's lock. It needs one thread, not two: a call whose work moved out
of its ``with self._lock`` is reported on its first run.

What it does not see: state outside those containers (an `Offload`'s own
fields, the transfer manager's, `_overrides`, tensors), order that comes
from anything but a common lock (a thread start, a future's result: such
hand-offs are reported unless declared), and races in code the test did not
run. Accesses in `LOCK_FREE` are deliberate and not recorded.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import count
from typing import Any

from kvref.core.runtime import ThreadingRuntime
from kvref.core.streams import CacheStream

# (datum kind, operation) -> why it may run without the lock. Kinds are the
# names containers were made with, `[]` for a table's rows and `.field` for
# a stream's fields.
LOCK_FREE: dict[tuple[str, str], str] = {
    # `has_request` and `remove_request`'s early return: one dict lookup,
    # atomic under the GIL. A stale answer orders the call before the ingest
    # or removal it missed, and remove re-reads the table under the lock.
    ("streams", "__contains__"): "one atomic lookup; remove re-checks under the lock",
}

# The manager's state: every read and write of it, made on behalf of a call
# into kvref, must hold that manager's lock (``Detector.guarding``). Kinds are
# matched by prefix. The host pool and the allocators' free lists have locks of
# their own, which the lockset check above covers.
GUARDED: tuple[str, ...] = ("streams", "stream.", "offloads", "manager.", "device pages.",
                             "leases", "overrides")
# (kind prefix, the public call on the stack) -> why it may touch that state
# without the manager's lock.
GUARD_FREE: dict[tuple[str, str], str] = {
    # one count read in one section of the pool's own lock: a snapshot no
    # other state has to agree with (what an engine's admission loop polls)
    ("device pages.", "num_free_pages"): "one read under the pool's lock",
    ("device pages.", "num_cached_pages"): "one read under the pool's lock",
    ("device pages.", "post_warmup_validate"): "one read under the pool's lock",
}
# Also lock-free, and not containers, so not watched: a stream's read
# `Future` is polled through `done()` outside the manager's lock (reset's and
# remove's drain, an offload's copy). A Future carries its own condition lock;
# the manager reads *which* future a stream holds only under its lock (R32).

_SKIP = {__file__, threading.__file__}


@dataclass(frozen=True)
class Access:
    thread: str
    tid: int
    op: str
    write: bool
    locks: tuple[Any, ...]
    stack: tuple[tuple[Any, int], ...]

    def render(self) -> str:
        held = ", ".join(getattr(lk, "name", repr(lk)) for lk in self.locks) or "no lock"
        what = "write" if self.write else "read"
        if self.op not in ("read", "write"):
            what += f" ({self.op})"
        lines = [f"  {self.thread}: {what} holding {held}"]
        lines += [f"    {os.path.relpath(code.co_filename)}:{n} in {code.co_name}"
                  for code, n in self.stack if code.co_filename not in _SKIP]
        return "\n".join(lines)


@dataclass(frozen=True)
class RaceReport:
    datum: str
    first: Access
    second: Access

    def __str__(self) -> str:
        return (f"data race on {self.datum}: no common lock\n"
                f"{self.first.render()}\n{self.second.render()}")


@dataclass(frozen=True)
class GuardReport:
    """An access to the manager's state, inside ``call``, without its lock."""

    datum: str
    call: str
    access: Access

    def __str__(self) -> str:
        return (f"unguarded access to {self.datum} in {self.call}: the manager's "
                f"lock is not held\n{self.access.render()}")


_ENTRY_TYPES: tuple[type, ...] = ()


def _entry_types() -> tuple[type, ...]:
    """The classes whose calls are kvref's entry points (imported late: the
    manager's modules import the runtime this module's users install)."""
    global _ENTRY_TYPES
    if not _ENTRY_TYPES:
        from kvref.manager import KVManager
        from kvref.offload.handle import Offload

        _ENTRY_TYPES = (KVManager, Offload)
    return _ENTRY_TYPES


def _stack(depth: int = 8) -> tuple[tuple[Any, int], ...]:
    """The caller's frames as (code, line): cheap now, rendered only in a report."""
    out: list[tuple[Any, int]] = []
    f: Any = sys._getframe(2)
    while f is not None and len(out) < depth:
        out.append((f.f_code, f.f_lineno))
        f = f.f_back
    return tuple(out)


class Detector:
    """The lockset check; one per manager under test (or per scheduled run)."""

    def __init__(self, record: bool = True) -> None:
        # False: the containers only provide switch points (no lockset check)
        self.record = record
        self._tl = threading.local()
        self._meta = threading.Lock()  # the detector's own tables, across real threads
        # (serial, field) -> (thread id, write, lock ids) -> first such access
        self._hist: dict[tuple[int, str], dict[tuple[int, bool, frozenset[int]], Access]] = {}
        self._serial = count(1)
        # id(stream) -> serial, name (streams have no weak references: kept alive)
        self._serials: dict[int, int] = {}
        self._names: dict[int, str] = {}
        self._keep: list[object] = []
        self._seen: set[tuple[str, Any, Any]] = set()
        self.reports: list[RaceReport] = []
        # the lock discipline (`guarding`): the managers' locks, and what broke it
        self.guarding = False
        self._guards: set[int] = set()
        self.unguarded: list[GuardReport] = []
        self._unguarded_seen: set[tuple[Any, ...]] = set()
        self.accesses = 0
        # called before an access made holding no lock: the scheduler's switch point
        self.preempt: Callable[[str], None] | None = None
        self._stream_cls = _traced_stream_class(self)

    # -- locks (the runtime's locks call these on their outermost acquire/release)

    def _held(self) -> list[Any]:
        held: list[Any] | None = getattr(self._tl, "held", None)
        if held is None:
            held = self._tl.held = []
        return held

    def acquired(self, lock: Any) -> None:
        self._held().append(lock)

    def released(self, lock: Any) -> None:
        held = self._held()
        if lock in held:
            held.remove(lock)

    # -- the lock discipline ------------------------------------------------------

    def guard(self, on: bool = True) -> None:
        """Check, besides the lockset, that every access to the manager's state
        (`GUARDED`) made inside a call into a `KVManager` (or its `Offload`)
        holds that manager's lock, whatever other thread runs: a read or
        write moved out of ``with self._lock`` is reported by a run with one
        thread, on the first call that reaches it, where the lockset check
        needs a second thread touching the same datum (and sees nothing at
        all when the datum has a lock of its own, as the page pool has)."""
        self.guarding = on

    def _unguarded(self, datum: str, kind: str, op: str, write: bool) -> None:
        # slow path only: no manager's lock known to be held. The entry is the
        # outermost frame whose ``self`` is a manager or an offload handle
        entry: tuple[Any, str] | None = None
        f: Any = sys._getframe(2)
        while f is not None:
            code = f.f_code
            if code.co_argcount and code.co_varnames[0] == "self":
                obj = f.f_locals.get("self")
                if isinstance(obj, _entry_types()):
                    entry = (obj, code.co_name)
            f = f.f_back
        if entry is None:
            return  # the test's own read, or a background task's
        who, name = entry
        # the manager's lock (an offload handle's: its manager's), known from now on
        lock = getattr(who, "_lock", None) or who._phases.table.lock
        self._guards.add(id(lock))
        if any(lk is lock for lk in getattr(self._tl, "held", None) or ()):
            return
        if any(kind.startswith(k) and name == call for k, call in GUARD_FREE):
            return
        stack = _stack()
        key = (kind, op, name, stack[:3])
        with self._meta:
            if key in self._unguarded_seen:
                return
            self._unguarded_seen.add(key)
            held = getattr(self._tl, "held", None) or ()
            self.unguarded.append(GuardReport(datum, name, Access(
                threading.current_thread().name, threading.get_ident(), op, write,
                tuple(held), stack)))

    # -- scope -------------------------------------------------------------------

    @contextmanager
    def ignoring(self) -> Iterator[None]:
        """Accesses of the test's own checks: neither recorded nor switch points."""
        self._tl.ignore = getattr(self._tl, "ignore", 0) + 1
        try:
            yield
        finally:
            self._tl.ignore -= 1

    def forget(self) -> None:
        """Drop the history: what ran before the threads started happens-before
        them (a thread start is an order the lockset algorithm cannot see)."""
        with self._meta:
            self._hist.clear()

    # -- the check -----------------------------------------------------------------

    def access(self, serial: int, base: str, field: str, kind: str, op: str,
               write: bool) -> None:
        """One read or write of datum ``base + field`` (named only if reported)."""
        tl = self._tl
        if getattr(tl, "ignore", 0):
            return
        held = getattr(tl, "held", None)
        if not held and self.preempt is not None:
            self.preempt(f"{op} {base}{field}")
        if not self.record or (kind, op) in LOCK_FREE:
            return
        if self.guarding and kind.startswith(GUARDED) and not (
                held and any(id(lk) in self._guards for lk in held)):
            self._unguarded(base + field, kind, op, write)
        locks = tuple(held) if held else ()
        ids = frozenset(id(lk) for lk in locks)
        me = threading.get_ident()
        k = (me, write, ids)
        with self._meta:
            self.accesses += 1
            entries = self._hist.setdefault((serial, kind), {})
            racing = [other for (tid, was_write, other_ids), other in entries.items()
                      if tid != me and (write or was_write) and not (ids & other_ids)]
            if not racing and k in entries:
                return  # seen from here before: the stack is only worth its cost once
        # outside the detector's lock: frames are this thread's own
        this = Access(threading.current_thread().name, me, op, write, locks, _stack())
        with self._meta:
            entries.setdefault(k, this)
            for other in racing:
                key = (kind, other.stack[:3], this.stack[:3])
                if key not in self._seen:
                    self._seen.add(key)
                    self.reports.append(RaceReport(base + field, other, this))

    def _drop(self, serial: int) -> None:
        with self._meta:
            for key in [k for k in self._hist if k[0] == serial]:
                del self._hist[key]

    def new_serial(self, obj: object) -> int:
        serial = next(self._serial)
        try:
            weakref.finalize(obj, self._drop, serial)
        except TypeError:  # no weak references (a slotted stream): kept alive
            self._keep.append(obj)
        return serial

    # -- instrumented containers ----------------------------------------------------

    def wrap(self, value: Any, name: str, kind: str | None = None) -> Any:
        """The instrumented twin of ``value`` (a dict, list, deque or CacheStream)."""
        kind = kind if kind is not None else name
        if isinstance(value, (TracedDict, TracedList, TracedDeque)):
            return value
        if isinstance(value, dict):
            d = TracedDict()
            d._init(self, name, kind)
            for k, v in value.items():
                dict.__setitem__(d, k, d._adopt(k, v))
            return d
        if isinstance(value, list):
            lst = TracedList(value)
            lst._init(self, name, kind)
            return lst
        if isinstance(value, deque):
            dq = TracedDeque(value)
            dq._init(self, name, kind)
            return dq
        if isinstance(value, CacheStream):
            self.adopt_stream(value, name)
            return value
        return value

    def adopt_stream(self, stream: CacheStream, name: str) -> None:
        if type(stream) is self._stream_cls:
            return
        pages = stream.page_indices
        self._serials[id(stream)] = self.new_serial(stream)
        self._names[id(stream)] = name
        # same slots, so the object can change class: its fields now record
        stream.__class__ = self._stream_cls
        stream.page_indices = pages  # through the recording setter: a traced list

    def watch_manager(self, kv: Any) -> None:
        """Record reads and writes of the staged preplan and the current plan
        states (`write_kv`/`read_kv` read them without the lock)."""
        cls = type(kv)
        sub = type(f"Watched{cls.__name__}", (cls,), {
            name: _attr_property(self, name, kind)
            for name, kind in (("_preplan", "manager.preplan"),
                               ("_current_plan_states", "manager.plan_states"))})
        kv.__class__ = sub
        self._manager_serial = self.new_serial(kv)

    def watch_tables(self, kv: Any) -> None:
        """Instrument the lease table and the request configs, which kvref
        makes as plain dicts (not through the runtime): the discipline
        watches them too."""
        leases = kv._table.leases
        leases._leases = self.wrap(leases._leases, "leases")
        # the manager keeps its own name for the table: both the instrumented one
        kv._overrides = kv._table.overrides = self.wrap(kv._table.overrides, "overrides")

    def report_text(self) -> str:
        return "\n".join(str(r) for r in [*self.reports, *self.unguarded])


def _attr_property(det: Detector, name: str, kind: str) -> property:
    def get(self: Any) -> Any:
        det.access(det._manager_serial, kind, "", kind, "read", False)
        return self.__dict__[name]

    def put(self: Any, value: Any) -> None:
        det.access(det._manager_serial, kind, "", kind, "write", True)
        self.__dict__[name] = value

    return property(get, put)


def _traced_stream_class(det: Detector) -> type[CacheStream]:
    def field(f: str) -> property:
        slot = CacheStream.__dict__[f]
        kind = f"stream.{f}"

        dot = f".{f}"

        def get(self: CacheStream) -> Any:
            i = id(self)
            det.access(det._serials[i], det._names[i], dot, kind, "read", False)
            return slot.__get__(self, CacheStream)

        def put(self: CacheStream, value: Any) -> None:
            i = id(self)
            det.access(det._serials[i], det._names[i], dot, kind, "write", True)
            if f == "page_indices" and isinstance(value, list):
                # the list is shared state too (admit extends it in place)
                value = det.wrap(value, f"{det._names[id(self)]}.pages", "stream.pages")
            slot.__set__(self, value)

        return property(get, put)

    ns: dict[str, Any] = {"__slots__": ()}
    for f in CacheStream.__slots__:
        ns[f] = field(f)
    return type("TracedCacheStream", (CacheStream,), ns)


# -- containers ---------------------------------------------------------------------


class _Traced:
    _det: Detector
    _name: str
    _kind: str
    _serial: int

    def _init(self, det: Detector, name: str, kind: str) -> None:
        self._det, self._name, self._kind = det, name, kind
        self._serial = det.new_serial(self)

    def _rec(self, op: str, write: bool) -> None:
        self._det.access(self._serial, self._name, "", self._kind, op, write)


def _methods(base: type, reads: tuple[str, ...], writes: tuple[str, ...]) -> dict[str, Any]:
    ns: dict[str, Any] = {}
    for names, write in ((reads, False), (writes, True)):
        for op in names:
            impl = getattr(base, op)

            def method(self: _Traced, *args: Any, _impl: Any = impl, _op: str = op,
                       _w: bool = write, **kwargs: Any) -> Any:
                self._rec(_op, _w)
                return _impl(self, *args, **kwargs)

            method.__name__ = op
            ns[op] = method
    return ns


class TracedDict(_Traced, dict):  # type: ignore[type-arg]
    """A dict whose reads and writes record; a table's rows (plain dicts,
    streams) are adopted as instrumented rows when stored."""

    def _adopt(self, key: Any, value: Any) -> Any:
        if isinstance(value, (dict, CacheStream)):
            return self._det.wrap(value, f"{self._name}[{key!r}]", f"{self._kind}[]"
                                  if isinstance(value, dict) else None)
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        self._rec("__setitem__", True)
        dict.__setitem__(self, key, self._adopt(key, value))

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self._rec("setdefault", True)
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        value = self._adopt(key, default)
        dict.__setitem__(self, key, value)
        return value

    def update(self, *args: Any, **kwargs: Any) -> None:
        for k, v in dict(*args, **kwargs).items():
            self[k] = v

    locals().update(_methods(
        dict,
        ("__getitem__", "get", "__contains__", "__iter__", "__len__", "keys", "values",
         "items", "copy", "__repr__"),
        ("__delitem__", "pop", "popitem", "clear"),
    ))


class TracedList(_Traced, list):  # type: ignore[type-arg]
    locals().update(_methods(
        list,
        ("__getitem__", "__len__", "__iter__", "__contains__", "index", "count", "copy",
         "__eq__", "__repr__"),
        ("append", "extend", "__iadd__", "__setitem__", "__delitem__", "pop", "clear",
         "insert", "remove", "sort", "reverse"),
    ))
    __hash__ = None


class TracedDeque(_Traced, deque):  # type: ignore[type-arg]
    locals().update(_methods(
        deque,
        ("__len__", "__iter__", "__getitem__", "__contains__", "copy", "__repr__"),
        ("popleft", "pop", "append", "appendleft", "extend", "extendleft", "clear",
         "remove", "rotate", "__iadd__"),
    ))


# -- a real-thread runtime that feeds the detector -----------------------------------


class TracedLock:
    """A reentrant lock that tells the detector when its thread holds it."""

    def __init__(self, det: Detector, name: str) -> None:
        self._lk = threading.RLock()
        self._det = det
        self.name = name
        self._depth = 0  # only its holder reads or writes it

    def __enter__(self) -> TracedLock:
        self._lk.acquire()
        self._depth += 1
        if self._depth == 1:
            self._det.acquired(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._det.released(self)
        self._lk.release()


class TracedRuntime(ThreadingRuntime):
    """`ThreadingRuntime` with instrumented locks and containers (the nightly
    stress run with the detector on)."""

    def __init__(self, detector: Detector, max_workers: int = 4) -> None:
        super().__init__(max_workers)
        self.detector = detector
        self._locks = 0

    def lock(self) -> TracedLock:
        self._locks += 1
        return TracedLock(self.detector, f"lock{self._locks}")

    def shared(self, value: Any, name: str) -> Any:
        return self.detector.wrap(value, name)
