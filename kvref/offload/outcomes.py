"""Typed answers to offload and reload, and the host pool as an engine sees it.

`KVManager.offload` and `KVManager.reload` keep the reference's ``int`` and
``bool``; `KVManager.offload_outcome` and `KVManager.reload_outcome` say the
same thing with the cause spelled out, because ``0`` and ``False`` each stand
for several causes an engine handles differently (retry after the step
commits, evict more first, give up). The ``int``/``bool`` calls are read off
these values (R44).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class OffloadReason(enum.Enum):
    """Why an offload moved fewer streams than it could have (or none)."""

    NO_HOST_POOL = "no host pool is configured (cpu_offload_pages=0)"
    UNKNOWN_REQUEST = "unknown request (never ingested, or removed)"
    OFFLOAD_RUNNING = "an offload of the request is already between claim and commit"
    STEP_IN_FLIGHT = "a step of the request is admitted; commit it first (R4)"
    PUBLISH_LEASED = "its publication is leased to a peer; release_published it first (R33)"
    NOTHING_ON_DEVICE = "no stream of the request holds device pages that are not offloaded"
    HOST_POOL_FULL = "the host pool had no room for a stream; it stayed on device"
    NOT_COPIED = "the offload was committed without copying this stream"
    REQUEST_CHANGED = "a stream was reset after the claim; nothing moved (generation guard)"
    REQUEST_REMOVED = "the request was removed during the offload"


# When streams of one offload stayed behind for different causes, the one
# the engine must act on first: a change under the copy voids the whole
# offload, a full pool calls for freeing host room, an uncopied stream is
# the handle's caller's choice.
_KEPT_ORDER = (OffloadReason.REQUEST_CHANGED, OffloadReason.HOST_POOL_FULL,
               OffloadReason.NOT_COPIED)


@dataclass(frozen=True)
class OffloadOutcome:
    """What an offload did: pages freed, labels moved and kept, and why not all.

    ``reason`` is None when every stream the claim took moved to the host.
    With a reason, ``pages_freed`` may still be above 0: a partial offload
    (``HOST_POOL_FULL``), whose ``kept`` streams are still on device.
    """

    pages_freed: int = 0
    moved: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    reason: OffloadReason | None = None

    @property
    def complete(self) -> bool:
        return self.reason is None

    @property
    def partial(self) -> bool:
        return self.reason is not None and self.pages_freed > 0


def kept_reason(kept: Sequence[str],
                refusals: Mapping[str, OffloadReason]) -> OffloadReason | None:
    """The reason an offload reports for the claimed ``kept`` streams."""
    if not kept:
        return None
    causes = {refusals.get(label, OffloadReason.NOT_COPIED) for label in kept}
    return next(r for r in _KEPT_ORDER if r in causes)


class ReloadReason(enum.Enum):
    """Why a reload moved nothing (a reload is all streams or none)."""

    NO_HOST_POOL = "no host pool is configured (cpu_offload_pages=0)"
    UNKNOWN_REQUEST = "unknown request (never ingested, or removed)"
    OFFLOAD_RUNNING = "an offload of the request is between claim and commit (R6)"
    NOTHING_ON_HOST = "the request has no committed host copy"
    DEVICE_FULL = "too few free device pages; evict pages_short more and retry"


@dataclass(frozen=True)
class ReloadOutcome:
    """What a reload did: device pages taken and labels brought back, or why not.

    ``pages_short`` is set with ``DEVICE_FULL``: the pages to free before a
    retry can succeed.
    """

    pages_taken: int = 0
    labels: tuple[str, ...] = ()
    reason: ReloadReason | None = None
    pages_short: int = 0

    @property
    def reloaded(self) -> bool:
        return self.reason is None


@dataclass(frozen=True)
class HostPoolView:
    """The host pool in pages. All zero when no pool is configured, so an
    engine's arithmetic needs no special case; ``capacity == 0`` says there
    is none (as `KVManager.supports_eviction` does).

    ``used`` counts host copies, committed or still being made, and pages a
    reload freed whose copy may still be reading them (CUDA, until the next
    sync): ``capacity - free``.
    """

    capacity: int = 0
    free: int = 0
    used: int = 0

