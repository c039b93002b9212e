"""The publisher's side of a `publish`: a lease per request (R33, R34).

While a lease is held, the pages `publish` named stay with their streams:
offload claims are refused and reset and remove raise `PublishLeasedError`.
A lease ends with `release_published`, or at its deadline (`KVConfig.
publish_lease_s`, on the runtime's clock so tests move it). A second publish
renews it. The table is read and written under the manager's lock only.
"""

from __future__ import annotations

from collections.abc import Callable

from kvref.core.errors import PublishLeasedError


class LeaseTable:
    def __init__(self, timeout_s: float | None, clock: Callable[[], float]) -> None:
        self._timeout_s = timeout_s
        self._clock = clock
        # request id -> its lease's deadline (None: until released)
        self._leases: dict[str, float | None] = {}

    def take(self, rid: str) -> None:
        """Take the lease, or renew it: a re-publish is the peer still asking."""
        self._leases[rid] = None if self._timeout_s is None else self._clock() + self._timeout_s

    def release(self, rid: str) -> None:
        # idempotent: the consumer cannot know whether the lease already expired
        self._leases.pop(rid, None)

    def held(self, rid: str) -> bool:
        if rid not in self._leases:
            return False
        deadline = self._leases[rid]
        if deadline is not None and self._clock() >= deadline:
            del self._leases[rid]  # expired: the pin ends as if released
            return False
        return True

    def leased(self) -> list[str]:
        """The requests leased now (expired leases dropped)."""
        return [rid for rid in list(self._leases) if self.held(rid)]

    def refuse(self, rid: str, what: str) -> None:
        """Raise `PublishLeasedError` if ``rid`` is leased (R33)."""
        if self.held(rid):
            raise PublishLeasedError(
                f"{what} while its publication is leased to a peer; "
                "release_published it first (or let the lease expire)",
                request_id=rid,
            )
