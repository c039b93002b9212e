"""Exhaustive bounded model checking of kvref's stream lifecycle model.

Breadth-first over every state the engine protocol (kvref_model.protocol) can
reach in a bounded scope, one state per symmetry class (request ids, and
labels other than main, are interchangeable: kvref_model.symmetry).  Every
invariant is checked on every state and transition; the first violation
prints its shortest trace, readable and as a pytest test against kvref's
public API, and exits 1.  At the end a table shows the state count, the
per-action fire counts (an action that never fired is a coverage hole) and,
per invariant, whether its interesting case arose.

The search (kvref_model.search) keeps 64-bit fingerprints, not states, keeps the
frontier on disk, and spreads each level over worker processes; the counts
do not depend on the number of workers.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from kvref_model import invariants as inv
from kvref_model.core import ACTIONS, SHARING_ACTIONS, Action, Model, Result, Scope, State
from kvref_model.coverage import RuleTracer, rule_id, rule_order
from kvref_model.coverage import flags as rule_flags
from kvref_model.protocol import calls
from kvref_model.render import describe, lname, render, rname, show, to_pytest
from kvref_model.search import CheckpointMismatch, Report, Search, Spec, Trace, loads
from kvref_model.symmetry import Canonicaliser, symmetries

__all__ = [
    "Report", "Trace", "canonical", "describe", "explore", "lname", "main", "make_spec",
    "reachable", "render", "rname", "show", "symmetries", "table", "to_pytest",
]


# ------------------------------------------------------------ the spec


def _state_checks(m: Model, s: State) -> list[tuple[str, str]]:
    return inv.violations(m, s)


PlanKey = tuple[type, type, bool, tuple[bool, ...]]
Pred = Callable[[Model, State, Action, Result, State], Any]


class Observer:
    """What the search asks of every transition, at the cost of what can
    happen on it: the interesting cases of `inv.INTERESTING` (counted into
    the `counts` it is handed) and the checks of `inv.TRANSITION` (returned:
    the same as `inv.violations(m, n, a, r, prev, states=False)`, in the same
    order).  It calls only the predicates that can hold (an interesting case)
    or fail (a check) on the transition, as `kvref_model.invariants` states them:

    - those the action's type, the result's type and the state it leaves do
      not rule out (`ON_ACTIONS`, `ON_RESULTS`, `WHEN`; `INTERESTING_ON`,
      `INTERESTING_RESULTS`, `INTERESTING_WHEN`);
    - where the next state is the very object the transition left (every
      refusal and misuse, most no-ops): not the checks that hold there
      (`UNCHANGED_HOLDS`, `UNCHANGED_ON_ACTIONS`); those whose verdict there
      is the state's alone once per state (`UNCHANGED_STATE_ONLY`,
      `INTERESTING_UNCHANGED_STATE_ONLY`), the verdict serving the rest; no
      case that cannot hold there (`INTERESTING_CHANGED_ONLY`).

    A state's signature is its guards (`WHEN`, `INTERESTING_WHEN`) and the
    truth of the state-only cases; per signature and (action type, result
    type, unchanged) the plan of what to call is made once.  `stats()` says per check on how many
    transitions it ran since the last call: the report's account of what was
    skipped."""

    def __init__(self) -> None:
        # each guard once, whether a check's or a case's (they share them)
        self._guards = tuple(dict.fromkeys([*inv.WHEN.values(),
                                            *inv.INTERESTING_WHEN.values()]))
        self._cases = tuple((i, inv.INTERESTING[i][1])
                            for i in sorted(inv.INTERESTING_UNCHANGED_STATE_ONLY)
                            if i in inv.INTERESTING)
        # per (action type, result type, unchanged, guards): [interesting cases,
        # state-only ones, checks, transitions seen]
        self._plans: dict[PlanKey, list[Any]] = {}
        # per signature, then per (action type, result type, unchanged): the
        # plan and, where it calls nothing but state-only cases, those that hold
        self._by_signature: dict[tuple[tuple[bool, ...], tuple[bool, ...]],
                                 dict[tuple[type, type, bool],
                                      tuple[list[Any], tuple[str, ...] | None]]] = {}
        self._prev: State | None = None
        self._flags: tuple[bool, ...] = ()
        self._truth: dict[str, bool] = {}  # the state-only cases on `_prev`
        self._mine: dict[tuple[type, type, bool], tuple[list[Any], tuple[str, ...] | None]] = {}
        self._held: set[str] = set()  # state-only checks that held on `_prev`
        self._state_only_runs: dict[str, int] = {}

    def _plan(self, key: PlanKey) -> list[Any]:
        ta, tr, unchanged, flags = key
        false = {g for g, ok in zip(self._guards, flags, strict=True) if not ok}
        off = {i for i, g in inv.WHEN.items() if g in false}
        preds: list[tuple[str, Pred]] = []
        state_only: list[tuple[str, Pred]] = []
        for i, (_, pred) in inv.INTERESTING.items():
            if ((i in inv.INTERESTING_ON and not issubclass(ta, inv.INTERESTING_ON[i]))
                    or (i in inv.INTERESTING_RESULTS
                        and not issubclass(tr, inv.INTERESTING_RESULTS[i]))
                    or inv.INTERESTING_WHEN.get(i) in false):
                continue
            if unchanged and i in inv.INTERESTING_CHANGED_ONLY:
                continue
            if unchanged and i in inv.INTERESTING_UNCHANGED_STATE_ONLY:
                state_only.append((i, pred))
            else:
                preds.append((i, pred))
        checks: list[tuple[str, inv.StepPred, bool]] = []
        for i, f in inv.TRANSITION.items():
            if (i in off or (i in inv.ON_ACTIONS and not issubclass(ta, inv.ON_ACTIONS[i]))
                    or (i in inv.ON_RESULTS and not issubclass(tr, inv.ON_RESULTS[i]))):
                continue
            if unchanged and (i in inv.UNCHANGED_HOLDS or (
                    i in inv.UNCHANGED_ON_ACTIONS
                    and not issubclass(ta, inv.UNCHANGED_ON_ACTIONS[i]))):
                continue
            checks.append((i, f, unchanged and i in inv.UNCHANGED_STATE_ONLY))
        return [tuple(preds), tuple(state_only), tuple(checks), 0]

    def _enter(self, m: Model, prev: State, a: Action, r: Result) -> None:
        """A new state: its guards, its state-only cases (asked as of a
        transition that left it unchanged: any action and result will do)."""
        self._prev = prev
        self._flags = tuple([g(prev) for g in self._guards])
        truths = tuple([bool(p(m, prev, a, r, prev)) for _, p in self._cases])
        self._truth = {i: t for (i, _), t in zip(self._cases, truths, strict=True)}
        self._mine = self._by_signature.setdefault((self._flags, truths), {})
        self._held = set()

    def _short(self, short: tuple[type, type, bool]
               ) -> tuple[list[Any], tuple[str, ...] | None]:
        key = (*short, self._flags)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(key)
        rise = None
        if not plan[0] and not plan[2]:
            rise = tuple(i for i, _ in plan[1] if self._truth.get(i))
        self._mine[short] = got = (plan, rise)
        return got

    def __call__(self, m: Model, prev: State, a: Action, r: Result, n: State,
                 counts: Counter[str]) -> Sequence[tuple[str, str]]:
        if prev is not self._prev:  # held, so its id is not reused while compared
            self._enter(m, prev, a, r)
        short = (type(a), type(r), n is prev)
        mine = self._mine.get(short)
        if mine is None:
            mine = self._short(short)
        plan, rise = mine
        plan[3] += 1
        if rise is not None:  # nothing to call: the state-only cases that hold
            for i in rise:
                counts[i] += 1
            return ()
        for i, pred in plan[0]:
            if pred(m, prev, a, r, n):
                counts[i] += 1
        for i, _ in plan[1]:
            if self._truth[i]:
                counts[i] += 1
        out = []
        for i, f, state_only in plan[2]:
            if state_only:
                if i in self._held:
                    continue  # it held on this very state, whatever the action
                self._state_only_runs[i] = self._state_only_runs.get(i, 0) + 1
                msg = f(m, prev, a, r, n)
                if not msg:
                    self._held.add(i)
            else:
                msg = f(m, prev, a, r, n)
            if msg:
                out.append((i, msg))
        return out

    def stats(self) -> dict[str, int]:
        """Per transition check, the transitions it ran on (since the last call)."""
        out = dict.fromkeys(inv.TRANSITION, 0)
        for plan in self._plans.values():
            for i, _, state_only in plan[2]:
                if not state_only:
                    out[i] += plan[3]
            plan[3] = 0
        for i, k in self._state_only_runs.items():
            out[i] += k
        self._state_only_runs = {}
        return out


class RulesObserver:
    """An observer that also counts, per transition, the rules that fired
    (`kvref_model.coverage.RuleTracer`), as "rule:R71" in the interesting
    counts the search merges; each transition is stepped again once per rule
    flag it consults, so it is off unless asked (--rules)."""

    def __init__(self, base: Observer) -> None:
        self.base = base
        self.tracer: RuleTracer | None = None  # built where it runs (a worker)

    def __call__(self, m: Model, prev: State, a: Action, r: Result, n: State,
                 counts: Counter[str]) -> Sequence[tuple[str, str]]:
        out = self.base(m, prev, a, r, n, counts)
        if self.tracer is None:
            self.tracer = RuleTracer(type(m), m.scope)
        for flag in self.tracer.fired(prev, a, r, n):
            counts["rule:" + rule_id(flag)] += 1
        return out

    def stats(self) -> dict[str, int]:
        return self.base.stats()


def _transition_checks(m: Model, prev: State, a: Action, r: Result,
                       n: State) -> list[tuple[str, str]]:
    return inv.violations(m, n, a, r, prev, states=False)


def make_spec(model: Model, reduce: bool = True, rules: bool = False) -> Spec:
    """kvref's model, its protocol, I1-I22 and the symmetry, as a search spec;
    with ``rules``, the rules that fired are counted too (slower)."""
    canon = Canonicaliser(model.scope, reduce)
    base = Observer()
    observer: Observer | RulesObserver = RulesObserver(base) if rules else base
    return Spec(
        model=model, enabled=calls, state_checks=_state_checks,
        transition_checks=_transition_checks,
        interesting={i: pred for i, (_, pred) in inv.INTERESTING.items()},
        key=canon.key, depth=model.scope.depth,
        identity=f"{type(model).__qualname__} {model.scope} reduce={canon.reduce}"
        + (" rules" if rules else ""),
        observe=observer, check_stats=observer.stats,
    )


def canonical(s: State, scope: Scope) -> State:
    """The representative of `s`'s symmetry class (for tests and display)."""
    return Canonicaliser(scope).canonical(s)


def explore(model: Model, *, keep_going: bool = False, progress: bool = False,
            report: Report | None = None, traces: bool = True, workers: int = 1,
            reduce: bool = True, checkpoint: str | None = None,
            checkpoint_every: float = 60.0, resume: str | None = None,
            stop_after_chunks: int | None = None,
            states: bool = True, ray: str | None = None,
            rules: bool = False) -> Iterator[tuple[State | None, Trace]]:
    """BFS; yields each reachable (representative) state with its shortest
    trace (empty unless `traces`).  Violations land in `report`; without
    keep_going the search stops at the first one.  With `states` False every
    state comes as None: none is decoded, and the deepest level's are not even
    kept (faster).  With `ray` (a cluster's address; "" for `ray.init()`'s
    choice) the workers and the visited set are Ray actors
    (kvref_model.ray_search): the same states, counts and traces.  With
    `rules`, the report's interesting counts hold, as "rule:R71", how often
    each rule fired (`kvref_model.coverage`)."""
    search: Search
    if ray is not None:
        from kvref_model.ray_search import RaySearch
        search = RaySearch(functools.partial(make_spec, model, reduce, rules), address=ray,
                           workers=workers, keep_going=keep_going, progress=progress,
                           stop_after_chunks=stop_after_chunks, report=report,
                           want_states=states or traces)
    else:
        search = Search(make_spec(model, reduce, rules), workers=workers, keep_going=keep_going,
                        progress=progress, checkpoint=checkpoint,
                        checkpoint_every=checkpoint_every, resume=resume,
                        stop_after_chunks=stop_after_chunks, report=report,
                        want_states=states or traces)
    for sid, data in search.run():
        yield loads(data) if data and states else None, search.trace(sid) if traces else ()


def reachable(scope: Scope, model: type[Model] = Model) -> Iterator[tuple[State, Trace]]:
    """Every reachable state (one per symmetry class) with its shortest trace:
    what the bounded conformance layer replays on kvref."""
    for state, trace in explore(model(scope), keep_going=True):
        assert state is not None  # states=True decodes every level
        yield state, trace


# ------------------------------------------------------------ reports


def rule_rows(rep: Report, cls: type[Model]) -> list[str]:
    """Per rule of ``cls``, the transitions it fired on (a `--rules` run)."""
    ids = sorted({rule_id(f) for f in rule_flags(cls)}, key=rule_order)
    rows = ["", "rule      fired   (switched off alone, the transition differs)"]
    for rid in ids:
        n = rep.interesting["rule:" + rid]
        rows.append(f"  {rid:7} {n:>9}" + ("" if n else "   <-- never fired"))
    return rows


def table(rep: Report, scope: Scope, rules: type[Model] | None = None) -> str:
    rows = [
        f"scope: {scope}",
        f"states {rep.states}   transitions {rep.transitions}   depth {rep.depth}   "
        f"{rep.seconds:.1f}s   {rep.states / max(rep.seconds, 1e-9):.0f} states/s   "
        f"{rep.workers} worker(s)" + ("" if rep.complete else "   (stopped early)"),
        f"fingerprints: {rep.fingerprint_bits}-bit, odds that two states collided "
        f"<= {rep.collision_odds:.1e}; peak memory {rep.peak_rss / 2**20:.0f} MiB "
        f"(+ workers {rep.peak_rss_workers / 2**20:.0f} MiB)",
        "", "action             fired",
    ]
    for cls in actions_of(scope):
        n = rep.fired[cls.__name__]
        hole = "" if n else "   <-- COVERAGE HOLE: never fired"
        rows.append(f"  {cls.__name__:18} {n:>9}{hole}")
    rows += ["", "invariant  violated  interesting case (count)"]
    for i in inv.INVARIANT_IDS:
        if i in inv.NOT_IN_MODEL:
            rows.append(f"  {i:8} {'n/a':8}  {inv.NOT_IN_MODEL[i]}")
            continue
        if not inv.applies(i, scope):
            rows.append(f"  {i:8} {'n/a':8}  {inv.FEATURE[i]} is off in this scope")
            continue
        what, _ = inv.INTERESTING[i]
        n = rep.interesting[i]
        rows.append(f"  {i:8} {'YES' if i in rep.violations else 'no':8}  {what} ({n})"
                    + ("   <-- VACUOUS" if not n else ""))
    return "\n".join(rows + (rule_rows(rep, rules) if rules else []) + _skipped(rep))


def _skipped(rep: Report) -> list[str]:
    """What the fast path left out, said: every transition was stepped,
    counted, fired and had its interesting cases looked at; the state checks
    ran on every new state; a transition check was skipped only where
    `kvref_model.invariants` says it cannot fail (or, on a transition that changed
    nothing, where its verdict is the state's and was taken once already)."""
    if not rep.checks:
        return []
    t = max(rep.transitions, 1)
    rows = ["", f"transitions that changed nothing: {rep.unchanged} of {rep.transitions} "
            f"({100 * rep.unchanged / t:.0f}%: the state they left, no successor)",
            "transition check  ran on     skipped where it cannot fail (kvref_model.invariants)"]
    for i in inv.TRANSITION:
        n = rep.checks[i]
        rows.append(f"  {i:8} {n:>13} {rep.transitions - n:>13} ({100 * (t - n) / t:.0f}%)")
    return rows


def to_json(rep: Report, scope: Scope, model: str,
            rules: type[Model] | None = None) -> dict[str, Any]:
    """The report as data, for nightly jobs to keep and compare."""
    checked = [i for i in inv.INVARIANT_IDS if inv.applies(i, scope)]
    extra: dict[str, Any] = {}
    if rules is not None:
        ids = sorted({rule_id(f) for f in rule_flags(rules)}, key=rule_order)
        extra = {"rules": {r: rep.interesting["rule:" + r] for r in ids},
                 "never_fired": [r for r in ids if not rep.interesting["rule:" + r]]}
    return extra | {
        "model": model, "scope": vars(scope), "complete": rep.complete,
        "states": rep.states, "transitions": rep.transitions, "depth": rep.depth,
        "seconds": round(rep.seconds, 3),
        "states_per_second": round(rep.states / max(rep.seconds, 1e-9), 1),
        "workers": rep.workers, "peak_rss_bytes": rep.peak_rss,
        "peak_rss_workers_bytes": rep.peak_rss_workers,
        "fingerprint_bits": rep.fingerprint_bits, "collision_odds": rep.collision_odds,
        "fired": {c.__name__: rep.fired[c.__name__] for c in actions_of(scope)},
        "coverage_holes": [c.__name__ for c in actions_of(scope) if not rep.fired[c.__name__]],
        "interesting": {i: rep.interesting[i] for i in checked},
        "vacuous": [i for i in checked if not rep.interesting[i]],
        # transitions whose next state is the state they left; per transition
        # check, the transitions it ran on (skipped on the rest: it cannot fail there)
        "unchanged_transitions": rep.unchanged,
        "transition_checks_ran": {i: rep.checks[i] for i in inv.TRANSITION},
        "violations": {
            i: {"message": msg, "trace": [[describe(a), show(r)] for a, r in trace]}
            for i, (msg, trace) in sorted(rep.violations.items(), key=lambda x: int(x[0][1:]))
        },
    }


# ------------------------------------------------------------------ main


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # one line, no usage block: the cause is what the user needs
        self.exit(2, f"{self.prog}: error: {message}\n")


def _count(least: int) -> Any:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if v < least:
            raise argparse.ArgumentTypeError(f"{v} is below the least allowed, {least}")
        return v
    return parse


def actions_of(scope: Scope) -> tuple[type, ...]:
    """The actions the protocol issues in ``scope``: the prefix cache's only with sharing."""
    return ACTIONS if scope.sharing else tuple(a for a in ACTIONS if a not in SHARING_ACTIONS)


# the checker's default scope: kvref as it ships (sharing on), one windowed
# label with a rollback margin, pages of two tokens so a copy-on-write and a
# part page arise; about a minute on two cores (specs/stream-lifecycle.md)
CHECK_DEFAULT = Scope(requests=2, labels=2, device_pages=3, host_pages=1, page_size=2,
                      max_span=2, depth=7, sharing=True, windows=(None, 1), margins=(0, 1))


def _labels(text: str) -> tuple[int | None, ...]:
    try:
        return tuple(None if w.strip().lower() in ("", "none", "-") else int(w)
                     for w in text.split(",")) if text else ()
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated ints or None") from None


def add_scope_arguments(ap: argparse.ArgumentParser, d: Scope | None = None) -> None:
    """The scope options, defaulting to ``d``; `kvref.testing.exhaustive` takes
    the same ones, with its CI scope (kvref as it ships) as their defaults."""
    d = d or Scope()
    sc = ap.add_argument_group("scope (the bounds of the search)")
    sc.add_argument("--requests", type=_count(1), default=d.requests,
                    help="request ids the engine may use")
    sc.add_argument("--labels", type=_count(1), default=d.labels,
                    help="labels per request, main included")
    sc.add_argument("--device-pages", type=_count(1), default=d.device_pages,
                    help="usable device pages")
    sc.add_argument("--host-pages", type=_count(0), default=d.host_pages,
                    help="host (offload) pages")
    sc.add_argument("--page-size", type=_count(1), default=d.page_size, help="tokens per page")
    sc.add_argument("--max-span", type=_count(1), default=d.max_span,
                    help="most tokens one segment writes")
    sc.add_argument("--depth", type=_count(0), default=d.depth,
                    help="longest trace explored; 0: until no new state")
    sc.add_argument("--sharing", action=argparse.BooleanOptionalAction, default=d.sharing,
                    help="copy-on-write forks and the prefix cache (KVConfig's default: on)")
    sc.add_argument("--windows", type=_labels, default=d.windows, metavar="None,1",
                    help="each label's retention window W (None: full attention); empty: none")
    sc.add_argument("--margins", type=_labels, default=d.margins, metavar="0,1",
                    help="each label's rollback margin k; empty: 0 for all")
    sc.add_argument("--salts", default=",".join(d.salts), metavar="a,b",
                    help="each request's cache_salt; empty: one salt for all")
    sc.add_argument("--groups", type=_labels, default=d.groups, metavar="None,1",
                    help="hybrid model: each attention group's window (None: full "
                    "attention); empty: one full group")
    sc.add_argument("--window-cache", action=argparse.BooleanOptionalAction,
                    default=d.window_cache,
                    help="windowed streams key pages and hit (H2-H4); off: W9 and W10")
    sc.add_argument("--chunked", type=_labels, default=d.chunked, metavar="1",
                    help="hybrid model: the groups (indices into --groups) whose number is "
                    "a chunk C of chunked local attention, not a window W (H7)")


def scope_of(o: argparse.Namespace) -> Scope:
    """The scope the options of `add_scope_arguments` name."""
    return Scope(o.requests, o.labels, o.device_pages, o.host_pages, o.page_size, o.max_span,
                 o.depth, o.sharing, tuple(o.windows),
                 tuple(int(k or 0) for k in o.margins),
                 tuple(o.salts.split(",")) if o.salts else (), tuple(o.groups),
                 o.window_cache, chunked=tuple(int(g) for g in o.chunked))


def _parser() -> _Parser:
    ap = _Parser(prog="python -m kvref_model.check", description=__doc__.split("\n\n")[0],
                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_scope_arguments(ap, CHECK_DEFAULT)
    mo = ap.add_argument_group("model")
    mo.add_argument("--model", choices=("kvref", "reference"), default="kvref",
                    help="kvref's rules, or the reference manager's (specs/findings.md)")
    mo.add_argument("--without", default="", metavar="R2,R5",
                    help="kvref's model minus these rules of specs/rules.md; empty: none")
    se = ap.add_argument_group("search")
    se.add_argument("--workers", type=_count(1), default=os.cpu_count() or 1,
                    help="processes expanding each BFS level; the default is this machine's core "
                    "count (the counts found do not depend on it)")
    se.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                    help="run the workers and the visited set as actors on a Ray cluster "
                    "(pip install 'kvref[ray]'): ADDRESS, or with none RAY_ADDRESS or a local "
                    "Ray; --workers actors; no checkpoints")
    se.add_argument("--keep-going", action="store_true",
                    help="report the shortest violation of every invariant, not just the first")
    se.add_argument("--no-symmetry", action="store_true",
                    help="explore every state, not one per symmetry class")
    se.add_argument("--checkpoint", metavar="FILE", default=None,
                    help="write a checkpoint to FILE now and then; none if unset")
    se.add_argument("--checkpoint-every", type=_count(1), default=60, metavar="SECONDS",
                    help="how often --checkpoint writes")
    se.add_argument("--resume", metavar="FILE", default=None,
                    help="go on from a checkpoint of the same model, scope and options")
    out = ap.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", default=None,
                     help="also write the report as JSON to FILE ('-': stdout)")
    out.add_argument("--emit-traces", metavar="FILE", default=None,
                     help="one JSON line per reachable state: its shortest trace")
    out.add_argument("--rules", action="store_true",
                     help="also count the rules of specs/ that fired: those that, switched off "
                     "alone, change the transition (slower: a step per rule a step consults)")
    out.add_argument("--quiet", action="store_true",
                     help="no progress lines on stderr (states, states/s, depth, queue, memory)")
    return ap


def model_class(name: str, without: str) -> type[Model]:
    from kvref_model.reference import ReferenceModel
    from kvref_model.reference import without as ablate
    if without:
        return ablate(*[r.strip() for r in without.split(",")])
    return ReferenceModel if name == "reference" else Model


def _terminated(signum: int, frame: object) -> NoReturn:
    # unwind, so the search stops its worker processes and removes its files
    # (the last periodic checkpoint stays: --resume goes on from it)
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    if __name__ == "__main__" or sys.argv[0].endswith("kvref-model-check"):
        signal.signal(signal.SIGTERM, _terminated)
    ap = _parser()
    o = ap.parse_args(argv)
    scope = scope_of(o)
    try:
        cls = model_class(o.model, o.without)
    except ValueError as err:
        ap.error(f"--without: {err}")
    if o.resume and not os.path.exists(o.resume):
        ap.error(f"--resume: no such file {o.resume}")
    if o.ray is not None:
        if o.checkpoint or o.resume:
            ap.error("--ray: no --checkpoint or --resume on Ray (the visited set is the actors')")
        from kvref_model.ray_search import RayUnavailable, import_ray
        try:
            import_ray()
        except RayUnavailable as err:
            ap.error(f"--ray: {err}")
    rep = Report()
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(o.emit_traces, "w")) if o.emit_traces else None
        try:
            for _, trace in explore(cls(scope), keep_going=o.keep_going, progress=not o.quiet,
                                    report=rep, traces=out is not None, workers=o.workers,
                                    reduce=not o.no_symmetry, checkpoint=o.checkpoint,
                                    checkpoint_every=o.checkpoint_every, resume=o.resume,
                                    states=False, ray=o.ray, rules=o.rules):
                if out:
                    out.write(json.dumps([[describe(a), show(r)] for a, r in trace]) + "\n")
        except CheckpointMismatch as err:
            ap.error(f"--resume: {err}")
        except RuntimeError as err:
            if o.ray is None or type(err).__name__ != "RayUnavailable":
                raise
            ap.error(f"--ray: {err}")
    print(table(rep, scope, cls if o.rules else None))
    for i, (msg, trace) in sorted(rep.violations.items(), key=lambda x: int(x[0][1:])):
        print(f"\nVIOLATION {i}: {msg}\nshortest trace ({len(trace)} steps):\n{render(trace)}")
        if not o.keep_going:
            print("\nas a test against kvref:\n")
            print(to_pytest(trace, scope, f"test_{i.lower()}_counterexample"))
    if o.json:
        doc = json.dumps(to_json(rep, scope, cls.__name__, cls if o.rules else None), indent=1)
        if o.json == "-":
            print(doc)
        else:
            with open(o.json, "w") as f:
                f.write(doc + "\n")
    # the last line, for whoever reads only that; stderr when stdout is the JSON
    print(verdict(rep, scope), file=sys.stderr if o.json == "-" else sys.stdout)
    return 1 if rep.violations else 0


def verdict(rep: Report, scope: Scope | None = None) -> str:
    if rep.violations:
        ids = ", ".join(sorted(rep.violations))
        return f"CHECK FAILED: invariant {ids} violated (traces above)"
    scope = scope or Scope()
    vacuous = [i for i in inv.INVARIANT_IDS
               if inv.applies(i, scope) and not rep.interesting[i]]
    holes = [c.__name__ for c in actions_of(scope) if not rep.fired[c.__name__]]
    gaps = "".join([f"; never arose: {', '.join(vacuous)}" if vacuous else "",
                    f"; never fired: {', '.join(holes)}" if holes else "",
                    "" if rep.complete else "; stopped early"])
    return f"CHECK PASSED: {rep.states} states, no invariant violated{gaps}"


if __name__ == "__main__":
    sys.exit(main())
