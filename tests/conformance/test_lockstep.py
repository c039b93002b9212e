"""kvref and the model in lockstep (the machine is `kvref.testing.lockstep`,
shipped so that engine teams can run it against their own factory)."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from kvref.testing.driver import DriverConfig
from kvref.testing.lockstep import (
    NIGHTLY_SCOPE,
    SCOPE,
    SHIPPED_NIGHTLY_SCOPE,
    SHIPPED_SCOPE,
    run_lockstep,
)


def test_lockstep(driver_config: DriverConfig, capsys: pytest.CaptureFixture[str]) -> None:
    coverage = run_lockstep(driver_config, SCOPE)
    with capsys.disabled():
        print("\n" + coverage)


@pytest.mark.nightly
@pytest.mark.xfail(strict=False, reason="issue 27: open CachePrefix-count and free-cached "
                   "disagreements with sharing on, found at 250 examples")
@pytest.mark.parametrize("scope", [SHIPPED_SCOPE, SHIPPED_NIGHTLY_SCOPE],
                         ids=["ci-size", "nightly-size"])
def test_lockstep_as_shipped(driver_config: DriverConfig, scope: object) -> None:
    """The prefix cache on, windowed labels with a margin, two salts."""
    examples = int(os.environ.get("KVREF_NIGHTLY_EXAMPLES", "20000"))
    print(run_lockstep(driver_config, scope, settings(max_examples=examples)))  # type: ignore[arg-type]


@pytest.mark.nightly
def test_lockstep_nightly(driver_config: DriverConfig) -> None:
    examples = int(os.environ.get("KVREF_NIGHTLY_EXAMPLES", "20000"))
    print(run_lockstep(driver_config, NIGHTLY_SCOPE, settings(max_examples=examples)))
