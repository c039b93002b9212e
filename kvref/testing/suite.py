"""Ready-made conformance tests for a manager an engine team builds.

Run against your own factory (a callable taking KVManager's keyword
arguments, e.g. one that builds your subclass, or a class that wraps a
`KVManager` and forwards the calls of `kvref.testing.driver.ManagerUnderTest`,
`observe` among them)::

    pytest -p kvref.testing.plugin --pyargs kvref.testing.suite \\
        --kvref-factory mypkg.mod:make_manager

``test_lockstep`` drives your manager and the model together with
Hypothesis (derandomized, no example database, so the run is reproducible
and fails if any action of the model never ran); ``test_exhaustive`` replays
every call of the model's total protocol in every reachable state of a small
scope. ``--kvref-examples`` and ``--kvref-depth`` trade time for coverage.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, settings

from kvref.testing.driver import DriverConfig
from kvref.testing.exhaustive import CI_SCOPE, check_scope, summary
from kvref.testing.lockstep import SCOPE, run_lockstep


def test_lockstep(driver_config: DriverConfig, request: pytest.FixtureRequest) -> None:
    examples: int = request.config.getoption("--kvref-examples")
    run = settings(max_examples=examples, stateful_step_count=50, deadline=None,
                   derandomize=True, database=None, print_blob=True,
                   suppress_health_check=[HealthCheck.too_slow])
    print(run_lockstep(driver_config, SCOPE, run))


def test_exhaustive(driver_config: DriverConfig, request: pytest.FixtureRequest) -> None:
    depth: int = request.config.getoption("--kvref-depth")
    out = check_scope(dataclasses.replace(CI_SCOPE, depth=depth), driver_config)
    print(summary(out))
    assert out.transitions > 0, "the scope reached no transition: nothing was checked"
    assert not out.failures, "\n".join(out.failures)
