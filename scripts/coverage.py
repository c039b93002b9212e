"""What each verification layer exercised: actions, invariants, rules (issue 41).

As TLC reports coverage, each layer here reports, from its own run, how often
each action was taken, each invariant's interesting case held
(`kvref_model.invariants.INTERESTING`: the check had something to check) and
each rule of specs/ fired (switched off alone, the transition differs:
`kvref_model.coverage`). The budgets are small by default; pass larger ones.

    PYTHONPATH=. python scripts/coverage.py [--layers checker,lockstep,exhaustive,scheduler]
        [--examples 50] [--seed 0] [--json FILE]

  checker     python -m kvref_model.check --rules at the scope given by
              --checker-depth over the default scope (depth 5 here: seconds)
  lockstep    kvref.testing.lockstep over SHIPPED_SCOPE, --examples machines
  exhaustive  kvref.testing.exhaustive's CI scope (as `--coverage` does)
  scheduler   every schedule of tests/support/shared_programs.py's programs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from typing import Any

from kvref_model import coverage


def checker(o: argparse.Namespace) -> dict[str, Any]:
    from kvref_model import check
    from kvref_model.core import Model
    from kvref_model.search import Report

    scope = replace(check.CHECK_DEFAULT, depth=o.checker_depth)
    rep = Report()
    for _ in check.explore(Model(scope), keep_going=True, report=rep, traces=False,
                           states=False, rules=True, workers=1):
        pass
    print(check.table(rep, scope, Model))
    return check.to_json(rep, scope, "Model", Model)


def lockstep(o: argparse.Namespace) -> dict[str, Any]:
    import hypothesis.core
    from hypothesis import HealthCheck, Phase, settings

    from kvref.testing.driver import DriverConfig
    from kvref.testing.lockstep import SHIPPED_SCOPE, run_lockstep
    from tests.support.admission_check import check_plain_admission

    hypothesis.core.global_force_seed = o.seed
    s = settings(max_examples=o.examples, derandomize=False, database=None, deadline=None,
                 stateful_step_count=50, phases=[Phase.explicit, Phase.generate],
                 suppress_health_check=list(HealthCheck), print_blob=False)
    with coverage.recording(f"the lockstep ({o.examples} machines, seed {o.seed})") as cov:
        try:
            run_lockstep(DriverConfig(before_admit=check_plain_admission), SHIPPED_SCOPE, s)
        except AssertionError as err:  # its own check that every action ran
            print(f"lockstep: {str(err).splitlines()[0]}")
    print(cov.table())
    return cov.to_json()


def exhaustive(o: argparse.Namespace) -> dict[str, Any]:
    from kvref.testing.exhaustive import CI_SCOPE, check_scope, summary

    with coverage.recording("the exhaustive replay (CI_SCOPE)") as cov:
        out = check_scope(CI_SCOPE)
    print(cov.table())
    print(summary(out))
    return cov.to_json()


def scheduler(o: argparse.Namespace) -> dict[str, Any]:
    from tests.support.shared_programs import CASES, explore

    runs = 0
    with coverage.recording("the scheduler's shared programs") as cov:
        for case in CASES.values():
            runs += explore(case)
    print(cov.table())
    print(f"{runs} schedules of {len(CASES)} programs")
    return cov.to_json()


LAYERS = {"checker": checker, "lockstep": lockstep, "exhaustive": exhaustive,
          "scheduler": scheduler}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--examples", type=int, default=50, help="lockstep machines")
    ap.add_argument("--seed", type=int, default=0, help="the lockstep's Hypothesis seed")
    ap.add_argument("--checker-depth", type=int, default=5)
    ap.add_argument("--json", default=None)
    o = ap.parse_args(argv)
    from tests.support.preload import preload
    preload()
    doc: dict[str, Any] = {}
    for name in o.layers.split(","):
        t0 = time.time()
        print(f"\n=== {name}")
        doc[name] = LAYERS[name](o)
        doc[name]["seconds"] = round(time.time() - t0, 1)
    print("\nnever reached, per layer:")
    for name, d in doc.items():
        print(f"  {name:10} invariants: {', '.join(d.get('never_arose', d.get('vacuous', [])))}"
              f"\n  {'':10} rules: {', '.join(d['never_fired'])}")
    if o.json:
        with open(o.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
