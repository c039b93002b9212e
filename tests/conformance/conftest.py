from __future__ import annotations

import importlib

import pytest
import torch

from kvref.testing.driver import DriverConfig, default_factory


@pytest.fixture(scope="session")
def driver_config(request: pytest.FixtureRequest) -> DriverConfig:
    device = request.config.getoption("--kvref-device")
    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("--kvref-device cuda without CUDA")
    dtype = getattr(torch, request.config.getoption("--kvref-dtype"))
    factory = default_factory
    spec = request.config.getoption("--kvref-factory")
    if spec:
        module, _, name = spec.partition(":")
        factory = getattr(importlib.import_module(module), name)
    return DriverConfig(device=device, dtype=dtype, factory=factory)
