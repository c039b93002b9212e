"""Races the scheduler found in kvref, now fixed: each program must pass every
schedule up to two preemptions (bounded DFS), with no data race reported."""

from __future__ import annotations

import pytest

from tests.support.sched_harness import Op, Program
from tests.support.sched_planted import KNOWN, STEP_NEW_LABEL, Race, allocator_users, dfs, nothing

KNOWN_RACES = {
    # reset_request/remove_request drained reads, then took the lock: a retrieve
    # admitted in between was still writing when the pages were reset or freed
    # (now: re-drain and retry when a read is pending under the lock)
    "reset over a retrieve admitted after its drain": KNOWN,
    # remove_request left _offloads[rid]: the offload's copy and commit went on
    # against a request that was gone (now: the removal cancels the offload)
    "remove during an offload": Race("remove during an offload", nothing, (
        Program("worker", [Op("offload", 0)]), Program("life", [Op("remove", 0)]))),
    # a copy checked its claim (manager lock), then allocated host pages (pool
    # lock): a reset in between and the copy still ran (now: both decisions in
    # one section, the record in a second that cannot change the answer)
    "reset between a copy's claim check and its allocation": Race(
        "reset during an offload copy", nothing,
        (Program("worker", [Op("offload", 0)]), Program("life", [Op("reset", 0)]))),
    # issue 9: reset and remove read the request's streams outside the lock (the
    # in-flight check, the futures to drain); an admit adding a label meanwhile
    # made them raise RuntimeError (now: read under the lock, drained outside)
    "reset while an admit adds a label": Race("reset while an admit adds a label", nothing, (
        Program("engine", [STEP_NEW_LABEL]), Program("life", [Op("reset", 0)]))),
    "remove while an admit adds a label": Race("remove while an admit adds a label", nothing, (
        Program("engine", [STEP_NEW_LABEL]), Program("life", [Op("remove", 0)]))),
    # issue 9: try_allocate checked the free count, then popped, unlocked: two
    # callers raised IndexError or lost pages (now: the allocator's own lock, R30)
    "two threads allocate": Race("two threads allocate", nothing, runner=allocator_users),
}


@pytest.mark.parametrize("name", sorted(KNOWN_RACES))
def test_known_race(name: str) -> None:
    found = dfs(KNOWN_RACES[name], bound=2, budget=2000)
    assert found.schedules is None, found.message
