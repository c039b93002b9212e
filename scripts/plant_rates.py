"""How often each lockstep plant is found, over seeds (issue 41, item 5).

The plant tests run the Hypothesis locksteps derandomized: one fixed draw per
budget, which moves whenever the library's source changes. A plant found
there may be found by that draw alone. Here every plant runs at its test's
budget under N seeds (Hypothesis's own random draws, `global_force_seed`,
no database, no shrinking), and so does the clean tree: a plant counts as
found under a seed only where the clean tree passed the same seed and
budget, so a clean failure is never credited to a plant.

    PYTHONPATH=. python scripts/plant_rates.py [--seeds 10] [--only SUBSTR]
        [--skip-controls | --controls-only] [--json FILE] [--markdown FILE]

Groups (the budgets their tests use):
  mutant     tests/conformance/test_mutations.py MUTANTS, PLAIN_SCOPE, 50, 100
             or 400 examples (HALF, BUDGET, NIGHTLY_BUDGET)
  seam       tests/conformance/test_interaction_plants.py LOCKSTEP_FINDS,
             SHIPPED_SCOPE, 100 examples
  admission  tests/conformance/test_admission_paths_lockstep.py, SCOPE, 200
  pool       tests/conformance/test_page_pool_plants.py, the page pool's
             lockstep, 200 examples
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import hypothesis.core
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from tests.support.preload import preload

Plant = Callable[[pytest.MonkeyPatch], None]
Apply = Callable[[ExitStack], None]  # a plant that undoes itself with the stack


def patched(plant: Plant) -> Apply:
    return lambda stack: plant(stack.enter_context(pytest.MonkeyPatch.context()))


@dataclass(frozen=True)
class Case:
    group: str
    name: str
    plant: Apply | None  # None: the clean tree (the control)
    run: Callable[[settings], None]  # raises on a failure
    examples: int
    control: str  # which clean run this plant is measured against


def seeded(examples: int) -> settings:
    """Random (not derandomized) draws, seeded from outside; no database, no
    shrinking: the first failure as met."""
    return settings(max_examples=examples, derandomize=False, database=None, deadline=None,
                    stateful_step_count=50, phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=list(HealthCheck), print_blob=False)


@contextlib.contextmanager
def seed(k: int) -> Iterator[None]:
    old = hypothesis.core.global_force_seed
    hypothesis.core.global_force_seed = k
    try:
        yield
    finally:
        hypothesis.core.global_force_seed = old


# `run_lockstep`'s own checks after the examples (a rule that never ran):
# not a disagreement, so not a plant found
COVERAGE = ("never exercised", "too few kinds of misuse")


def composed(scope_name: str) -> Callable[[settings], None]:
    from kvref.testing import lockstep as L
    from kvref.testing.driver import DriverConfig
    from tests.support.admission_check import check_plain_admission

    scope = {"PLAIN_SCOPE": L.PLAIN_SCOPE, "SHIPPED_SCOPE": L.SHIPPED_SCOPE}[scope_name]

    def run(s: settings) -> None:
        L.run_lockstep(DriverConfig(before_admit=check_plain_admission), scope, s)
    return run


def mutant_run(s: settings) -> None:
    """As test_mutations runs them: the Lockstep class as configured, PLAIN_SCOPE."""
    from kvref.testing.lockstep import PLAIN_SCOPE, Lockstep
    old = Lockstep.scope
    Lockstep.scope = PLAIN_SCOPE
    try:
        run_state_machine_as_test(Lockstep, settings=s)
    finally:
        Lockstep.scope = old


def pool_run(s: settings) -> None:
    from tests.conformance.test_page_pool_lockstep import PagePoolLockstep
    run_state_machine_as_test(PagePoolLockstep, settings=s)


def cases() -> list[Case]:
    from tests.conformance import test_interaction_plants as ti
    from tests.conformance import test_mutations as tm
    from tests.conformance import test_page_pool_plants as tp
    from tests.support import admission_plants, seam_plants

    out: list[Case] = []
    for name, mutant in sorted(tm.MUTANTS.items()):
        n = (tm.NIGHTLY_BUDGET if name in tm.NIGHTLY_ONLY else tm.BUDGET
             if name in tm.FULL_BUDGET_ONLY else tm.HALF).max_examples
        assert n is not None
        out.append(Case("mutant", name, mutant, mutant_run, n, f"mutant clean {n}"))
    for name in ti.LOCKSTEP_FINDS:
        out.append(Case("seam", name, patched(getattr(seam_plants, name)),
                        composed("SHIPPED_SCOPE"), ti.LOCKSTEP_EXAMPLES,
                        f"shipped clean {ti.LOCKSTEP_EXAMPLES}"))
    from tests.conformance import test_admission_paths_lockstep as ta
    for name in ta.FOUND_IN:
        out.append(Case("admission", name, patched(admission_plants.PLANTS[name]),
                        composed("SHIPPED_SCOPE"), ta.BUDGET, f"shipped clean {ta.BUDGET}"))
    pool_n = tp.BUDGET.max_examples
    assert pool_n is not None
    for name, (plant_fn, _, _) in sorted(tp.PLANTS.items()):
        out.append(Case("pool", name, patched(plant_fn), pool_run, pool_n, f"pool clean {pool_n}"))
    # the controls: one clean run per (runner, budget) the plants use, after
    # the group's plants (a partial run has the cheap rows first)
    order = ("pool", "seam", "mutant", "admission")
    # (the seam and admission plants run the same lockstep, the composed
    # manager in SHIPPED_SCOPE: at one budget they share one control)
    done: list[Case] = []
    for g in order:
        mine = [c for c in out if c.group == g]
        ran = {c.name for c in done}
        controls = {c.control: Case(g, c.control, None, c.run, c.examples, c.control)
                    for c in mine if c.control not in ran}
        done += mine + list(controls.values())
    return done


@contextlib.contextmanager
def planted(plant: Apply | None) -> Iterator[None]:
    with ExitStack() as stack:
        if plant is not None:
            plant(stack)
        yield


def found(case: Case, k: int) -> tuple[bool, str]:
    """Whether the run under seed ``k`` failed, and how (first line)."""
    with planted(case.plant), seed(k):
        try:
            case.run(seeded(case.examples))
        except BaseException as err:  # any failure of the suite counts, as in the tests
            if isinstance(err, KeyboardInterrupt):
                raise
            text = f"{type(err).__name__}: {err}"
            if any(c in text for c in COVERAGE):
                return False, "coverage check only: " + text.splitlines()[0][:160]
            return True, text.splitlines()[0][:160]
    return False, ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--only", default="", help="only cases whose group or name has one of these "
                    "(comma-separated)")
    ap.add_argument("--max-examples", type=int, default=0,
                    help="skip the plants (and controls) whose budget is larger; 0: none")
    ap.add_argument("--skip-controls", action="store_true",
                    help="run the plants only: each failing seed counts, marked "
                    "'control not run' (a control costs a plant's whole budget per seed)")
    ap.add_argument("--controls-only", action="store_true",
                    help="run only the clean runs (controls) whose names have one of --only's "
                    "words (a control run later than its plants, or again)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--render", metavar="JSON", nargs="+", default=None,
                    help="only print the table of earlier runs' --json files, merged: "
                    "runs over other seeds (one process per seed range) add up")
    o = ap.parse_args(argv)
    if o.render:
        print(render(merged(o.render)))
        return 0
    preload()  # Hypothesis's pool of constants, as in the suite (tests/conftest.py)
    seeds = range(o.first_seed, o.first_seed + o.seeds)
    words = o.only.split(",")
    if o.controls_only:
        todo = [c for c in cases() if c.plant is None and any(w in c.name for w in words)]
    else:
        todo = [c for c in cases() if c.plant is None
                or any(w in f"{c.group} {c.name}" for w in words)]
    if o.max_examples:
        todo = [c for c in todo if c.examples <= o.max_examples]
    wanted = set() if o.skip_controls else {c.control for c in todo if c.plant is not None}
    if o.controls_only:
        wanted = {c.name for c in todo}
    todo = [c for c in todo if c.plant is not None or c.name in wanted]
    rows: dict[str, dict[str, object]] = {}
    for c in todo:
        t0 = time.time()
        per_seed: list[bool] = []
        # seeds whose run failed only its own coverage check: no find, and
        # no disagreement, but the run did not reach what the lockstep needs
        short: list[int] = []
        notes: list[str] = []
        for k in seeds:
            hit, note = found(c, k)
            per_seed.append(hit)
            if note.startswith("coverage check only"):
                short.append(k)
            if note:
                notes.append(f"seed {k}: {note}")
        rows[c.name] = {"group": c.group, "examples": c.examples, "control": c.control,
                        "clean": c.plant is None, "failed": per_seed,
                        "seconds": round(time.time() - t0, 1), "notes": notes,
                        "coverage_only": short}
        print(f"{c.group:9} {c.name[:60]:60} {sum(per_seed)}/{len(per_seed)} "
              f"({time.time() - t0:.0f}s)", flush=True)
        if o.json:  # after every row: a run cut short keeps what it measured
            with open(o.json, "w") as f:
                json.dump({"seeds": list(seeds), "rows": rows}, f, indent=1)
    table = render(rows)
    print(table)
    if o.markdown:
        with open(o.markdown, "w") as f:
            f.write(table + "\n")
    return 0


def merged(paths: list[str]) -> dict[str, dict[str, object]]:
    """The rows of several --json runs as one run: each plant's seeds, in the
    files' order. A seed run twice would count twice, so it is refused."""
    rows: dict[str, dict[str, object]] = {}
    seen: dict[str, set[int]] = {}
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        for name, r in run["rows"].items():
            mine = seen.setdefault(name, set())
            # a row cut short has fewer results than seeds: only those it ran
            ran = run["seeds"][:len(r["failed"])]
            if mine & set(ran):
                raise SystemExit(f"{path}: {name!r} ran seeds {sorted(mine & set(ran))} "
                                 "in an earlier file too")
            mine.update(ran)
            if name not in rows:
                rows[name] = dict(r)
                continue
            got = rows[name]
            got["failed"] = [*got["failed"], *r["failed"]]  # type: ignore[misc]
            got["notes"] = [*got["notes"], *r["notes"]]  # type: ignore[misc]
            got["coverage_only"] = [*got.get("coverage_only", []),  # type: ignore[misc]
                                    *r.get("coverage_only", [])]
            got["seconds"] = round(float(got["seconds"]) + float(r["seconds"]), 1)  # type: ignore[arg-type]
    return rows


def render(rows: dict[str, dict[str, object]]) -> str:
    """A plant's rate counts only seeds its control passed clean."""
    out = ["| group | plant | examples | found (seeds the clean tree passed) |",
           "|---|---|---:|---|"]
    for name, r in rows.items():
        failed = r["failed"]
        assert isinstance(failed, list)
        if r["clean"]:
            short = r.get("coverage_only") or []
            assert isinstance(short, list)
            cov = (f" (its coverage check alone failed under seed{'s' * (len(short) > 1)} "
                   f"{', '.join(map(str, short))})" if short else "")
            out.append(f"| {r['group']} | clean tree (control) | {r['examples']} | "
                       f"passed {failed.count(False)}/{len(failed)}{cov} |")
            continue
        ctl = rows.get(str(r["control"]))
        ok = ctl["failed"] if ctl else [False] * len(failed)
        assert isinstance(ok, list)
        fair = [hit for hit, bad in zip(failed, ok, strict=True) if not bad]
        mark = "" if sum(fair) >= 0.9 * len(fair) else " **below 9/10**"
        out.append(f"| {r['group']} | `{name}` | {r['examples']} | "
                   f"{sum(fair)}/{len(fair)}{mark}"
                   f"{'' if ctl else ' (control not run)'} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
