"""HypoFuzz targets: the lockstep and the concurrency check as fuzzable tests.

HypoFuzz runs ``@given`` tests and ``RuleBasedStateMachine.TestCase``s; the
suite's own entry points are neither (the lockstep calls
``run_state_machine_as_test`` inside a test, the nightly concurrency test
suppresses every health check, which HypoFuzz refuses). These wrap the same
machines at the nightly scope. Only under ``KVREF_FUZZ=1 ... -m nightly``:

    KVREF_FUZZ=1 hypothesis fuzz -n 8 -- -m nightly tests/fuzz
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given

from kvref.testing.driver import DriverConfig, default_factory
from kvref.testing.lockstep import NIGHTLY_SCOPE, Lockstep
from tests.concurrency.programs import choices, programs
from tests.support.sched_harness import Program, run_once
from tests.support.scheduler import Replay

pytestmark = [
    pytest.mark.nightly,
    pytest.mark.skipif(os.environ.get("KVREF_FUZZ") != "1", reason="HypoFuzz only: KVREF_FUZZ=1"),
]


class LockstepFuzz(Lockstep):
    """The lockstep machine at the nightly scope, on ``KVREF_FUZZ_DEVICE`` (default cpu)."""

    config = DriverConfig(device=os.environ.get("KVREF_FUZZ_DEVICE", "cpu"),
                          dtype=torch.float32, factory=default_factory)
    scope = NIGHTLY_SCOPE


TestLockstepFuzz = LockstepFuzz.TestCase


@given(programs(), choices(200))
def test_concurrency_schedules_fuzz(progs: list[Program], schedule: list[int]) -> None:
    run_once(progs, Replay(schedule))
