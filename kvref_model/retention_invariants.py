"""The invariants of the sliding-window retention model (kvref_model.retention),
checked on every state and every transition the checker reaches.

The pool's own invariants (kvref_model.pages_invariants P1, P2, P3, P5) are
checked on the pool inside each state; P1 there is "reference counts =
tables naming the page", since the pool's tables are the streams' slot
tables less their released slots.  IDs V1..V10 are this model's;
specs/retention.md says which rule W.. each holds the model to.

State checks take `(model, state)`; transition checks take `(model, before,
action, result, after)`; both return `[(id, what is wrong), ...]`.
"""

from __future__ import annotations

from collections.abc import Callable

from kvref_model.pages_invariants import INVARIANTS as POOL_INVARIANTS
from kvref_model.pages_invariants import state_violations as pool_state_violations
from kvref_model.retention import (
    RELEASED,
    AllocationFailed,
    Append,
    CachePrefix,
    Count,
    Fork,
    MatchPrefix,
    Misuse,
    Offload,
    Refused,
    Reload,
    Remove,
    RetentionModel,
    Retrieve,
    State,
    Stream,
    Truncate,
    _ceil,
)

Check = tuple[str, str]

POOL = ("P1", "P2", "P3", "P5")  # kvref_model.pages_invariants, on the pool

INVARIANTS: dict[str, str] = {
    **{iid: POOL_INVARIANTS[iid] for iid in POOL},
    "V1": "a stream's table has ceil(n / ps) slots; `released` is whole pages, at most "
          "the window's first token; released slots hold no page, every other slot of a "
          "resident stream holds one, every slot of an offloaded stream none",
    "V2": "no page is released twice: every release the manager makes lists distinct "
          "pages the stream holds (the pool never refuses the manager)",
    "V3": "every token in the window (all tokens, for full attention) is resident and "
          "reads back right: slot i % ps of table[i // ps] holds (i, tokens[i])",
    "V4": "settled: a windowed stream holds no page wholly before its window, so at most "
          "ceil(W / ps) + 1 pages; a full-attention stream releases nothing",
    "V5": "the prefix cache: no page a windowed stream holds is registered",
    "V6": "the reference's counters: `position` is n, the next token's position",
    "V7": "no leak: with every stream removed, no page is held",
    "V8": "an action on one stream (a fork: on its target; a request's: on its streams) "
          "leaves every other stream, and the tokens of its window, as they were",
    "V9": "results: a refusal or misuse changes nothing; truncate and offload count the "
          "pages that became free, reload the pages it took: the retained slots only",
    "V10": "a write lands only in a page the writing stream holds alone, unregistered",
    "V11": "a window release never makes a page free-cached (it cannot push another "
           "stream's cached prefix toward eviction)",
    "V12": "a registered page's slots hold its key's tokens at their positions",
}


def _resident(st: Stream | None) -> bool:
    return st is not None and not st.offloaded


def _stream_checks(m: RetentionModel, s: State, h: int, st: Stream) -> list[Check]:
    out: list[Check] = []
    ps, n = m.scope.page_size, st.n
    first = m.window_start(h, n)
    if len(st.table) != _ceil(n, ps):
        out.append(("V1", f"stream {h}: {len(st.table)} slots for {n} tokens"))
    if st.released % ps or not 0 <= st.released <= first:
        out.append(("V1", f"stream {h}: released {st.released}, window starts at {first}"))
    lo = st.released // ps
    for i, p in enumerate(st.table):
        if i < lo and p is not None:
            out.append(("V1", f"stream {h}: released slot {i} holds page {p}"))
        elif i >= lo and (p is None) != st.offloaded:
            what = "holds page" if st.offloaded else "holds no page"
            out.append(("V1", f"stream {h}: retained slot {i} {what} {p or ''}".rstrip()))
    if st.position != n:
        out.append(("V6", f"stream {h}: position {st.position}, {n} tokens"))
    if st.offloaded:
        return out
    for i in range(first, n):
        p = st.table[i // ps] if i // ps < len(st.table) else None
        got = None if p is None else s.slots[p - 1][i % ps]
        if got != (i, st.tokens[i]):
            out.append(("V3", f"stream {h}: token {i} ({st.tokens[i]}) reads {got} "
                              f"from page {p}"))
            break
    held = [p for p in st.table if p is not None]
    bound = m.bound(h)
    if bound is None:
        if st.released:
            out.append(("V4", f"full-attention stream {h} released {st.released}"))
    else:
        keep = m.release_start(h, n)  # the window less the rollback margin (W15)
        early = [p for i, p in enumerate(st.table) if p is not None and (i + 1) * ps <= keep]
        if early or len(held) > bound:
            out.append(("V4", f"stream {h}: holds {held}, {early} wholly before the first "
                              f"token it keeps ({keep}), bound {bound}"))
        regd = [p for p in held if s.pool.page(p).key is not None]
        if regd:
            out.append(("V5", f"windowed stream {h} holds registered pages {regd}"))
    return out


def state_violations(m: RetentionModel, s: State) -> list[Check]:
    out = [(iid, msg) for iid, msg in pool_state_violations(m.pool, s.pool) if iid in POOL]
    if s.fault:
        out.append(("V2", s.fault))
    for h, st in enumerate(s.streams):
        if st is not None:
            out += _stream_checks(m, s, h, st)
    ps = m.scope.page_size
    for p, pg in enumerate(s.pool.pages, 1):
        if pg.key is None:
            continue
        depth, k, toks = 0, pg.key, pg.key.tokens
        while k.parent is not None:
            depth, k = depth + 1, k.parent
        want = tuple((depth * ps + j, t) for j, t in enumerate(toks))
        if s.slots[p - 1] != want:
            out.append(("V12", f"page {p} registered under {pg.key}, holds {s.slots[p - 1]}"))
    if all(st is None for st in s.streams) and any(pg.holders for pg in s.pool.pages):
        out.append(("V7", "no stream exists, yet pages are held: "
                          f"{[p for p, pg in enumerate(s.pool.pages, 1) if pg.holders]}"))
    return out


def _targets(m: RetentionModel, a: object) -> set[int] | None:
    """The streams an action may change (None: any)."""
    if isinstance(a, Append | Truncate | CachePrefix | MatchPrefix | Retrieve):
        return {m.holder(a.rid, a.label)} if m.in_scope(a.rid, a.label) else set()
    if isinstance(a, Fork):
        return {m.holder(a.rid, a.dst)} if m.in_scope(a.rid, a.dst) else set()
    if isinstance(a, Remove | Offload | Reload):
        return set(m.holders_of(a.rid)) if 0 <= a.rid < m.scope.requests else set()
    return None


def _window_reads(m: RetentionModel, s: State, h: int) -> list[object]:
    st, ps = s.streams[h], m.scope.page_size
    if st is None or st.offloaded:
        return []
    out: list[object] = []
    for i in range(m.window_start(h, st.n), st.n):
        p = st.table[i // ps] if i // ps < len(st.table) else None
        out.append(None if p is None else s.slots[p - 1][i % ps])
    return out


def transition_violations(m: RetentionModel, s: State, a: object, r: object,
                          n: State) -> list[Check]:
    out: list[Check] = []
    if isinstance(r, Misuse | Refused | AllocationFailed):
        if n != s:
            out.append(("V9", f"{r} changed the state"))
        return out
    targets = _targets(m, a)
    if targets is not None:
        for g in range(len(s.streams)):
            if g in targets:
                continue
            if n.streams[g] != s.streams[g] or _window_reads(m, n, g) != _window_reads(
                    m, s, g):
                out.append(("V8", f"{a} changed stream {g}: {s.streams[g]} -> "
                                  f"{n.streams[g]}"))
    free_before, free_after = m.num_free(s), m.num_free(n)
    if isinstance(a, Truncate | Offload) and isinstance(r, Count) and (
            r.n != free_after - free_before):
        out.append(("V9", f"{a} reported {r.n} freed, {free_after - free_before} were"))
    if isinstance(a, Reload) and isinstance(r, Count):
        ps = m.scope.page_size
        # the offloaded streams' retained slots: a sibling left on the device
        # (it held no page at the offload) takes nothing
        retained = sum(len(st.table) - st.released // ps for h in m.holders_of(a.rid)
                       if (st := s.streams[h]) is not None and st.offloaded)
        # S29: a slot whose page the cache still holds is shared again (a held
        # page costs nothing), so a reload takes at most one page per slot
        if r.n != free_before - free_after or r.n > retained:
            out.append(("V9", f"reload took {r.n} pages ({free_before - free_after} left the "
                              f"free count), {retained} slots were retained"))
    if isinstance(a, Append | Retrieve) and m.in_scope(a.rid, a.label):
        h = m.holder(a.rid, a.label)
        st, ps = n.streams[h], m.scope.page_size
        old = s.streams[h]
        if st is not None:
            for j in range((old.n if old is not None else 0), st.n):
                p = st.table[j // ps]
                if p is not None and not m.private(n, h, p):
                    out.append(("V10", f"token {j} written into page {p}, held by "
                                       f"{sorted(n.pool.page(p).holders)}, key "
                                       f"{n.pool.page(p).key}"))
        if m.window(h) is not None and set(n.pool.lru) - set(s.pool.lru):
            out.append(("V11", f"{type(a).__name__} to windowed stream {h} made pages "
                              f"{sorted(set(n.pool.lru) - set(s.pool.lru))} free-cached"))
    if isinstance(a, Fork) and m.in_scope(a.rid, a.dst):
        h, ps = m.holder(a.rid, a.dst), m.scope.page_size
        st = n.streams[h]
        if st is not None and st.n % ps and st.table and st.table[-1] is not None and (
                not m.private(n, h, st.table[-1])):
            out.append(("V10", f"fork target {h}'s part page {st.table[-1]} is not private"))
    return out


def violations(m: RetentionModel, s: State, a: object = None, r: object = None,
               prev: State | None = None) -> list[Check]:
    out = state_violations(m, s)
    if prev is not None:
        out += transition_violations(m, prev, a, r, s)
    return out


# ------------------------------------------------------------ coverage


def _released_more(m: RetentionModel, s: State, a: object, r: object, n: State) -> bool:
    if not isinstance(a, Append) or not m.in_scope(a.rid, a.label):
        return False
    h = m.holder(a.rid, a.label)
    before, after = s.streams[h], n.streams[h]
    return after is not None and after.released > (before.released if before else 0)


def _retired_shared(m: RetentionModel, s: State, a: object, r: object, n: State) -> bool:
    """A window release that dropped only this stream's reference."""
    if not _released_more(m, s, a, r, n):
        return False
    assert isinstance(a, Append)
    h = m.holder(a.rid, a.label)
    before, after = s.streams[h], n.streams[h]
    assert before is not None and after is not None
    return any(p is not None and q is None and n.pool.page(p).holders
               for p, q in zip(before.table, after.table, strict=False))


def _with_released(m: RetentionModel, s: State, a: object) -> bool:
    hs = _targets(m, a) or set()
    if isinstance(a, Fork):
        hs = {m.holder(a.rid, a.src)} if m.in_scope(a.rid, a.src) else set()
    return any((st := s.streams[h]) is not None and st.released > 0 for h in hs)


def _evicted(m: RetentionModel, s: State, a: object, r: object, n: State) -> bool:
    return bool(set(s.pool.lru) - set(n.pool.lru)) and not isinstance(a, MatchPrefix)


def _cow(m: RetentionModel, s: State, a: object, r: object, n: State) -> bool:
    if not isinstance(a, Append) or not m.in_scope(a.rid, a.label):
        return False
    h, ps = m.holder(a.rid, a.label), m.scope.page_size
    before, after = s.streams[h], n.streams[h]
    if before is None or after is None or not before.n % ps:
        return False
    i = before.n // ps
    return i < len(after.table) and before.table[i] != after.table[i] and (
        after.table[i] is not None)


def _windowed_nothing(m: RetentionModel, s: State, a: object, r: object, n: State) -> bool:
    if not isinstance(a, CachePrefix | MatchPrefix) or not m.in_scope(a.rid, a.label):
        return False
    h = m.holder(a.rid, a.label)
    st = s.streams[h]
    full = st is not None and st.n >= m.scope.page_size
    cached = any(pg.key is not None for pg in s.pool.pages)
    return m.window(h) is not None and r == Count(0) and (
        full if isinstance(a, CachePrefix) else cached)


def _retrieved(m: RetentionModel, s: State, a: object, r: object, n: State, *,
               let_go: bool) -> bool:
    """A retrieve that took a released prefix (let_go: and let the consumer's
    own pages of it go)."""
    if not isinstance(a, Retrieve) or not m.in_scope(a.rid, a.label) or n is s:
        return False
    h = m.holder(a.rid, a.label)
    before, after = s.streams[h] or Stream(), n.streams[h]
    if after is None or after.released <= before.released:
        return False
    return not let_go or any(p is not None for p in before.table[:after.released
                                                                  // m.scope.page_size])


# the interesting case of each mechanism: the checker reports how often it arose
INTERESTING: dict[str, Callable[[RetentionModel, State, object, object, State], bool]] = {
    "a commit released window pages": _released_more,
    "a window release of a shared page dropped only a reference": _retired_shared,
    "a copy-on-write on append": _cow,
    "a fork of a stream with a released prefix": lambda m, s, a, r, n: isinstance(a, Fork)
        and r.__class__.__name__ == "Ok" and _with_released(m, s, a),
    "a truncate refused: its window would reach released tokens": lambda m, s, a, r, n:
        isinstance(a, Truncate) and r == Misuse(RELEASED),
    "a truncate of a stream with a released prefix": lambda m, s, a, r, n: isinstance(
        a, Truncate) and isinstance(r, Count) and n is not s and _with_released(m, s, a),
    "an offload of a stream with a released prefix": lambda m, s, a, r, n: isinstance(
        a, Offload) and isinstance(r, Count) and _with_released(m, s, a),
    "a reload of a stream with a released prefix": lambda m, s, a, r, n: isinstance(
        a, Reload) and isinstance(r, Count) and _with_released(m, s, a),
    "a cached prefix evicted": _evicted,
    "a full-attention prefix hit": lambda m, s, a, r, n: isinstance(a, MatchPrefix)
        and isinstance(r, Count) and r.n > 0,
    "a windowed cache_prefix or match_prefix that did nothing": _windowed_nothing,
    "a retrieve that took the peer's released prefix": lambda m, s, a, r, n: _retrieved(
        m, s, a, r, n, let_go=False),
    "a retrieve that let the consumer's pages of that prefix go": lambda m, s, a, r, n:
        _retrieved(m, s, a, r, n, let_go=True),
}
