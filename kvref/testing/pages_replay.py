"""The page-pool model's exhaustive replay against another engine's pool.

`kvref.testing.vllm_pool` and `kvref.testing.transformers_pool` each adapt one
engine's pool to the model's actions; what a disagreement is, how findings are
filed and tabled, and the replay itself are the same for both, and live here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from kvref.testing.engine_search import Agreed, Differed, LockstepReport, explore
from kvref_model import pages as M
from kvref_model.pages_check import Canon, calls, show, show_trace
from kvref_model.pages_invariants import INTERESTING

Trace = list[tuple[M.Action, M.Result]]  # each call, with what the model answered
P = TypeVar("P")  # an engine's pool, brought to a state


@dataclass(frozen=True)
class Disagreement:
    action: M.Action
    want: M.Result
    got: str  # the engine's result, or the exception it raised
    detail: str
    engine: str = "vLLM"  # kvref.testing.transformers_pool files its own under this

    def __str__(self) -> str:
        return (f"{show(self.action)}: {self.engine} {self.got}, model {show(self.want)}"
                + (f" ({self.detail})" if self.detail else ""))


@dataclass
class ReplayReport:
    scope: M.Scope
    states: int = 0
    edges: int = 0  # transitions compared
    unexpressible: int = 0
    seconds: float = 0.0
    interesting: Counter[str] = field(default_factory=Counter)  # agreed edges
    # the shortest trace to a disagreement, per action kind
    findings: dict[str, tuple[list[tuple[M.Action, M.Result]], Disagreement]] = field(
        default_factory=dict)

    def table(self) -> str:
        lines = [f"scope: {self.scope}",
                 f"states {self.states}   transitions compared {self.edges}   "
                 f"unexpressible {self.unexpressible}   {self.seconds:.1f}s",
                 "interesting cases: " + ", ".join(
                     f"{k} {self.interesting[k]}" for k in INTERESTING)]
        if not self.findings:
            lines.append("disagreements: none")
        for kind, (trace, bad) in sorted(self.findings.items()):
            lines.append(f"disagreement on {kind}, shortest trace:")
            lines.append(show_trace(tuple(trace)) if trace else "    (the initial state)")
            lines.append(f"    {len(trace) + 1}. {bad}")
        return "\n".join(lines)


def kind_of(s: M.State, a: M.Action, want: M.Result) -> str:
    """What a disagreement is filed under: the action, and a careless call's kind."""
    kind = type(a).__name__
    if isinstance(a, M.Register) and s.page(a.page).key is not None:
        return kind + (", a repeat" if isinstance(want, M.Registered)
                       else ", other tokens for a cached page")
    if not isinstance(want, M.Misuse):
        return kind
    pages: tuple[int, ...] = getattr(a, "pages", ())
    if len(set(pages)) != len(pages):
        why = "a page twice in one list"
    elif isinstance(a, M.Release | M.Share) and any(not s.page(p).holders for p in pages):
        why = "a free page"
    elif isinstance(a, M.Release):
        why = "a page it does not hold"
    elif isinstance(a, M.Take) and any(s.page(p).key is None for p in pages):
        why = "a page no key names"
    elif isinstance(a, M.Share | M.Match | M.Take):
        why = "a page it holds already"
    elif isinstance(a, M.Allocate):
        why = "a negative count"
    else:
        why = "refused by the model"
    return f"{kind}, {why}"



def replay_pages(scope: M.Scope, bring: Callable[[Trace], P],
                 compare: Callable[[M.PagesModel, M.State, M.Action, P],
                                   tuple[M.State, Disagreement | None]],
                 first: bool = False) -> ReplayReport:
    """Every state the model reaches within `scope.depth` calls of its protocol,
    breadth first (see `engine_search.explore`): each call compared, by
    `compare`, on the pool `bring` leaves at the end of the state's trace."""
    model, rep = M.PagesModel(scope), ReplayReport(scope)

    def judge(trace: Trace, s: M.State, a: M.Action
              ) -> Agreed[M.State, tuple[M.Action, M.Result]] | Differed[Disagreement]:
        after, bad = compare(model, s, a, bring(trace))
        if bad is not None:
            return Differed(kind_of(s, a, bad.want), bad)
        want = model.step(s, a)[0]
        rep.interesting.update(name for name, pred in INTERESTING.items()
                               if pred(model, s, a, want, after))
        return Agreed(after, (a, want))

    explore(rep, model.init(), scope.depth, Canon(scope), lambda s: calls(model, s), judge,
            first)
    return rep


# ------------------------------------------------------------------ CLI lines


def print_clean_run(differences: tuple[tuple[str, str], ...], lock: LockstepReport,
                    rep: ReplayReport) -> bool:
    """The differences the scope states, then the clean run; True if it disagreed."""
    print("differences, as scope settings of the model:")
    print("\n".join(f"  Scope.{name}: {what}" for name, what in differences))
    print(f"lockstep: {lock.examples} examples, {lock.seconds:.1f}s: "
          + ("no disagreement" if lock.failure is None else lock.failure))
    print("exhaustive replay:\n" + rep.table())
    return lock.failure is not None or bool(rep.findings)


def print_plant(title: str, lock: LockstepReport, short: ReplayReport) -> bool:
    """What found a planted defect; True if either layer missed it."""
    found = lock.failure is not None
    print(f"plant {title}: lockstep "
          + (f"found it at example {lock.examples}, {lock.seconds:.1f}s: {lock.failure}"
             if found else "NOT FOUND"))
    # the table's first three lines are the scope and the counts
    print("  replay: " + ("\n".join(short.table().splitlines()[3:])
                          if short.findings else "NOT FOUND"))
    return not found or not short.findings
