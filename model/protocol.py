"""Preconditions: which actions the engine protocol issues in a state.

These are not refusals (those are results of `Model.step`): they are the
calls an engine never makes, or makes only once a blocking wait is over.
The checker explores exactly these.  Bounds come from the `Scope`.
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
    WRITTEN,
    Action,
    Admit,
    ClearPreplan,
    Commit,
    Ingest,
    Model,
    OffloadAbandon,
    OffloadClaim,
    OffloadCommit,
    OffloadCopy,
    Plan,
    Publish,
    Reload,
    Remove,
    Reset,
    RetrieveComplete,
    RetrieveStart,
    Seg,
    State,
    Step,
    Write,
)


def step_shapes(m: Model, reqs: list[int]) -> Iterator[Step]:
    """One segment per step (any request, label, span), optionally one fork
    from main, padded to that request or to every ingested one."""
    sc = m.scope
    forks: list[tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]] = [((), ())]
    for t in range(1, sc.labels):
        forks += [(((0, t),), ()), ((), ((0, t),))]
    for r in reqs:
        for label in range(sc.labels):
            for span in range(sc.max_span + 1):
                for pre, post in forks:
                    paddings = {(r,), tuple(reqs)} if (pre or post) else {(r,)}
                    for padded in sorted(paddings):
                        for commit in (True, False) if span else (True,):
                            yield Step((Seg(r, label, span),), pre, post, padded, commit)


def enabled(m: Model, s: State) -> Iterator[Action]:
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
                # the copy waits for an in-flight read of the stream first
                v = st.get((r, label))  # the reference may drop a claimed label
                if label not in off.copied and (v is None or v.retrieve != PENDING):
                    yield OffloadCopy(r, label)
                    yield OffloadCopy(r, label, copy_error=True)
            yield OffloadCommit(r)
            yield OffloadAbandon(r)
        if any(v.offload in (CLAIMED, OFFLOADED) for k, v in st.items() if k[0] == r):
            yield Reload(r)
        yield Publish(r)
        for label in range(sc.labels):
            k = (r, label)
            v = st.get(k)
            if v is not None and v.retrieve == PENDING:
                yield RetrieveComplete(r, label, ok=True)
                yield RetrieveComplete(r, label, ok=False)
            # also into a stream a step names: kvref raises and nothing moves
            for n in range(1, sc.max_span + 1):
                yield RetrieveStart(r, label, n)
        if all(v.retrieve != PENDING for k, v in st.items() if k[0] == r):
            yield Reset(r, free=False)
            yield Reset(r, free=True)
            yield Remove(r)
