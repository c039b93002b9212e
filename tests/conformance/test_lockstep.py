"""kvref and the model in lockstep (the machine is `kvref.testing.lockstep`,
shipped so that engine teams can run it against their own factory)."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from kvref.stepping import decode_table
from kvref.testing.driver import DriverConfig
from kvref.testing.lockstep import NIGHTLY_SCOPE, SCOPE, run_lockstep


def test_lockstep(driver_config: DriverConfig, capsys: pytest.CaptureFixture[str],
                  monkeypatch: pytest.MonkeyPatch) -> None:
    # the kept decode table (issue 28) plans from one row, so the lockstep's
    # batches of one to three requests run it (in production: from 32)
    monkeypatch.setattr(decode_table, "SMALL_BATCH", 1)
    coverage = run_lockstep(driver_config, SCOPE)
    with capsys.disabled():
        print("\n" + coverage)


@pytest.mark.nightly
def test_lockstep_nightly(driver_config: DriverConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_table, "SMALL_BATCH", 1)
    examples = int(os.environ.get("KVREF_NIGHTLY_EXAMPLES", "20000"))
    print(run_lockstep(driver_config, NIGHTLY_SCOPE, settings(max_examples=examples)))
