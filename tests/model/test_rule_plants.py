"""Shared-page and window rules switched off in the one model, each found by
its checker (kvref_model.check) through the invariant named here, in a scope
small enough for CI; the model with every rule passes the same scopes.

These replace the retired sharing and retention models' plant tests (issue
27) rule by rule where the one model has the rule; the rules not yet found
in a CI-sized scope are listed in docs/verification/planted-bugs.md. The
pool's own rules (S4-S13) are the pool model's plants
(tests/conformance/test_page_pool_plants.py).
"""

from __future__ import annotations

import pytest

from kvref_model.check import explore
from kvref_model.core import (
    Admit,
    CachePrefix,
    Commit,
    Ingest,
    Model,
    Plan,
    Publish,
    Refused,
    RetrieveStart,
    Scope,
    Seg,
    Step,
    Truncate,
    Write,
)
from kvref_model.invariants import violations
from kvref_model.reference import without
from kvref_model.search import Report

SHARED = Scope(requests=2, labels=2, device_pages=3, host_pages=1, page_size=2, max_span=2,
               depth=5, sharing=True)
# label 1 windowed (W=1) with a rollback margin of one token
WINDOWED = Scope(requests=2, labels=2, device_pages=3, host_pages=1, page_size=2, max_span=2,
                 depth=6, sharing=True, windows=(None, 1), margins=(0, 1))

# the CI budget: the same scopes with one request find every plant within a
# few seconds each (the two-request scopes: nightly, below)
SHARED_1 = Scope(requests=1, labels=2, device_pages=3, host_pages=1, page_size=2, max_span=2,
                 depth=6, sharing=True)
WINDOWED_1 = Scope(requests=1, labels=2, device_pages=3, host_pages=1, page_size=2,
                   max_span=2, depth=6, sharing=True, windows=(None, 1), margins=(0, 1))
SMALL = {id(SHARED): SHARED_1, id(WINDOWED): WINDOWED_1}

# rule switched off -> (the defect, its scope, the invariant that finds it)
PLANTS: dict[str, tuple[str, Scope, str]] = {
    "S18": ("missing copy-on-write: a write lands in a shared or keyed page", SHARED, "I24"),
    "S19": ("a fork shares the source's part page instead of copying it", SHARED, "I17"),
    "S21": ("reset_request(free=False) keeps a shared or keyed page as spare", SHARED, "I25"),
    "W6": ("a truncate into the released prefix: the window's tokens are gone",
           WINDOWED, "I26"),
    "W9": ("a windowed label's pages are cached: the window's release leaves them on "
           "the LRU (vLLM 42948)", WINDOWED, "I28"),
}


def check(model: Model) -> Report:
    rep = Report()
    for _ in explore(model, report=rep, workers=1, states=False):
        pass
    return rep


@pytest.mark.parametrize("small", [
    pytest.param(True, id="ci"), pytest.param(False, id="full", marks=pytest.mark.nightly)])
@pytest.mark.parametrize("rule", sorted(PLANTS))
def test_checker_finds_the_rule_removed(rule: str, small: bool,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    what, scope, invariant = PLANTS[rule]
    scope = SMALL[id(scope)] if small else scope
    rep = check(without(rule)(scope))
    assert invariant in rep.violations, (rule, sorted(rep.violations))
    msg, trace = rep.violations[invariant]
    assert trace, "a counterexample is a trace from the first state"
    with capsys.disabled():
        print(f"\n  without {rule} ({what}): {invariant} after {len(trace)} calls, "
              f"{rep.states} states: {msg}")


# SHARED_1 is not here: the clean model breaks I3 there (a cache_prefix on a
# stream an admitted step pre-forks onto; kvref's plan raises a plain
# KVRefError on the same trace): open, issue 27 part 1
@pytest.mark.parametrize("scope", [
    pytest.param(WINDOWED_1, id="windowed-1"),
    pytest.param(SHARED, id="shared", marks=pytest.mark.nightly),
    pytest.param(WINDOWED, id="windowed", marks=pytest.mark.nightly)])
def test_the_clean_model_passes_the_same_scopes(scope: Scope) -> None:
    rep = check(Model(scope))
    assert not rep.violations, sorted(rep.violations)
    assert rep.complete


# every label windowed (label 0 is full attention in every other scope): the
# clean one model broke I18 here at depth 8 (I6 there is fixed: a copy holds
# the host pages it took, tests/model/test_host_copy_and_key_order.py): a commit on a
# windowed label released a window page of a request published between the
# step's admit and its commit, a page the peer may still be copying; kvref did
# the same. R70 refuses that publish (and such a step of a leased request);
# kvref's replay: tests/conformance/test_composed_regressions.py
ALL_WINDOWED = Scope(requests=1, labels=1, device_pages=3, host_pages=1, page_size=2,
                     max_span=2, depth=8, windows=(1,), margins=(1,))


def test_the_clean_model_passes_a_scope_where_every_label_is_windowed() -> None:
    rep = Report()
    for _ in explore(Model(ALL_WINDOWED), report=rep, workers=1, states=False,
                     keep_going=True):
        pass
    assert not rep.violations, {i: msg for i, (msg, _) in rep.violations.items()}
    assert rep.complete


def test_without_r70_the_checker_finds_a_commit_releasing_leased_window_pages() -> None:
    rep = check(without("R70")(ALL_WINDOWED))
    assert "I18" in rep.violations, sorted(rep.violations)
    msg, trace = rep.violations["I18"]
    # I18 follows the leased pages by identity (issue 44): the release is seen
    # at once, in 6 calls, where the page count needed a net drop (8 calls)
    assert msg == "Commit let go of page 1 (slot 0) of leased (0, 0)", msg
    assert any(type(a).__name__ == "Publish" for a, *_ in trace), trace


# R71 (issue 44, item 1): a retrieve into a request whose own publication is
# leased gave back pages the lease names; I18 compared page counts at offload
# claims, resets and removals only, so nothing saw it. I18 now follows each
# named page to its slot across every call. A windowed label (W=1, no margin,
# one token a page) releases, on a retrieve to 2 tokens, the slot publish named
WINDOW_RETRIEVE = Scope(requests=1, labels=1, device_pages=3, host_pages=1, page_size=1,
                        max_span=2, depth=5, sharing=True, windows=(1,), margins=(0,))
# full attention: a truncate into a keyed page, then publish; the next write
# after it (an admit's or a retrieve's) copies that page and gives it back
# (no host pool: offload plays no part, and the search is half as long)
KEYED_TAIL = Scope(requests=1, labels=1, device_pages=2, host_pages=0, page_size=2,
                   max_span=2, depth=9, sharing=True)


@pytest.mark.parametrize("scope, action", [
    pytest.param(WINDOW_RETRIEVE, "RetrieveStart", id="windowed-retrieve"),
    pytest.param(KEYED_TAIL, "Admit", id="keyed-tail-admit")])
def test_without_r71_the_checker_finds_leased_pages_given_back(scope: Scope,
                                                               action: str) -> None:
    rep = check(without("R71")(scope))
    assert "I18" in rep.violations, sorted(rep.violations)
    msg, trace = rep.violations["I18"]
    assert msg.startswith(f"{action} let go of page"), msg
    assert any(type(a).__name__ == "Publish" for a, *_ in trace), trace
    clean = check(Model(scope))
    assert not clean.violations and clean.complete, sorted(clean.violations)


def test_without_r71_a_retrieve_after_a_truncate_into_a_keyed_page_gives_it_back() -> None:
    """The issue's second case, which the checker reports through the admit (a
    trace as short): replayed on the model with and without the rule."""
    trace = [Ingest(0), Admit(Step((Seg(0, 0, 2),), padded=(0,))), Plan(), Write(), Commit(),
             CachePrefix(0, 0), Truncate(0, 0, 1), Publish(0)]
    for model, refused in ((without("R71")(KEYED_TAIL), False), (Model(KEYED_TAIL), True)):
        s = model.init()
        for a in trace:
            _, s = model.step(s, a)
        r, n = model.step(s, RetrieveStart(0, 0, 2))
        found = dict(violations(model, n, RetrieveStart(0, 0, 2), r, s))
        if refused:
            assert r == Refused("PublishLeased") and n == s and not found, (r, found)
        else:
            assert "I18" in found and found["I18"].startswith("RetrieveStart let go"), found
