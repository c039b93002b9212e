"""Sliding-window retention defects, planted in the model, and the check that
finds each.

Each plant is the retention model (kvref_model.retention) with one of its rules
switched off (`kvref_model.retention.variant`): the defect class the rule
prevents (specs/retention.md, W1..).  Four are the anchors' (issue 19),
adapted to kvref's design; the others are the careless versions of the
remaining rules.  The bounded checker (kvref_model.retention_check) must find
every one, at its default scope (it stops at the first violation) and, with
every violation kept, at the default scope cut to depth 6, through the
invariant named here: the symptom, not only a counter that went wrong on
the way.  The model with every rule passes both scopes
(tests/model/test_retention_model.py checks the whole default scope).  The
kvref plants of the same classes are the lockstep's to find, once KVManager
releases window pages.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvref_model.pages_check import show_trace
from kvref_model.retention import (
    RULES,
    Action,
    Append,
    Offload,
    RetentionModel,
    Scope,
    variant,
)
from kvref_model.retention_check import SCOPE, check
from kvref_model.retention_invariants import violations

DEEP = replace(SCOPE, depth=6)  # every violation kept: each finishes in seconds

# rule switched off -> (the defect, where it was reported, the invariant that finds it)
PLANTS: dict[str, tuple[str, str, str]] = {
    "WINDOW_NEVER_CACHED": (
        "(a) a windowed label's pages are registered, so the window's release puts "
        "them at the LRU's tail as cached: dead pages that push other requests' "
        "cached prefixes toward eviction", "vLLM 42948", "V11"),
    "WINDOW_TRACKS_LENGTH": (
        "(b) a stale window mapping: truncate and fork leave the `position` the "
        "window is computed from, so the next commit frees a live slot of the window",
        "SGLang PR 27586", "V3"),
    "RELEASE_FROM_LIVE_SLOTS": (
        "(c) an offload or a remove releases from a list that still names the pages "
        "the window retired: the same page released twice", "vLLM 42571", "V2"),
    "RETIRE_WHOLE_PAGES_ONLY": (
        "(d) an off-by-one at the window's first page: a page that *starts* before "
        "the window is released, with the window's first token in it",
        "issue 19 (off-by-one)", "V3"),
    "FORK_INHERITS_WINDOW": (
        "a fork target keeps its own `released`, not the source's: its retained "
        "slots name no page", "issue 19 (forks)", "V1"),
    "TRUNCATE_KEEPS_WINDOW": (
        "a truncate into the released prefix: the new window's tokens are gone",
        "issue 19 (truncate)", "V3"),
    "RELOAD_ONLY_RETAINED": (
        "a reload gives pages to released slots too: released slots hold pages",
        "issue 19 (offload and reload)", "V1"),
    "WINDOW_NEVER_HITS": (
        "a prefix hit on a windowed label attaches pages before its window",
        "issue 19 (prefix cache)", "V4"),
    "RETRIEVE_ONLY_RETAINED": (
        "a retrieve keeps the consumer's own `released`, not the peer's: it gives the "
        "slots the peer released pages, held against the window's bound",
        "issue 19 (publish and retrieve)", "V4"),
}


def test_every_rule_is_planted() -> None:
    assert set(PLANTS) == set(RULES)


@pytest.mark.parametrize("rule", sorted(PLANTS))
def test_model_checker_finds_the_rule_removed(rule: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    _, anchor, invariant = PLANTS[rule]
    assert check(variant(rule)(SCOPE)).violations, f"the model without {rule} passed"
    rep = check(variant(rule)(DEEP), keep_going=True)
    assert invariant in rep.violations, (rule, sorted(rep.violations))
    msg, trace = rep.violations[invariant]
    assert trace, "a counterexample is a trace from the first state"
    with capsys.disabled():
        print(f"\n  {rule} ({anchor}): {invariant} after {len(trace)} steps, "
              f"{rep.states} states: {msg}\n{show_trace(trace)}")


def test_the_clean_model_passes_the_same_scope() -> None:
    rep = check(RetentionModel(DEEP), keep_going=True)
    assert not rep.violations, rep.violations


def test_vllm_42571_the_same_page_twice_in_one_offload() -> None:
    # the anchor's exact shape: the window retires a page, the pool hands it
    # back to the same stream as the window slides, and the offload's list (the
    # eager store list, still naming the retired page) holds it twice
    scope = Scope(pages=3, page_size=2, windows=(3,), max_len=7)
    steps: list[Action] = [Append(0, 0, (0,)), Append(0, 0, (0, 0)), Append(0, 0, (0, 0)),
                           Append(0, 0, (0, 0))]
    bad = variant("RELEASE_FROM_LIVE_SLOTS")(scope)
    s = bad.init()
    for a in steps:
        _, s = bad.step(s, a)
    st = s.streams[0]
    assert st is not None and st.retired[0] in st.table  # the retired page came back
    listed = [p for p in (*st.table[::-1], *st.retired) if p is not None]
    assert listed.count(st.retired[0]) == 2  # one release list, the page twice
    r, n = bad.step(s, Offload(0))
    assert n.fault == f"the pool refused Release(0, {tuple(listed)})"
    assert any(iid == "V2" for iid, _ in violations(bad, n, Offload(0), r, s))
    good = RetentionModel(scope)
    g = good.init()
    for a in (*steps, Offload(0)):
        r, n = good.step(g, a)
        assert not violations(good, n, a, r, g)
        g = n
