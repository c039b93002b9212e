"""The scheduler itself: one actor at a time, exact replay, DFS counts,
deadlock and livelock reports."""

from __future__ import annotations

import pytest

from tests.support.scheduler import (
    CoopRuntime,
    Prefix,
    RandomWalk,
    Replay,
    ScheduleFailure,
    Scheduler,
    next_dfs_prefix,
)


def counter_run(strategy: Replay | Prefix | RandomWalk, locked: bool) -> tuple[int, Scheduler]:
    """Two actors each increment a shared counter twice, read and write split
    by a checkpoint: a lost update unless the lock covers both."""
    sched = Scheduler(strategy)
    rt = CoopRuntime(sched)
    lk = rt.lock()
    box = [0]

    def inc() -> None:
        for _ in range(2):
            if locked:
                lk.acquire()
            v = box[0]
            rt.checkpoint("read")
            box[0] = v + 1
            if locked:
                lk.release()

    sched.run([("a", inc), ("b", inc)])
    return box[0], sched


def all_schedules(locked: bool, bound: int) -> list[int]:
    results: list[int] = []
    prefix: list[int] | None = []
    n = 0
    while prefix is not None:
        n += 1
        value, sched = counter_run(Prefix(prefix), locked)
        results.append(value)
        prefix = next_dfs_prefix(sched.trace, bound)
        assert n < 10_000
    return results


def test_dfs_finds_the_lost_update_and_the_lock_prevents_it() -> None:
    assert min(all_schedules(locked=False, bound=1)) < 4
    assert set(all_schedules(locked=True, bound=3)) == {4}


def test_dfs_visits_more_schedules_with_a_larger_bound() -> None:
    counts = [len(all_schedules(False, b)) for b in (0, 1, 2)]
    # bound 0: only who starts first (not a preemption): a or b
    assert counts[0] == 2 and counts[0] < counts[1] < counts[2]


def test_replay_is_exact() -> None:
    value, sched = counter_run(RandomWalk(7), locked=False)
    again, resched = counter_run(Replay(sched.schedule), locked=False)
    assert (again, resched.schedule) == (value, sched.schedule)


def test_deadlock_reports_where_each_actor_waits() -> None:
    sched = Scheduler(Replay([0, 0, 1]))  # a takes x, then b runs and takes y
    rt = CoopRuntime(sched)
    x, y = rt.lock(), rt.lock()

    def ab() -> None:
        with x, y:
            pass

    def ba() -> None:
        with y, x:
            pass

    with pytest.raises(ScheduleFailure, match="deadlock") as err:
        sched.run([("a", ab), ("b", ba)])
    text = str(err.value)
    assert "a: acquire lock1 (holds lock0)" in text and "b: acquire lock0 (holds lock1)" in text
    assert "schedule=" in text


def test_livelock_is_a_step_budget() -> None:
    sched = Scheduler(Replay([]), max_steps=50)
    rt = CoopRuntime(sched)

    def spin() -> None:
        while True:
            rt.checkpoint("spin")

    with pytest.raises(ScheduleFailure, match="livelock"):
        sched.run([("spinner", spin)])


def test_a_task_is_an_actor_and_wait_blocks_on_it() -> None:
    sched = Scheduler(Replay([]))
    rt = CoopRuntime(sched)
    seen: list[str] = []

    def main() -> None:
        fut = rt.submit(lambda: seen.append("task"))
        seen.append("submitted")
        rt.wait([fut])
        seen.append("waited")

    sched.run([("main", main)])
    assert seen == ["submitted", "task", "waited"]
    assert [a.name for a in sched.actors] == ["main", "task1"]
