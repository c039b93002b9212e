"""kvref and the model in lockstep (the machine is `kvref.testing.lockstep`,
shipped so that engine teams can run it against their own factory): first
in the configuration kvref ships (the prefix cache on, windowed labels with
a rollback margin, two salts), then with the prefix cache off and no window."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from kvref.stepping import admit_plan_commit, decode_table
from kvref.testing import lockstep
from kvref.testing.driver import DriverConfig
from kvref.testing.lockstep import (
    HYBRID_SCOPE,
    NIGHTLY_SCOPE,
    PLAIN_NIGHTLY_SCOPE,
    PLAIN_SCOPE,
    SCOPE,
    run_lockstep,
)
from kvref_model.core import Scope

# the ci profile, at half its examples: the two scopes' 400 runs were a fifth
# of CI's CPU (issue 41's 15 minutes), and 200 still exercise every fault and
# action (run_lockstep checks); the nightly runs 20,000. Sharing off, 100 do
# as well (derandomized: 44 s against 109): the decode steps' keying (issue
# 41) and the admission plant's later find took CI to 12-14 minutes here
LOCKSTEP_CI = settings(settings.get_profile("ci"), max_examples=200)
PLAIN_CI = settings(LOCKSTEP_CI, max_examples=100)


@pytest.fixture(autouse=True)
def kept_decode_table(monkeypatch: pytest.MonkeyPatch) -> None:
    # the kept decode table (issue 28) plans from one row, so the lockstep's
    # batches of one to three requests run it (in production: from 32)
    monkeypatch.setattr(decode_table, "SMALL_BATCH", 1)
    # and a plain admit takes the pages of two streams or more in one pool
    # call (issue 42; in production from 4): both ways run here
    monkeypatch.setattr(admit_plan_commit, "_BATCHED_TAKE", 2)
    # and the same streams committed twice in a row are a decode batch
    # (`StreamBatch`, issue 42; in production from 32 rows): from one row here
    monkeypatch.setattr(admit_plan_commit, "BATCH_ROWS", 1)
    monkeypatch.setattr(admit_plan_commit, "_BATCH_AFTER", 1)  # from the second in a row


@pytest.mark.parametrize("scope", [SCOPE, PLAIN_SCOPE], ids=["as-shipped", "sharing-off"])
def test_lockstep(driver_config: DriverConfig, scope: Scope,
                  capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    if scope is PLAIN_SCOPE:
        # a plain admit's decode step is planned by the kept table from
        # SMALL_BATCH rows, below that afresh from the admit's streams
        # (`fresh_plan`): each scope runs one, as shipped the kept table
        monkeypatch.setattr(decode_table, "SMALL_BATCH", 1 << 20)
    # the ci profile's budget in every run: derandomized and without a
    # database, so the coverage check (every fault and action exercised) is
    # the same here, under CI (where Hypothesis drops the database and a
    # smaller dev budget then failed it) and in the packaged suite
    coverage = run_lockstep(driver_config, scope,
                            PLAIN_CI if scope is PLAIN_SCOPE else LOCKSTEP_CI)
    with capsys.disabled():
        print("\n" + coverage)


@pytest.mark.nightly
@pytest.mark.parametrize("scope", [NIGHTLY_SCOPE, PLAIN_NIGHTLY_SCOPE],
                         ids=["as-shipped", "sharing-off"])
def test_lockstep_nightly(driver_config: DriverConfig, scope: Scope) -> None:
    examples = int(os.environ.get("KVREF_NIGHTLY_EXAMPLES", "20000"))
    print(run_lockstep(driver_config, scope, settings(max_examples=examples)))


# issue 40's hybrid scope: a small budget in CI (the whole ci profile's 400
# examples take minutes), the ci profile's in the nightly run
HYBRID_EXAMPLES = 50
# (10 reached everything below until the lockstep's rules changed for the
# plant rates, issue 41: then 20 did; overlapped_steps' what-fits change
# (issue 41 item 5) moved the fork that shares pages past 35: 40 did, 50
# leaves room for the next change)
# what those examples reach (measured: derandomized, the same every run):
# pages keyed (by a call and by a followed commit), shared by a fork,
# copied on write, evicted. A hit every group serves and a window's
# release are what the hybrid traces run in CI
# (tests/conformance/test_hybrid_plants.py), and the nightly run's 400
# examples (600 passed clean, every fault and action exercised)
HYBRID_REACHES = ("CachePrefix (keyed)", "Commit (keyed a followed stream)",
                  "fork shares pages (full labels)", "copy-on-write", "cached page evicted")


def test_lockstep_hybrid(driver_config: DriverConfig) -> None:
    settings_ = settings(settings.get_profile("ci"), max_examples=HYBRID_EXAMPLES)
    print(run_lockstep(driver_config, HYBRID_SCOPE, settings_, coverage=False))
    never = [name for name in HYBRID_REACHES if not lockstep.RULES[name]]
    assert not never, f"the hybrid lockstep's budget never reached {never}"


@pytest.mark.nightly
def test_lockstep_hybrid_nightly(driver_config: DriverConfig) -> None:
    print(run_lockstep(driver_config, HYBRID_SCOPE, settings.get_profile("ci")))
