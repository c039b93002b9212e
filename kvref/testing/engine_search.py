"""What every other engine's adapter does beside the model, written once.

`kvref.testing.vllm_pool` (vLLM's BlockPool), `kvref.testing.vllm_hybrid`
(vLLM's hybrid coordinator) and `kvref.testing.transformers_pool`
(transformers' paged cache) each play one engine's caller against one model.
They differ in the engine and the calls; the two ways they search are the
same, and live here:

- `run_lockstep`: a Hypothesis state machine under the CI budget, reporting
  the first disagreement's message rather than raising it;
- `explore`: every model state within a depth, breadth first, each call
  compared on an engine brought to the state by its trace.  Breadth first
  is what makes each finding's trace a shortest one.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

S = TypeVar("S")  # a model state (or world)
A = TypeVar("A")  # one call of the protocol
T = TypeVar("T")  # one step of a trace: the call, with what the model answered
D = TypeVar("D")  # a disagreement


class Unexpressible(Exception):
    """A model action the engine has no call for: skipped, not a disagreement."""


def budget(examples: int = 200, steps: int = 30) -> settings:
    """The CI budget: derandomized, no database, no shrinking."""
    return settings(max_examples=examples, stateful_step_count=steps, derandomize=True,
                    database=None, deadline=None, phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=list(HealthCheck), print_blob=False)


@dataclass
class LockstepReport:
    examples: int
    seconds: float
    failure: str | None  # the first disagreement's message


def run_lockstep(machine: type[RuleBasedStateMachine], cfg: settings) -> LockstepReport:
    """Run `machine` (whose class counts its `runs`) until it disagrees or the
    budget is spent."""
    t = time.perf_counter()
    failure = None
    try:
        run_state_machine_as_test(machine, settings=cfg)
    except AssertionError as err:
        failure = str(err).splitlines()[0] if str(err) else repr(err)
    return LockstepReport(machine.runs, time.perf_counter() - t, failure)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Agreed(Generic[S, T]):
    after: S
    step: T  # what the trace records of the call


@dataclass(frozen=True)
class Differed(Generic[D]):
    kind: str  # what the finding is filed under: one shortest trace per kind
    bad: D


class Report(Protocol[T, D]):
    """What `explore` counts into: each adapter's report adds its own table."""

    states: int
    edges: int  # calls compared
    unexpressible: int
    seconds: float
    findings: dict[str, tuple[list[T], D]]


def explore(rep: Report[T, D], start: S, depth: int, key: Callable[[S], Hashable],
            calls: Callable[[S], Iterable[A]],
            judge: Callable[[list[T], S, A], Agreed[S, T] | Differed[D]],
            first: bool = False) -> None:
    """Every state within `depth` calls of `start` (0: no bound), breadth first.
    `judge(trace, state, call)` brings a fresh engine to `state` by `trace`,
    makes the call on both sides and says whether they agreed; it raises
    `Unexpressible` for a call the engine lacks.  A state is entered only by a
    call both sides agreed on, so a finding's trace holds no other finding.
    `first`: stop at the first finding."""
    t = time.perf_counter()
    seen = {key(start)}
    frontier: deque[tuple[S, list[T]]] = deque([(start, [])])
    while frontier:
        s, trace = frontier.popleft()
        rep.states += 1
        if depth and len(trace) >= depth:
            continue
        for a in calls(s):
            try:
                got = judge(trace, s, a)
            except Unexpressible:
                rep.unexpressible += 1
                continue
            rep.edges += 1
            if isinstance(got, Differed):
                rep.findings.setdefault(got.kind, (trace, got.bad))
                if first:
                    frontier.clear()
                    break
                continue
            k = key(got.after)
            if k not in seen:
                seen.add(k)
                frontier.append((got.after, [*trace, got.step]))
    rep.seconds += time.perf_counter() - t
