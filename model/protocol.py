"""Which calls the checkers issue in a state.

The model is total: every call of the manager's API has a result in every
state (ok, a typed refusal, a misuse that changes nothing, or an injected
fault), so `calls` issues all of them, careless ones included. `enabled` is
the subset a careful engine issues: what the engine-like rules of the
lockstep suite and the concurrency programs draw from. Only the
environment's events (a retrieve completing) have preconditions.
Bounds come from the `Scope`.
"""

from __future__ import annotations

from collections.abc import Iterator

from model.core import (
    ADMITTED,
    CLAIMED,
    IDLE,
    OFFLOADED,
    PENDING,
    PLANNED,
    RESIDENT,
    WRITTEN,
    Action,
    Admit,
    ClearPreplan,
    Commit,
    Ingest,
    LeaseTimeout,
    Model,
    OffloadAbandon,
    OffloadClaim,
    OffloadCommit,
    OffloadCopy,
    Plan,
    Publish,
    Read,
    ReleasePublished,
    Reload,
    Remove,
    Reset,
    RetrieveComplete,
    RetrieveStart,
    Seg,
    State,
    Step,
    Stream,
    Write,
)

Forks = tuple[tuple[int, int], ...]


def fork_shapes(labels: int) -> list[tuple[Forks, Forks]]:
    """(pre_forks, post_forks): none; one fork between any two labels, either
    kind; a chain or cycle of two pre-forks (a->b, b->c; c may be a); one of
    each kind."""
    pairs = [(f, t) for f in range(labels) for t in range(labels) if f != t]
    shapes: list[tuple[Forks, Forks]] = [((), ())]
    shapes += [((p,), ()) for p in pairs] + [((), (p,)) for p in pairs]
    shapes += [((p, q), ()) for p in pairs for q in pairs if q[0] == p[1]]
    shapes += [((p,), (q,)) for p in pairs for q in pairs]
    return shapes


def step_shapes(m: Model, reqs: list[int]) -> Iterator[Step]:
    """One segment per step (any request, label, span); forks as `fork_shapes`,
    padded to every one of ``reqs`` (so some padded requests lack the source or
    already hold the target); a fork-free step padded to its own request."""
    sc = m.scope
    forks = fork_shapes(sc.labels)
    for r in reqs:
        for label in range(sc.labels):
            for span in range(sc.max_span + 1):
                for pre, post in forks:
                    padded = tuple(reqs) if (pre or post) else (r,)
                    for commit in (True, False) if span else (True,):
                        yield Step((Seg(r, label, span),), pre, post, padded, commit)


def completions(st: dict[tuple[int, int], Stream], rid: int, label: int
                ) -> Iterator[Action]:
    """The environment's event: a running retrieve lands, or fails."""
    v = st.get((rid, label))
    if v is not None and v.retrieve == PENDING:
        yield RetrieveComplete(rid, label, ok=True)
        yield RetrieveComplete(rid, label, ok=False)


def calls(m: Model, s: State) -> Iterator[Action]:
    """Every call, in every state: the total protocol the checker explores.

    Calls whose answer an early rule of `Model.step` fixes whatever their
    arguments are issued once, not once per argument: with a step running,
    every other plain admit is the same `StepInFlightError` (R23); with a
    preplan staged, every other admit the same `PreplanPendingError`; a step
    over a request never ingested is `UnknownRequestError` before anything
    else; a fault flag on a call that runs no such copy changes nothing, and
    neither does a stale flag on a retrieve an earlier rule answers; releasing a
    request not leased is one no-op, whichever request it names.
    """
    sc = m.scope
    every = list(range(sc.requests))
    ingested = sorted(s.requests())
    st = s.stream_map()
    for r in every:
        yield Ingest(r)
    shapes = list(step_shapes(m, ingested))
    held = s.staged or s.current
    plain = shapes if held is None else [held.step, *shapes[:1]]
    preplan = shapes if s.staged is None else shapes[:1]
    for step in plain:
        yield Admit(step)
    for step in preplan:
        yield Admit(step, preplan=True)
    unknown = [r for r in every if r not in ingested]
    if unknown:  # a step over a request never ingested, or removed
        yield Admit(Step((Seg(unknown[0], 0, 1),), (), (), (unknown[0],)))
    # a step with a fork and nobody to apply it to
    yield Admit(Step((Seg(0, 0, 1),), ((0, 1),), (), ()))
    forks = held is not None and bool(held.step.pre_forks or held.step.post_forks)
    yield Plan()
    yield Plan(preplan=True)
    yield Write()
    yield Read()
    yield Commit()
    if forks:
        yield Plan(fork_error=True)
        yield Commit(fork_error=True)
    yield ClearPreplan()
    for r in every:
        yield OffloadClaim(r)
        off = s.offload_of(r)
        for label in range(sc.labels):
            yield OffloadCopy(r, label)
            if off is not None and label in dict(off.claimed):
                yield OffloadCopy(r, label, copy_error=True)
        yield OffloadCommit(r)
        yield OffloadAbandon(r)
        yield Reload(r)
        if any(k[0] == r for k, _ in s.host):
            yield Reload(r, copy_error=True)
        yield Publish(r)
        for label in range(sc.labels):
            yield from completions(st, r, label)
            for n in range(sc.max_span + 1):
                yield RetrieveStart(r, label, n)
            yield RetrieveStart(r, label, sc.max_span, start_error=True)
            v = st.get((r, label))
            if r in ingested and (v is None or (v.retrieve == IDLE and not v.in_flight
                                                and v.offload == RESIDENT)):
                # elsewhere an earlier rule answers, as for the same call not stale
                yield RetrieveStart(r, label, sc.max_span, stale=True)
        yield Reset(r, free=False)
        yield Reset(r, free=True)
        yield Remove(r)
        if r in s.leases:
            yield ReleasePublished(r)
    # a release of a request not leased is one no-op whichever request it names
    yield ReleasePublished(next((r for r in every if r not in s.leases), 0))
    if s.leases:  # with nothing leased, the clock passing a deadline changes nothing
        yield LeaseTimeout()


def enabled(m: Model, s: State) -> Iterator[Action]:
    """What a careful engine issues: steps in order over ready requests, handle
    calls on open handles, no fault injected (the fault rules add those)."""
    sc = m.scope
    reqs = sorted(s.requests())
    st = s.stream_map()
    for r in range(sc.requests):
        if r not in reqs:
            yield Ingest(r)
    # a step is admitted only once its requests are ready (no retrieve running or failed)
    ready = {r for r in reqs if all(v.retrieve == IDLE for k, v in st.items() if k[0] == r)}
    if s.staged is None:
        for step in step_shapes(m, sorted(ready)):
            yield Admit(step, preplan=True)
            if s.current is None:
                yield Admit(step)
    if s.current is None and s.staged is not None and s.staged.phase == PLANNED:
        yield Admit(s.staged.step)  # the staged step's real admit: already reserved
        yield Plan()  # promotes it
    if s.current is not None:
        ph, step = s.current.phase, s.current.step
        if ph == ADMITTED:
            yield Plan()
        elif ph == PLANNED and any(g.span for g in step.segments):
            yield Write()
        elif ph in (WRITTEN, PLANNED):
            yield Commit()
    if s.staged is not None:
        if s.staged.phase == ADMITTED:
            yield Plan(preplan=True)
        yield ClearPreplan()
    for r in reqs:
        off = s.offload_of(r)
        if off is None:
            yield OffloadClaim(r)
        else:
            for label, _ in off.claimed:
                if label not in off.copied:
                    yield OffloadCopy(r, label)
            yield OffloadCommit(r)
            yield OffloadAbandon(r)
        if any(v.offload in (CLAIMED, OFFLOADED) for k, v in st.items() if k[0] == r):
            yield Reload(r)
        yield Publish(r)
        for label in range(sc.labels):
            yield from completions(st, r, label)
            # also into a stream a step names: kvref raises and nothing moves
            for n in range(1, sc.max_span + 1):
                yield RetrieveStart(r, label, n)
            # the peer's pages changed since it published: not the engine's doing
            yield RetrieveStart(r, label, sc.max_span, stale=True)
        # a careful engine releases first; reset and remove of a leased request
        # are still issued, as an engine aborting a request would
        yield Reset(r, free=False)
        yield Reset(r, free=True)
        yield Remove(r)
        if r in s.leases:
            yield ReleasePublished(r)
    if s.leases:
        yield LeaseTimeout()
