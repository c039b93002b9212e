"""A pytest plugin: the ``--kvref-*`` options and the ``driver_config`` fixture.

Opt in with ``-p kvref.testing.plugin`` (or ``pytest_plugins`` in a
conftest). It is deliberately not a ``pytest11`` entry point: an entry point
loads into every pytest run of every environment kvref is installed in,
including those without the ``testing`` extra, where importing Hypothesis
would break pytest itself; and it would register the options a second time
in any project that already declares them.

The ready-made tests live in `kvref.testing.suite`::

    pytest -p kvref.testing.plugin --pyargs kvref.testing.suite \\
        --kvref-factory mypkg.mod:make_manager
"""

from __future__ import annotations

import importlib

import pytest
import torch

from kvref.testing.driver import DriverConfig, ManagerFactory, default_factory

DTYPES = ("float32", "bfloat16", "float16")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvref", "kvref conformance harness")
    group.addoption("--kvref-device", default="cpu",
                    help="device the managers under test use (default: cpu)")
    group.addoption("--kvref-dtype", default="float32", choices=DTYPES,
                    help="cache dtype (default: float32)")
    group.addoption(
        "--kvref-factory", default=None, metavar="MODULE:CALLABLE",
        help="builds the manager under test; called with KVManager's keyword arguments "
             "(cfg, name, joint_comm_group, transfer_engine_info, device, dtype, runtime) "
             "(default: KVManager itself)",
    )
    group.addoption("--kvref-examples", default=400, type=int, metavar="N",
                    help="lockstep runs of the ready-made suite (default: 400, the ci profile's)")
    group.addoption("--kvref-depth", default=3, type=int, metavar="N",
                    help="calls deep the ready-made suite's exhaustive replay goes (default: 3; "
                         "each level costs several times the last)")


def load_factory(spec: str) -> ManagerFactory:
    """``module:callable`` -> the callable; a usage error (one line) otherwise."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise pytest.UsageError(f"--kvref-factory {spec!r}: expected MODULE:CALLABLE")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise pytest.UsageError(f"--kvref-factory {spec!r}: cannot import {module_name}: "
                                f"{err}") from err
    factory = getattr(module, name, None)
    if not callable(factory):
        raise pytest.UsageError(f"--kvref-factory {spec!r}: {module_name} has no callable "
                                f"{name!r}")
    return factory  # type: ignore[no-any-return]


def pytest_configure(config: pytest.Config) -> None:
    # a bad factory is reported before collection, once, not as an error per test
    spec = config.getoption("--kvref-factory")
    if spec:
        load_factory(spec)
    if config.getoption("--kvref-examples") < 1:
        raise pytest.UsageError("--kvref-examples must be at least 1")
    if config.getoption("--kvref-depth") < 1:
        raise pytest.UsageError("--kvref-depth must be at least 1")


@pytest.fixture(scope="session")
def driver_config(request: pytest.FixtureRequest) -> DriverConfig:
    """The device, dtype and factory the conformance tests drive."""
    device: str = request.config.getoption("--kvref-device")
    if device.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("--kvref-device cuda without CUDA")
    dtype = getattr(torch, request.config.getoption("--kvref-dtype"))
    spec = request.config.getoption("--kvref-factory")
    factory = load_factory(spec) if spec else default_factory
    return DriverConfig(device=device, dtype=dtype, factory=factory)
