"""A bounded checker's ends: run a search to its report, and print the
report as a table (kvref_model.pages_check, the pool model's checker).
kvref_model.check, the one model's checker, prints its own."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvref_model.search import Report, Search, Spec


def run_check(spec: Spec, *, keep_going: bool = False, workers: int = 1) -> Report:
    """Search every reachable state; violations (with traces) land in the report."""
    rep = Report()
    for _ in Search(spec, keep_going=keep_going, report=rep, want_states=False,
                    workers=workers).run():
        pass
    return rep


def report_table(rep: Report, scope: object, actions: Iterable[type],
                 interesting: Iterable[str], invariants: Mapping[str, str],
                 show_trace: Callable[[Any], str]) -> str:
    """The scope, the counts, which action never fired, each interesting case,
    each invariant's verdict, and per violation its shortest trace."""
    cases = list(interesting)
    width = max((len(name) for name in cases), default=0)
    rows = [f"scope: {scope}",
            f"states {rep.states}   transitions {rep.transitions}   depth {rep.depth}   "
            f"{rep.seconds:.1f}s" + ("" if rep.complete else "   (stopped early)"),
            "", "action              fired"]
    for cls in actions:
        n = rep.fired[cls.__name__]
        rows.append(f"  {cls.__name__:18} {n:>8}" + ("" if n else "   <-- never fired"))
    rows += ["", f"  {'interesting case':{width}} {'count':>6}"]
    rows += [f"  {name:{width}} {rep.interesting[name]:>6}" for name in cases]
    rows += ["", "invariant  violated"]
    for iid, text in invariants.items():
        rows.append(f"  {iid:4} {'YES' if iid in rep.violations else 'no ':3}  {text}")
    for iid, (msg, trace) in rep.violations.items():
        rows += ["", f"{iid} violated: {msg}", "  shortest trace:", show_trace(trace)]
    return "\n".join(rows)
