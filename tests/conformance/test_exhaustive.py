"""Every reachable state of a small scope, every call, replayed on kvref."""

from __future__ import annotations

import pytest

from kvref.testing.driver import DriverConfig
from kvref.testing.exhaustive import CI_SCOPE, check_scope, summary
from model import core as m

NIGHTLY_SCOPE = m.Scope(requests=2, labels=2, device_pages=3, host_pages=2, page_size=1,
                        max_span=2, depth=5)


@pytest.mark.slow
def test_every_reachable_state_and_action(driver_config: DriverConfig,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = check_scope(CI_SCOPE, driver_config)
    with capsys.disabled():
        print("\n" + summary(out))
    assert not out.failures, "\n".join(out.failures)
    # the scope must be the one reviewed: a model change that shrank it would pass vacuously
    # (684 states, 35,931 calls since a preplan over the running step is issued as
    # the next decode of each of its streams, not as every shape: R41, protocol.calls)
    assert out.states > 600 and out.transitions > 30_000


@pytest.mark.nightly
def test_every_reachable_state_and_action_nightly(driver_config: DriverConfig) -> None:
    out = check_scope(NIGHTLY_SCOPE, driver_config, progress=True)
    print(summary(out))
    assert not out.failures, "\n".join(out.failures)
