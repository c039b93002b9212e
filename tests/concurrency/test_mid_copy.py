"""A publisher that moves while a peer's retrieve copies from it (R35, R50).

The retrieve reads the publisher's generation before its copy and again after
it (a sequence lock). The peer thread moves the publisher (its lease released,
then reset) at every point the scheduler can put it: before the start's check
(the start latches `RetrieveStale`), between the start and the copy, between
the copy and its second read, or after the copy landed. Bounded DFS: every
result and state checked against the model, in which a copy whose publisher
moved after the start is latched (`RetrieveComplete(moved=True)`), whatever
kvref's copy answered. Half the sequence lock, planted, must be found.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kvref.transfer.engine import KVTransferManager
from tests.support.sched_harness import Op, Program
from tests.support.sched_planted import Race, dfs, dfs_count, nothing

BOUND, BUDGET = 2, 400

# request 0 holds 3 tokens in main; label 1 receives 2 from another manager
RETRIEVE = Op("retrieve", 0, label=1, n=2)
MID_COPY = (Program("engine", [RETRIEVE]), Program("peer", [Op("move", 0, label=1, n=2)]))


def test_clean_tree_latches_every_mid_copy_move() -> None:
    found = dfs(Race("publisher moves mid-copy", nothing, MID_COPY), bound=BOUND,
                budget=BUDGET)
    assert found.schedules is None, found.message
    # not vacuous: the move lands before the start, in the copy and after it
    assert dfs_count(MID_COPY, BOUND, BUDGET) > 3


@contextmanager
def checked_before_only() -> Iterator[None]:
    """Half a sequence lock: the generation read before the copy, not after."""
    orig = KVTransferManager._check_source

    def before_only(self: KVTransferManager, remote: Any, source: Any, when: str) -> None:
        if when == "before":
            orig(self, remote, source, when)

    KVTransferManager._check_source = before_only  # type: ignore[method-assign]
    try:
        yield
    finally:
        KVTransferManager._check_source = orig  # type: ignore[method-assign]


@pytest.mark.parametrize("bound", [1, BOUND])
def test_half_a_sequence_lock_is_found(bound: int) -> None:
    found = dfs(Race("checked before the copy only", checked_before_only, MID_COPY),
                bound=bound, budget=BUDGET)
    assert found.schedules is not None, found.message
    assert "RetrieveComplete" in found.message
