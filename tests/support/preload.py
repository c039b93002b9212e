"""Make what Hypothesis draws depend on the seed and the project's library alone.

Hypothesis draws, now and then (one integer draw in twenty), a constant found
in the source of the *local* modules loaded so far (`sys.modules`, outside
site-packages and the standard library), so what a derandomized run generates
depended on which modules happened to be imported when it ran. A test that
imports a module lazily (the exhaustive replay imports the model checker's
search) changed what every later lockstep run drew: after
`test_exhaustive.py`, one planted bug of `test_mutations.py` was no longer
found within its budget (issue 17); which test files a run collected, or the
script that ran the machine, did the same.

`preload` imports every library module (kvref, kvref_model, tests.support,
benchmarks, the example engine), so nothing a test imports late changes
anything, and pins Hypothesis's pool of local constants to an empty one. It
once pinned the pool to the library's own constants; then every edit to the
library (a new module, a changed number) moved every derandomized draw, and
planted bugs were found or lost by the luck of the draws (issue 41): two
mutants of test_mutations.py went unfound after merging modules that touched
nothing they exercise. With the pool empty, a derandomized run's draws follow
its seed and its strategies only. The lockstep's strategies draw small ids
and counts from its scope, where the library's constants (page sizes, byte
counts, hash widths) add nothing. Pinning reaches into Hypothesis's
internals; where they differ (another version), loading everything up front
still keeps the order out.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvref", "kvref_model", "tests.support", "benchmarks")
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


def preload() -> list[ModuleType]:
    """Import the library's modules; pin Hypothesis's constants to theirs."""
    modules = [importlib.import_module(name) for name in local_module_names()]
    for name, path in EXAMPLES.items():
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
        modules.append(sys.modules[name])
    pin_constants([])  # the draws follow the seed, not the library's source
    return modules


def pin_constants(modules: list[ModuleType]) -> bool:
    """Hypothesis's local constants are those of ``modules`` (none, as the
    suite pins them), whatever is loaded later. False where this Hypothesis
    has no such pool."""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:
        return False
    needed = ("_get_local_constants", "Constants", "SortedSet", "float_to_int",
              "constants_from_module", "CONSTANTS_CACHE")
    if not all(hasattr(providers, n) for n in needed):
        return False
    pool = providers.Constants(
        integers=providers.SortedSet(), floats=providers.SortedSet(key=providers.float_to_int),
        bytes=providers.SortedSet(), strings=providers.SortedSet())
    for module in modules:
        pool = pool | providers.constants_from_module(module)
    providers._get_local_constants = lambda: pool
    providers.CONSTANTS_CACHE.cache.clear()  # answers computed from the old pool
    return True
