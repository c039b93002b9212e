"""kvref's page-pool model in lockstep with vLLM's own BlockPool (issue 30).

Runs on a copy of vLLM's KV-manager files: $KVREF_VLLM_COPY, or
../shared/anchors/vllm_kv beside the checkout; skipped, saying how to get
one, when there is none.  The copy is never modified: plants go into
scratch copies.  Budget: the lockstep 200 examples of at most 30 steps,
derandomized; the replay every state within 7 calls at two pages.
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import pytest

from kvref.testing import vllm_pool as V
from kvref.testing.vllm_plants import PLANTS, PatchMissing, apply, planted_copy
from kvref_model import pages as M
from kvref_model.pages_invariants import INTERESTING

REPO = Path(__file__).resolve().parents[3]
COPY = V.find_copy(REPO)
needs_copy = pytest.mark.skipif(COPY is None, reason=V.HOW_TO_GET_ONE)

# cases the vLLM scope cannot reach: it keeps duplicates instead of deduplicating
UNREACHABLE = {"dedup on register"}


@pytest.fixture
def vllm() -> V.Vllm:
    assert COPY is not None
    return V.load(COPY)


@needs_copy
def test_the_copy_is_byte_identical_to_its_wheel_record() -> None:
    # the files the lockstep calls are vLLM's, not edited: RECORD.subset holds the
    # wheel's sha256 for each (scripts/vllm_copy.py writes it)
    assert COPY is not None
    lines = [ln for ln in (COPY / "RECORD.subset").read_text().splitlines()
             if ln and not ln.startswith("#")]
    names = {ln.split(",")[0] for ln in lines}
    assert {"vllm/v1/core/block_pool.py", "vllm/v1/core/kv_cache_utils.py",
            "vllm/v1/core/kv_cache_manager.py"} <= names
    for ln in lines:
        name, want = ln.split(",")[:2]
        got = "sha256=" + base64.urlsafe_b64encode(
            hashlib.sha256((COPY / name).read_bytes()).digest()).rstrip(b"=").decode()
        assert got == want, f"{name} differs from the wheel"


@needs_copy
def test_lockstep_agrees_with_the_unmodified_pool(vllm: V.Vllm) -> None:
    machine = V.lockstep_machine(vllm)
    got = V.run_lockstep(vllm, V.budget(200, 30), machine=machine)
    assert got.failure is None, got.failure
    assert got.examples >= 200
    seen = machine.seen  # type: ignore[attr-defined]
    missing = [k for k in INTERESTING if k not in UNREACHABLE and not seen[k]]
    assert not missing, f"never arose: {missing}"
    assert seen[V.TWO_BLOCKS_ONE_KEY], "no key ever named two blocks"


@needs_copy
def test_exhaustive_replay_agrees_with_the_unmodified_pool(vllm: V.Vllm) -> None:
    rep = V.replay(vllm)
    assert not rep.findings, rep.table()
    assert rep.states > 1000 and rep.unexpressible == 0
    missing = [k for k in INTERESTING if k not in UNREACHABLE and not rep.interesting[k]]
    assert not missing, f"never arose: {missing}"


@needs_copy
@pytest.mark.parametrize("name", sorted(PLANTS))
def test_lockstep_and_replay_find_the_plant(name: str, vllm: V.Vllm,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    plant = PLANTS[name]
    with planted_copy(vllm.root, plant) as (root, form):
        planted = V.load(root)
        got = V.run_lockstep(planted, V.budget(200, 30))
        short = V.replay(planted, first=True)
    assert got.failure is not None, f"{name} ({plant.anchor}): the lockstep missed it"
    assert short.findings, f"{name} ({plant.anchor}): the replay missed it"
    (trace, _), = short.findings.values()
    assert len(trace) <= 5, short.table()  # a shortest trace: 6 calls at most
    with capsys.disabled():
        print(f"\n  {name} ({plant.anchor}, {form}): example {got.examples}, "
              f"{got.seconds:.1f}s: {got.failure[:160]}")


@needs_copy
def test_the_scratch_copy_is_planted_and_the_copy_is_not(vllm: V.Vllm) -> None:
    plant = PLANTS["touch_leaves_block_queued"]
    with planted_copy(vllm.root, plant) as (root, form):
        assert form == "0.33.0's text"
        text = (root / plant.patches[0].file).read_text()
        assert plant.patches[0].new in text and plant.patches[0].old not in text
        with pytest.raises(PatchMissing):  # planting twice: the text is gone
            apply(root, plant)
    assert plant.patches[0].old in (vllm.root / plant.patches[0].file).read_text()


@needs_copy
def test_careless_calls_vllm_does_not_refuse(vllm: V.Vllm) -> None:
    # kvref's checked protocol against vLLM's unchecked pool: each careless call
    # kvref refuses, vLLM carries out (its manager is trusted not to make them)
    import dataclasses

    rep = V.replay(vllm, dataclasses.replace(V.REPLAY_SCOPE, depth=4, trusts_caller=False))
    assert set(rep.findings) == {
        "Allocate, a negative count", "Release, a free page",
        "Release, a page it does not hold", "Release, a page twice in one list",
        "Share, a free page", "Share, a page it holds already",
        "Match, a page it holds already", "Register, a repeat",
        "Register, other tokens for a cached page", "Take, a page no key names"}, rep.table()
    # the one vLLM stops: cache_full_blocks asserts on a block cached already
    for kind in ("Register, a repeat", "Register, other tokens for a cached page"):
        assert "raised AssertionError" in rep.findings[kind][1].got


@needs_copy
def test_a_negative_allocation_corrupts_the_free_count(vllm: V.Vllm) -> None:
    # finding 1: get_new_blocks(-1) passes its check and popleft_n(-1) adds one
    # to num_free_blocks; the next full allocation hands out the fake tail
    vp = V.VllmPool(vllm, V.vllm_scope(pages=2, holders=2))
    assert vp.step(M.Allocate(0, -1)) == M.Pages(())  # kvref: InvalidArgumentError
    assert vp.pool.get_num_free_blocks() == 3  # two blocks in the queue
    assert vp.step(M.Allocate(0, 3)) == M.Pages((1, 2, -1))


@needs_copy
def test_a_block_twice_in_one_free_list_frees_a_block_still_held(vllm: V.Vllm) -> None:
    # vLLM 42571's class at the pool: free_blocks takes a block listed twice, so
    # a block two requests hold is freed by one of them and handed out again
    vp = V.VllmPool(vllm, V.vllm_scope(pages=2, holders=2))
    assert vp.step(M.Allocate(0, 1)) == M.Pages((1,))
    vp.step(M.Share(1, (1,)))
    assert vp.step(M.Release(0, (1, 1))) == M.Count(1)  # kvref: PageRefError
    assert vp.observe().refs[0] == 0 and 1 in vp.observe().queue
    assert vp.step(M.Allocate(0, 2)) == M.Pages((1, 2))  # holder 1 still reads it


def test_no_copy_says_how_to_get_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                     ) -> None:
    monkeypatch.setenv(V.ENV, str(tmp_path))
    assert V.find_copy(REPO) is None
    assert "scripts/vllm_copy.py" in V.HOW_TO_GET_ONE and V.ENV in V.HOW_TO_GET_ONE
    with pytest.raises(FileNotFoundError):
        V.load(tmp_path)
