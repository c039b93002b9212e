"""kvref's page-pool model in lockstep with transformers' continuous-batching
paged cache (issue 43), on the transformers the dev extra installs, unmodified.

Plants go into scratch copies of its continuous_batching folder.  Budget: the
lockstep 100 examples of at most 25 steps, derandomized; the replay every
state within 7 calls at two pages and three holders.  Skipped when the
installed transformers has no continuous-batching cache (before 5).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from kvref.testing import transformers_pool as T
from kvref.testing.transformers_plants import PLANTS, PatchMissing, apply, planted_copy
from kvref_model import pages as M
from kvref_model.pages_invariants import INTERESTING

HAS_CACHE = importlib.util.find_spec("transformers") is not None and (
    importlib.util.find_spec(T.PACKAGE + ".cache_allocators") is not None)
pytestmark = pytest.mark.skipif(not HAS_CACHE, reason="no transformers with "
                                "generation.continuous_batching.cache_allocators (5.25 has it)")

# what the transformers scope cannot reach: an allocation never evicts, an
# eviction is never refused, and there are no extra keys
UNREACHABLE = {"eviction of a cached page", "reset refused while held",
               "hit with another salt misses"}
LOCKSTEP = (100, 25)


@pytest.fixture(scope="module")
def tf() -> T.Tf:
    return T.load()


def test_lockstep_agrees_with_the_installed_cache(tf: T.Tf) -> None:
    machine = T.lockstep_machine(tf)
    got = T.run_tf_lockstep(tf, *LOCKSTEP, machine=machine)
    assert got.failure is None, got.failure
    assert got.examples >= LOCKSTEP[0]
    seen = machine.seen  # type: ignore[attr-defined]
    # the engine never writes into a shared page: that refusal is the replay's
    missing = [k for k in INTERESTING if k not in UNREACHABLE | {
        "write refused (shared or registered)"} and not seen[k]]
    assert not missing, f"never arose: {missing}"


def test_exhaustive_replay_agrees_with_the_installed_cache(tf: T.Tf) -> None:
    rep = T.replay(tf)
    assert not rep.findings, rep.table()
    assert rep.states > 150 and rep.edges > 2500
    missing = [k for k in INTERESTING if k not in UNREACHABLE and not rep.interesting[k]]
    assert not missing, f"never arose: {missing}"


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_lockstep_and_replay_find_the_plant(name: str, tf: T.Tf,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    plant = PLANTS[name]
    with planted_copy(Path(tf.where), plant) as root:
        planted = T.load_copy(root)
        got = T.run_tf_lockstep(planted, *LOCKSTEP)
        short = T.replay(planted, first=True)
    assert got.failure is not None, f"{name}: the lockstep missed it"
    assert short.findings, f"{name}: the replay missed it"
    (trace, _), = short.findings.values()
    assert len(trace) <= 6, short.table()
    with capsys.disabled():
        print(f"\n  {name}: example {got.examples}, {got.seconds:.1f}s: "
              f"{got.failure[:160]}")


def test_an_unplanted_scratch_copy_agrees_and_the_install_is_untouched(tf: T.Tf) -> None:
    plant = PLANTS["explicit_count_of_one"]
    with planted_copy(Path(tf.where), None) as root:
        rep = T.replay(T.load_copy(root))
        assert not rep.findings, rep.table()
        apply(root, plant)
        with pytest.raises(PatchMissing):  # planting twice: the text is gone
            apply(root, plant)
    installed = (Path(tf.where) / plant.patches[0].file).read_text()
    assert plant.patches[0].old in installed and plant.patches[0].new not in installed


def test_dedup_adopts_the_hashed_block_and_releases_the_duplicate(tf: T.Tf) -> None:
    # Scope.dedup_adopts, on transformers: two requests write the same block; the
    # second to mark it takes the first's block, and its own goes back free
    sc = dataclasses.replace(T.REPLAY_SCOPE, depth=0)
    tp, m = T.TfPool(tf, sc), M.PagesModel(sc)
    s, k = m.init(), M.Key(None, (0,), ())
    for a in (M.Allocate(0, 1), M.Allocate(1, 1), M.Write(0, 1, k), M.Write(1, 2, k),
              M.Register(1, None, (0,), (), 0), M.Register(2, None, (0,), (), 1)):
        s, bad = T.compare(m, s, a, tp)
        assert bad is None, str(bad)
    assert s.tables[:2] == ((1,), (1,)) and s.blank == (2,)
    assert tp.ledger.shared_ref_counts == {tp.m2t[1]: 2}  # the 1 of page 2: implicit


def test_an_eviction_takes_every_cached_block_while_others_are_held(tf: T.Tf) -> None:
    sc = dataclasses.replace(T.REPLAY_SCOPE, depth=0)
    tp, m = T.TfPool(tf, sc), M.PagesModel(sc)
    s = m.init()
    k0, k1 = M.Key(None, (0,), ()), M.Key(None, (1,), ())
    for a in (M.Allocate(0, 1), M.Write(0, 1, k0), M.Register(1, None, (0,), (), 0),
              M.Release(0, (1,)), M.Allocate(1, 1), M.Write(1, 2, k1),
              M.Register(2, None, (1,), (), 1), M.NumFree()):
        s, bad = T.compare(m, s, a, tp)
        assert bad is None, str(bad)
    assert s.lru == (1,) and m.step(s, M.NumFree())[0] == M.Count(0)  # cached: not free
    s, bad = T.compare(m, s, M.ResetPrefixCache(), tp)
    assert bad is None and s.blank == (1,) and s.page(2).key is not None


@pytest.mark.parametrize(("window", "ps", "steps"), [
    (4, 2, [1] * 12), (3, 2, [1] * 9), (5, 2, [3, 1, 1, 4, 1, 2, 1]),
    (8, 4, [5, 1, 1, 1, 6, 2, 1, 1]), (6, 1, [2, 5, 1, 1, 7, 1])])
def test_the_sliding_ring_holds_at_most_kvrefs_window_pages(
        tf: T.Tf, window: int, ps: int, steps: list[int]) -> None:
    # item 5: transformers' ring keeps ceil(min(n, W) / ps) blocks; kvref, after a
    # commit, the pages of [max(0, n - W), n), one more when the window straddles
    from kvref.testing.transformers_window import compare

    rows = compare(tf, window, ps, steps)
    assert [r.tokens for r in rows][-1] == sum(steps)
    for r, q in zip(rows, steps, strict=True):
        assert r.transformers == -(-min(r.tokens, window) // ps)
        assert r.transformers <= r.kvref_settled <= r.transformers + 1 <= r.bound
        assert r.kvref_peak <= r.bound + -(-q // ps)  # W3: plus the step's new pages
    if (window, ps) == (4, 2):  # the window straddles a page at every odd length
        assert [r.kvref_settled - r.transformers for r in rows[4:]] == [1, 0] * 4


def test_an_explicit_count_of_one_frees_a_held_block_then_frees_it_again(tf: T.Tf) -> None:
    # the plant's consequence, beyond the stored count the observation shows: the
    # first release frees the block the other holder still has, the second
    # release puts it in the pool a second time
    with planted_copy(Path(tf.where), PLANTS["explicit_count_of_one"]) as root:
        tp = T.TfPool(T.load_copy(root), dataclasses.replace(T.REPLAY_SCOPE, depth=0))
        for a in (M.Allocate(0, 1), M.Share(1, (1,)), M.Release(0, (1,))):
            tp.step(a, M.Pages((1,)))
        seen = tp.observe()
        assert seen.tables[1] == (1,) and 1 in seen.free  # held, and free
        tp.step(M.Release(1, (1,)), M.Count(1))
        assert tp.observe().free.count(1) == 2  # freed twice
