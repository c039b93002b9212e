"""Invariants I1-I22 (DESIGN.md, specs/stream-lifecycle.md), each a named predicate carrying its ID.

A predicate returns None when it holds and a one-line reason when it does
not.  State predicates look at one state; transition predicates look at
(state, action, result, next state), for the invariants that speak of
"after X" or "never dropped".  Where DESIGN.md speaks of page identities
(I1, I2, I8) the model states the counting form; the identity form is the
lockstep tests' to check.  `INTERESTING` says, per invariant, what
transition makes it non-vacuous, so the checker can report coverage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from kvref_model.core import (
    ADMITTED,
    CLAIMED,
    FAILED,
    IDLE,
    OFFLOADED,
    PENDING,
    RESIDENT,
    UNWRITTEN,
    WRITTEN,
    Action,
    Admit,
    CachePrefix,
    ClearPreplan,
    Commit,
    Count,
    Fault,
    Flag,
    Freed,
    Latched,
    MatchPrefix,
    Misuse,
    Model,
    OffloadClaim,
    OffloadCommit,
    OffloadCopy,
    Ok,
    Plan,
    Read,
    Reclaimable,
    Refused,
    Reload,
    Remove,
    Reset,
    Result,
    RetrieveComplete,
    RetrieveStart,
    State,
    Stream,
    Write,
    named,
)

Msg = str | None
StatePred = Callable[[Model, State], Msg]
StepPred = Callable[[Model, State, Action, Result, State], Msg]


def i1(m: Model, s: State) -> Msg:
    # a page two streams share is one page (I23 checks the ids)
    held = (sum(v.pages for _, v in s.streams) if s.pool is None or not m.scope.sharing
            else len({p for _, v in s.streams for p in v.table if p}))
    if s.free < 0 or s.free + held != m.scope.device_pages:
        return f"free {s.free} + held {held} != {m.scope.device_pages} usable pages"
    return None


def i2(m: Model, s: State) -> Msg:
    # counting form: the sink is outside the count, so no count may exceed it
    if s.free > m.scope.device_pages or any(v.pages < 0 for _, v in s.streams):
        return f"free {s.free} exceeds the {m.scope.device_pages} usable pages (sink freed?)"
    return None


def i3(m: Model, s: State) -> Msg:
    # a window's released slots hold no page (W2): the rest must
    for k, v in s.streams:
        if v.offload != OFFLOADED and v.pages < m.need(v.stored_len) - m.released(v):
            return f"{k} holds {v.pages} pages for {v.stored_len} tokens"
    # the running step only: a staged preplan's lengths settle at promotion (R11)
    for p in (s.current,):
        if p is None or p.phase == ADMITTED:
            continue  # lengths settle once plan applies the pre-forks
        st = s.stream_map()  # only here: most states run no planned step
        for g in p.step.segments:
            w = st.get((g.rid, g.label))
            if g.span and w is not None and w.pages < m.need(w.stored_len + g.span) - (
                    m.released(w)):
                return f"planned step writes {g.span} past {w.stored_len} into {w.pages} pages"
    return None


def i4(m: Model, s: State) -> Msg:
    if all(v.offload == RESIDENT for _, v in s.streams):
        return None  # nothing offloading: no named stream can be (most states)
    st = s.stream_map()
    for p in (s.current, s.staged):
        for k in sorted(named(p.step)) if p else ():
            if k in st and st[k].offload != RESIDENT:
                return f"{k} is {st[k].offload} while an admitted step names it"
    return None


def i5(m: Model, s: State) -> Msg:
    host = dict(s.host)
    for k, v in s.streams:
        if v.offload == OFFLOADED and (v.pages or host.get(k) != v.contents):
            return f"offloaded {k} holds {v.pages} pages / host copy {host.get(k)} != {v.contents}"
    return None


def i6(m: Model, s: State) -> Msg:
    if m.host_used(s) > m.scope.host_pages:
        return f"host uses {m.host_used(s)} of {m.scope.host_pages} pages"
    st = s.stream_map()
    for k, _ in s.host:
        off = s.offload_of(k[0])
        v = st.get(k)
        copied = off is not None and k[1] in off.copied
        if v is None or not (v.offload == OFFLOADED or (v.offload == CLAIMED and copied)):
            return f"host copy of {k} belongs to no offload"
    return None


def i7(m: Model, s: State) -> Msg:
    for k, v in s.streams:
        if len(v.contents) != v.stored_len:
            return f"{k} stores {v.stored_len} tokens but holds {len(v.contents)}"
        if not _TOKENS[m.nlab].issuperset(v.contents):  # a C-level pass, not a generator
            return f"{k} holds a token no write or retrieve produced"
    return None


class _Tokens(dict[int, frozenset[int]]):
    """Per label count L: the token identities a write or a retrieve makes
    (0 .. 2L - 1) and UNWRITTEN."""

    def __missing__(self, nlab: int) -> frozenset[int]:
        got = self[nlab] = frozenset([*range(2 * nlab), UNWRITTEN])
        return got


_TOKENS = _Tokens()


def i8_state(m: Model, s: State) -> Msg:
    st = s.stream_map()
    for p in (s.current, s.staged):
        for g in p.step.segments if p and p.phase != ADMITTED else ():
            if g.span and (g.rid, g.label) not in st:
                return f"planned step still writes ({g.rid}, {g.label}), which was removed"
    return None


def i8(m: Model, s: State, a: Action, r: Result, n: State) -> Msg:
    if isinstance(a, (Write, Read)) and r == Ok() and (
        s.current is None or s.current.phase == ADMITTED
    ):
        return f"{type(a).__name__} went through with no planned step to address"
    p = s.current if not (isinstance(a, Plan) and a.preplan) else s.staged
    if not isinstance(a, (Plan, Write, Commit)) or p is None:
        return None
    mine = named(p.step)
    before, after = s.stream_map(), n.stream_map()
    for k in set(before) | set(after):
        old, new = before.get(k), after.get(k)
        if k not in mine and (old and old.contents) != (new and new.contents):
            return f"{type(a).__name__} changed {k}, which the step does not name"
    return None


def i9(m: Model, s: State, a: Action, r: Result, n: State) -> Msg:
    if not isinstance(a, ClearPreplan) or s.staged is None:
        return None
    after = n.stream_map()
    invented = set(s.staged.fresh) | {k for k, old in s.staged.undo if old is None}
    for k in sorted(invented):
        if k in after:
            return f"label {k} the preplan created survives clear_preplan"
    if s.staged.phase != ADMITTED:
        for k, old in s.staged.undo:
            if old is not None and k in after and after[k].contents != old:
                return f"fork target {k} not rewound: {after[k].contents} != {old}"
    owned = n.current.marks if n.current else frozenset()
    for k, v in n.streams:
        if v.in_flight != (k in owned):
            return (f"{k} in_flight={v.in_flight} after clear_preplan; "
                    f"the running step owns it: {k in owned}")
    return None


def i10(m: Model, s: State, a: Action, r: Result, n: State) -> Msg:
    # every misuse and every refusal, of every call: nothing at all changes
    if isinstance(r, (Refused, Misuse)) and s != n:
        return f"{type(a).__name__} was refused ({r}) but changed the state"
    return None


def i11(m: Model, s: State, a: Action, r: Result, n: State) -> Msg:
    after = n.stream_map()
    for k, v in s.streams:
        if v.retrieve != FAILED or k not in after:
            continue
        cleared = isinstance(a, (Reset, Remove)) and a.rid == k[0] and not isinstance(r, Misuse)
        if cleared and after[k].retrieve == FAILED:
            return f"reset of {k[0]} kept the latched retrieve failure"
        if not cleared and after[k].retrieve != FAILED:
            return f"latched failure on {k} vanished on {type(a).__name__}"
        asked = isinstance(a, RetrieveStart) and (a.rid, a.label * m.scope.group_count) == k
        if asked and r != Refused("AdmitRuntimeError"):
            return f"retrieve on failed {k} answered {r}"
    return None


def i12(m: Model, s: State) -> Msg:
    if not s.streams and (s.free != m.scope.device_pages or s.host):
        return f"no request left, yet {m.scope.device_pages - s.free} pages held, host {s.host}"
    return None


def i13(m: Model, s: State) -> Msg:
    cur, staged = s.current, s.staged
    # a union only where both steps own marks: most states hold one step or none
    owned = (cur.marks | staged.marks if cur and staged else cur.marks if cur
             else staged.marks if staged else frozenset())
    for k, v in s.streams:
        if v.in_flight != (k in owned):
            return f"{k} in_flight={v.in_flight} but an admitted step owns its mark: {k in owned}"
    return None


def i14(m: Model, s: State, a: Action, r: Result, n: State) -> Msg:
    # the generation guard's purpose: never free a stream behind a stale copy
    if not isinstance(a, OffloadCommit) or not isinstance(r, Freed) or r.pages == 0:
        return None
    host, before = dict(n.host), s.stream_map()
    for k, v in n.streams:
        now_offloaded = v.offload == OFFLOADED and before[k].offload != OFFLOADED
        if now_offloaded and (host.get(k) != before[k].contents
                              or before[k].offload != CLAIMED):
            return f"offload commit freed {k}, changed since its host copy"
    return None


def i15(m: Model, s: State, a: Action, r: Result, n: State) -> Msg:
    if not isinstance(a, Commit) or s.current is None or not s.current.step.commit:
        return None
    p, before, after = s.current, s.stream_map(), n.stream_map()
    # a fork target's tokens are the source's: its own span is not what lands
    forks = p.step.post_forks + (() if p.forked else p.step.pre_forks)
    targets = {(rid, t) for _, t in forks for rid in p.step.padded}
    written = p.phase == WRITTEN
    for g in p.step.segments:
        k = (g.rid, g.label)
        if g.span == 0 or k in targets or k not in before:
            continue
        want = before[k].contents + ((g.label if written else UNWRITTEN),) * g.span
        if k not in after or after[k].contents != want:
            return f"commit dropped the {g.span} tokens of {k}"
    return None


def i17(m: Model, s: State, a: Action, r: Result, n: State) -> Msg:
    """A fault keeps the call's promise: beside what a fault-free call does,
    a fork fault may only leave fork targets empty; a reload gives back the
    pages it took (the free-cached ones it took uncached); a
    copy fault leaves nothing of the offload behind."""
    if not isinstance(r, Fault):
        return None
    if isinstance(a, Reload):
        # the pages it took came back (R26): only the pool may differ, every
        # page held as before (so as many free), and a key gone only from a
        # page that was free-cached (taken as a fresh one, perhaps written by
        # the copy)
        if replace(n, pool=s.pool) != s:
            return "a faulted reload moved something"
        if s.pool is not None and n.pool is not None and any(
                q.holders != p.holders or (q.key != p.key and (q.key is not None or p.holders))
                for p, q in zip(s.pool.pages, n.pool.pages, strict=True)):
            return "a faulted reload moved a page"
        return None
    if isinstance(a, OffloadCopy):
        off = s.offload_of(a.rid)
        claimed = {(a.rid, label) for label, _ in off.claimed} if off else set()
        left = [k for k, _ in n.host if k in claimed] + [r for r, _ in n.offloads if r == a.rid]
        return f"a faulted offload copy left {left}" if left else None
    if isinstance(a, (Plan, Commit)):
        preplan = isinstance(a, Plan) and a.preplan
        p = s.staged if preplan else (s.current if s.current is not None else s.staged)
        assert p is not None
        _, clean = m.step(s, replace(a, fork_error=False))
        forks = p.step.pre_forks + (p.step.post_forks if isinstance(a, Commit) else ())
        targets = {(rid, t) for _, t in forks for rid in p.step.padded}
        got, want = n.stream_map(), clean.stream_map()
        for k in set(got) | set(want):
            g, w = got.get(k), want.get(k)
            if g == w:
                continue
            # a target left empty keeps only what the step added after the
            # fork (its own span), and so does a target fed by it in a chain
            lost = (k in targets and g is not None and w is not None
                    # its pages: the ones it keeps private (S19), which sharing may
                    # leave fewer than a fork that shared the source's
                    # and no key chain: its tokens are not the ones whose
                    # keys the fork would have given it (S23)
                    and g.chain == 0
                    and replace(g, stored_len=w.stored_len, contents=w.contents,
                                pages=w.pages, table=w.table, chain=w.chain) == w
                    and w.contents[len(w.contents) - len(g.contents):] == g.contents)
            if not lost:
                return f"a fork fault changed {k} beyond emptying a fork target: {g} != {w}"
        return None
    return None


def i18_state(m: Model, s: State) -> Msg:
    st = s.stream_map()
    for rid in s.leases:
        mine = [(k, v) for k, v in st.items() if k[0] == rid]
        if not mine:
            return f"request {rid} is leased to a peer but was removed"
        for k, v in mine:
            if v.offload != RESIDENT:
                return f"{k} is {v.offload} while its publication is leased"
    return None


_NO_STREAM = Stream()  # a removed stream (frozen: one value serves every call)


def i18(m: Model, s: State, a: Action, r: Result, n: State) -> Msg:
    # the pin: pages a peer may be copying stay with their stream, each at its
    # slot, whatever the call (a retrieve's window release or copy-on-write
    # too, R71). Their tokens may still change (a fork onto the stream): the
    # generation says so (R35)
    before, after = s.stream_map(), n.stream_map()
    for rid in s.leases:
        for k, v in before.items():
            if k[0] != rid:
                continue
            # what publish named: the pages under its tokens (a label a cleared
            # preplan invented holds none of those, and goes with its pages)
            # (less the slots its window released: no page, nothing to copy)
            w = after.get(k, _NO_STREAM)
            if w.pages < m.need(v.stored_len) - m.released(v):
                return f"{type(a).__name__} took pages of leased {k}"
            # by identity where tables are kept (an abstract read-back has none)
            for i in range(min(m.need(v.stored_len), len(v.table))):
                p = v.table[i]
                if p and (i >= len(w.table) or w.table[i] != p):
                    return f"{type(a).__name__} let go of page {p} (slot {i}) of leased {k}"
    return None


def i19(m: Model, s: State, a: Action, r: Result, n: State) -> Msg:
    # a retrieve of stale published info never copies: it fails, latched
    if isinstance(a, RetrieveComplete) and a.moved:
        k = (a.rid, a.label * m.scope.group_count)  # group 0's (I30: they agree)
        v = n.stream_map().get(k)
        if v is not None and v.retrieve == IDLE:
            return f"a copy whose publisher moved mid-copy landed in {k}"
        return None
    if not isinstance(a, RetrieveStart) or not a.stale:
        return None
    k = (a.rid, a.label * m.scope.group_count)
    old, new = s.stream_map().get(k), n.stream_map().get(k)
    if new is None:
        return None
    grew = new.stored_len > (old.stored_len if old else 0)
    started = new.retrieve == PENDING and (old is None or old.retrieve != PENDING)
    if grew or started:
        return f"a retrieve of stale published info started copying into {k}"
    if isinstance(r, Latched) and new.retrieve != FAILED:
        return f"a stale retrieve answered {r} but {k} is not latched"
    return None


def i22(m: Model, s: State, a: Action, r: Result, n: State) -> Msg:
    """While a request stays leased, what its streams held is never overwritten
    in place: each stream's old contents are a prefix of its new ones (R50).
    Across processes the lease is all that protects a peer's copy (R35)."""
    if not s.leases:
        return None
    old, new = s.stream_map(), n.stream_map()
    for k, v in old.items():
        leased = k[0] in s.leases and k[0] in n.leases
        if leased and k in new and new[k].contents[:len(v.contents)] != v.contents:
            return f"{a} overwrote leased stream {k} in place"
    return None


def i21(m: Model, s: State, a: Action, r: Result, n: State) -> Msg:
    """A preplan over the running step runs only against the lengths it was
    planned from: its promotion (or its real admit answering ok) finds every
    stream it shares with that step at the length its plan assumed."""
    p = s.staged
    if p is None or s.current is not None or not p.basis:
        return None
    promoted = isinstance(a, Plan) and not a.preplan and n.staged is None
    admitted = isinstance(a, Admit) and not a.preplan and r == Ok()
    if not (promoted or admitted):
        return None
    st = s.stream_map()
    for k, want in p.basis:
        got = st[k].stored_len if k in st else None
        if got != want:
            return f"preplan promoted over {k} at length {got}; its plan assumed {want}"
    return None


# --- page identities: the pool model's invariants and the sharing and
# retention models' (P1-P3, Q1-Q11, V1-V12), stated once over the one model


def i23(m: Model, s: State) -> Msg:
    """S1, S2: every page is held (its holders exactly the streams whose
    table names it, each once), free-cached (keyed, in the LRU once) or
    free-blank (no key, in the blank queue once); `free` counts both."""
    pool = s.pool
    if pool is None:
        return None
    refs: dict[int, set[int]] = {}
    for k, v in s.streams:
        mine = [p for p in v.table if p]
        if len(set(mine)) != len(mine):
            return f"{k} holds a page twice: {v.table}"
        if v.pages != len(mine):
            return f"{k} counts {v.pages} pages, its table holds {len(mine)}"
        for p in mine:
            refs.setdefault(p, set()).add(m.holder(k))
    lru, blank = set(pool.lru), set(pool.blank)
    if len(lru) != len(pool.lru) or len(blank) != len(pool.blank) or lru & blank:
        return f"a page queued twice: lru {pool.lru}, blank {pool.blank}"
    for p, pg in enumerate(pool.pages, 1):
        if pg.holders != refs.get(p, set()):
            return f"page {p}: held by {sorted(pg.holders)}, named by {sorted(refs.get(p, ()))}"
        if (p in lru or p in blank) == bool(pg.holders):
            return f"page {p} is {'free and held' if pg.holders else 'neither free nor held'}"
        if (p in lru) != (not pg.holders and pg.key is not None):
            return f"page {p}: in the LRU {p in lru}, key {pg.key}"
    if s.free != len(lru) + len(blank):
        return f"free {s.free}, the pool has {len(lru) + len(blank)} free pages"
    return None


def i24(m: Model, s: State) -> Msg:
    """S17, S4, R55: every holder of a page holds it at the same slot and reads
    the same tokens there; a keyed page's key is the chain of each holder's
    tokens (so an evicted or stale key is never a holder's), and never names
    KV nobody wrote or a peer's."""
    pool = s.pool
    if pool is None or not m.scope.sharing:
        return None
    ps = m.scope.page_size
    seen: dict[int, tuple[object, int, tuple[int, ...]]] = {}
    for k, v in s.streams:
        if v.offload == OFFLOADED:
            continue
        parent = None
        for i, p in enumerate(v.table):
            toks = v.contents[i * ps:(i + 1) * ps]
            key = pool.pages[p - 1].key if p else None
            if key is not None:
                if len(toks) == ps:
                    parent = m.pool.key_of(parent, toks, m.extras(k[0]))
                    if key != parent:
                        return f"{k} slot {i}: page {p} keyed {key}, its tokens chain to {parent}"
                elif key.tokens[:len(toks)] != toks:
                    return f"{k} slot {i}: page {p} keyed {key}, holds {toks}"
                if not m._cachable(key.tokens):
                    return f"page {p} is keyed over KV no one computed here: {key}"
            elif len(toks) == ps:
                parent = m.pool.key_of(parent, toks, m.extras(k[0]))
            if not p:
                continue
            if p in seen:
                k0, i0, t0 = seen[p]
                n = min(len(t0), len(toks))
                if i0 != i or t0[:n] != toks[:n]:
                    return f"page {p}: {k0} reads {t0} at slot {i0}, {k} {toks} at slot {i}"
            if p not in seen or len(toks) > len(seen[p][2]):
                seen[p] = (k, i, toks)
    return None


def i25(m: Model, s: State) -> Msg:
    """S10, S27: the running step's planned writes land in pages private to
    their stream (unshared, unkeyed), and so does every spare page."""
    pool = s.pool
    if pool is None or not m.scope.sharing:
        return None
    st = s.stream_map()
    spans: dict[tuple[int, int], int] = {}
    if s.current is not None and s.current.phase != ADMITTED:
        for g in s.current.step.segments:
            spans[(g.rid, g.label)] = spans.get((g.rid, g.label), 0) + g.span
    for k, v in st.items():
        if v.offload == OFFLOADED:
            continue
        ps = m.scope.page_size
        lo = v.stored_len // ps if spans.get(k) else m.need(v.stored_len)
        for i in range(lo, len(v.table)):
            p = v.table[i]
            if p and not m.private(pool, k, p):
                why = "a planned write" if i < m.need(v.stored_len + spans.get(k, 0)) \
                    else "a spare page"
                return f"{k} slot {i}: {why} into page {p}, shared or keyed"
    return None


def i26(m: Model, s: State) -> Msg:
    """W1-W3, W15, H7: a windowed stream on the device holds no page wholly
    before max(0, n - W - k), and every slot of its window [max(0, n - W), n)
    holds one; a chunked one likewise from its chunk's start k tokens back,
    and from its chunk's start n // C * C (`Scope.first_kept`, `first_read`)."""
    if s.pool is None or not m.scope.windowed:
        return None
    ps = m.scope.page_size
    for k, v in s.streams:
        w = m.scope.window(k[1])
        if w is None or v.offload == OFFLOADED:
            continue
        whole = min(len(v.table), m.scope.first_kept(k[1], v.stored_len) // ps)
        if any(v.table[:whole]):
            return f"{k} at {v.stored_len} tokens holds a page before its window: {v.table}"
        start = m.scope.first_read(k[1], v.stored_len) // ps
        if not all(v.table[start:m.need(v.stored_len)]):
            return f"{k} at {v.stored_len} tokens lost a page of its window: {v.table}"
    return None


def i27(m: Model, s: State, a: Action, r: Result, n: State) -> Msg:
    """S29: a reload shares again each full page whose key its host copy
    remembers and the cache held before the call (the very cached page, at
    its slot), and every other page it takes is fresh and private: after
    preemption by offload, no private copy of a page whose key is cached."""
    if not isinstance(a, Reload) or r != Flag(True) or s.pool is None or n.pool is None:
        return None
    index, st, after, ps = s.pool.index(), s.stream_map(), n.stream_map(), m.scope.page_size
    for k, c in s.host:
        if k[0] != a.rid or k not in after:
            continue
        v, w = st[k], after[k]
        keys, parent = {}, None
        for i in range(len(c) // ps):
            parent = keys[i] = m.pool.key_of(parent, c[i * ps:(i + 1) * ps], m.extras(k[0]))
        for i in range(m.released(v), len(w.table)):
            p = w.table[i]
            want = index.get(keys[i]) if i in v.keyed and i in keys else None
            if want is not None and p != want:
                return f"{k} slot {i}: reloaded into page {p}, the cache holds its key in {want}"
            if want is None and p and not m.private(n.pool, k, p):
                return f"{k} slot {i}: reloaded into page {p}, shared or keyed, not its own"
    return None


def i28(m: Model, s: State) -> Msg:
    """W9, W10: no page a windowed stream holds is keyed, so a window's
    release never leaves a cached page on the LRU that pushes another
    stream's prefix toward eviction (vLLM 42948), and a hit never attaches
    pages before a window (the retired retention model's V5, V11)."""
    pool = s.pool
    if pool is None or not m.scope.windowed or m.scope.window_cache:
        return None  # with window_cache, W9 and W10 are off: H2-H4 instead
    for k, v in s.streams:
        if m.scope.window(k[1]) is None:
            continue
        keyed = [p for p in v.table if p and pool.pages[p - 1].key is not None]
        if keyed:
            return f"{k} is windowed and holds keyed pages {keyed}"
    return None


def i29(m: Model, s: State, a: Action, r: Result, n: State) -> Msg:
    """S26, S13: reclaimable counts the pages removing the request frees: those
    whose last reference it holds, each once (SGLang 35270; the retired
    sharing model's Q10)."""
    if not isinstance(a, Reclaimable) or not isinstance(r, Count) or s.pool is None:
        return None
    got, after = m.step(s, Remove(a.rid))
    if not isinstance(got, Ok):
        return None
    if r.n != after.free - s.free:
        return f"reclaimable says {r.n}, removing {a.rid} frees {after.free - s.free}"
    return None


def i30(m: Model, s: State) -> Msg:
    """H1: a label's groups move together: each group's stream of a label
    exists with group 0's and has its length, its tokens (each in its own
    group's identity) and its flags (following ids only where the group
    caches: W9's window group follows none); so a hit attached the same length in
    every group, and a refused call changed none. Where the stream is
    (resident, claimed, offloaded) may differ: an offload copies each
    group's stream on its own, and the host may take one and not another."""
    g = m.scope.group_count
    if g == 1:
        return None
    st = s.stream_map()
    for (rid, lb), v in s.streams:
        if lb % g:
            continue
        for i in range(1, g):
            w = st.get((rid, lb + i))
            if w is None:
                return f"{(rid, lb)} has no stream for group {i}"
            # group i's own token identity is group 0's plus i (UNWRITTEN stays)
            same = tuple(t - i if t >= 0 else t for t in w.contents) == v.contents
            if not same or (w.stored_len, w.in_flight, w.retrieve) != (
                    v.stored_len, v.in_flight, v.retrieve):
                return f"{(rid, lb)}: group {i} is at {w} where group 0 is at {v}"
        # followed ids (S33) key only where a group caches: a window group
        # under W9 follows none, the label's other groups all or none
        follows = {st[(rid, lb + i)].followed for i in range(g) if not m._never_cached(lb + i)}
        if len(follows) > 1:
            return f"{(rid, lb)}: its caching groups disagree on following ids"
        if any(st[(rid, lb + i)].followed for i in range(g) if m._never_cached(lb + i)):
            return f"{(rid, lb)}: a group that never caches (W9) follows ids"
    return None


def i31(m: Model, s: State, a: Action, r: Result, n: State) -> Msg:
    """H3, H4: the pages one window stream lets go of in one call reach the
    LRU in chain order: none waits behind a later page of its own chain, so
    the tail a window hit reads is evicted last (vLLM 48435). Only pages the
    stream held alone before the call: a page another stream (a fork, a
    hit) also held goes free when that one lets go, in its own call or
    later in this one, and its place is then that stream's release."""
    pool, before = n.pool, s.pool
    if pool is None or before is None or not m.scope.window_cache:
        return None
    old = set(before.lru)
    new = [p for p in pool.lru if p not in old]
    if len(new) < 2:
        return None
    place = {pool.pages[p - 1].key: i for i, p in enumerate(new)}
    for i, p in enumerate(new):
        key = pool.pages[p - 1].key
        if key is None or not key.tokens or m.scope.window(key.tokens[0]) is None:
            continue
        mine = before.pages[p - 1].holders
        up = key.parent
        while up is not None:
            j = place.get(up, -1)
            if j > i and len(mine) == 1 and before.pages[new[j] - 1].holders == mine:
                return (f"window page {p} is evicted before page {new[j]}, "
                        "which comes before it in its chain")
            up = up.parent
    return None


STATE: dict[str, StatePred] = {
    "I1": i1, "I2": i2, "I3": i3, "I4": i4, "I5": i5, "I6": i6, "I7": i7,
    "I8": i8_state, "I12": i12, "I13": i13, "I18": i18_state,
    "I23": i23, "I24": i24, "I25": i25, "I26": i26, "I28": i28, "I30": i30,
}
TRANSITION: dict[str, StepPred] = {
    "I8": i8, "I9": i9, "I10": i10, "I11": i11, "I14": i14, "I15": i15, "I17": i17,
    "I18": i18, "I19": i19, "I21": i21, "I22": i22, "I27": i27, "I29": i29, "I31": i31,
}
# I16 (tp-symmetry) is not a property of one manager: the model is
# deterministic, so every rank replaying one trace has one free count.
# tests/distributed checks it on real ranks.
NOT_IN_MODEL = {"I16": "checked by the distributed test only (the model is one rank)"}
INVARIANT_IDS = (*(f"I{i}" for i in range(1, 20)), "I21", "I22", "I23", "I24", "I25", "I26",
                 "I27", "I28", "I29", "I30", "I31")
# the invariants a scope setting gives content to: without it they hold vacuously
FEATURE: dict[str, str] = {"I24": "sharing", "I25": "sharing", "I26": "windowed",
                           "I27": "sharing", "I28": "windowed", "I29": "sharing",
                           "I30": "groups", "I31": "window_cache"}


def applies(i: str, scope: object) -> bool:
    """Whether invariant ``i`` can arise in ``scope`` (its feature is on)."""
    return i not in NOT_IN_MODEL and bool(getattr(scope, FEATURE.get(i, "depth"), True))


# built once, not per call; a result of another class equals neither
_I22_REFUSALS = (Refused("PublishLeased"), Refused("ForkPending"))


def _claim_in_flight(m: Model, s: State, a: Action, r: Result, n: State) -> bool:
    return isinstance(a, OffloadClaim) and any(
        v.in_flight for k, v in s.streams if k[0] == a.rid)


def _i(what: str, pred: Callable[[Model, State, Action, Result, State], bool]
       ) -> tuple[str, Callable[[Model, State, Action, Result, State], bool]]:
    return what, pred


INTERESTING: dict[str, tuple[str, Callable[[Model, State, Action, Result, State], bool]]] = {
    "I1": _i("pages returned by an offload commit",
             lambda m, s, a, r, n: isinstance(a, OffloadCommit) and isinstance(r, Freed)
             and r.pages > 0),
    "I2": _i("every usable page handed out", lambda m, s, a, r, n: n.free == 0),
    "I3": _i("a step planned on a high-water stream",
             lambda m, s, a, r, n: isinstance(a, Plan)
             and any(v.pages > m.need(v.stored_len) for _, v in n.streams)),
    "I4": _i("a claim attempted while a step was in flight", _claim_in_flight),
    "I5": _i("an offload committed",
             lambda m, s, a, r, n: isinstance(a, OffloadCommit) and r != Freed(0)),
    "I6": _i("a copy refused: host pool full",
             lambda m, s, a, r, n: isinstance(a, OffloadCopy) and r == Flag(False)),
    "I7": _i("a reload restored tokens",
             lambda m, s, a, r, n: isinstance(a, Reload) and r == Flag(True)
             and any(v.contents for k, v in n.streams if k[0] == a.rid)),
    "I8": _i("a commit while another request held tokens",
             lambda m, s, a, r, n: isinstance(a, Commit) and s.current is not None
             and any(v.contents for k, v in s.streams if k not in named(s.current.step))),
    "I9": _i("a clear_preplan of a planned preplan with a pre-fork",
             lambda m, s, a, r, n: isinstance(a, ClearPreplan) and s.staged is not None
             and s.staged.phase != ADMITTED and bool(s.staged.undo)),
    "I10": _i("an admit refused after part of it could have been reserved",
              lambda m, s, a, r, n: isinstance(a, Admit) and isinstance(r, Refused)
              and len(m.reservations(a.step, s.stream_map())) > 1),
    "I11": _i("a failed retrieve reported again later",
              lambda m, s, a, r, n: isinstance(a, RetrieveStart)
              and r == Refused("AdmitRuntimeError")),
    "I12": _i("the last request removed after holding pages",
              lambda m, s, a, r, n: isinstance(a, Remove) and not n.streams
              and s.free < m.scope.device_pages),
    "I13": _i("a commit cleared marks",
              lambda m, s, a, r, n: isinstance(a, Commit) and s.current is not None
              and bool(s.current.marks)),
    "I14": _i("an offload commit refused by the guard (a claimed stream changed)",
              lambda m, s, a, r, n: isinstance(a, OffloadCommit) and r == Freed(0)
              and any(o.touched for rid, o in s.offloads if rid == a.rid)),
    "I17": _i("a fork copy fault that emptied a target",
              lambda m, s, a, r, n: isinstance(a, (Plan, Commit)) and r == Fault("ForkCopyError")),
    "I15": _i("a commit of a span",
              lambda m, s, a, r, n: isinstance(a, Commit) and s.current is not None
              and s.current.step.commit and any(g.span for g in s.current.step.segments)),
    "I18": _i("a claim, reset, remove or retrieve of a leased request",
              lambda m, s, a, r, n: isinstance(a, (OffloadClaim, Reset, Remove, RetrieveStart))
              and a.rid in s.leases and any(v.pages for k, v in s.streams if k[0] == a.rid)),
    "I19": _i("a retrieve of stale published info latched",
              lambda m, s, a, r, n: isinstance(a, RetrieveStart) and a.stale
              and isinstance(r, Latched)),
    "I22": _i("a fork refused over a leased stream, or a publish under a pending fork",
              lambda m, s, a, r, n: type(r) is Refused and r in _I22_REFUSALS),
    "I21": _i("a preplan over the running step promoted",
              lambda m, s, a, r, n: isinstance(a, Plan) and s.staged is not None
              and bool(s.staged.basis) and s.current is None and n.staged is None),
    "I23": _i("pages let go to the pool by an offload commit",
              lambda m, s, a, r, n: isinstance(a, OffloadCommit) and isinstance(r, Freed)
              and n.free > s.free),
    "I24": _i("a prefix hit attached cached pages",
              lambda m, s, a, r, n: isinstance(a, MatchPrefix) and isinstance(r, Count)
              and r.n > 0),
    "I25": _i("a copy-on-write at plan (a shared or keyed page swapped for a spare)",
              lambda m, s, a, r, n: isinstance(a, Plan) and isinstance(r, Ok)
              and n.pool is not None and n.free == s.free and n.pool != s.pool),
    "I27": _i("a reload re-attached a page the cache still held",
              lambda m, s, a, r, n: isinstance(a, Reload) and r == Flag(True)
              and n.pool is not None and any(
                  p and not m.private(n.pool, k, p) for k, v in n.streams
                  if k[0] == a.rid and k in dict(s.host) for p in v.table)),
    "I26": _i("a commit released pages before the window",
              lambda m, s, a, r, n: isinstance(a, Commit) and isinstance(r, Ok | Fault)
              and n.free > s.free),
    "I28": _i("a prefix-cache call on a windowed stream",
              lambda m, s, a, r, n: isinstance(a, MatchPrefix | CachePrefix)
              and m.scope.window(a.label * m.scope.group_count) is not None),
    "I29": _i("reclaimable counted pages a removal would free",
              lambda m, s, a, r, n: isinstance(a, Reclaimable) and isinstance(r, Count)
              and r.n > 0),
    "I30": _i("a hit attached in every group",
              lambda m, s, a, r, n: isinstance(a, MatchPrefix) and isinstance(r, Count)
              and r.n > 0 and m.scope.group_count > 1),
    "I31": _i("a window page freed free-cached behind another",
              lambda m, s, a, r, n: n.pool is not None and s.pool is not None
              and len(n.pool.lru) > 1 and len(n.pool.lru) > len(s.pool.lru)
              and any(m.scope.window(lb) is not None for lb in range(m.nlab))),
}


# ---------------------------------------------------------------------------
# Where each transition predicate and interesting case can fail or hold, for
# the checker's fast path (kvref_model.check.TransitionChecks): it skips a predicate
# only where the predicate returns None (an interesting case: False) whatever
# else holds, as its first lines say.  An ID absent from a table is not
# limited by it.  tests/model/test_fast_path.py calls every predicate outside
# its limits, on pairs of states no transition joins, and wants None there.

# the action types a transition predicate can fail on (its first test)
ON_ACTIONS: dict[str, tuple[type, ...]] = {
    "I8": (Write, Read, Plan, Commit), "I9": (ClearPreplan,), "I14": (OffloadCommit,),
    "I15": (Commit,), "I19": (RetrieveStart, RetrieveComplete), "I21": (Plan, Admit),
    "I27": (Reload,), "I29": (Reclaimable,),
}
# the result types it can fail on
ON_RESULTS: dict[str, tuple[type, ...]] = {
    "I10": (Refused, Misuse), "I14": (Freed,), "I17": (Fault,), "I27": (Flag,),
    "I29": (Count,),
}


def _latched(s: State) -> bool:
    return any(v.retrieve == FAILED for _, v in s.streams)


def _leased(s: State) -> bool:
    return bool(s.leases)


def _staged(s: State) -> bool:
    return s.staged is not None


def _committing(s: State) -> bool:
    return s.current is not None and s.current.step.commit


def _over_basis(s: State) -> bool:
    return s.staged is not None and s.current is None and bool(s.staged.basis)


# what the state a transition leaves must have for the predicate to fail (its
# first lines return None otherwise): I11 looks only at streams whose retrieve
# failed, I18 and I22 only at leased ones, I9 at a staged preplan, I15 at a
# running step that keeps its span, I21 at a preplan built over a step
WHEN: dict[str, Callable[[State], bool]] = {
    "I11": _latched, "I18": _leased, "I22": _leased, "I9": _staged, "I15": _committing,
    "I21": _over_basis,
}
# what the state a transition leaves must have for an interesting case to
# hold (its first lines ask it): I18 names a leased request, and most states
# lease none while most of I18's actions are refusals (the others' actions
# are rare: guarding them would save nothing)
INTERESTING_WHEN: dict[str, Callable[[State], bool]] = {"I18": _leased}
# the predicates that hold on every transition whose next state is the very
# object it left: I10 fails only if the state changed (`s != n`), I22 only if
# a stream's contents changed, I14 only if a stream became offloaded, I31
# only if pages joined the LRU
UNCHANGED_HOLDS = frozenset({"I10", "I14", "I22", "I31"})
# on such a transition, the action types a predicate can still fail on: I11's
# latch cannot vanish when nothing changed, so only a reset or remove that
# kept it, or a retrieve answered otherwise than refused, fails it
UNCHANGED_ON_ACTIONS: dict[str, tuple[type, ...]] = {"I11": (Reset, Remove, RetrieveStart)}
# on such a transition, the predicates whose verdict depends on the state
# alone (the action and result only name it in the message): I18 compares the
# leased streams' pages after with their lengths before, here one state
UNCHANGED_STATE_ONLY = frozenset({"I18"})
# the action types an interesting case can hold on
INTERESTING_ON: dict[str, tuple[type, ...]] = {
    "I1": (OffloadCommit,), "I3": (Plan,), "I4": (OffloadClaim,), "I5": (OffloadCommit,),
    "I6": (OffloadCopy,), "I7": (Reload,), "I8": (Commit,), "I9": (ClearPreplan,),
    "I10": (Admit,), "I11": (RetrieveStart,), "I12": (Remove,), "I13": (Commit,),
    "I14": (OffloadCommit,), "I15": (Commit,), "I17": (Plan, Commit),
    "I18": (OffloadClaim, Reset, Remove, RetrieveStart), "I19": (RetrieveStart,), "I21": (Plan,),
    "I23": (OffloadCommit,), "I24": (MatchPrefix,), "I25": (Plan,), "I26": (Commit,),
    "I27": (Reload,), "I28": (MatchPrefix, CachePrefix), "I29": (Reclaimable,),
    "I30": (MatchPrefix,),
}
# the result types it can hold on
INTERESTING_RESULTS: dict[str, tuple[type, ...]] = {
    "I1": (Freed,), "I6": (Flag,), "I7": (Flag,), "I10": (Refused,), "I11": (Refused,),
    "I14": (Freed,), "I17": (Fault,), "I19": (Latched,), "I22": (Refused,),
    "I23": (Freed,), "I24": (Count,), "I25": (Ok,), "I26": (Ok, Fault), "I27": (Flag,),
    "I29": (Count,), "I30": (Count,),
}
# on a transition whose next state is the very object it left, the cases
# whose truth is that state's alone: I2 looks only at the next state's pages
INTERESTING_UNCHANGED_STATE_ONLY = frozenset({"I2"})
# the cases that cannot hold on such a transition: I31 wants the LRU longer
# after than before
INTERESTING_CHANGED_ONLY = frozenset({"I31"})


def violations(m: Model, s: State, a: Action | None = None, r: Result | None = None,
               prev: State | None = None, states: bool = True) -> list[tuple[str, str]]:
    """Every (ID, reason) that fails on `s`, and on the transition into it."""
    out = [(i, msg) for i, f in STATE.items() if states and (msg := f(m, s))]
    if a is not None and r is not None and prev is not None:
        out += [(i, msg) for i, f in TRANSITION.items() if (msg := f(m, prev, a, r, s))]
    return out

