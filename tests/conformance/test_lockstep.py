"""kvref and the model in lockstep (the machine is `kvref.testing.lockstep`,
shipped so that engine teams can run it against their own factory)."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from kvref.testing.driver import DriverConfig
from kvref.testing.lockstep import NIGHTLY_SCOPE, PLAIN_SCOPE, SCOPE, run_lockstep


def test_lockstep(driver_config: DriverConfig, capsys: pytest.CaptureFixture[str]) -> None:
    coverage = run_lockstep(driver_config, SCOPE)
    with capsys.disabled():
        print("\n" + coverage)


def test_lockstep_without_sharing_or_windows(driver_config: DriverConfig) -> None:
    """The second configuration: the prefix cache off, no window."""
    print(run_lockstep(driver_config, PLAIN_SCOPE))


@pytest.mark.nightly
def test_lockstep_nightly(driver_config: DriverConfig) -> None:
    examples = int(os.environ.get("KVREF_NIGHTLY_EXAMPLES", "20000"))
    print(run_lockstep(driver_config, NIGHTLY_SCOPE, settings(max_examples=examples)))
