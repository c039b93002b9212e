"""Every reachable state of a small scope, every call, replayed on kvref."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvref.offload.calls import EvictionCalls
from kvref.testing.driver import DriverConfig
from kvref.testing.exhaustive import (
    CI_SCOPE,
    HYBRID_CI_SCOPE,
    HYBRID_NIGHTLY_SCOPE,
    PLAIN_CI_SCOPE,
    check_scope,
    main,
    summary,
)
from kvref_model import core as m

# the second configuration (the prefix cache off, no window), and a manager
# with no host pool (cpu_offload_pages=0): every claim refused, NO_HOST_POOL,
# and priority 0 (R44, R45); the model says so since issue 20
NO_HOST_SCOPE = replace(PLAIN_CI_SCOPE, host_pages=0)

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
    # (with the prefix cache on and a windowed label: 164 states, 17,066 calls
    # since follow_tokens, S33; 144 and 14,318 before it;
    # a fork between the two labels is a misuse there, W5)
    assert out.states > 130 and out.transitions > 13_000


def test_every_reachable_state_and_action_of_a_hybrid_scope(driver_config: DriverConfig) -> None:
    """Issue 40: one full group and one window group over one pool, depth 2
    (a few seconds): every call in every state, the driver mapping each
    group's stream (`kvref.testing.group_map`)."""
    out = check_scope(HYBRID_CI_SCOPE, driver_config)
    print(summary(out))
    assert not out.failures, "\n".join(out.failures)
    # 15 states, 856 calls since a late start fault (H1); 14 and 769 before
    assert out.states >= 15 and out.transitions >= 850


@pytest.mark.nightly
def test_every_reachable_state_and_action_of_a_hybrid_scope_nightly(
        driver_config: DriverConfig) -> None:
    out = check_scope(HYBRID_NIGHTLY_SCOPE, driver_config, progress=True)
    print(summary(out))
    assert not out.failures, "\n".join(out.failures)
    # 63 states, 3,712 calls since a late start fault (H1); 59 and 3,341 before
    assert out.states >= 63 and out.transitions >= 3_700


# depth 2 in CI: every claim refused (NO_HOST_POOL) and priority 0 (R44,
# R45) arise there, as the plant below shows; depth 3 (719 states, 38,504
# calls) was an eighth of CI's CPU and runs nightly
@pytest.mark.parametrize("depth", [
    pytest.param(2, id="depth-2"), pytest.param(3, id="depth-3", marks=pytest.mark.nightly)])
def test_every_reachable_state_and_action_without_a_host_pool(
        driver_config: DriverConfig, depth: int) -> None:
    out = check_scope(replace(NO_HOST_SCOPE, depth=depth), driver_config)
    print(summary(out))
    assert not out.failures, "\n".join(out.failures)
    # depth 2: 140 states, 7,398 calls; depth 3: 719 states, 38,504 calls
    least = {2: (130, 7_000), 3: (600, 30_000)}[depth]
    assert out.states > least[0] and out.transitions > least[1]


def test_a_priority_without_a_host_pool_is_found(driver_config: DriverConfig,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: with no host pool, the offload priority counts the pages held
    (a victim filter would pick a request it can never evict)."""
    def priority(self: EvictionCalls, rid: str) -> float:
        if not self.has_request(rid):  # type: ignore[attr-defined]
            return 0.0
        return float(self.reclaimable(rid))  # type: ignore[attr-defined]

    monkeypatch.setattr(EvictionCalls, "get_offload_priority", priority)
    out = check_scope(replace(NO_HOST_SCOPE, depth=2), driver_config, max_failures=1)
    assert out.failures and "R45" in out.failures[0], out.failures


@pytest.mark.nightly
def test_every_reachable_state_and_action_nightly(driver_config: DriverConfig) -> None:
    out = check_scope(NIGHTLY_SCOPE, driver_config, progress=True)
    print(summary(out))
    assert not out.failures, "\n".join(out.failures)


# copy-on-write forks between two windowed labels, a hit across requests:
# 971 states, 170,957 calls, 0 mismatches (about 210 s alone, 520 s under load)
FORKS_SCOPE = replace(CI_SCOPE, labels=3, windows=(None, 1, 1), margins=(0, 1, 1))


@pytest.mark.nightly
def test_every_reachable_state_with_shared_forks_between_windows(
        driver_config: DriverConfig) -> None:
    out = check_scope(FORKS_SCOPE, driver_config, progress=True)
    print(summary(out))
    assert not out.failures, "\n".join(out.failures)
    assert out.states > 900 and out.transitions > 160_000


def test_the_command_replays_the_shipped_scope_by_default(capsys: pytest.CaptureFixture[str],
                                                          ) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert "--sharing, --no-sharing copy-on-write forks and the prefix cache " \
        "(KVConfig's default: on) (default: True)" in usage
    assert "(default: (None, 1))" in usage and "(default: (0, 1))" in usage
    assert main(["--depth", "1", "--quiet"]) == 0
    assert "CONFORMANCE PASSED" in capsys.readouterr().out
    # a hybrid scope: its groups' windows, not the shipped scope's label windows
    assert main(["--groups", "None,1", "--window-cache", "--labels", "1", "--depth", "1",
                 "--quiet"]) == 0
    assert "CONFORMANCE PASSED" in capsys.readouterr().out
