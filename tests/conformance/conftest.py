"""kvref's own conformance runs hold admission's fast path to the general
rules before every admit the driver issues (tests/support/admission_check.py);
the packaged harness leaves the hook empty for engine teams' factories."""

from __future__ import annotations

import dataclasses

import pytest

from kvref.testing.driver import DriverConfig
from tests.support.admission_check import check_plain_admission


@pytest.fixture
def driver_config(driver_config: DriverConfig) -> DriverConfig:
    return dataclasses.replace(driver_config, before_admit=check_plain_admission)
