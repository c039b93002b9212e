"""One node of the shared-database test (tests/unit/test_shared_example_db.py).

    python -m tests.support.shared_db_child PLANT PHASES EXAMPLES

Loads the suite's Hypothesis profiles as a pytest run does (so the
database is the one ``KVREF_HYPOTHESIS_REDIS`` names), plants PLANT (a
name of tests/conformance/test_mutations.py's MUTANTS) and runs the
lockstep over the plain scope with PHASES (``reuse`` and/or ``generate``,
comma-separated) for up to EXAMPLES examples, unshrunk. Prints one JSON
line: whether it failed and at which example (machine) it did.
"""

from __future__ import annotations

import json
import sys
from contextlib import ExitStack

from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import tests.conftest  # noqa: F401  (registers and loads the profiles)
from kvref.testing.lockstep import PLAIN_SCOPE, Lockstep
from tests.conformance.test_mutations import MUTANTS


class Counted(Lockstep):
    scope = PLAIN_SCOPE
    built = 0
    first: int | None = None  # the example that failed first

    def __init__(self) -> None:
        Counted.built += 1
        super().__init__()

    def keep(self, err: BaseException) -> None:
        if Counted.first is None:
            Counted.first = Counted.built
        super().keep(err)


def main(plant: str, phases: str, examples: int) -> dict[str, object]:
    run = settings(settings.default, max_examples=examples, derandomize=False,
                   stateful_step_count=20,
                   phases=[Phase[p] for p in phases.split(",")], print_blob=False)
    with ExitStack() as stack:
        MUTANTS[plant](stack)
        try:
            run_state_machine_as_test(Counted, settings=run)
        except Exception as err:
            if Counted.first is None:  # no example failed: reuse found none to run
                return {"failed": False, "ran": Counted.built,
                        "error": str(err).splitlines()[0]}
            return {"failed": True, "at": Counted.first, "error": str(err).splitlines()[0]}
    return {"failed": False, "ran": Counted.built}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
