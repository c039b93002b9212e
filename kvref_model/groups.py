"""Hybrid models: a label's stream is one stream per attention group (H1).

`Scope.groups` names each group's window (None: full attention).  Inside the
model, group ``g`` of label ``L`` is the stream of internal label
``L * G + g``: its own page table, from the one pool, under its group's
window; a token's identity is its internal label, so a page key names its
group and a hit never crosses groups.  The calls still name labels: this
module is the one place that turns a call on a label into the calls on its
groups, all or nothing (H1), and the groups' answers into the label's.  The
hit every group serves (H2) is `Model.hit_every_group`.

`user_view` is the state as the calls see it (group 0 of each label, under
its label), for the checker's protocol: the groups agree (I30), so group 0
speaks for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvref_model.core import (
    FAILED,
    IDLE,
    NO_STREAM,
    PENDING,
    Admit,
    CachePrefix,
    Claimed,
    Count,
    Fault,
    Flag,
    FollowTokens,
    Freed,
    Key,
    Latched,
    MatchPrefix,
    Misuse,
    NotReady,
    Offload,
    OffloadCopy,
    Ok,
    Pending,
    Published,
    Refused,
    Result,
    RetrieveComplete,
    RetrieveStart,
    Seg,
    State,
    Step,
    Stream,
    Truncate,
    _sorted,
    replace,
)

if TYPE_CHECKING:
    from kvref_model.core import Action, Model

_EXPANDED: dict[tuple[int, Step], Step] = {}


def expand(step: Step, g: int) -> Step:
    """The step on every group: each segment and fork once per group."""
    got = _EXPANDED.get((g, step))
    if got is None:
        if len(_EXPANDED) > 4096:
            _EXPANDED.clear()
        got = _EXPANDED[(g, step)] = replace(
            step,
            segments=tuple(Seg(x.rid, x.label * g + i, x.span)
                           for x in step.segments for i in range(g)),
            pre_forks=tuple((f * g + i, t * g + i) for f, t in step.pre_forks for i in range(g)),
            post_forks=tuple((f * g + i, t * g + i) for f, t in step.post_forks
                             for i in range(g)))
    return got


def collapse(step: Step, g: int) -> Step:
    """The step as its caller named it: group 0's segments and forks."""
    return replace(
        step,
        segments=tuple(Seg(x.rid, x.label // g, x.span) for x in step.segments
                       if x.label % g == 0),
        pre_forks=tuple((f // g, t // g) for f, t in step.pre_forks if f % g == 0),
        post_forks=tuple((f // g, t // g) for f, t in step.post_forks if f % g == 0))


# the calls that name one label: each runs on the label's every group, in
# group order, and the first that is not accepted answers for all, with the
# state as it was (H1). MatchPrefix is one decision over the groups (H2).
_PER_GROUP = (OffloadCopy, RetrieveStart, RetrieveComplete, Truncate, CachePrefix, FollowTokens)
_GOES_ON = (Ok, NotReady, Count, Latched, Freed)  # the next group's call runs too


def step(m: Model, s: State, a: Action) -> tuple[Result, State]:
    """`Model.step` of a call, on a scope with groups."""
    g = m.scope.group_count
    if isinstance(a, Admit):
        return m.step_one(s, replace(a, step=expand(a.step, g)))
    if isinstance(a, OffloadCopy) and a.group is not None:
        # one group's copy: kvref's own critical sections (H1)
        if not 0 <= a.group < g:
            return Misuse("OffloadStateError"), s
        return m.step_one(s, replace(a, label=a.label * g + a.group, group=None))
    if isinstance(a, _PER_GROUP):
        return _on_every_group(m, s, a, g)
    if isinstance(a, MatchPrefix):
        return _match(m, s, a.rid, a.label, a.length, g)
    r, t = m.step_one(s, a)
    if isinstance(r, Claimed):
        return Claimed(tuple(sorted({lb // g for lb in r.labels}))), t
    if isinstance(r, Published):
        return Published(tuple((lb // g, n) for lb, n in r.lengths if lb % g == 0)), t
    return r, t


def _on_every_group(m: Model, s: State, a: Action, g: int) -> tuple[Result, State]:
    r, t = _each_group(m, s, a, g)
    if isinstance(a, OffloadCopy) and t is not s:
        t = _retrieve_done_as_one(s, t, a.rid, a.label * g, g)
    return r, t


def _retrieve_done_as_one(s: State, t: State, rid: int, first: int, g: int) -> State:
    """A retrieve a copy waited out is done in every group of the label
    (H1), the groups the copy did not claim too (a chunk at its start)."""
    before, after = s.stream_map(), t.stream_map()
    keys = [(rid, first + i) for i in range(g)]
    if not any(k in before and k in after and before[k].retrieve == PENDING
               and after[k].retrieve == IDLE for k in keys):
        return t
    for k in keys:
        if k in after and after[k].retrieve == PENDING:
            after[k] = replace(after[k], retrieve=IDLE)
    return replace(t, streams=_sorted(after))


def _each_group(m: Model, s: State, a: Action, g: int) -> tuple[Result, State]:
    label: int = a.label  # type: ignore[union-attr]
    t, added, first, short = s, 0, None, False
    acted = _groups_acted_on(s, a, label, g)
    for i in acted:
        # an injected fault strikes the last group's call only (one copy
        # raises), once the groups before it did what the call does first
        # (a copy waits for the retrieve writing its pages)
        each = replace(a, label=label * g + i)
        if i != acted[-1] and getattr(each, "copy_error", False):
            each = replace(each, copy_error=False)
        if i != acted[-1] and getattr(each, "start_error", False):
            each = replace(each, start_error=False)
        r, t = m.step_one(t, each)
        if first is None:
            first = r
        if r == Flag(False):
            # a host copy is one stream's: the host pool full for this
            # group's, the other groups' copies still run (each waits for
            # its retrieve first), and the label's copy answers False
            short = True
            continue
        if not isinstance(r, _GOES_ON) and r != Flag(True):
            # refused or a misuse: no group changes (H1); a fault keeps what
            # the groups before it did, and its offload is abandoned (R8)
            if isinstance(r, Refused) and r.kind == "AllocationFailed":
                # one call takes every group's pages: short by what they all need
                return Refused("AllocationFailed", _short(m, s, a, g)), s
            if isinstance(a, RetrieveStart) and a.start_error and a.late and i == acted[-1] and (
                    r == Refused("AdmitRuntimeError")):  # the fault, not a refusal before it
                fault_free = replace(a, label=label * g + i, start_error=False)
                aborted = _abort_started(m, s, t, fault_free, g)
                if aborted is not None:
                    return Latched("RetrieveAborted"), aborted
            return r, (t if isinstance(r, Fault) else s)
        if isinstance(r, Count):
            added += r.n
        if isinstance(r, Freed):  # a truncate frees each group's pages: their sum
            added += r.pages
    assert first is not None
    if short:
        return Flag(False), t
    if isinstance(first, Freed):
        return Freed(added), t
    return (Count(added) if isinstance(first, Count) else first), t


def _groups_acted_on(s: State, a: Action, label: int, g: int) -> list[int]:
    """The groups a per-group call acts on: every one, but a copy of a
    label only its claimed groups. A chunk at its start holds no page (H7),
    so an offload does not claim it. None claimed: every group, and the
    first one's call answers the misuse."""
    every = list(range(g))
    if isinstance(a, OffloadCopy):
        off = s.offload_of(a.rid)
        claimed = dict(off.claimed) if off is not None else {}
        return [i for i in every if label * g + i in claimed] or every
    return every


def _abort_started(m: Model, s: State, t: State, struck: RetrieveStart, g: int
                   ) -> State | None:
    """A retrieve whose last group's copy could not start once the groups
    before it started theirs (H1). A started copy cannot be called back (it
    writes its pages until it ends), so the refusal cannot leave every group
    as it was; the struck group takes its pages as a copy that failed at
    once would, and every group of the label is latched failed: the state a
    copy failing later leaves (I11), the groups alike (I30), each keeping
    what it took until a reset. None where no earlier group started a copy:
    then nothing moved (R26)."""
    before, after = s.stream_map(), t.stream_map()
    keys = [(struck.rid, struck.label - g + 1 + i) for i in range(g)]
    if not any(after.get(k, NO_STREAM).retrieve == PENDING
               and before.get(k, NO_STREAM).retrieve != PENDING for k in keys[:-1]):
        return None
    r, t = m.step_one(t, struck)
    assert isinstance(r, NotReady), r  # it passed every check before the fault
    st = t.stream_map()
    for k in keys:
        st[k] = replace(st[k], retrieve=FAILED)
    return replace(t, streams=_sorted(st))


def _short(m: Model, s: State, a: Action, g: int) -> int:
    """The pages a call that allocates (a retrieve start) lacks for every
    group of its label at once: it takes each group's pages before any
    window lets go of its passed ones, so each group's need is asked alone
    of ``s`` with nothing free (a group's need depends on its own stream)."""
    none_free = replace(s, free=0)
    need = 0
    for i in range(g):
        # an injected start fault strikes after the pages are counted
        r, _ = m.step_one(none_free, replace(a, label=a.label * g + i,  # type: ignore[union-attr]
                                             start_error=False))
        if isinstance(r, Refused) and r.kind == "AllocationFailed":
            need += r.pages_short
    return need - s.free


def _match(m: Model, s: State, rid: int, label: int, length: int, g: int
           ) -> tuple[Result, State]:
    labels = tuple(label * g + i for i in range(g))
    # group 0's call answers the misuses (the groups agree, I30) and makes
    # its stream (S24); the other groups' streams are made with it
    r, made = m.step_one(s, MatchPrefix(rid, labels[0], 0))
    if not isinstance(r, Count):
        return r, s
    st = made.stream_map()
    for lb in labels:
        st.setdefault((rid, lb), NO_STREAM)
    made = replace(made, streams=_sorted(st))
    if any(m.scope.window(lb) is not None for lb in labels) and not m.scope.window_cache \
            and m.W10_window_never_hits:
        return Count(0), made  # W10: a windowed group never hits, so no label does
    return m.hit_every_group(s, made, rid, labels, length)


def user_view(m: Model, s: State) -> State:
    """The state as a caller names it: group 0 of each label, under its label."""
    g = m.scope.group_count

    def mine(k: Key) -> bool:
        return k[1] % g == 0

    def lb(k: Key) -> Key:
        return (k[0], k[1] // g)

    def pending(p: Pending | None) -> Pending | None:
        if p is None:
            return None
        return replace(p, step=collapse(p.step, g),
                       marks=frozenset(lb(k) for k in p.marks if mine(k)),
                       undo=tuple((lb(k), c) for k, c in p.undo if mine(k)),
                       fresh=frozenset(lb(k) for k in p.fresh if mine(k)),
                       basis=tuple((lb(k), n) for k, n in p.basis if mine(k)))

    def offload(o: Offload) -> Offload:
        return replace(o, claimed=tuple((x // g, n) for x, n in o.claimed if x % g == 0),
                       copied=frozenset(x // g for x in o.copied if x % g == 0),
                       hosted=tuple((x // g, n) for x, n in o.hosted if x % g == 0))

    streams: tuple[tuple[Key, Stream], ...] = tuple((lb(k), v) for k, v in s.streams if mine(k))
    return replace(s, streams=streams,
                   host=tuple((lb(k), c) for k, c in s.host if mine(k)),
                   current=pending(s.current), staged=pending(s.staged),
                   offloads=tuple((r, offload(o)) for r, o in s.offloads))
