"""Stream-level shared-page defects, planted in the model, and the check that
finds each.

Each plant is the stream model (kvref_model.sharing) with one of its rules
switched off (`kvref_model.sharing.variant`): the defect class the rule
prevents (specs/shared-pages.md, S17..).  The bounded checker
(kvref_model.sharing_check, at its default scope) must find every one, with a
counterexample trace, through the invariant named here; the model with every
rule passes the same scope (tests/model/test_sharing_model.py).  The kvref
plants of the same classes are the lockstep's to find, once KVManager
shares pages.
"""

from __future__ import annotations

import pytest

from kvref_model.sharing import RULES, SharingModel, variant
from kvref_model.sharing_check import SCOPE, check, show_trace

# rule switched off -> (the defect, where it was reported, the invariant that finds it)
PLANTS: dict[str, tuple[str, str, str]] = {
    "APPEND_COPIES_ON_WRITE": (
        "missing copy-on-write: an append writes into a shared or registered page",
        "issue 18", "Q7"),
    "FORK_COPIES_PART_PAGE": (
        "a fork shares the source's part page instead of copying it",
        "issue 18 (copy-on-write forks)", "Q8"),
    "TRUNCATE_CUTS_CHAIN": (
        "a truncate keeps the chain's keys past the cut: a later cache_prefix "
        "skips, or registers, pages under keys of tokens the stream no longer has",
        "vLLM PRs 18668/19006 (rejected draft tokens counted as cacheable)", "Q3"),
    "RESET_KEEPS_ONLY_PRIVATE": (
        "reset_request(free=False) keeps a shared or registered page as spare",
        "issue 18 (spare pages are written without a copy)", "Q4"),
    "RECLAIM_COUNTS_LAST_REFERENCE": (
        "reclaimable counts a page another request still holds",
        "SGLang 35270", "Q10"),
    "MATCH_NEEDS_EMPTY_STREAM": (
        "a prefix hit onto a stream that is not empty: its pages become spare while "
        "shared", "issue 18 (careless call)", "Q4"),
    "RESET_REFUSED_WHILE_OFFLOADED": (
        "reset_prefix_cache accepted while a stream is on the host: a reload brings "
        "its pre-reset KV back and cache_prefix keys it for the next match",
        "issue 27 (defect 3)", "Q12"),
}


def test_every_rule_is_planted() -> None:
    assert set(PLANTS) == set(RULES)


@pytest.mark.parametrize("rule", sorted(PLANTS))
def test_model_checker_finds_the_rule_removed(rule: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    _, anchor, invariant = PLANTS[rule]
    model: SharingModel = variant(rule)(SCOPE)
    rep = check(model)
    assert rep.violations, f"the model without {rule} broke no invariant"
    assert invariant in rep.violations, (rule, sorted(rep.violations))
    msg, trace = rep.violations[invariant]
    assert trace, "a counterexample is a trace from the first state"
    with capsys.disabled():
        print(f"\n  {rule} ({anchor}): {invariant} after {len(trace)} steps, "
              f"{rep.states} states: {msg}\n{show_trace(trace)}")
