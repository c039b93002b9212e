"""Bounded exhaustive conformance: every reachable model state, every call, on kvref.

For each state the model checker reaches in a scope (one per symmetry
class), a fresh manager replays the state's shortest trace, then each call
of the total protocol (`kvref_model.protocol.calls`: careless calls and injected
faults included) is tried once more on a fresh replay. Results,
abstract states, page ownership and bytes are compared after every action,
as in the Hypothesis lockstep suite; the difference is coverage: nothing here
is sampled.

Run by ``tests/conformance/test_exhaustive.py`` (CI scope) and by
``python -m kvref.testing.exhaustive`` (any scope, the options of
``python -m kvref_model.check``; by default `CI_SCOPE`, kvref as it
ships). The entry point lives here, on kvref's side: the model and its
checker import nothing of kvref.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

from kvref.testing import trace as trace_file
from kvref.testing.driver import Driver, DriverConfig
from kvref_model import core as m
from kvref_model import coverage
from kvref_model.check import add_scope_arguments, reachable, scope_of
from kvref_model.protocol import calls

# small enough for CI (every call of the total protocol in every state is a
# fresh replay); `python -m kvref.testing.exhaustive` takes any scope. kvref
# as it ships: the prefix cache on (one salt: the two requests share), and a
# windowed label with a rollback margin (its W5, W9, W10 answers; a window
# releasing pages needs more tokens than depth 3 commits, which the lockstep
# reaches)
CI_SCOPE = m.Scope(requests=2, labels=2, device_pages=2, host_pages=1, page_size=1,
                   max_span=1, depth=3, sharing=True, windows=(None, 1), margins=(0, 1))
# the second configuration: the prefix cache off, no window
PLAIN_CI_SCOPE = m.Scope(requests=2, labels=2, device_pages=2, host_pages=1, page_size=1,
                         max_span=1, depth=3)
# a hybrid model (issue 40): one full group and one window group (W = 1),
# the window group keying and hitting (H2-H4); depth 2 in CI (a few
# seconds), `HYBRID_NIGHTLY_SCOPE` at depth 3 in the nightly run
HYBRID_CI_SCOPE = m.Scope(requests=2, labels=1, device_pages=3, host_pages=1, page_size=1,
                          max_span=2, depth=2, sharing=True, groups=(None, 1),
                          window_cache=True)
HYBRID_NIGHTLY_SCOPE = m.Scope(requests=2, labels=1, device_pages=3, host_pages=1,
                               page_size=1, max_span=2, depth=3, sharing=True,
                               groups=(None, 1), window_cache=True)


@dataclass
class Outcome:
    states: int = 0
    transitions: int = 0
    actions_run: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)


class Mismatch(AssertionError):
    pass


def run_trace(model: m.Model, actions: list[m.Action], config: DriverConfig,
              note_from: int = 0) -> None:
    """Replay ``actions`` on the model and a fresh kvref together, checking each
    step; the calls from ``note_from`` on are noted for coverage (a replayed
    prefix was counted where it was first checked)."""
    s = model.init()
    d = Driver(model.scope, config)
    before = d.observe()
    for i, a in enumerate(actions):
        want, nxt = model.step(s, a)
        if i >= note_from:
            coverage.note(model, s, a, want, nxt)
        got = d.apply(a, s)
        prev, s = s, nxt
        if got != want:
            raise Mismatch(f"step {i} {a}: kvref {got}, model {want}")
        seen = d.observe()  # one snapshot for every check after this call
        got_state = d.abstract(s, seen)
        if got_state != m.project(s):  # the model's page ids: not read back
            raise Mismatch(f"step {i} {a}: states differ\n  kvref {got_state}\n  model {s}")
        wrong = d.check_publication(s, seen)
        if wrong is not None:
            raise Mismatch(f"step {i} {a}: {wrong}")
        try:
            d.check_pages(seen)
            d.check_observed(s, seen)
            d.check_page_map(s, seen)
            d.check_free_order(prev, before, s, seen, a)
            before = seen
            d.check_host_lengths(s, seen)
            d.check_bytes(s)
            d.check_queries(s)
        except Mismatch:
            raise
        except AssertionError as err:  # a check on the state: kvref and the model differ
            raise Mismatch(f"step {i} {a}: {err}") from err


def check_scope(scope: m.Scope, config: DriverConfig | None = None,
                progress: bool = False, max_failures: int = 5) -> Outcome:
    config = config or DriverConfig()
    model = m.Model(scope)
    out = Outcome()
    t0 = last = time.monotonic()
    for state, trace in reachable(scope):
        prefix = [a for a, _ in trace]
        out.states += 1
        for a in calls(model, state):
            out.transitions += 1
            try:
                run_trace(model, [*prefix, a], config, note_from=len(prefix))
            except Exception as err:  # a crash on kvref's side is a mismatch too
                path = trace_file.keep(err, functools.partial(
                    trace_file.build, "exhaustive", scope, [*prefix, a], err, config))
                out.failures.append(f"after {len(prefix)} steps {prefix} then {a}: "
                                    f"{type(err).__name__}: {err} (trace: {path})")
                if len(out.failures) >= max_failures:
                    out.seconds = time.monotonic() - t0
                    return out
            out.actions_run += len(prefix) + 1
        if progress and time.monotonic() - last > 5:
            last = time.monotonic()
            print(f"  conformance: {out.states} states, {out.transitions} transitions, "
                  f"{out.actions_run / (last - t0):.0f} actions/s", file=sys.stderr)
    out.seconds = time.monotonic() - t0
    return out


def summary(out: Outcome) -> str:
    rate = out.actions_run / max(out.seconds, 1e-9)
    return (f"exhaustive conformance: {out.states} states, {out.transitions} transitions "
            f"replayed ({out.actions_run} kvref actions, {rate:.0f}/s) in {out.seconds:.1f}s, "
            f"{len(out.failures)} mismatches")


def main(argv: list[str] | None = None) -> int:
    """Replay a scope; the last line is the verdict, the exit status 1 on a mismatch."""
    ap = argparse.ArgumentParser(
        prog="python -m kvref.testing.exhaustive", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_scope_arguments(ap, CI_SCOPE)  # kvref as it ships; sharing off is --no-sharing
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ap.add_argument("--coverage", action="store_true",
                    help="also report the actions, invariants and rules the replay exercised "
                    "(kvref_model.coverage; slower)")
    o = ap.parse_args(argv)
    scope = scope_of(o)
    given = {a.split("=", 1)[0] for a in (sys.argv[1:] if argv is None else argv)}
    if scope.groups:
        # a hybrid scope's windows are its groups' (`--groups`): the shipped
        # scope's label windows and margins are not its defaults
        scope = replace(scope, windows=scope.windows if "--windows" in given else (),
                        margins=scope.margins if "--margins" in given else ())
    with coverage.recording("the exhaustive replay") if o.coverage else nullcontext() as cov:
        result = check_scope(scope, progress=not o.quiet)
    if cov is not None:
        print(cov.table())
    print(summary(result))
    for failure in result.failures:
        print("MISMATCH", failure)
    print(f"CONFORMANCE FAILED: {len(result.failures)} mismatches" if result.failures
          else "CONFORMANCE PASSED: kvref agreed with the model on every call")
    return 1 if result.failures else 0


if __name__ == "__main__":
    sys.exit(main())
