"""The concurrency seam: every lock, background task and wait of kvref.

The manager never touches `threading` or `concurrent.futures` directly; it
asks the runtime it was built with. The default is plain threads. The
concurrency tests swap in a runtime that runs one thread at a time and picks
who runs next at each of these calls, so an interleaving becomes a value
that can be searched, shrunk and replayed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Runtime(Protocol):
    """The concurrency seam: where kvref gets its locks, background work and waits.

    `ThreadingRuntime` is the default; the tests swap in a cooperative
    scheduler that chooses which thread runs at every lock, wait and
    checkpoint (`set_default_runtime`, or ``KVManager(..., runtime=...)``).
    """

    def lock(self) -> AbstractContextManager[Any]:
        """A new reentrant lock."""
        ...

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` in the background (a transfer, a host copy)."""
        ...

    def wait(self, futures: Iterable[Future[Any]]) -> None:
        """Block until every future is done (results are not read)."""
        ...

    def checkpoint(self, name: str) -> None:
        """A named point between critical sections where another thread may run."""
        ...

    # optional: ``shared(value, name) -> value`` (see `shared` below),
    # ``monotonic() -> float`` (`monotonic`) and ``fault(site)`` (`fault_hook`)


class ThreadingRuntime:
    """Real threads: an RLock per lock, one shared pool for background work."""

    def __init__(self, max_workers: int = 4) -> None:
        self._max_workers = max_workers
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def lock(self) -> AbstractContextManager[Any]:
        return threading.RLock()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        with self._pool_lock:
            # created on first use: most managers never retrieve, and an idle
            # pool per manager is threads an engine worker did not ask for
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self._max_workers, thread_name_prefix="kvref"
                )
            pool = self._pool
        return pool.submit(fn, *args)

    def wait(self, futures: Iterable[Future[Any]]) -> None:
        futures_wait(list(futures))

    def checkpoint(self, name: str) -> None:
        del name

    def shutdown(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def shared(runtime: Runtime, value: T, name: str) -> T:
    """``value`` (a container of shared state), as ``runtime`` wants it held.

    An optional extension of `Runtime`: a runtime with a ``shared(value,
    name)`` method may hand back an instrumented container of the same type
    (the race detector's, in the tests) that records every read and write.
    The default runtime has none, so production gets ``value`` itself: the
    cost is this call, once, when the container is made.
    """
    hook = getattr(runtime, "shared", None)
    return value if hook is None else hook(value, name)


def monotonic(runtime: Runtime) -> float:
    """Seconds on ``runtime``'s clock: an optional extension, as `shared`. A
    runtime with a ``monotonic()`` method gives the time (a test's, which it
    moves); the others get `time.monotonic`. Lease deadlines read it."""
    hook = getattr(runtime, "monotonic", None)
    return time.monotonic() if hook is None else float(hook())


# where kvref calls a runtime's ``fault(site)``: just before each copy that
# can fail, so a test fails exactly that copy
FAULT_SITES = ("fork.copy", "offload.copy", "reload.copy", "retrieve.start")


def fault_hook(runtime: Runtime) -> Callable[[str], None] | None:
    """``runtime``'s ``fault(site)`` method, or None: an optional extension, as
    `shared`. kvref calls it just before the copy at each of `FAULT_SITES` (a
    fork's page copy, an offload's copy to the host, a reload's copy back, the
    start of a retrieve); whatever it raises fails that copy as a real fault
    would. The conformance harness injects its faults this way, through the
    runtime it hands the manager and nothing else. Looked up once, when the
    owner is built: the default runtime has none, and production pays a None
    test per copy."""
    return getattr(runtime, "fault", None)


_default: Runtime = ThreadingRuntime()


def default_runtime() -> Runtime:
    """The runtime a manager built without one uses (a `ThreadingRuntime` unless set)."""
    return _default


def set_default_runtime(runtime: Runtime) -> Runtime:
    """Install ``runtime`` for managers built from now on; returns the previous one."""
    global _default
    previous, _default = _default, runtime
    return previous
