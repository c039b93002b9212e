"""Import every module of the project before the first test runs.

Hypothesis draws, now and then, a constant found in the source of the
*local* modules loaded so far (`sys.modules`, outside site-packages and the
standard library), so what a derandomized run generates depends on which of
the project's modules happen to be imported when it runs. A test that imports
a module lazily (the exhaustive replay imports the model checker's search)
changed what every later lockstep run drew: after `test_exhaustive.py`, one
planted bug of `test_mutations.py` was no longer found within its budget
(issue 17). Loading them all up front makes the pool the same in any order,
in one process or per xdist worker, and for a test run alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvref", "model", "tests.support", "benchmarks")
# loaded by file by the e2e tests; the same module name they use
EXAMPLES = {"kvref_example_engine": ROOT / "examples" / "engine.py"}


def local_module_names() -> list[str]:
    """Every importable module of ``PACKAGES`` (entry points excluded)."""
    names: list[str] = []
    for pkg in PACKAGES:
        names.append(pkg)
        path = importlib.import_module(pkg).__path__
        names += [m.name for m in pkgutil.walk_packages(path, f"{pkg}.")
                  if not m.name.endswith("__main__")]
    return names


def preload() -> None:
    for name in local_module_names():
        importlib.import_module(name)
    for name, path in EXAMPLES.items():
        if name in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
