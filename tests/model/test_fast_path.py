"""The checker's fast path (issue 17, part 3) answers as the plain one does.

`kvref_model.check.Observer` calls a transition check or an interesting case only
where `kvref_model.invariants` says it can fail or hold (ON_ACTIONS, ON_RESULTS,
WHEN, UNCHANGED_*, INTERESTING_*).  Here those limits are held to account
twice: every transition of small scopes, of kvref's model, the reference's,
every rule switched off and the planted mutants, gets the same checks and
cases as `inv.violations` and every INTERESTING predicate give; and each
predicate is called outside its limits on pairs of states no transition
joins, with actions and results of every type, and must say nothing there.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import Counter
from collections.abc import Iterator

import pytest

from kvref_model import core
from kvref_model import invariants as inv
from kvref_model.check import Observer, make_spec
from kvref_model.core import (
    Admit,
    Claimed,
    Commit,
    Fault,
    Flag,
    Freed,
    Ingest,
    Latched,
    Misuse,
    Model,
    NotReady,
    Ok,
    Plan,
    Publish,
    Published,
    Refused,
    Result,
    Scope,
    Seg,
    State,
    Step,
    Stream,
    Write,
)
from kvref_model.protocol import calls
from kvref_model.reference import ReferenceModel, without
from kvref_model.search import Report, Search, dumps, loads
from kvref_model.symmetry import Canonicaliser

from .test_mutations import AbandonKeepsHostCopy, ClaimIgnoresMarks, ClearForgetsForkUndo

SMALL = Scope(requests=2, labels=2, device_pages=2, host_pages=1, page_size=1, max_span=1,
              depth=3)
RULES = sorted(n.split("_")[0] for n in vars(Model) if n[:1] == "R" and n[1].isdigit())
MODELS: list[type[Model]] = [Model, ReferenceModel, ClaimIgnoresMarks, AbandonKeepsHostCopy,
                             ClearForgetsForkUndo, *(without(r) for r in RULES)]
RESULTS: list[Result] = [
    Ok(), NotReady(), Refused("AllocationFailed", 1), Refused("AdmitRuntimeError"),
    Refused("PublishLeased"), Refused("ForkPending"), Misuse("StepInFlightError"),
    Fault("ForkCopyError"), Fault("OffloadCopyError"), Freed(0), Freed(1), Flag(True),
    Flag(False), Claimed(()), Claimed((0,)), Published(((0, 1),)), Latched("RetrieveStale"),
]


def states(m: Model, depth: int) -> list[State]:
    """Every state within `depth` calls, unreduced, in BFS order."""
    seen, frontier = {m.init(): None}, [m.init()]
    for _ in range(depth):
        nxt = []
        for s in frontier:
            for a in calls(m, s):
                n = m.step(s, a)[1]
                if n not in seen:
                    seen[n] = None
                    nxt.append(n)
        frontier = nxt
    return list(seen)


def transitions(m: Model, depth: int) -> Iterator[tuple[State, object, Result, State]]:
    for s in states(m, depth - 1):
        for a in calls(m, s):
            r, n = m.step(s, a)
            yield s, a, r, n


@pytest.mark.parametrize("cls", MODELS, ids=lambda c: c.__name__)
def test_the_observer_gives_the_plain_checks_and_cases_on_every_transition(
        cls: type[Model]) -> None:
    m = cls(SMALL)
    obs = Observer()
    everything = list(transitions(m, SMALL.depth))
    # in order (the observer keeps what it learnt of the state it was last
    # handed), then shuffled (each state handed again and again, in between)
    order = everything + random.Random(0).sample(everything, min(len(everything), 3000))
    for s, a, r, n in order:
        counts: Counter[str] = Counter()
        got = obs(m, s, a, r, n, counts)  # type: ignore[arg-type]
        assert list(got) == inv.violations(m, n, a, r, s, states=False), (s, a, r)  # type: ignore[arg-type]
        want = {i for i, (_, p) in inv.INTERESTING.items() if p(m, s, a, r, n)}  # type: ignore[arg-type]
        assert counts == dict.fromkeys(want, 1), (s, a, r)
    ran = obs.stats()
    assert set(ran) == set(inv.TRANSITION)
    assert all(0 <= k <= len(order) for k in ran.values())


# a request leased while it holds pages: past the depth-3 scopes above, so
# I18's case (and the state guard the observer skips it by) never arises there
LEASED = (Ingest(0), Admit(Step((Seg(0, 0, 1),), padded=(0,))), Plan(), Write(), Commit(),
          Publish(0))


def test_the_observer_counts_the_cases_of_a_leased_request() -> None:
    m = Model(SMALL)
    s = m.init()
    for a in LEASED:
        s = m.step(s, a)[1]
    assert s.leases and any(v.pages for _, v in s.streams)
    obs = Observer()
    held: Counter[str] = Counter()
    # the leased state and every state one call away (a preplan staged over
    # it, the lease released, ...), each call out of them
    for t in dict.fromkeys([s, *(m.step(s, a)[1] for a in calls(m, s))]):
        for a in calls(m, t):
            r, n = m.step(t, a)
            counts: Counter[str] = Counter()
            got = obs(m, t, a, r, n, counts)
            assert list(got) == inv.violations(m, n, a, r, t, states=False), (t, a, r)
            want = {i for i, (_, p) in inv.INTERESTING.items() if p(m, t, a, r, n)}
            assert counts == dict.fromkeys(want, 1), (t, a, r)
            held.update(want)
    assert held["I18"]  # the guarded case arose: its guard was tried


def test_the_reference_breaks_checks_the_observer_sees() -> None:
    # the comparison above must have violations to compare
    m = ReferenceModel(SMALL)
    assert any(inv.violations(m, n, a, r, s, states=False)  # type: ignore[arg-type]
               for s, a, r, n in transitions(m, SMALL.depth))


def _sample() -> tuple[Model, list[State], list[object]]:
    m = Model(SMALL)
    pool = states(m, 3) + states(ReferenceModel(SMALL), 3)
    actions = {a for s in pool[::7] for a in calls(m, s)}
    return m, pool, sorted(actions, key=repr)


def _excluded(i: str, a: object, r: Result, s: State, n: State, table: dict[str, tuple[type, ...]],
              results: dict[str, tuple[type, ...]]) -> bool:
    return ((i in table and not isinstance(a, table[i]))
            or (i in results and not isinstance(r, results[i])))


def test_checks_say_nothing_outside_their_limits() -> None:
    m, pool, actions = _sample()
    rng = random.Random(1)
    assert set(inv.ON_ACTIONS) | set(inv.ON_RESULTS) | set(inv.WHEN) <= set(inv.TRANSITION)
    for i, f in inv.TRANSITION.items():
        tried = 0
        for _ in range(4000):
            s, n = rng.choice(pool), rng.choice(pool)
            a, r = rng.choice(actions), rng.choice(RESULTS)
            if i in inv.WHEN and not inv.WHEN[i](s):
                pass  # any transition out of s
            elif not _excluded(i, a, r, s, n, inv.ON_ACTIONS, inv.ON_RESULTS):
                continue
            tried += 1
            assert f(m, s, a, r, n) is None, (i, s, a, r, n)  # type: ignore[arg-type]
        assert tried or not ({i} & (set(inv.ON_ACTIONS) | set(inv.ON_RESULTS) | set(inv.WHEN)))


def test_checks_on_an_unchanged_state_say_what_their_tables_say() -> None:
    m, pool, actions = _sample()
    assert inv.UNCHANGED_HOLDS | set(inv.UNCHANGED_ON_ACTIONS) | inv.UNCHANGED_STATE_ONLY \
        <= set(inv.TRANSITION)
    limited = inv.UNCHANGED_HOLDS | set(inv.UNCHANGED_ON_ACTIONS) | inv.UNCHANGED_STATE_ONLY
    pairs = list(itertools.product(actions, RESULTS))
    rng = random.Random(3)
    for s in pool:
        tried = rng.sample(pairs, 120)
        for i, f in inv.TRANSITION.items():
            if i not in limited:
                continue  # the others run on every such transition
            verdicts = set()
            for a, r in tried:
                msg = f(m, s, a, r, s)  # type: ignore[arg-type]
                if i in inv.UNCHANGED_HOLDS or (
                        i in inv.UNCHANGED_ON_ACTIONS
                        and not isinstance(a, inv.UNCHANGED_ON_ACTIONS[i])):
                    assert msg is None, (i, s, a, r)
                verdicts.add(msg is None)
            if i in inv.UNCHANGED_STATE_ONLY:
                assert len(verdicts) == 1, (i, s)


def test_interesting_cases_hold_only_inside_their_limits() -> None:
    m, pool, actions = _sample()
    rng = random.Random(2)
    for i, (_, p) in inv.INTERESTING.items():
        for _ in range(4000):
            s, n = rng.choice(pool), rng.choice(pool)
            a, r = rng.choice(actions), rng.choice(RESULTS)
            if _excluded(i, a, r, s, n, inv.INTERESTING_ON, inv.INTERESTING_RESULTS) or (
                    i in inv.INTERESTING_WHEN and not inv.INTERESTING_WHEN[i](s)):
                assert not p(m, s, a, r, n), (i, s, a, r, n)  # type: ignore[arg-type]
    pairs = list(itertools.product(actions, RESULTS))
    for s in pool:
        for i in inv.INTERESTING_CHANGED_ONLY:
            _, p = inv.INTERESTING[i]
            assert not any(p(m, s, a, r, s)  # type: ignore[arg-type]
                           for a, r in rng.sample(pairs, 60)), (i, s)
        for i in inv.INTERESTING_UNCHANGED_STATE_ONLY:
            _, p = inv.INTERESTING[i]
            assert len({bool(p(m, s, a, r, s))  # type: ignore[arg-type]
                        for a, r in rng.sample(pairs, 60)}) == 1, (i, s)


def summary(rep: Report) -> tuple[object, ...]:
    return (rep.states, rep.transitions, rep.depth, dict(rep.fired), dict(rep.interesting),
            rep.violations, rep.complete)


@pytest.mark.parametrize("cls", [Model, ReferenceModel, without("R38")],
                         ids=lambda c: c.__name__)
def test_the_search_finds_the_same_with_and_without_the_fast_path(cls: type[Model]) -> None:
    scope = dataclasses.replace(SMALL, depth=4)
    fast, plain = Report(), Report()
    spec = make_spec(cls(scope))
    for _ in Search(spec, keep_going=True, report=fast).run():
        pass
    for _ in Search(dataclasses.replace(spec, observe=None, check_stats=None), keep_going=True,
                    report=plain).run():
        pass
    assert summary(fast) == summary(plain) and fast.transitions > 1000
    # what the fast path skipped is counted, and only it
    assert 0 < fast.unchanged < fast.transitions and set(fast.checks) == set(inv.TRANSITION)
    assert not plain.checks


def test_the_model_returns_the_state_itself_for_most_calls() -> None:
    # the fast path pays off only if refusals, misuses and no-ops hand back
    # the very state object (an equal copy would be compared and hashed)
    m = Model(SMALL)
    outcomes = Counter(n is s for s, _, _, n in transitions(m, SMALL.depth))
    assert outcomes[True] > 3 * outcomes[False]


def test_replace_is_dataclasses_replace() -> None:
    s = State(free=2, streams=(((0, 0), Stream(pages=1, stored_len=1, contents=(0,))),))
    hash(s)  # cached in its __dict__: a copy must not inherit it
    for changes in ({}, {"free": 1}, {"leases": (0,), "free": 0}):
        got, want = core.replace(s, **changes), dataclasses.replace(s, **changes)
        assert got == want and type(got) is State and "_hash" not in got.__dict__
        assert hash(got) == hash(want)
    v = Stream(pages=1)
    assert core.replace(v, in_flight=True) == Stream(pages=1, in_flight=True)
    with pytest.raises(TypeError):
        core.replace(s, nope=1)


def test_states_travel_whole_and_without_their_cached_hash() -> None:
    m = Model(SMALL)
    for s in states(m, 3)[::11]:
        hash(s)
        back = loads(dumps(s))
        assert back == s and "_hash" not in back.__dict__ and type(back) is State


def test_the_key_is_a_function_of_the_value_alone() -> None:
    # the same string, once interned (a literal) and once built: equal states,
    # one key (marshal's later formats would write them differently)
    built = "".join(["clai", "med"])
    assert built == core.CLAIMED and built is not core.CLAIMED
    a = State(free=1, streams=(((0, 0), Stream(pages=1, offload=core.CLAIMED)),))
    b = State(free=1, streams=(((0, 0), Stream(pages=1, offload=built)),))
    c = Canonicaliser(SMALL)
    assert a == b and c.key(a) == c.key(b)
    assert c.key(a) != c.key(dataclasses.replace(a, free=0))



def test_the_report_says_what_was_skipped(capsys: pytest.CaptureFixture[str],
                                          tmp_path: object) -> None:
    from kvref_model.check import main
    out_json = f"{tmp_path}/r.json"
    assert main(["--depth", "3", "--quiet", "--workers", "1", "--json", out_json]) == 0
    out = capsys.readouterr().out
    assert "transitions that changed nothing:" in out and "skipped where it cannot fail" in out
    import json
    with open(out_json) as f:
        doc = json.load(f)
    assert 0 < doc["unchanged_transitions"] < doc["transitions"]
    ran = doc["transition_checks_ran"]
    assert set(ran) == set(inv.TRANSITION)
    assert all(0 <= k <= doc["transitions"] for k in ran.values())
    # every refusal of kvref's model hands back the state itself: I10 has
    # nothing to check (it runs where a refusal builds a new state, below)
    assert ran["I10"] == 0


def test_a_refusal_that_changes_the_state_is_still_caught() -> None:
    # the reference's admit keeps what it reserved before a refusal (R1 off)
    scope = Scope(requests=1, labels=2, device_pages=3, host_pages=1, page_size=1,
                  max_span=1, depth=3)
    rep = Report()
    for _ in Search(make_spec(ReferenceModel(scope)), keep_going=True, report=rep).run():
        pass
    assert "I10" in rep.violations and rep.checks["I10"] > 0
