"""A runtime whose background work runs only when the test says so.

`kvref.core.runtime`'s seam, for lockstep tests: a retrieve submitted by the
manager stays pending until the test completes it (ok or failed), which is
what the model's ``RetrieveComplete`` action is. So a retrieve is still
writing while admit, claims, copies, publish, reset and remove run. A
blocking ``wait`` (a reset or removal draining, an offload copy waiting for
the read) completes what it waits on, ok, at that moment: the deferred
completion the model states for those calls, and the copy then reads the
bytes the transfer just wrote.

It is also how the harness injects faults and interleavings without
touching the manager: `failing` makes kvref's ``fault(site)`` hook
(`kvref.core.runtime.fault_hook`) raise at a copy site, and `at_checkpoint`
runs a function at a named checkpoint (another actor moving mid-copy).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any


class InjectedRetrieveFailure(RuntimeError):
    """The failure a test completes a retrieve with."""


class InjectedCopyFault(OSError):
    """The failure an injected copy fault raises."""


@dataclass
class _Task:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: Future[Any]


class ManualRuntime:
    def __init__(self) -> None:
        self.pending: list[_Task] = []
        self.checkpoints: list[str] = []
        self.deferred = 0  # completions a blocking wait brought about
        self.clock = 0.0  # what `monotonic` answers: moved by `advance` only
        # copy site -> fail only its next copy (True) or every copy (False)
        self.failing_sites: dict[str, bool] = {}
        # copy site -> passes that go through before its fault strikes
        self.passing: dict[str, int] = {}
        # checkpoint name -> run once when the manager passes it
        self.checkpoint_hooks: dict[str, Callable[[], None]] = {}

    def fault(self, site: str) -> None:
        """kvref's hook before each copy that can fail: raise where armed."""
        once = self.failing_sites.get(site)
        if once is None:
            return
        if self.passing.get(site):
            self.passing[site] -= 1
            return
        if once:
            del self.failing_sites[site]
        raise InjectedCopyFault(f"{site} failed (injected)")

    @contextlib.contextmanager
    def failing(self, site: str, once: bool = False, after: int = 0) -> Iterator[None]:
        """Within the block, copies at ``site`` raise (only the first with
        ``once``), the first ``after`` of them let through: a fault that
        strikes a hybrid label's later group, once the earlier ones ran."""
        self.failing_sites[site] = once
        self.passing[site] = after
        try:
            yield
        finally:
            self.failing_sites.pop(site, None)
            self.passing.pop(site, None)

    @contextlib.contextmanager
    def at_checkpoint(self, name: str, fn: Callable[[], None]) -> Iterator[None]:
        """Within the block, the first pass of checkpoint ``name`` runs ``fn``."""
        self.checkpoint_hooks[name] = fn
        try:
            yield
        finally:
            self.checkpoint_hooks.pop(name, None)

    def monotonic(self) -> float:
        return self.clock

    def advance(self, seconds: float) -> None:
        self.clock += seconds

    def lock(self) -> AbstractContextManager[Any]:
        return threading.RLock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        self.pending.append(_Task(fn, args, fut))
        return fut

    def wait(self, futures: Iterable[Future[Any]]) -> None:
        for fut in futures:
            if not fut.done():
                self.deferred += 1
                self.complete(fut)

    def checkpoint(self, name: str) -> None:
        self.checkpoints.append(name)
        hook = self.checkpoint_hooks.pop(name, None)
        if hook is not None:
            hook()

    def complete(self, future: Future[Any], ok: bool = True) -> None:
        """Run (ok) or fail (not ok) the task behind ``future``."""
        task = next(t for t in self.pending if t.future is future)
        self.pending.remove(task)
        if not ok:
            task.future.set_exception(InjectedRetrieveFailure("retrieve failed (injected)"))
            return
        try:
            task.future.set_result(task.fn(*task.args))
        except BaseException as err:  # the manager latches it, as a real failure
            task.future.set_exception(err)

    def complete_all(self) -> None:
        for task in list(self.pending):
            self.complete(task.future)
