"""The rollback margin (W15 of specs/retention.md): a windowed label keeps k
tokens past its window, so a speculative step's rollback of up to k tokens
is always legal, and the truncate check still uses W alone. The lockstep
against the one model is the composed lockstep (SHIPPED_SCOPE keeps a
margin); its plants (e) and (f) are traces in
tests/conformance/test_feature_plants.py."""

from __future__ import annotations

import math

import pytest
import torch

from kvref import (
    KVStep,
    ReleasedPrefixError,
    RetentionPolicy,
    Segment,
    StepContext,
)
from kvref.core.errors import InvalidArgumentError, InvalidConfigError
from kvref.manager import KVManager
from tests.unit._manager_fixtures import make_manager

PS, W, K = 4, 8, 3


def manager(margin: int) -> KVManager:
    return make_manager(page_size=PS, heads=1, head_dim=1, layers=1, pages=32,
                        retention={"w": RetentionPolicy(W, rollback_margin=margin)})


def commit(kv: KVManager, n: int) -> None:
    if not kv.has_request("r"):
        kv.ingest_request("r")
    s, ctx = KVStep([Segment("r", "w", n)]), StepContext(("r",))
    assert kv.admit(s, ctx).ok
    kv.plan(s, ctx)
    z = torch.zeros(n, 1, 1)
    kv.write_kv(z, z.clone(), layer_idx=0, label="w")
    kv.commit(s, ctx)


@pytest.mark.parametrize("bad", [-1, 1.5, "2", None])
def test_a_margin_is_a_non_negative_int(bad: object) -> None:
    with pytest.raises(InvalidConfigError, match="rollback_margin"):
        RetentionPolicy(W, rollback_margin=bad)  # type: ignore[arg-type]


def test_every_verify_step_can_roll_back_its_drafts() -> None:
    """Decode by verify steps of 1 + K tokens, each rejecting every draft:
    with the margin no rollback is refused, and the stream holds at most
    ceil((W + K) / ps) + 1 pages."""
    kv = manager(K)
    commit(kv, 5)
    for _ in range(40):
        n = kv.stored_len("r", "w")
        commit(kv, 1 + K)
        kv.truncate("r", "w", n + 1)  # every draft rejected
        st = kv._table.stream("r", "w")
        assert len(st.page_indices) <= math.ceil((W + K) / PS) + 1
    assert kv._table.stream("r", "w").released > 0  # the window slid


def test_without_the_margin_the_same_rollback_is_refused() -> None:
    """The control: margin 0 releases from n - W, and a rollback of K after
    a release reaches into released tokens (what the example engine hit)."""
    kv = manager(0)
    commit(kv, 5)
    with pytest.raises(ReleasedPrefixError):
        for _ in range(40):
            n = kv.stored_len("r", "w")
            commit(kv, 1 + K)
            kv.truncate("r", "w", n + 1)


def test_a_fork_needs_the_same_margin() -> None:
    """W5 with W15: a fork keeps the retention, margin included."""
    kv = make_manager(page_size=PS, heads=1, head_dim=1, layers=1, pages=32,
                      retention={"a": RetentionPolicy(W, rollback_margin=1),
                                 "b": RetentionPolicy(W)})
    kv.ingest_request("r")
    s = KVStep([Segment("r", "a", 4)])
    ctx = StepContext(("r",))
    assert kv.admit(s, ctx).ok
    kv.plan(s, ctx)
    z = torch.zeros(4, 1, 1)
    kv.write_kv(z, z.clone(), layer_idx=0, label="a")
    kv.commit(s, ctx)
    fork = KVStep([Segment("r", "a", 0)], pre_forks=(("a", "b"),))
    with pytest.raises(InvalidArgumentError, match="margins"):
        kv.admit(fork, ctx)
