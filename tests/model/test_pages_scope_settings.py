"""The pool model's scope settings for another engine's pool (issue 30,
docs/verification/vllm-block-pool.md): each off by default, keeping kvref's
rules; each on states one of vLLM's differences, and the checker still finds
no violation of the invariants that hold there."""

from __future__ import annotations

from dataclasses import replace

from kvref_model.pages import (
    Allocate,
    AllocationFailed,
    Count,
    Hit,
    Key,
    Match,
    Misuse,
    NumFree,
    Page,
    Pages,
    PagesModel,
    Register,
    Registered,
    Release,
    ResetPrefixCache,
    ResetRefused,
    Scope,
    State,
    Write,
)
from kvref_model.pages_check import SCOPE, calls, check

VLLM = replace(SCOPE, duplicates=True, blank_to_front=True, trusts_caller=True)


def run(m: PagesModel, *actions: object) -> tuple[list[object], State]:
    s, out = m.init(), []
    for a in actions:
        r, s = m.step(s, a)  # type: ignore[arg-type]
        out.append(r)
    return out, s


def two_pages_one_key(scope: Scope) -> tuple[list[object], State]:
    k = Key(None, (0,), ())
    return run(PagesModel(scope), Allocate(0, 1), Allocate(1, 1), Write(0, 1, k),
               Write(1, 2, k), Register(1, None, (0,)), Register(2, None, (0,)))


def test_the_defaults_are_kvrefs_rules() -> None:
    assert not (Scope().duplicates or Scope().blank_to_front or Scope().trusts_caller)
    got, s = two_pages_one_key(Scope())
    assert got[-1] == Registered(1)  # dedup: the page that had the key wins
    assert s.page(2).key is None and s.order == ()


def test_duplicates_keep_both_and_a_hit_takes_the_oldest() -> None:
    got, s = two_pages_one_key(replace(Scope(), duplicates=True))
    assert got[-1] == Registered(2) and s.page(1).key == s.page(2).key
    assert s.order == (1, 2) and s.index()[Key(None, (0,), ())] == 1
    m = PagesModel(replace(Scope(), duplicates=True))
    _, s = m.step(s, Release(0, (1,)))  # page 1 to the LRU, then evicted
    r, s = m.step(s, Allocate(0, 2))
    assert r == Pages((3, 1)) and s.order == (2,)
    r, _ = m.step(s, Match(0, (0, 0)))
    assert r == Hit((2,), 1)  # the surviving duplicate


def test_blank_pages_to_the_front_in_the_order_given() -> None:
    for front, want in ((False, (3, 2, 1)), (True, (2, 1, 3))):
        m = PagesModel(replace(Scope(), blank_to_front=front))
        _, s = run(m, Allocate(0, 2), Release(0, (2, 1)))
        assert s.blank == want, (front, s.blank)


def test_a_trusting_protocol_leaves_out_careless_calls_but_not_the_write_check() -> None:
    m = PagesModel(VLLM)
    _, s = run(m, Allocate(0, 1), Write(0, 1, Key(None, (0,), ())),
               Register(1, None, (0,)))
    trusted = list(calls(m, s))
    assert trusted and all(not isinstance(m.step(s, a)[0], Misuse) or isinstance(a, Write)
                           for a in trusted)
    assert not any(isinstance(a, Register) and a.page == 1 for a in trusted)  # a repeat
    checked = list(calls(PagesModel(SCOPE), s))
    assert any(isinstance(a, Release) and len(set(a.pages)) < len(a.pages) for a in checked)
    assert not any(isinstance(a, Release) and len(set(a.pages)) < len(a.pages)
                   for a in trusted)


def test_the_vllm_scope_checks_clean_and_the_default_search_is_unchanged() -> None:
    rep = check(PagesModel(replace(VLLM, depth=6)))
    assert rep.complete and not rep.violations and rep.states > 500
    default = check(PagesModel(SCOPE))
    assert (default.states, default.transitions) == (4652, 81416)


# transformers' continuous-batching cache (issue 43)
TRANSFORMERS = replace(SCOPE, holders=3, extras=((),), trusts_caller=True, dedup_adopts=True,
                       allocate_evicts=False, reset_while_held=True)


def test_dedup_adopts_swaps_the_holders_page_and_releases_its_own() -> None:
    k = Key(None, (0,), ())
    m = PagesModel(replace(SCOPE, dedup_adopts=True))
    got, s = run(m, Allocate(0, 1), Allocate(1, 1), Write(0, 1, k), Write(1, 2, k),
                 Register(1, None, (0,), (), 0), Register(2, None, (0,), (), 1))
    assert got[-1] == Registered(1) and s.tables == ((1,), (1,))
    assert s.page(1).holders == {0, 1} and s.page(2) == Page() and s.blank[-1] == 2
    # a holder that does not hold the page names nobody's table: refused
    _, s2 = run(m, Allocate(0, 1), Write(0, 1, k))
    assert m.step(s2, Register(1, None, (0,), (), 1))[0] == Misuse("PageRegisterError")


def test_without_allocate_evicts_cached_pages_are_not_free() -> None:
    k = Key(None, (0,), ())
    for evicts, want in ((True, Pages((2, 3, 1))), (False, AllocationFailed(1))):
        m = PagesModel(replace(SCOPE, allocate_evicts=evicts))
        _, s = run(m, Allocate(0, 1), Write(0, 1, k), Register(1, None, (0,)),
                   Release(0, (1,)))
        assert m.step(s, Allocate(0, 3))[0] == want
        assert m.step(s, NumFree())[0] == Count(3 if evicts else 2)


def test_reset_while_held_evicts_the_cached_pages_and_keeps_the_held_keys() -> None:
    k0, k1 = Key(None, (0,), ()), Key(None, (1,), ())
    for held_ok, want in ((False, ResetRefused(1)), (True, Count(1))):
        m = PagesModel(replace(SCOPE, reset_while_held=held_ok))
        _, s = run(m, Allocate(0, 1), Write(0, 1, k0), Register(1, None, (0,)),
                   Release(0, (1,)), Allocate(1, 1), Write(1, 2, k1), Register(2, None, (1,)))
        r, t = m.step(s, ResetPrefixCache())
        assert r == want
        if held_ok:
            assert t.lru == () and t.page(2).key is not None and 1 in t.blank


def test_the_transformers_scope_checks_clean() -> None:
    rep = check(PagesModel(replace(TRANSFORMERS, depth=6)))
    assert rep.complete and not rep.violations and rep.states > 300
    assert rep.fired.get("Register", 0) and any(
        isinstance(a, Register) and a.holder is not None
        for a in calls(PagesModel(TRANSFORMERS), run(
            PagesModel(TRANSFORMERS), Allocate(0, 1), Write(0, 1, Key(None, (0,), ())))[1]))
