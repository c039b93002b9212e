"""Which rules, invariants and actions a verification layer exercised.

TLC reports, per action, how often it fired and, per invariant, whether it
was checked on anything. kvref's layers (the checker, the lockstep, the
exhaustive replay, the scheduler harness) all step `kvref_model.core.Model`,
so one recorder serves them all. Per transition it counts:

- the action (its class name);
- each invariant whose *interesting case* holds (`invariants.INTERESTING`:
  the transition is one where the invariant checks something, e.g. I10 on a
  refused admit that could have reserved part of the step); an invariant
  whose case never holds was checked only vacuously;
- each rule that *fired*: a rule of specs/ (a `Model` flag such as
  `R71_lease_keeps_its_pages`) fires on a transition where the model with
  that one rule switched off gives another result or next state. A rule the
  step never consulted cannot have fired, so only the flags read while
  stepping are tried (each costs one more step of a variant model).

Recording is off unless a layer asks (`recording()`); the hook the layers
call (`note`) is then one global read.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvref_model import invariants as inv
from kvref_model.core import POOL_RULES, Action, Admit, Model, Refused, Result, Scope, State

FLAG = re.compile(r"^([RSWH]\d+[a-z]?)_[a-z_]+$")
# the rules Model states by construction, not by a flag it reads: its admit is
# atomic (R1) and refuses an offloaded stream first (R3); switched off, the
# reference's sequential admit runs (kvref_model.reference), which differs
# from Model's in more than the one rule, so each counts only where its own
# difference shows: R1 on a refusal whose state the sequential admit would
# change, R3 on a RequestOffloading refusal the sequential admit answers
# otherwise
BUILT_IN: dict[type, tuple[str, ...]] = {Admit: ("R1_atomic_admit", "R3_offloaded_refuses")}
_OFFLOADING = Refused("RequestOffloading")


def _differs(flag: str, r: Result, n: State, got: tuple[Result, State]) -> bool:
    if flag == "R1_atomic_admit":
        return isinstance(r, Refused) and got[1] != n
    if flag == "R3_offloaded_refuses":
        return r == _OFFLOADING and got[0] != r
    return got != (r, n)


def flags(cls: type[Model] = Model) -> tuple[str, ...]:
    """The rule flags of ``cls`` that are on: the rules that can fire."""
    names = {n for k in cls.__mro__ for n in vars(k) if FLAG.match(n)}
    return tuple(sorted(n for n in names if getattr(cls, n) is True))


def rule_id(flag: str) -> str:
    m = FLAG.match(flag)
    assert m is not None, flag
    return m.group(1)


def _traced(cls: type[Model], names: tuple[str, ...], reads: set[str]) -> type[Model]:
    """``cls`` whose rule flags (and the pool's, by their Model names) note
    every read into ``reads``."""
    def prop(name: str, value: bool) -> property:
        def get(self: object) -> bool:
            reads.add(name)
            return value
        return property(get)

    attrs: dict[str, Any] = {n: prop(n, getattr(cls, n)) for n in names}
    pool_attrs = {POOL_RULES[n]: n for n in names if n in POOL_RULES}
    model_init = cls.__init__

    def __init__(self: Model, scope: Scope) -> None:
        model_init(self, scope)
        pool_cls = type(self.pool)
        self.pool.__class__ = type("Traced" + pool_cls.__name__, (pool_cls,), {
            attr: prop(n, getattr(pool_cls, attr)) for attr, n in pool_attrs.items()})

    attrs["__init__"] = __init__
    return type("Traced" + cls.__name__, (cls,), attrs)


def _without(cls: type[Model], flag: str) -> type[Model]:
    if flag in BUILT_IN[Admit]:
        from kvref_model.reference import without
        return without(rule_id(flag))
    return type(f"Without_{flag}", (cls,), {flag: False})


class RuleTracer:
    """The rules of a model class that fire on given transitions."""

    def __init__(self, cls: type[Model], scope: Scope) -> None:
        self.cls, self.scope = cls, scope
        self.flags = flags(cls)
        self.reads: set[str] = set()
        self.model = _traced(cls, self.flags, self.reads)(scope)
        self._variants: dict[str, Model] = {}

    def fired(self, prev: State, a: Action, r: Result, n: State) -> list[str]:
        """The flags whose rule fired on ``prev --a--> (r, n)``."""
        self.reads.clear()
        self.model.step(prev, a)  # which flags this step consults
        tried = set(self.reads) | set(BUILT_IN.get(type(a), ()))
        out = []
        for flag in sorted(tried & set(self.flags)):
            v = self._variants.get(flag)
            if v is None:
                v = self._variants[flag] = _without(self.cls, flag)(self.scope)
            try:
                got = v.step(prev, a)
            except Exception:  # the variant broke down where the rule held it up
                out.append(flag)
                continue
            if _differs(flag, r, n, got):
                out.append(flag)
        return out


@dataclass
class Coverage:
    """What one layer exercised: per action, invariant and rule, a count."""

    layer: str
    actions: Counter[str] = field(default_factory=Counter)
    invariants: Counter[str] = field(default_factory=Counter)
    rules: Counter[str] = field(default_factory=Counter)
    transitions: int = 0
    scopes: list[Scope] = field(default_factory=list)
    rule_flags: set[str] = field(default_factory=set)  # the rules that could fire
    _tracers: dict[tuple[type, Scope], RuleTracer] = field(default_factory=dict, repr=False)

    def record(self, m: Model, prev: State, a: Action, r: Result, n: State) -> None:
        self.transitions += 1
        self.actions[type(a).__name__] += 1
        for i, (_, pred) in inv.INTERESTING.items():
            if pred(m, prev, a, r, n):
                self.invariants[i] += 1
        key = (type(m), m.scope)
        t = self._tracers.get(key)
        if t is None:
            t = self._tracers[key] = RuleTracer(type(m), m.scope)
            self.scopes.append(m.scope)
            self.rule_flags |= set(t.flags)
        for flag in t.fired(prev, a, r, n):
            self.rules[rule_id(flag)] += 1

    def merge(self, other: Coverage) -> None:
        self.actions.update(other.actions)
        self.invariants.update(other.invariants)
        self.rules.update(other.rules)
        self.transitions += other.transitions
        self.scopes += [s for s in other.scopes if s not in self.scopes]
        self.rule_flags |= other.rule_flags

    # --- the report

    def rule_ids(self) -> list[str]:
        return sorted({rule_id(f) for f in self.rule_flags}, key=rule_order)

    def table(self) -> str:
        from kvref_model.check import actions_of
        issued = sorted({c.__name__ for s in self.scopes for c in actions_of(s)})
        rows = [f"coverage of {self.layer}: {self.transitions} transitions over "
                f"{len(self.scopes)} scope(s)", "", "action              taken"]
        rows += [f"  {a:18} {self.actions[a]:>9}" + ("" if self.actions[a] else "   <-- never")
                 for a in issued]
        rows += ["", "invariant  arose   (its interesting case held)"]
        for i in inv.INVARIANT_IDS:
            if i in inv.NOT_IN_MODEL:
                rows.append(f"  {i:8} {'n/a':>7}  {inv.NOT_IN_MODEL[i]}")
                continue
            if not any(inv.applies(i, s) for s in self.scopes):
                rows.append(f"  {i:8} {'n/a':>7}  {inv.FEATURE[i]} is off in every scope")
                continue
            n = self.invariants[i]
            rows.append(f"  {i:8} {n:>7}  {inv.INTERESTING[i][0]}"
                        + ("" if n else "   <-- never arose"))
        rows += ["", "rule       fired   (switched off alone, the transition differs)"]
        for rid in self.rule_ids():
            n = self.rules[rid]
            rows.append(f"  {rid:8} {n:>7}" + ("" if n else "   <-- never fired"))
        return "\n".join(rows)

    def to_json(self) -> dict[str, Any]:
        applies = [i for i in inv.INVARIANT_IDS if any(inv.applies(i, s) for s in self.scopes)]
        return {
            "layer": self.layer, "transitions": self.transitions,
            "scopes": [vars(s) for s in self.scopes],
            "actions": dict(sorted(self.actions.items())),
            "invariants": {i: self.invariants[i] for i in applies},
            "never_arose": [i for i in applies if not self.invariants[i]],
            "rules": {r: self.rules[r] for r in self.rule_ids()},
            "never_fired": [r for r in self.rule_ids() if not self.rules[r]],
        }


def rule_order(rid: str) -> tuple[str, int, str]:
    m = re.match(r"([A-Z])(\d+)(.*)", rid)
    assert m is not None
    return m.group(1), int(m.group(2)), m.group(3)


# ------------------------------------------------------------ the layers' hook

_ACTIVE: list[Coverage] = []


def note(m: Model, prev: State, a: Action, r: Result, n: State) -> None:
    """A layer stepped the model: record it where a recording is on."""
    if _ACTIVE:
        _ACTIVE[-1].record(m, prev, a, r, n)


@contextlib.contextmanager
def recording(layer: str) -> Iterator[Coverage]:
    """Record every transition the layers `note` until the block ends."""
    cov = Coverage(layer)
    _ACTIVE.append(cov)
    try:
        yield cov
    finally:
        _ACTIVE.remove(cov)
