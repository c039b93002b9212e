"""S29 in the one model (issue 28, part 4): a reload shares again each page
whose key its host copy remembers and the cache still holds; I27 checks it.

A scope small enough to explore to depth 10, the shortest trace that keys a
page, offloads it and reloads it (ingest, a step of four calls, a
cache_prefix, claim, copy, commit, reload). The clean model passes with the
re-attach arising; each rule switched off is found.
"""

from __future__ import annotations

import pytest

from kvref_model import core
from kvref_model.check import explore
from kvref_model.reference import without
from kvref_model.search import Report

SCOPE = core.Scope(requests=1, labels=1, device_pages=3, host_pages=2, page_size=1,
                   max_span=2, depth=10, sharing=True)


def _check(model: core.Model) -> Report:
    report = Report()
    list(explore(model, report=report, traces=True, states=False))
    return report


def test_the_clean_model_reattaches_and_passes() -> None:
    report = _check(core.Model(SCOPE))
    assert not report.violations, report.violations
    assert report.interesting["I27"] > 0  # a reload shared a cached page again


@pytest.mark.parametrize(("rule", "found_by"), [
    ("S29", {"I27"}),  # copies every page back: a private copy of a cached page
    ("S29k", {"I27", "I24", "I23"}),  # a page under another slot's key
])
def test_each_rule_switched_off_is_found(rule: str, found_by: set[str]) -> None:
    report = _check(without(rule)(SCOPE))
    assert report.violations and set(report.violations) <= found_by, report.violations
    _, trace = next(iter(report.violations.values()))
    assert any(isinstance(a, core.Reload) for a, _ in trace)


def test_reload_need_counts_only_the_pages_it_takes() -> None:
    m = core.Model(core.Scope(requests=2, labels=1, device_pages=4, host_pages=2,
                              page_size=1, sharing=True))
    step = core.Step((core.Seg(0, 0, 2),), padded=(0,))
    s = m.init()
    for a in (core.Ingest(0), core.Admit(step), core.Plan(), core.Write(), core.Commit(),
              core.CachePrefix(0, 0), core.Ingest(1), core.MatchPrefix(1, 0, 2)):
        _, s = m.step(s, a)
    for a in (core.OffloadClaim(0), core.OffloadCopy(0, 0), core.OffloadCommit(0)):
        _, s = m.step(s, a)
    # page 0 is r1's (a hit of one token: S8), page 1 free-cached: one page
    assert m.reload_need(s, 0) == 1
    r, n = m.step(s, core.Reload(0))
    assert r == core.Flag(True) and n.free == s.free - 1
    assert n.stream_map()[(0, 0)].table[0] == n.stream_map()[(1, 0)].table[0]


class _KeepsTheEvictedKey(core.Model):
    """A failed reload that keeps the cache as it was: the state before the
    call, with its Fault (what the model said before the composed harness
    found kvref disagreeing)."""

    def do_Reload(self, s: core.State, a: core.Reload) -> tuple[core.Result, core.State]:
        got, n = super().do_Reload(s, a)
        return got, (s if got == core.Fault("ReloadCopyError") else n)


class _FaultAfterReloading(core.Model):
    """A failed reload that leaves the request reloaded (a half-kept call)."""

    def do_Reload(self, s: core.State, a: core.Reload) -> tuple[core.Result, core.State]:
        got, n = super().do_Reload(s, a)
        if got != core.Fault("ReloadCopyError"):
            return got, n
        _, done = super().do_Reload(s, core.Reload(a.rid))
        return got, done


def test_a_faulted_reload_gives_back_what_it_took() -> None:
    """I17 at a reload fault: the pages come back, every stream and host copy
    as it was; the old 'nothing moves' model passes too (I17 allows a key
    kept), the half-kept one is found."""
    clean = _check(core.Model(SCOPE))
    assert "I17" not in clean.violations
    assert "I17" not in _check(_KeepsTheEvictedKey(SCOPE)).violations
    assert "I17" in _check(_FaultAfterReloading(SCOPE)).violations
