"""Suite-wide options and Hypothesis profiles.

Profiles (``--hypothesis-profile NAME`` or ``HYPOTHESIS_PROFILE=NAME``):
  dev      the default: a few hundred examples, failures saved for replay
  ci       derandomized, no database, sized for CI's time budget
  nightly  long fuzzing on larger scopes (see docs/gpu-and-nightly.md)

dev and nightly share failing examples through Redis when
``KVREF_HYPOTHESIS_REDIS=host:port`` is set (tests/support/example_db.py);
ci keeps none. Every failure of the lockstep, the exhaustive replay and the
scheduler harness writes a trace file (kvref.testing.trace) to
``$KVREF_TRACE_DIR``, by default ``traces/`` in pytest's temporary directory.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from tests.support.example_db import shared_database

# the local directory and the Redis server the nightly nodes share, if named
_shared = {"database": db} if (db := shared_database()) is not None else {}
settings.register_profile("dev", max_examples=200, stateful_step_count=50, deadline=None,
                          **_shared)
settings.register_profile(
    "ci", max_examples=400, stateful_step_count=50, deadline=None,
    derandomize=True, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "nightly", max_examples=20_000, stateful_step_count=120, deadline=None,
    suppress_health_check=list(HealthCheck), **_shared,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# --kvref-device, --kvref-dtype, --kvref-factory and the driver_config fixture:
# the plugin engine teams run the harness with
pytest_plugins = ["kvref.testing.plugin"]


@pytest.hookimpl(trylast=True)  # after Hypothesis's own: its initialization is over
def pytest_sessionstart(session: pytest.Session) -> None:
    # before collection: Hypothesis's draws depend on which of the project's
    # modules are loaded (tests/support/preload.py); not at configure, where
    # Hypothesis warns against touching its storage
    from tests.support.preload import preload

    preload()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # one xdist worker per core (-n auto): torch's own pool of a thread
        # per core in every worker oversubscribed the cores, each tensor op
        # spinning against the other worker's tests
        import torch

        torch.set_num_threads(1)
    # failures' trace files: into this session's temporary directory unless
    # the caller chose a place (scripts/nightly.sh: its artifacts)
    # (each xdist worker: its own temporary directory)
    factory = getattr(session.config, "_tmp_path_factory", None)
    if "KVREF_TRACE_DIR" not in os.environ and factory is not None:
        os.environ["KVREF_TRACE_DIR"] = str(factory.getbasetemp() / "traces")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # nightly tests run only when asked for by marker
    if "nightly" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="nightly: run with -m nightly")
    for item in items:
        if "nightly" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter,
                            exitstatus: int, config: pytest.Config) -> None:
    # the order the tests ran in, even under -q (pytest-randomly's header is
    # hidden there): a failure that depends on it replays with this seed
    seed = getattr(config.option, "randomly_seed", None)
    if isinstance(seed, int):
        terminalreporter.write_line(f"test order: random, --randomly-seed={seed}")
