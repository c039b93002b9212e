"""An offload in progress: claim, copy, then commit or abandon.

`KVManager.offload` runs all three phases; an engine that schedules its own
host copies (or a test that interleaves them with other calls) drives the
handle `KVManager.begin_offload` returns. Only claim and commit take the
manager's lock; the copies run outside it so steps of other requests go on.
The handle records why each stream it could not copy stayed behind, and its
commit's `OffloadOutcome` (`outcome`), which `KVManager.offload_outcome`
reports.

The handle checks its own state (open, which labels it claimed, which it
copied) and hands the work on the stream table to the `OffloadPhases` it
was given (`kvref.offload.phases`), never to the manager.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from kvref.core.errors import OffloadCopyError, OffloadStateError
from kvref.core.streams import ClaimedStream
from kvref.offload.outcomes import OffloadOutcome, OffloadReason


class OffloadPhases(Protocol):
    """The work an `Offload` hands on: each phase over the stream table."""

    def wait(self, futures: Sequence[Future[Any]]) -> None: ...

    def copy_to_host(self, offload: Offload,
                     claim: ClaimedStream) -> OffloadReason | None: ...

    def commit(self, offload: Offload, claims: Mapping[str, ClaimedStream],
               copied: Sequence[str]) -> OffloadOutcome: ...

    def abandon(self, offload: Offload, labels: Sequence[str]) -> None: ...


class Offload:
    """A claim on every offloadable stream of one request.

    While it is open its streams are marked ``offloaded``: admit and the
    allocator refuse them, so nothing extends a stream behind the copy.
    A claim that is neither committed nor abandoned keeps the request
    unschedulable, so `KVManager.offload` always ends in one or the other.
    """

    def __init__(
        self,
        phases: OffloadPhases,
        request_id: str,
        claims: Sequence[ClaimedStream],
        read_futures: Mapping[str, Future[Any]],
    ) -> None:
        self._phases = phases
        self.request_id = request_id
        self._claims = {c.label: c for c in claims}
        # label -> a retrieve still writing that stream's pages
        self._read_futures = dict(read_futures)
        self._copied: list[str] = []
        # label -> why its copy did not run (the pool was full, the claim changed)
        self._refusals: dict[str, OffloadReason] = {}
        self._outcome: OffloadOutcome | None = None
        self._open = True
        # `cancel`: the request is gone, so every later phase does nothing
        self._cancelled = False

    @property
    def labels(self) -> list[str]:
        return list(self._claims)

    @property
    def claims(self) -> Mapping[str, ClaimedStream]:
        return self._claims

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """The request is gone (`remove_request`, under the manager's lock):
        every later phase of this offload does nothing."""
        self._cancelled = True

    @property
    def copied(self) -> list[str]:
        return list(self._copied)

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def refusals(self) -> Mapping[str, OffloadReason]:
        return dict(self._refusals)

    @property
    def outcome(self) -> OffloadOutcome | None:
        """What the commit did; None until committed (an abandon moves nothing)."""
        return self._outcome

    def copy(self, label: str) -> bool:
        """Copy one claimed stream to the host. False if the host pool is full, or
        if a claimed stream changed since the claim (the commit will undo it);
        `refusals` says which.

        A copy that raises undoes the whole offload (every host copy
        discarded, every claim released) and re-raises as `OffloadCopyError`:
        a half-copied request must not be left for a reload to trust. A
        `BaseException` that is not an `Exception` (`KeyboardInterrupt`,
        `SystemExit`) undoes it the same way and then propagates as itself,
        unwrapped (R8): it is the process being stopped, not a copy fault.
        """
        self._check_open("copy")
        claim = self._claims.get(label)
        if claim is None:
            raise OffloadStateError(
                "offload did not claim this stream", request_id=self.request_id, label=label
            )
        if label in self._copied:
            raise OffloadStateError(
                "stream already copied", request_id=self.request_id, label=label
            )
        read = self._read_futures.pop(label, None)
        if read is not None:
            # a retrieve still writing these pages would be torn into the copy
            self._phases.wait([read])
        try:
            refused = self._phases.copy_to_host(self, claim)
        except BaseException as err:
            self.abandon()
            if not isinstance(err, Exception):
                raise  # KeyboardInterrupt, SystemExit: after the cleanup, as itself
            raise OffloadCopyError(
                f"host copy failed, offload abandoned: {type(err).__name__}: {err}",
                request_id=self.request_id,
                label=label,
            ) from err
        if refused is None:
            self._copied.append(label)
        else:
            self._refusals[label] = refused
        return refused is None

    def copy_all(self) -> list[str]:
        """Copy every claimed stream; returns the labels that fit on the host."""
        for label in self.labels:
            self.copy(label)
        return self.copied

    def commit(self) -> int:
        """Release the device pages of every copied stream; returns pages freed.

        All or nothing over the copied streams: if any changed since the
        claim (a reset, a removal) its host copy may be torn, so the whole
        request stays on device and 0 is returned. Streams that did not fit
        on the host are released back to the device either way.
        """
        self._check_open("commit")
        self._open = False
        self._outcome = self._phases.commit(self, self._claims, self._copied)
        return self._outcome.pages_freed

    def abandon(self) -> None:
        """Drop every host copy made so far and release every claim."""
        if not self._open:
            return
        self._open = False
        self._phases.abandon(self, list(self._claims))

    def _check_open(self, what: str) -> None:
        if not self._open:
            raise OffloadStateError(
                f"{what} on an offload that was already committed or abandoned",
                request_id=self.request_id,
            )

    def __repr__(self) -> str:
        state = "open" if self._open else "closed"
        return f"Offload({self.request_id!r}, claims={self.labels}, copied={self._copied}, {state})"
