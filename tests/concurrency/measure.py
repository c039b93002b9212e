"""Schedules per second and schedules-to-detection per planted race.

    python -m tests.concurrency.measure [seeds]

Prints the table `docs/verification/concurrency.md` reads from. PCT and
random walk: median (min-max) over ``seeds`` seeds, each run until the first
failing schedule (budget 2000).
Hypothesis: examples drawn (generation phase, before shrinking) until the
first failure. DFS: schedules visited in depth-first order, bound 1 and 2.
Those columns count only wrong results, states or exceptions (the race
detector's reports ignored); the lockset column is whether the detector
reports the race in the run-to-completion schedule (no preemption at all).
"""

from __future__ import annotations

import statistics
import sys
import time

from hypothesis import HealthCheck, Phase, given, seed, settings

from tests.concurrency.programs import choices, programs
from tests.support.sched_harness import Program, run_once
from tests.support.sched_planted import (
    DATA_RACES,
    KNOWN,
    RACES,
    Race,
    detect,
    dfs,
    pct,
    random_walk,
    run_race,
)
from tests.support.scheduler import Replay, ScheduleFailure

BUDGET = 2000


def hypothesis_count(race: Race, s: int) -> int | None:
    count = [0]
    found: list[int] = []

    @seed(s)
    @settings(max_examples=BUDGET, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(choices())
    def probe(schedule: list[int]) -> None:
        count[0] += 1
        if found:
            return
        try:
            run_race(race, Replay(schedule), lockset=False)
        except ScheduleFailure:
            found.append(count[0])

    with race.patch():
        probe()
    return found[0] if found else None


def summary(xs: list[int | None]) -> str:
    got = [x for x in xs if x is not None]
    miss = len(xs) - len(got)
    if not got:
        return f"not found ({len(xs)}x{BUDGET})"
    text = f"{statistics.median(got):g} ({min(got)}-{max(got)})"
    return text + (f", {miss} missed" if miss else "")


def throughput(n: int = 200) -> float:
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(programs(), choices())
    def one(progs: list[Program], schedule: list[int]) -> None:
        run_once(progs, Replay(schedule))

    t0 = time.perf_counter()
    one()
    return n / (time.perf_counter() - t0)


def lockset_cell(race: Race) -> str:
    # no switch at accesses: else a quiescent check inside the unlocked code
    # may fail the run before the second thread's access is recorded
    d = detect(race, iter([Replay([])]), 1, access_points=False)
    return "reported" if d.schedules and "data race on" in d.message else "no report"


def main() -> None:
    seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    print(f"drawn programs (2-4 threads): {throughput():.0f} schedules/s")
    print("| race | lockset | DFS bound 1 | DFS bound 2 | PCT d=2 | PCT d=3 | random walk "
          "| Hypothesis |")
    print("|---|---|---|---|---|---|---|---|")
    for race in (*RACES, *DATA_RACES, KNOWN):
        t0 = time.perf_counter()
        cells = [lockset_cell(race)]
        for bound in (1, 2):
            d = dfs(race, bound, BUDGET, lockset=False)
            cells.append(str(d.schedules) if d.schedules else "not found")
        for depth in (2, 3):
            cells.append(summary([detect(race, pct(s, depth), BUDGET, lockset=False).schedules
                                  for s in range(seeds)]))
        cells.append(summary([detect(race, random_walk(s), BUDGET, lockset=False).schedules
                              for s in range(seeds)]))
        cells.append(summary([hypothesis_count(race, s) for s in range(min(seeds, 5))]))
        print(f"| {race.name} | " + " | ".join(cells) + f" |  ({time.perf_counter() - t0:.0f}s)",
              flush=True)


if __name__ == "__main__":
    main()
