"""The abstract stream-lifecycle model: state, actions, results and `step`.

Porcupine style: `Model(scope).init()` gives the first state and
`Model.step(state, action)` is a pure function to `(result, next_state)`.
Nothing else.  Page ids, generations, locks and tensors are left out on
purpose: a stream is a page *count*, a length and a tuple of token
identities.  Each action is one critical section of the manager, and its
result is what the manager must return.

The rules kvref departs from the reference by (specs/rules.md)
are class attributes, so `model.reference` can switch them off and the
checker can show what each one prevents.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

Key = tuple[int, int]  # (request, label); label 0 is "main"
Tokens = tuple[int, ...]  # token identities, one per stored position

MAIN = 0
# offload state of one stream
RESIDENT, CLAIMED, OFFLOADED = "", "claimed", "offloaded"
# retrieve state of one stream (the failure is latched)
IDLE, PENDING, FAILED = "", "pending", "failed"
# phase of an admitted step
ADMITTED, PLANNED, WRITTEN = "admitted", "planned", "written"

LABEL_NAMES = ("main", "cfg", "draft", "aux")


class ProtocolError(Exception):
    """An action the engine protocol never issues in this state (not a
    manager result: the checker only generates enabled actions)."""


@dataclass(frozen=True)
class Scope:
    requests: int = 2
    labels: int = 2
    # the default scope: every action fires and every invariant's interesting
    # case arises within depth 7, in ~20 s on two cores (host_pages=1 so a
    # copy can find the pool full; findings.md uses page_size=2 scopes)
    device_pages: int = 3  # usable pages; the sink is extra and never counted
    host_pages: int = 1
    page_size: int = 1
    max_span: int = 2
    depth: int = 7  # 0: explore until no new state


# ---------------------------------------------------------------- state


@dataclass(frozen=True)
class Stream:
    pages: int = 0  # device pages held: a high-water count
    stored_len: int = 0
    contents: Tokens = ()  # logical tokens, kept while the stream is on host
    in_flight: bool = False
    offload: str = RESIDENT
    retrieve: str = IDLE


@dataclass(frozen=True)
class Seg:
    rid: int
    label: int
    span: int


@dataclass(frozen=True)
class Step:
    segments: tuple[Seg, ...]
    pre_forks: tuple[tuple[int, int], ...] = ()
    post_forks: tuple[tuple[int, int], ...] = ()
    padded: tuple[int, ...] = ()  # ctx.padded_request_ids
    commit: bool = True


@dataclass(frozen=True)
class Pending:
    """An admitted step (the running one, or the staged preplan)."""

    step: Step
    phase: str
    marks: frozenset[Key]  # the in-flight marks this step owns
    # preplan only: what clear_preplan restores. None: a label the preplan
    # invented (removed with its pages); else a pre-fork target's contents
    undo: tuple[tuple[Key, Tokens | None], ...] = ()
    # ghost, for I9 only: the streams this (preplan) admit created
    fresh: frozenset[Key] = frozenset()


@dataclass(frozen=True)
class Offload:
    """An offload between claim and commit/abandon."""

    claimed: tuple[tuple[int, int], ...]  # (label, pages held at claim)
    copied: frozenset[int] = frozenset()
    touched: bool = False  # a claimed stream changed: the generation guard fails


@dataclass(frozen=True, eq=True, unsafe_hash=False)
class State:
    free: int
    streams: tuple[tuple[Key, Stream], ...] = ()  # sorted by key
    host: tuple[tuple[Key, Tokens], ...] = ()  # host copies, sorted by key
    current: Pending | None = None
    staged: Pending | None = None
    offloads: tuple[tuple[int, Offload], ...] = ()

    def __hash__(self) -> int:
        # cached: the checker hashes each state many times (dict keys)
        h: int | None = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.free, self.streams, self.host, self.current, self.staged,
                      self.offloads))
            object.__setattr__(self, "_hash", h)
        return h

    def stream_map(self) -> dict[Key, Stream]:
        return dict(self.streams)

    def requests(self) -> set[int]:
        return {k[0] for k, _ in self.streams}

    def offload_of(self, rid: int) -> Offload | None:
        return dict(self.offloads).get(rid)


def _sorted(d: dict[Key, Stream]) -> tuple[tuple[Key, Stream], ...]:
    return tuple(sorted(d.items()))


# -------------------------------------------------------------- actions


@dataclass(frozen=True)
class Ingest:
    rid: int


@dataclass(frozen=True)
class Admit:
    step: Step
    preplan: bool = False


@dataclass(frozen=True)
class Plan:
    preplan: bool = False


@dataclass(frozen=True)
class Write:
    """attention writes K/V for the planned (running) step's segments"""


@dataclass(frozen=True)
class Commit:
    """commit the running step"""


@dataclass(frozen=True)
class ClearPreplan:
    pass


@dataclass(frozen=True)
class OffloadClaim:
    rid: int


@dataclass(frozen=True)
class OffloadCopy:
    rid: int
    label: int
    copy_error: bool = False  # a host copy that raises


@dataclass(frozen=True)
class OffloadCommit:
    rid: int


@dataclass(frozen=True)
class OffloadAbandon:
    rid: int


@dataclass(frozen=True)
class Reload:
    rid: int


@dataclass(frozen=True)
class Publish:
    rid: int


@dataclass(frozen=True)
class RetrieveStart:
    """admit_retrieve of info published by another manager: `length` tokens"""

    rid: int
    label: int
    length: int


@dataclass(frozen=True)
class RetrieveComplete:
    rid: int
    label: int
    ok: bool


@dataclass(frozen=True)
class Reset:
    rid: int
    free: bool


@dataclass(frozen=True)
class Remove:
    rid: int


Action = (
    Ingest | Admit | Plan | Write | Commit | ClearPreplan | OffloadClaim | OffloadCopy
    | OffloadCommit | OffloadAbandon | Reload | Publish | RetrieveStart
    | RetrieveComplete | Reset | Remove
)
ACTIONS: tuple[type, ...] = (
    Ingest, Admit, Plan, Write, Commit, ClearPreplan, OffloadClaim, OffloadCopy,
    OffloadCommit, OffloadAbandon, Reload, Publish, RetrieveStart, RetrieveComplete,
    Reset, Remove,
)


# -------------------------------------------------------------- results


@dataclass(frozen=True)
class Ok:
    pass


@dataclass(frozen=True)
class NotReady:
    """admitted (ok=True) but not ready: a retrieve is in progress"""


@dataclass(frozen=True)
class Refused:
    kind: str  # AllocationFailed | RequestOffloading | AdmitRuntimeError
    pages_short: int = 0


@dataclass(frozen=True)
class Misuse:
    kind: str  # the KVRefError subclass kvref raises


@dataclass(frozen=True)
class Freed:
    pages: int


@dataclass(frozen=True)
class Flag:
    value: bool  # reload's answer; a copy's (False: host pool full)


@dataclass(frozen=True)
class Claimed:
    labels: tuple[int, ...]  # () : begin_offload returned None


@dataclass(frozen=True)
class Published:
    lengths: tuple[tuple[int, int], ...]  # (label, stored_len) on device


Result = Ok | NotReady | Refused | Misuse | Freed | Flag | Claimed | Published


# ---------------------------------------------------------------- model


def named(step: Step) -> set[Key]:
    """Every stream a step names: its segments, and both ends of every fork
    for every padded request."""
    keys = {(g.rid, g.label) for g in step.segments}
    for f, t in step.pre_forks + step.post_forks:
        for rid in step.padded:
            keys |= {(rid, f), (rid, t)}
    return keys


class Model:
    # kvref's rules (specs/rules.md); model.reference switches them off
    R1_atomic_admit = True
    R2_mark_everything_named = True
    R3_offloaded_refuses = True
    R5_no_reset_in_flight = True
    R6_no_reload_mid_offload = True
    R7_reset_clears_latch = True
    R9_fork_then_grow = True
    R10_preplan_after_commit = True
    R11_preplan_forks_at_promotion = True
    R12_reset_forgets_host = True
    R13_publish_resident = True
    R14_retrieve_refuses_named = True
    R15_retrieve_refuses_absent_named = True
    R16_admit_makes_named = True

    def __init__(self, scope: Scope) -> None:
        self.scope = scope

    def init(self) -> State:
        return State(free=self.scope.device_pages)

    def need(self, tokens: int) -> int:
        return -(-tokens // self.scope.page_size)

    def step(self, s: State, a: Action) -> tuple[Result, State]:
        handler = getattr(self, "do_" + type(a).__name__)
        result, nxt = handler(s, a)
        assert isinstance(result, (Ok, NotReady, Refused, Misuse, Freed, Flag, Claimed, Published))
        assert isinstance(nxt, State)
        return result, nxt

    # --- requests

    def do_Ingest(self, s: State, a: Ingest) -> tuple[Result, State]:
        st = s.stream_map()
        st.setdefault((a.rid, MAIN), Stream())  # idempotent, as the reference
        return Ok(), replace(s, streams=_sorted(st))

    def _in_flight(self, s: State, rid: int) -> bool:
        return any(v.in_flight for k, v in s.streams if k[0] == rid)

    def _draining(self, s: State, rid: int) -> None:
        # reset/remove wait for in-flight reads: blocked, so not enabled
        if any(v.retrieve == PENDING for k, v in s.streams if k[0] == rid):
            raise ProtocolError("reset/remove waits for the retrieve to finish")

    def _latch(self, v: Stream) -> str:
        return IDLE if self.R7_reset_clears_latch else v.retrieve  # R7

    def do_Reset(self, s: State, a: Reset) -> tuple[Result, State]:
        self._draining(s, a.rid)
        if self.R5_no_reset_in_flight and self._in_flight(s, a.rid):
            return Misuse("StepInFlightError"), s
        st, free, offloads = s.stream_map(), s.free, dict(s.offloads)
        for k, v in st.items():
            if k[0] != a.rid:
                continue
            if v.offload == OFFLOADED and not self.R12_reset_forgets_host:
                st[k] = replace(v, retrieve=self._latch(v))  # reload brings it back
                continue
            pages = 0 if a.free else v.pages
            free += v.pages - pages
            # R12: a committed host copy is forgotten with the tokens
            off = RESIDENT if v.offload == OFFLOADED else v.offload
            st[k] = Stream(pages=pages, offload=off, retrieve=self._latch(v))
            if v.offload == CLAIMED:  # the offload's generation guard will fail
                offloads[a.rid] = replace(offloads[a.rid], touched=True)
        host = s.host
        if self.R12_reset_forgets_host:
            host = tuple(h for h in s.host if h[0][0] != a.rid
                         or (h[0] in st and st[h[0]].offload == CLAIMED))
        return Ok(), replace(
            s, free=free, streams=_sorted(st), host=host,
            offloads=tuple(sorted(offloads.items())),
        )

    def do_Remove(self, s: State, a: Remove) -> tuple[Result, State]:
        self._draining(s, a.rid)
        if self.R5_no_reset_in_flight and self._in_flight(s, a.rid):
            return Misuse("StepInFlightError"), s
        st = s.stream_map()
        freed = sum(v.pages for k, v in st.items() if k[0] == a.rid)
        st = {k: v for k, v in st.items() if k[0] != a.rid}
        return Ok(), replace(
            s, free=s.free + freed, streams=_sorted(st),
            host=tuple(h for h in s.host if h[0][0] != a.rid),
            offloads=tuple(o for o in s.offloads if o[0] != a.rid),
        )

    # --- steps

    def reservations(self, step: Step, st: dict[Key, Stream]) -> dict[Key, int]:
        """Pages each stream must hold once the step is admitted."""
        growth: dict[Key, int] = {}
        for g in step.segments:
            if step.commit:
                growth[(g.rid, g.label)] = growth.get((g.rid, g.label), 0) + g.span
        want: dict[Key, int] = {}

        def ask(k: Key, tokens: int) -> None:
            want[k] = max(want.get(k, 0), self.need(tokens))

        base = {k: v.stored_len for k, v in st.items()}
        for forks, post in ((step.pre_forks, False), (step.post_forks, True)):
            for f, t in forks:
                for rid in step.padded:
                    extra = growth.get((rid, f), 0) if post else 0
                    if (rid, f) in st:
                        ask((rid, t), st[(rid, f)].stored_len + extra)
                        if not post and self.R9_fork_then_grow:
                            base[(rid, t)] = st[(rid, f)].stored_len
                    elif extra > 0:  # the step's own segment creates the source
                        ask((rid, t), extra)
        for g in step.segments:
            if g.span > 0:
                ask((g.rid, g.label), base.get((g.rid, g.label), 0) + g.span)
        return want

    def do_Admit(self, s: State, a: Admit) -> tuple[Result, State]:
        if not a.preplan and s.staged is not None:
            return Ok(), s  # the staged preplan already reserved this step
        st = s.stream_map()
        keys = named(a.step)
        if a.preplan and self.R10_preplan_after_commit and any(
            st[k].in_flight for k in keys if k in st
        ):
            return Misuse("StepInFlightError"), s
        if any(st[k].offload != RESIDENT for k in keys if k in st):
            return Refused("RequestOffloading"), s
        want = self.reservations(a.step, st)
        if self.R16_admit_makes_named:  # every named stream exists, so a mark covers it
            for k in sorted(keys):
                want.setdefault(k, 0)
        new = sum(max(0, n - st[k].pages) if k in st else n for k, n in want.items())
        if new > s.free:
            return Refused("AllocationFailed", new - s.free), s
        undo: list[tuple[Key, Tokens | None]] = []
        for k, n in want.items():
            if k not in st:
                undo.append((k, None))
            st[k] = replace(st.get(k, Stream()), pages=max(st.get(k, Stream()).pages, n))
        before = s.stream_map()
        for _, t in a.step.pre_forks:
            for rid in a.step.padded:
                if (rid, t) in before:
                    undo.append(((rid, t), before[(rid, t)].contents))
        marks = frozenset(k for k in keys if k in st)
        fresh = frozenset(k for k in st if k not in before)
        return Ok(), self._admitted(s, st, s.free - new, a, marks, tuple(undo), fresh)

    def _admitted(
        self, s: State, st: dict[Key, Stream], free: int, a: Admit,
        marks: frozenset[Key], undo: tuple[tuple[Key, Tokens | None], ...],
        fresh: frozenset[Key],
    ) -> State:
        if not self.R2_mark_everything_named:  # the reference marks segments only
            marks = frozenset(k for k in marks if k in {(g.rid, g.label) for g in a.step.segments})
        for k in marks:
            st[k] = replace(st[k], in_flight=True)
        p = Pending(a.step, ADMITTED, marks, undo if a.preplan else (),
                    fresh if a.preplan else frozenset())
        if a.preplan:
            return replace(s, free=free, streams=_sorted(st), staged=p)
        return replace(s, free=free, streams=_sorted(st), current=p)

    def _fork(self, st: dict[Key, Stream], rid: int, f: int, t: int) -> None:
        if (rid, f) in st and (rid, t) in st:
            src = st[(rid, f)]
            st[(rid, t)] = replace(st[(rid, t)], stored_len=src.stored_len, contents=src.contents)

    def do_Plan(self, s: State, a: Plan) -> tuple[Result, State]:
        if not a.preplan and s.current is None:
            if s.staged is None or s.staged.phase != PLANNED:
                raise ProtocolError("plan without an admitted step")
            # promotion: the staged step becomes the running one, undo dropped
            promoted = replace(s.staged, undo=(), fresh=frozenset())
            st = s.stream_map()
            if self.R11_preplan_forks_at_promotion:  # the preplan only planned them
                for f, t in promoted.step.pre_forks:
                    for rid in promoted.step.padded:
                        self._fork(st, rid, f, t)
            return Ok(), replace(s, streams=_sorted(st), current=promoted, staged=None)
        p = s.staged if a.preplan else s.current
        if p is None or p.phase != ADMITTED:
            raise ProtocolError("plan of a step that is not admitted")
        st = s.stream_map()
        if not (a.preplan and self.R11_preplan_forks_at_promotion):
            for f, t in p.step.pre_forks:
                for rid in p.step.padded:
                    self._fork(st, rid, f, t)
        p = replace(p, phase=PLANNED)
        if a.preplan:
            return Ok(), replace(s, streams=_sorted(st), staged=p)
        return Ok(), replace(s, streams=_sorted(st), current=p)

    def do_Write(self, s: State, a: Write) -> tuple[Result, State]:
        if s.current is None or s.current.phase != PLANNED:
            raise ProtocolError("write outside a planned step")
        return Ok(), replace(s, current=replace(s.current, phase=WRITTEN))

    def _unmark(self, st: dict[Key, Stream], keys: frozenset[Key], keep: frozenset[Key]) -> None:
        # kvref: a mark another pending step also owns stays (R10 makes this
        # moot for kvref; the reference clears it regardless)
        for k in keys - keep if self.R10_preplan_after_commit else keys:
            if k in st:
                st[k] = replace(st[k], in_flight=False)

    def do_Commit(self, s: State, a: Commit) -> tuple[Result, State]:
        p = s.current
        if p is None or p.phase == ADMITTED:
            raise ProtocolError("commit of a step that was not planned")
        st = s.stream_map()
        self._unmark(st, p.marks, s.staged.marks if s.staged else frozenset())
        for g in p.step.segments:
            k = (g.rid, g.label)
            if not p.step.commit or g.span == 0 or k not in st:
                continue
            if st[k].offload != RESIDENT:
                continue  # the reference's "dropping committed tokens" (I15)
            v = st[k]
            st[k] = replace(v, stored_len=v.stored_len + g.span,
                            contents=v.contents + (g.label,) * g.span)
        for f, t in p.step.post_forks:
            for rid in p.step.padded:
                self._fork(st, rid, f, t)
        return Ok(), replace(s, streams=_sorted(st), current=None)

    def do_ClearPreplan(self, s: State, a: ClearPreplan) -> tuple[Result, State]:
        p = s.staged
        if p is None:
            return Ok(), s
        st, free = s.stream_map(), s.free
        for k, old in reversed(p.undo):
            if k not in st:
                continue
            if old is None:  # invented by the preplan: removed with its pages
                free += st.pop(k).pages
            else:
                st[k] = replace(st[k], stored_len=len(old), contents=old)
        self._unmark(st, p.marks, s.current.marks if s.current else frozenset())
        return Ok(), replace(s, free=free, streams=_sorted(st), staged=None)

    # --- offload

    def do_OffloadClaim(self, s: State, a: OffloadClaim) -> tuple[Result, State]:
        st = s.stream_map()
        mine = {k: v for k, v in st.items() if k[0] == a.rid}
        if any(v.in_flight for v in mine.values()):  # R4: the whole request
            return Claimed(()), s
        claim = tuple((k[1], v.pages) for k, v in sorted(mine.items())
                      if v.offload == RESIDENT and v.pages > 0)
        if not claim:
            return Claimed(()), s
        for label, _ in claim:
            st[(a.rid, label)] = replace(st[(a.rid, label)], offload=CLAIMED)
        offloads = dict(s.offloads)
        offloads[a.rid] = Offload(claim)
        return Claimed(tuple(lb for lb, _ in claim)), replace(
            s, streams=_sorted(st), offloads=tuple(sorted(offloads.items())))

    def host_used(self, s: State) -> int:
        return sum(self.need(len(c)) for _, c in s.host)

    def do_OffloadCopy(self, s: State, a: OffloadCopy) -> tuple[Result, State]:
        off = s.offload_of(a.rid)
        if off is None or a.label in off.copied:
            raise ProtocolError("copy outside a claim")
        if off.touched:
            # a claimed stream changed since the claim: the commit is doomed,
            # so kvref copies nothing (and nothing can fail)
            return Flag(False), s
        v = s.stream_map().get((a.rid, a.label), Stream())  # removed: copies nothing
        if self.host_used(s) + self.need(v.stored_len) > self.scope.host_pages:
            # host full: this stream stays on device; no copy runs, so none can fail
            return Flag(False), s
        if a.copy_error:  # R8: every claim of the offload is abandoned
            _, nxt = self.do_OffloadAbandon(s, OffloadAbandon(a.rid))
            return Misuse("OffloadCopyError"), nxt
        offloads = dict(s.offloads)
        offloads[a.rid] = replace(off, copied=off.copied | {a.label})
        host = dict(s.host)
        host[(a.rid, a.label)] = v.contents
        return Flag(True), replace(
            s, host=tuple(sorted(host.items())), offloads=tuple(sorted(offloads.items())))

    def do_OffloadCommit(self, s: State, a: OffloadCommit) -> tuple[Result, State]:
        off = s.offload_of(a.rid)
        if off is None:
            raise ProtocolError("commit outside a claim")
        st = s.stream_map()
        gone = any((a.rid, label) not in st for label in off.copied)
        if off.touched or gone or not off.copied:  # all or nothing: the generation guard
            _, nxt = self.do_OffloadAbandon(s, OffloadAbandon(a.rid))
            return Freed(0), nxt
        freed = 0
        for label, pages in off.claimed:
            k = (a.rid, label)
            if label in off.copied:
                freed += pages  # the pages taken at claim (the reference's claim.pages)
                st[k] = replace(st[k], pages=0, offload=OFFLOADED)
            elif k in st:
                st[k] = replace(st[k], offload=RESIDENT)
        return Freed(freed), replace(
            s, free=s.free + freed, streams=_sorted(st),
            offloads=tuple(o for o in s.offloads if o[0] != a.rid))

    def do_OffloadAbandon(self, s: State, a: OffloadAbandon) -> tuple[Result, State]:
        off = s.offload_of(a.rid)
        if off is None:
            raise ProtocolError("abandon outside a claim")
        st = s.stream_map()
        for label, _ in off.claimed:
            if (a.rid, label) in st:
                st[(a.rid, label)] = replace(st[(a.rid, label)], offload=RESIDENT)
        dropped = {(a.rid, label) for label, _ in off.claimed}
        return Ok(), replace(
            s, streams=_sorted(st), host=tuple(h for h in s.host if h[0] not in dropped),
            offloads=tuple(o for o in s.offloads if o[0] != a.rid))

    def do_Reload(self, s: State, a: Reload) -> tuple[Result, State]:
        if self.R6_no_reload_mid_offload and s.offload_of(a.rid) is not None:
            return Flag(False), s
        copies = {k: c for k, c in s.host if k[0] == a.rid}
        needed = sum(self.need(len(c)) for c in copies.values())
        if not copies or needed > s.free:
            return Flag(False), s  # nothing moves
        st = s.stream_map()
        for k, c in copies.items():
            st[k] = replace(st.get(k, Stream()), pages=self.need(len(c)), stored_len=len(c),
                            contents=c, offload=RESIDENT)
        return Flag(True), replace(
            s, free=s.free - needed, streams=_sorted(st),
            host=tuple(h for h in s.host if h[0] not in copies))

    # --- disaggregation

    def do_Publish(self, s: State, a: Publish) -> tuple[Result, State]:
        if self.R13_publish_resident and any(
            v.offload != RESIDENT for k, v in s.streams if k[0] == a.rid
        ):
            return Published(()), s  # its pages are not on the device to be read
        lengths = tuple((k[1], v.stored_len if v.offload != OFFLOADED else 0)
                        for k, v in s.streams if k[0] == a.rid)
        return Published(lengths), s

    def do_RetrieveStart(self, s: State, a: RetrieveStart) -> tuple[Result, State]:
        st = s.stream_map()
        k = (a.rid, a.label)
        v = st.get(k, Stream())
        if v.retrieve == FAILED:
            return Refused("AdmitRuntimeError"), s
        if v.retrieve == PENDING:
            return NotReady(), s
        if a.length <= v.stored_len:
            return Ok(), s
        busy = set().union(*(named(p.step) for p in (s.current, s.staged) if p))
        if (self.R14_retrieve_refuses_named and v.in_flight) or (
            self.R15_retrieve_refuses_absent_named and k in busy
        ):
            # R14: the step planned its writes at the old length; R15: a step
            # names a label that did not exist at admit, so no mark covers it
            return Misuse("StepInFlightError"), s
        if v.offload != RESIDENT:
            return Refused("RequestOffloading"), s
        new = max(0, self.need(a.length) - v.pages)
        if new > s.free:
            return Refused("AllocationFailed", new - s.free), s
        # retrieved tokens carry identity labels+label: distinct from local writes
        tokens = v.contents + (self.scope.labels + a.label,) * (a.length - v.stored_len)
        st[k] = replace(v, pages=v.pages + new, stored_len=a.length, contents=tokens,
                        retrieve=PENDING)
        return NotReady(), replace(s, free=s.free - new, streams=_sorted(st))

    def do_RetrieveComplete(self, s: State, a: RetrieveComplete) -> tuple[Result, State]:
        st = s.stream_map()
        k = (a.rid, a.label)
        if st.get(k, Stream()).retrieve != PENDING:
            raise ProtocolError("no retrieve in progress")
        st[k] = replace(st[k], retrieve=IDLE if a.ok else FAILED)
        return Ok(), replace(s, streams=_sorted(st))
