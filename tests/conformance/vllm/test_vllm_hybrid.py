"""The one model's hybrid scope in lockstep with vLLM's HybridKVCacheCoordinator
(issue 40, item 4): one full-attention group and one sliding-window group.

Runs on a copy of vLLM's KV-manager files ($KVREF_VLLM_COPY, or
../shared/anchors/vllm_kv beside the checkout); skipped when there is none.
Budget: the lockstep 100 examples of at most 20 operations, derandomized, at
pages of one and of two tokens; the replay every world within 5 operations.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvref.testing import vllm_hybrid as H
from kvref.testing import vllm_pool as V
from kvref.testing.vllm_plants import HYBRID_PLANTS, planted_copy
from kvref_model.core import Model

REPO = Path(__file__).resolve().parents[3]
COPY = V.find_copy(REPO)
needs_copy = pytest.mark.skipif(COPY is None, reason=V.HOW_TO_GET_ONE)
SCOPES = {"page 1": H.ENGINE_SCOPE, "page 2": H.ENGINE_SCOPE_2}
REPLAYS = {"page 1": H.REPLAY_SCOPE, "page 2": H.REPLAY_SCOPE_2}


@pytest.fixture
def vllm() -> V.Vllm:
    assert COPY is not None
    return V.load(COPY)


@needs_copy
@pytest.mark.parametrize("name", sorted(SCOPES))
def test_lockstep_agrees_with_the_unmodified_coordinator(name: str, vllm: V.Vllm) -> None:
    machine = H.lockstep_machine(vllm, SCOPES[name])
    got = H.run_lockstep(vllm, 100, 20, SCOPES[name], machine=machine)
    assert got.failure is None, got.failure
    assert got.examples >= 100
    assert machine.hits, "no prefix hit ever arose"  # type: ignore[attr-defined]


@needs_copy
@pytest.mark.parametrize("name", sorted(REPLAYS))
def test_exhaustive_replay_agrees_with_the_unmodified_coordinator(name: str,
                                                                  vllm: V.Vllm) -> None:
    rep = H.replay(vllm, REPLAYS[name])
    assert not rep.findings, rep.table()
    assert rep.states > 300


class _WindowAsIs(H.VllmHybridModel):
    """vLLM's W taken as the model's W (the first difference not stated)."""

    def __init__(self, scope: H.Scope) -> None:
        w = scope.groups[1]
        assert w is not None
        super().__init__(dataclasses.replace(scope, groups=(None, w + 1)))


# each difference, left unstated, is a disagreement the replay finds (at the
# page size that reaches it): none of the settings is there for nothing
UNSTATED = {
    "window W - 1": ("page 1", _WindowAsIs, {}),
    "H3 (passed window blocks stay cached)": (
        "page 1", type("M", (Model,), {"H4_window_frees_head_first": False}), {}),
    "H4 (tail first)": (
        "page 1", type("M", (Model,), {"H3_window_release_blank": False}), {}),
    "duplicates": ("page 1", H.VllmHybridModel, {"duplicates": False}),
    "blank_to_front": ("page 2", H.VllmHybridModel, {"blank_to_front": False}),
}


@needs_copy
@pytest.mark.parametrize("name", sorted(UNSTATED))
def test_each_difference_is_needed(name: str, vllm: V.Vllm) -> None:
    where, model, flags = UNSTATED[name]
    scope = dataclasses.replace(REPLAYS[where], **flags)
    rep = H.replay(vllm, scope, model=model, first=True)
    assert rep.findings, f"{name}: no disagreement without it"
    (trace, _), = rep.findings.values()
    assert len(trace) <= 3, rep.table()


@needs_copy
@pytest.mark.parametrize("name", sorted(HYBRID_PLANTS))
def test_lockstep_finds_the_plant(name: str, vllm: V.Vllm,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    plant = HYBRID_PLANTS[name]
    with planted_copy(vllm.root, plant) as (root, form):
        planted = V.load(root)
        got = [H.run_lockstep(planted, 100, 20, sc) for sc in SCOPES.values()]
    found = [g for g in got if g.failure is not None]
    assert found, f"{name} ({plant.anchor}): the lockstep missed it"
    with capsys.disabled():
        g = min(found, key=lambda g: g.examples)
        print(f"\n  {name} ({plant.anchor}, {form}): example {g.examples}, "
              f"{g.seconds:.1f}s: {(g.failure or '')[:160]}")


@needs_copy
def test_round_robin_sessions_hits(vllm: V.Vllm) -> None:
    """vLLM 48435's shape: three sessions re-sending a growing prefix in turn.
    vLLM in lockstep with its scope's model; kvref's rules hit at least as
    often in every session at each pool size."""
    for pages in (24, 32):
        theirs = H.round_robin(vllm, pages=pages)
        ours = H.round_robin(None, pages=pages, model=Model, vllm_rules=False)
        assert all(sum(o) >= sum(t) for o, t in zip(ours, theirs, strict=True))
        assert sum(map(sum, ours)) > sum(map(sum, theirs)), (pages, ours, theirs)


@pytest.mark.nightly
@needs_copy
@pytest.mark.parametrize("name", sorted(SCOPES))
def test_lockstep_nightly(name: str, vllm: V.Vllm) -> None:
    got = H.run_lockstep(vllm, 2000, 40, SCOPES[name])
    assert got.failure is None, got.failure


@pytest.mark.nightly
@needs_copy
@pytest.mark.parametrize("name", sorted(REPLAYS))
def test_replay_nightly(name: str, vllm: V.Vllm) -> None:
    rep = H.replay(vllm, REPLAYS[name], depth=7, lengths=(2, 3, 5, 6))
    assert not rep.findings, rep.table()
