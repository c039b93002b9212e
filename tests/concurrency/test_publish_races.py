"""publish racing offload, reset and remove under the controlled scheduler (R33).

The clean tree must pass every schedule up to two preemptions (bounded DFS:
every result and state checked against the model, no data race reported);
the same search, with the same budget, must find each planted lease bug.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kvref.manager import KVManager
from kvref.transfer.lease import LeaseTable
from kvref.transfer.published import PublishedKVInfo, PublishRefused
from kvref.transfer.retrieval import Retrieval
from tests.support.sched_harness import Op, Program
from tests.support.sched_planted import Race, dfs, dfs_count, nothing

BOUND, BUDGET = 2, 400

PEER_PUBLISHES = Program("peer", [Op("publish", 0), Op("release", 0)])
PROGRAMS = {
    "publish racing offload": (PEER_PUBLISHES, Program("worker", [Op("offload", 0)])),
    "publish racing remove": (PEER_PUBLISHES, Program("life", [Op("remove", 0)])),
    "publish racing reset": (PEER_PUBLISHES, Program("life", [Op("reset", 0, n=1)])),
    # an offloaded request (the set-up offloads r1): publish refuses while a
    # reload brings it back, or publishes what came back
    "publish racing reload": (Program("peer", [Op("publish", 1), Op("release", 1)]),
                              Program("worker", [Op("reload", 1)])),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_clean_tree_passes_every_schedule(name: str) -> None:
    found = dfs(Race(name, nothing, PROGRAMS[name]), bound=BOUND, budget=BUDGET)
    assert found.schedules is None, found.message
    # the search was not vacuous: the two threads interleaved in several ways
    assert dfs_count(PROGRAMS[name], BOUND, BUDGET) > 2


@contextmanager
def publish_leases_apart() -> Iterator[None]:
    """publish builds the info in one critical section and takes the lease in
    a second: an offload claiming in between takes pages the peer is told to
    copy."""
    orig = Retrieval.publish

    def racy(self: Retrieval, rid: str) -> PublishedKVInfo | PublishRefused:
        real = LeaseTable.take
        LeaseTable.take = lambda table, r: None  # type: ignore[method-assign]
        try:
            info = orig(self, rid)
        finally:
            LeaseTable.take = real  # type: ignore[method-assign]
        self._table.runtime.checkpoint("publish.info-built")
        if isinstance(info, PublishedKVInfo):
            with self._table.lock:
                self._table.leases.take(rid)
        return info

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Retrieval, "publish", racy)
        yield


@contextmanager
def remove_ignores_lease() -> Iterator[None]:
    """remove_request frees the pages of a request a peer is still copying."""
    orig = KVManager.remove_request

    def careless(self: KVManager, rid: str) -> Any:
        real = self._table.leases.refuse
        self._table.leases.refuse = lambda r, what: None  # type: ignore[method-assign]
        try:
            return orig(self, rid)
        finally:
            self._table.leases.refuse = real  # type: ignore[method-assign]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KVManager, "remove_request", careless)
        yield


PLANTED = {
    "publish leases apart": Race("publish leases apart", publish_leases_apart,
                                 PROGRAMS["publish racing offload"]),
    "remove ignores the lease": Race("remove ignores the lease", remove_ignores_lease,
                                     PROGRAMS["publish racing remove"]),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_planted_lease_bug_is_found(name: str) -> None:
    found = dfs(PLANTED[name], bound=BOUND, budget=BUDGET)
    assert found.schedules is not None, f"{name}: {found.message}"
