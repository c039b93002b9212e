"""The shared-page and window defects the retired sharing and retention
locksteps found in kvref (their kvref plants, issues 18 and 19), each found
now against the one model: a named trace of the one model, replayed on kvref
with `kvref.testing.exhaustive.run_trace` (every result, abstract state, page
map and byte compared after each call), fails with the plant in and passes on
the clean tree. The retired locksteps' own scenarios are here too, as traces
of the one model.

Which of these the composed lockstep (`kvref.testing.lockstep`, SHIPPED_SCOPE)
also finds at a Hypothesis budget is measured, not assumed: see
docs/verification/planted-bugs.md. The plants are in tests/support/seam_plants.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvref.testing.driver import DriverConfig
from kvref.testing.exhaustive import Mismatch, run_trace
from kvref_model import core as m
from tests.support import seam_plants as P
from tests.support.seam_traces import TRACES

Plant = Callable[[pytest.MonkeyPatch], None]

# sharing on, three full-attention labels (forks between any two)
SHARED = m.Scope(requests=2, labels=3, device_pages=6, host_pages=4, page_size=2, max_span=4,
                 sharing=True)
# labels 1 and 2 windowed (W=2), no margin; and the same with a margin of one
WINDOWED = m.Scope(requests=2, labels=3, device_pages=6, host_pages=4, page_size=2,
                   max_span=3, sharing=True, windows=(None, 2, 2), margins=(0, 0, 0))
MARGIN = m.Scope(requests=2, labels=3, device_pages=6, host_pages=4, page_size=2, max_span=3,
                 sharing=True, windows=(None, 2, 2), margins=(0, 1, 1))


def step(rid: int, label: int, span: int, **kw: Any) -> list[m.Action]:
    """One whole step (admit, plan, write, commit) of one segment."""
    return [m.Admit(m.Step((m.Seg(rid, label, span),), padded=(rid,), **kw)),
            m.Plan(), m.Write(), m.Commit()]


def offload(rid: int) -> list[m.Action]:
    return [m.OffloadClaim(rid), m.OffloadCopy(rid, 0), m.OffloadCommit(rid)]


@dataclass(frozen=True)
class Case:
    plant: Plant
    old_layer: str  # the retired layer that found it
    scope: m.Scope
    trace: list[m.Action] = field(hash=False)


FORKED = [m.Ingest(0), *step(0, 0, 4, post_forks=((0, 1),))]  # label 1 shares 0's pages

CASES: dict[str, Case] = {
    "a fork shares the partial last page (R51)": Case(
        P.fork_shares_the_partial_page, "sharing lockstep", SHARED,
        [m.Ingest(0), *step(0, 0, 3, post_forks=((0, 1),)), *step(0, 1, 1)]),
    "a truncate keeps the chain's keys (vLLM 18668/19006)": Case(
        P.truncate_keeps_the_chain, "sharing lockstep", SHARED,
        [*FORKED, m.CachePrefix(0, 1), m.Truncate(0, 1, 2), *step(0, 1, 2),
         m.CachePrefix(0, 1)]),
    "reset keeps shared pages as spare (R62)": Case(
        P.reset_keeps_shared_pages, "sharing lockstep", SHARED,
        [*FORKED, m.Reset(0, free=False)]),
    "reclaimable counts shared pages (SGLang 35270)": Case(
        P.reclaimable_counts_shared_pages, "sharing lockstep", SHARED,
        [m.Ingest(0), *step(0, 0, 2), m.CachePrefix(0, 0), m.Ingest(1),
         m.MatchPrefix(1, 0, 3), m.Reclaimable(1)]),
    "a hit onto a stream that holds tokens (R58)": Case(
        P.hit_onto_a_stream_with_tokens, "sharing lockstep", SHARED,
        [m.Ingest(0), *step(0, 0, 2), m.CachePrefix(0, 0), m.Ingest(1), *step(1, 0, 1),
         m.MatchPrefix(1, 0, 3)]),
    "a fork target keeps its old key chain": Case(
        P.fork_keeps_the_targets_key_chain, "sharing lockstep", SHARED,
        [m.Ingest(0), *step(0, 1, 2), m.CachePrefix(0, 1), *step(0, 0, 4, post_forks=((0, 1),)),
         m.CachePrefix(0, 1)]),
    "(a) window pages cached (vLLM 42948)": Case(
        P.window_pages_cached, "retention lockstep", WINDOWED,
        [m.Ingest(0), *step(0, 1, 3), m.CachePrefix(0, 1)]),
    "(b) a stale window after truncate or fork (SGLang PR 27586)": Case(
        P.stale_window, "retention lockstep", WINDOWED,
        [m.Ingest(0), *step(0, 1, 3), m.Truncate(0, 1, 1), *step(0, 1, 3)]),
    "(c) a release list naming retired pages (vLLM 42571)": Case(
        P.release_lists_name_retired_pages, "retention lockstep", WINDOWED,
        [m.Ingest(0), *step(0, 1, 3), *step(0, 1, 3), m.Remove(0)]),
    "(d) an off-by-one at the window's first page": Case(
        P.off_by_one_at_the_window, "retention lockstep", WINDOWED,
        [m.Ingest(0), *step(0, 1, 3)]),
    "(e) the rollback margin ignored at release": Case(
        P.margin_ignored, "retention lockstep (margin)", MARGIN,
        [m.Ingest(0), *step(0, 1, 3), *step(0, 1, 1)]),
    "(f) the rollback margin counted as window by truncate": Case(
        P.margin_counted_as_window, "retention lockstep (margin)", MARGIN,
        [m.Ingest(0), *step(0, 1, 3), *step(0, 1, 3), m.Truncate(0, 1, 4)]),
}

# the four the harness could not express before: a copy-on-write admit the
# model did not make (now it does), draft ids past the committed length
# (CachePrefix.drafts), a publication's released prefix (the driver checks
# what publish names, Driver.check_publication) and a retrieve into a window
CASES.update({
    "no copy-on-write after a truncate into a shared page (R52)": Case(
        P.no_copy_on_write, "sharing lockstep", SHARED,
        [*FORKED, m.Truncate(0, 1, 3), *step(0, 1, 1)]),
    "draft tokens cached before commit (vLLM 18668/19006)": Case(
        P.draft_tokens_cached, "sharing lockstep", SHARED,
        [m.Ingest(0), *step(0, 0, 1), m.Admit(m.Step((m.Seg(0, 0, 1),), padded=(0,))),
         m.Plan(), m.Write(), m.CachePrefix(0, 0, drafts=1)]),
    # the driver's publisher holds no window (a publication's released is 0),
    # so this finds the plant through the consumer's own release, which the
    # plant loses as well: what the peer released is checked by hand in
    # tests/unit/test_retention_transfer.py
    "(g) a retrieve that ignores the peer's released prefix": Case(
        P.retrieve_ignores_released, "retention lockstep", TRACES["retrieve into a window"][0],
        TRACES["retrieve into a window"][1]),
    "(h) a publish that forgets its released prefix": Case(
        P.publish_forgets_released, "retention lockstep", WINDOWED,
        [m.Ingest(0), *step(0, 1, 3), *step(0, 1, 3), m.Publish(0)]),
})

# the retired layers' plants no one-model layer finds yet, and why: none now
NOT_FOUND: dict[str, str] = {}


def replay(scope: m.Scope, trace: list[m.Action]) -> None:
    run_trace(m.Model(scope), trace, DriverConfig())


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_clean_manager_replays_the_trace(name: str) -> None:
    replay(CASES[name].scope, CASES[name].trace)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_plant_is_found(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES[name]
    case.plant(monkeypatch)
    with pytest.raises(Mismatch):
        replay(case.scope, case.trace)


# --- the retired sharing lockstep's scenarios (its rare cases), as traces of
# the one model: each replayed on kvref, and reaching its case

def run_model(scope: m.Scope, trace: list[m.Action]) -> tuple[list[m.Result], m.State]:
    model, out = m.Model(scope), []
    s = model.init()
    for a in trace:
        r, s = model.step(s, a)
        out.append(r)
    return out, s


def test_reclaimable_below_the_pages_the_request_holds() -> None:
    trace = [m.Ingest(0), *step(0, 0, 4), m.CachePrefix(0, 0), m.Ingest(1),
             m.MatchPrefix(1, 0, 4), m.Reclaimable(1)]
    replay(SHARED, trace)
    rs, s = run_model(SHARED, trace)
    assert s.stream_map()[(1, 0)].pages == 1 and rs[-1] == m.Count(0)


def test_a_fork_refused_pages_short() -> None:
    """The cache is full, and the fork's copy of a partial page needs one."""
    tight = m.Scope(requests=2, labels=3, device_pages=4, host_pages=4, page_size=2,
                    max_span=4, sharing=True)
    trace = [m.Ingest(0), *step(0, 0, 3), m.CachePrefix(0, 0), m.Ingest(1), *step(1, 1, 4),
             m.Admit(m.Step((m.Seg(0, 0, 0),), post_forks=((0, 2),), padded=(0,)))]
    replay(tight, trace)
    assert run_model(tight, trace)[0][-1] == m.Refused("AllocationFailed", pages_short=1)


def test_reset_prefix_cache_refused_while_a_stream_is_on_the_host() -> None:
    """Issue 27 defect 3: the only request is on the host, its host copy holds
    KV from before the reset (S30)."""
    trace = [m.Ingest(0), *step(0, 0, 4), m.CachePrefix(0, 0), *offload(0),
             m.ResetPrefixCache(), m.Reload(0), m.CachePrefix(0, 0)]
    replay(SHARED, trace)
    rs, _ = run_model(SHARED, trace)
    assert rs[-3] == m.Refused("RequestOffloading") and rs[-1] == m.Count(0)


@pytest.mark.parametrize("other_holds", [False, True], ids=["free-cached", "held"])
def test_reload_shares_again_what_the_cache_still_holds(other_holds: bool) -> None:
    """S29: the offloaded request's keyed pages stay cached (free, or held by
    the other request), and its reload shares them again."""
    share = [m.Ingest(1), m.MatchPrefix(1, 0, 4)] if other_holds else []
    before = [m.Ingest(0), *step(0, 0, 4), m.CachePrefix(0, 0), *share]
    trace = [*before, *offload(0), m.Reload(0)]
    replay(SHARED, trace)
    table = run_model(SHARED, before)[1].stream_map()[(0, 0)].table
    assert run_model(SHARED, trace)[1].stream_map()[(0, 0)].table == table


def test_every_retired_kvref_plant_is_accounted_for() -> None:
    """The retired layers had 16 kvref plants (8 sharing, 8 retention): each is
    a case above or says why it is not found."""
    assert not set(CASES) & set(NOT_FOUND)
    assert len(set(CASES) | set(NOT_FOUND)) == 16


PLANTS = sorted({*CASES, *NOT_FOUND})  # the catalogue's names (tests/test_docs.py)
