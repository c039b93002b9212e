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

from kvref_model.core import (
    ADMITTED,
    CLAIMED,
    IDLE,
    MAIN,
    OFFLOADED,
    PENDING,
    PLANNED,
    RESIDENT,
    WRITTEN,
    Action,
    Admit,
    CachePrefix,
    ClearPreplan,
    Commit,
    FollowTokens,
    Ingest,
    LeaseTimeout,
    MatchPrefix,
    Model,
    NumFree,
    OffloadAbandon,
    OffloadClaim,
    OffloadCommit,
    OffloadCopy,
    Plan,
    Publish,
    Read,
    Reclaimable,
    ReleasePublished,
    Reload,
    Remove,
    Reset,
    ResetPrefixCache,
    RetrieveComplete,
    RetrieveStart,
    Scope,
    Seg,
    State,
    Step,
    Stream,
    Truncate,
    Write,
    named,
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


class _Shapes:
    """`step_shapes(m, reqs)` as the admits `calls` issues, built once per
    scope and request set (the steps are frozen values: sharing them is safe)."""

    def __init__(self, m: Model, reqs: list[int]) -> None:
        self.max_span = m.scope.max_span
        self.steps = tuple(step_shapes(m, reqs))
        self.plain = tuple(Admit(step) for step in self.steps)
        self.preplan = tuple(Admit(step, preplan=True) for step in self.steps)
        self.named = tuple(frozenset(named(step)) for step in self.steps)
        self._over: dict[frozenset[tuple[int, int]], tuple[Admit, ...]] = {}

    def over(self, running: Step) -> tuple[Admit, ...]:
        """The preplans issued over a running step: the shapes that name none
        of its streams, then the next decode of each of them."""
        busy = frozenset(named(running))
        got = self._over.get(busy)
        if got is None:
            got = self._over[busy] = tuple(
                [a for a, keys in zip(self.preplan, self.named, strict=True) if not keys & busy]
                + [Admit(Step((Seg(r, lb, self.max_span),), padded=(r,)), preplan=True)
                   for r, lb in sorted(busy)])
        return got


_SHAPES: dict[tuple[Scope, tuple[int, ...]], _Shapes] = {}


def _shapes(m: Model, reqs: list[int]) -> _Shapes:
    got = _SHAPES.get((m.scope, tuple(reqs)))
    if got is None:
        got = _SHAPES[(m.scope, tuple(reqs))] = _Shapes(m, reqs)
    return got


class _PerRequest:
    """The calls `calls` issues about request `r` whatever the state, made once
    per scope (actions are frozen values: sharing them is safe), in its order."""

    def __init__(self, sc: Scope, r: int) -> None:
        labels = range(sc.labels)
        self.claim = OffloadClaim(r)
        self.copy = [OffloadCopy(r, label) for label in labels]
        self.copy_error = [OffloadCopy(r, label, copy_error=True) for label in labels]
        self.close = (OffloadCommit(r), OffloadAbandon(r), Reload(r))
        self.reload_error = Reload(r, copy_error=True)
        self.publish = Publish(r)
        # a label of groups: a start fault also at its last group, once the
        # others started their copies (H1)
        late = (True,) if sc.group_count > 1 else ()
        self.retrieve = [(*(RetrieveStart(r, label, n) for n in range(sc.max_span + 1)),
                          RetrieveStart(r, label, sc.max_span, start_error=True),
                          *(RetrieveStart(r, label, sc.max_span, start_error=True, late=x)
                            for x in late))
                         for label in labels]
        self.stale = [RetrieveStart(r, label, sc.max_span, stale=True) for label in labels]
        self.reset = (Reset(r, free=False), Reset(r, free=True), Remove(r))
        self.release = ReleasePublished(r)


_FIXED: dict[Scope, list[_PerRequest]] = {}


def _fixed(sc: Scope) -> list[_PerRequest]:
    got = _FIXED.get(sc)
    if got is None:
        got = _FIXED[sc] = [_PerRequest(sc, r) for r in range(sc.requests)]
    return got


def completions(st: dict[tuple[int, int], Stream], rid: int, label: int
                ) -> Iterator[Action]:
    """The environment's event: a running retrieve lands, or fails."""
    v = st.get((rid, label))
    if v is not None and v.retrieve == PENDING:
        yield RetrieveComplete(rid, label, ok=True)
        yield RetrieveComplete(rid, label, ok=False)
        # the publisher moves while the copy reads (R35's second read)
        yield RetrieveComplete(rid, label, ok=True, moved=True)


def settled(v: Stream) -> bool:
    """A stream truncate may cut: no step names it, resident, no retrieve
    copying into it or failed (R38)."""
    return not v.in_flight and v.offload == RESIDENT and v.retrieve == IDLE


def _as_called(m: Model, s: State) -> State:
    """With groups, the state as the calls name it (`kvref_model.groups`)."""
    if not m.scope.groups:
        return s
    from kvref_model.groups import user_view
    return user_view(m, s)


def truncations(m: Model, s: State) -> Iterator[Action]:
    """Truncate by argument class (the answer, and the state it leads to, is
    the same within a class): a negative length and a stream that does not
    exist, each a misuse whatever else holds, once per state; a stream that
    is not settled or is leased, once (a misuse whatever the length); per
    settled stream:
    one past its length (a misuse), its length (a no-op), and three cuts: to
    nothing, to one token less (a rejected draft), and to the last page
    boundary below its length (the least cut that frees a page). Other cuts
    differ from these only in how many of the same tokens stay."""
    sc = m.scope
    st = s.stream_map()
    yield Truncate(0, MAIN, -1)
    absent = [(r, lb) for r in range(sc.requests) for lb in range(sc.labels)
              if (r, lb) not in st]
    if absent:
        yield Truncate(*absent[0], 0)
    for (r, lb), v in sorted(st.items()):
        if not settled(v) or r in s.leases:  # a misuse whatever the length (R38, R33)
            yield Truncate(r, lb, 0)
            continue
        boundary = sc.page_size * max(0, m.need(v.stored_len) - 1)
        for n in sorted({v.stored_len + 1, v.stored_len, 0, max(0, v.stored_len - 1),
                         boundary}):
            yield Truncate(r, lb, n)


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
    s = _as_called(m, s)
    every = list(range(sc.requests))
    ingested = sorted(s.requests())
    st = s.stream_map()
    for r in every:
        yield Ingest(r)
    shapes = _shapes(m, ingested)
    held = s.staged or s.current
    if held is None:
        yield from shapes.plain
    else:
        yield Admit(held.step)
        yield from shapes.plain[:1]
    if s.staged is not None:
        yield from shapes.preplan[:1]
    elif s.current is None:
        yield from shapes.preplan
    else:
        # a preplan over the running step (R41) is issued as the next decode of
        # one of its streams (fork-free, the widest span): every shape over
        # them made 12x the states at depth 4 (argument-class reduction)
        yield from shapes.over(s.current.step)
    unknown = [r for r in every if r not in ingested]
    if unknown:  # a step over a request never ingested, or removed
        yield Admit(Step((Seg(unknown[0], 0, 1),), (), (), (unknown[0],)))
        if ingested:  # a plain step on a known request, padded to an unknown one
            yield Admit(Step((Seg(ingested[0], 0, 1),), (), (), (ingested[0], unknown[0])))
    # a step with a fork and nobody to apply it to
    yield Admit(Step((Seg(0, 0, 1),), ((0, 1),), (), ()))
    # the running step's forks fault at its plan or commit, the staged one's
    # at its promotion: with both, either may be the one with forks
    forks = any(p is not None and bool(p.step.pre_forks or p.step.post_forks)
                for p in (s.current, s.staged))
    yield Plan()
    yield Plan(preplan=True)
    yield Write()
    yield Read()
    yield Commit()
    if forks:
        yield Plan(fork_error=True)
        yield Commit(fork_error=True)
    yield ClearPreplan()
    fixed = _fixed(sc)
    for r in every:
        mine = fixed[r]
        yield mine.claim
        off = s.offload_of(r)
        if sc.host_pages:
            # without a host pool no claim succeeds, so no engine holds a
            # handle to copy, commit or abandon with, not even a stale one
            for label in range(sc.labels):
                yield mine.copy[label]
                if off is not None and label in dict(off.claimed):
                    yield mine.copy_error[label]
            yield from mine.close
        else:
            yield mine.close[-1]  # reload: refused, NO_HOST_POOL
        if any(k[0] == r for k, _ in s.host):
            yield mine.reload_error
        yield mine.publish
        for label in range(sc.labels):
            yield from completions(st, r, label)
            yield from mine.retrieve[label]
            v = st.get((r, label))
            if r in ingested and (v is None or (v.retrieve == IDLE and not v.in_flight
                                                and v.offload == RESIDENT)):
                # elsewhere an earlier rule answers, as for the same call not stale
                yield mine.stale[label]
        yield from mine.reset
        if r in s.leases:
            yield mine.release
    # a release of a request not leased is one no-op whichever request it names
    yield ReleasePublished(next((r for r in every if r not in s.leases), 0))
    if s.leases:  # with nothing leased, the clock passing a deadline changes nothing
        yield LeaseTimeout()
    yield from truncations(m, s)
    yield from prefix_calls(m, s)


def prefix_calls(m: Model, s: State) -> Iterator[Action]:
    """With sharing on, the prefix cache's calls: register each stream's full
    pages; a match per request and label of ids long enough to hit every
    cached page of the label's own identity (a shorter one hits a prefix of
    the same chain); the counts; the reset."""
    sc = m.scope
    if not sc.sharing:
        return
    longest = sc.device_pages * sc.page_size + 1
    for r in sorted(s.requests()):
        for label in range(sc.labels):
            yield CachePrefix(r, label)
            yield FollowTokens(r, label)
            yield MatchPrefix(r, label, longest)
        yield Reclaimable(r)
    yield NumFree()
    yield ResetPrefixCache()


def enabled(m: Model, s: State) -> Iterator[Action]:
    """What a careful engine issues: steps in order over ready requests, handle
    calls on open handles, no fault injected (the fault rules add those)."""
    sc = m.scope
    s = _as_called(m, s)
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
    for (r, lb), v in sorted(st.items()):
        if settled(v) and r not in s.leases:  # to any length it holds (R33: not leased)
            for n in range(v.stored_len + 1):
                yield Truncate(r, lb, n)
    yield from prefix_calls(m, s)
