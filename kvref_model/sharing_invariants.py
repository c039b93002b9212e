"""The invariants of the stream-level shared-pages model (kvref_model.sharing),
checked on every state and every transition the checker reaches.

The pool's own invariants (kvref_model.pages_invariants P1, P2, P3, P5, P8) are
checked on the pool inside each state; P4 is replaced by Q2, since here a
page's contents are its slots, not the pool model's `content` chain.  IDs
Q1..Q12 are this model's; specs/shared-pages.md (S17..) says which rule
each holds the model to.

State checks take `(model, state)`; transition checks take `(model, before,
action, result, after)`; both return `[(id, what is wrong), ...]`.
"""

from __future__ import annotations

from collections.abc import Callable

from kvref_model import pages
from kvref_model.pages_invariants import INVARIANTS as POOL_INVARIANTS
from kvref_model.pages_invariants import state_violations as pool_state_violations
from kvref_model.sharing import (
    Append,
    CachePrefix,
    Count,
    Fork,
    MatchPrefix,
    Misuse,
    Ok,
    Reclaimable,
    Reload,
    Remove,
    Reset,
    ResetPrefixCache,
    SharingModel,
    State,
    Stream,
    Truncate,
)

Check = tuple[str, str]

POOL = ("P1", "P2", "P3", "P5", "P8")  # kvref_model.pages_invariants, on the pool

INVARIANTS: dict[str, str] = {
    **{iid: POOL_INVARIANTS[iid] for iid in POOL},
    "Q1": "every stream reads back its tokens: position i < n is slot i % ps of "
          "table[i // ps], and holds tokens[i]",
    "Q2": "a registered page's slots hold the tokens its key names",
    "Q3": "a stream's chain is the keys of its first full pages of tokens under its "
          "request's salt, at most n // ps of them",
    "Q4": "the spare-page rule: a page past a stream's last token is private to it",
    "Q5": "a stream that does not exist holds no page",
    "Q6": "no leak: with every request removed, a prefix-cache reset leaves every page "
          "free-blank",
    "Q7": "no write lands in a shared or registered page (append, the fork's copy)",
    "Q8": "a fork shares only the source's full pages: the target's other pages are "
          "private to it",
    "Q9": "pages allocated are the first free ones (blank first, then least recently "
          "used cached), handed out unregistered: eviction takes only unheld pages and "
          "drops the key first",
    "Q10": "reclaimable counts only pages whose last reference would go: what removing "
           "the request frees",
    "Q11": "results: truncate returns the pages that became free; a refusal or misuse "
           "changes nothing; a truthful cache_prefix of a resident stream is not "
           "refused; a hit attaches "
           "whole pages, at most len(tokens) - 1 tokens",
    "Q12": "no KV from before a prefix-cache reset is found after it: a reset that "
           "forgets the cache leaves no stream holding tokens, on the device or the host",
}


def _ceil(n: int, d: int) -> int:
    return -(-n // d)


def _literal_keys(m: SharingModel, h: int, st: Stream) -> list[pages.Key]:
    """The keys of the full pages of the stream's tokens under its salt and
    the label whose KV it holds (literal: not the model's helper)."""
    ps, out, parent, tokens = m.scope.page_size, [], None, st.tokens
    space = st.space if st.space is not None else h % m.scope.labels
    extras = m.extras(m.rid_of(h), space)
    for i in range(len(tokens) // ps):
        parent = pages.Key(parent, tokens[i * ps:(i + 1) * ps], extras)
        out.append(parent)
    return out


def state_violations(m: SharingModel, s: State) -> list[Check]:
    out = [(iid, msg) for iid, msg in pool_state_violations(m.pool, s.pool) if iid in POOL]
    ps = m.scope.page_size
    for h, st in enumerate(s.streams):
        table = s.table(h)
        if st is None:
            if table:
                out.append(("Q5", f"stream {h} does not exist and holds {table}"))
            continue
        if st.offloaded:
            if table:
                out.append(("Q5", f"stream {h} is offloaded and holds {table}"))
            continue
        if len(table) < _ceil(st.n, ps):
            out.append(("Q1", f"stream {h}: {st.n} tokens in {len(table)} pages"))
        else:
            got = tuple(s.slots[table[i // ps] - 1][i % ps] for i in range(st.n))
            if got != st.tokens:
                out.append(("Q1", f"stream {h} reads {got}, its tokens are {st.tokens}"))
        want = _literal_keys(m, h, st)
        if len(st.chain) > st.n // ps or list(st.chain) != want[:len(st.chain)]:
            out.append(("Q3", f"stream {h} of {st.n} tokens {st.tokens}: chain "
                              f"{[str(k) for k in st.chain]}"))
        for i, p in enumerate(table[_ceil(st.n, ps):], _ceil(st.n, ps)):
            if not m.private(s, h, p):
                pg = s.pool.page(p)
                out.append(("Q4", f"stream {h}'s spare page {p} (index {i}, n {st.n}): "
                                  f"holders {sorted(pg.holders)}, key {pg.key}"))
    for p, pg in enumerate(s.pool.pages, 1):
        if pg.key is not None and s.slots[p - 1] != pg.key.tokens:
            out.append(("Q2", f"page {p} registered under {pg.key} holds {s.slots[p - 1]}"))
    if all(st is None for st in s.streams):
        r, pool = m.pool.step(s.pool, pages.ResetPrefixCache())
        if sorted(pool.blank) != list(range(1, m.scope.pages + 1)):
            out.append(("Q6", f"nothing exists, and after a reset ({r}) free-blank is "
                              f"{pool.blank}"))
    return out


def _write_checks(m: SharingModel, s: State, h: int, written: set[int], n: State,
                  what: str) -> list[Check]:
    """Each page in `written` (pages of h's table in `n`): before, free or private
    to h; after, private to h."""
    out: list[Check] = []
    for p in sorted(written):
        before, after = s.pool.page(p), n.pool.page(p)
        was_ok = not before.holders or (before.holders == {h} and before.key is None)
        if not was_ok or after.holders != {h} or after.key is not None:
            out.append(("Q7", f"{what} writes page {p}: before holders "
                              f"{sorted(before.holders)} key {before.key}, after holders "
                              f"{sorted(after.holders)} key {after.key}"))
    return out


def transition_violations(m: SharingModel, s: State, a: object, r: object,
                          n: State) -> list[Check]:
    out: list[Check] = []
    ps = m.scope.page_size
    if n is not s and isinstance(r, Misuse | pages.AllocationFailed | pages.ResetRefused
                                 ) and n != s:
        out.append(("Q11", f"{r} changed the state"))
    if isinstance(a, Reclaimable) and isinstance(r, Count):
        _, t = m.step(s, Remove(a.rid))
        freed = m.num_free(t) - m.num_free(s)
        if r.n != freed:
            out.append(("Q10", f"reclaimable says {r.n}, removing the request frees {freed}"))
    if isinstance(a, ResetPrefixCache) and isinstance(r, Count):
        # an offloaded stream's host copy would come back with a reload, and a
        # cache_prefix would key its pre-reset KV for the next match (S30)
        kept = [h for h, st in enumerate(n.streams) if st is not None and st.n]
        if kept:
            out.append(("Q12", f"reset_prefix_cache forgot the cache while streams {kept} "
                               "still hold tokens computed before it"))
    if isinstance(a, CachePrefix) and isinstance(r, Misuse) and m.in_scope(a.rid, a.label):
        st = s.streams[m.holder(a.rid, a.label)]
        if st is not None and not st.offloaded and a.tokens == st.tokens[:len(a.tokens)]:
            out.append(("Q11", f"a truthful cache_prefix of {a.tokens} refused: {r}"))
    if n is s:
        return out
    # any slot given a new value was written: the page must be the writer's alone
    for p in range(1, m.scope.pages + 1):
        if any(v is not None and v != u
               for u, v in zip(s.slots[p - 1], n.slots[p - 1], strict=True)):
            now = n.pool.page(p).holders
            out += _write_checks(m, s, next(iter(now)) if len(now) == 1 else -1, {p}, n,
                                 type(a).__name__)
    if isinstance(a, Append) and isinstance(r, Ok):
        h = m.holder(a.rid, a.label)
        st = s.streams[h]
        start = st.n if st is not None else 0
        table = n.table(h)
        out += _write_checks(m, s, h, {table[i // ps] for i in
                                       range(start, start + len(a.tokens))}, n, "append")
    src_of = s.streams[m.holder(a.rid, a.src)] if isinstance(a, Fork) else None
    # (a fork from a label the request lacks gives nothing, R20: no checks)
    if isinstance(a, Fork) and isinstance(r, Ok) and src_of is not None:
        hs, hd = m.holder(a.rid, a.src), m.holder(a.rid, a.dst)
        src = src_of
        full, dst = src.n // ps, n.table(hd)
        if dst[:full] != s.table(hs)[:full]:
            out.append(("Q8", f"fork target's table {dst} does not start with the "
                              f"source's full pages {s.table(hs)[:full]}"))
        for p in dst[full:]:
            if not m.private(n, hd, p):
                out.append(("Q8", f"fork target's page {p} past the source's full pages "
                                  f"is not its own: holders "
                                  f"{sorted(n.pool.page(p).holders)}"))
        if src.n % ps and len(dst) > full:
            out += _write_checks(m, s, hd, {dst[full]}, n, "fork's copy")
    if not isinstance(a, MatchPrefix):  # a hit takes cached pages by key, not allocation
        held = {p for p, pg in enumerate(n.pool.pages, 1) if pg.holders}
        # a reload shares again, by key, cached pages that keep their key (S29):
        # not an allocation
        again = {p for p in s.pool.lru if p in held and n.pool.page(p).key is not None
                 and n.pool.page(p).key == s.pool.page(p).key} if isinstance(a, Reload) else set()
        order = tuple(p for p in (*s.pool.blank, *s.pool.lru) if p not in again)
        taken = [p for p in order if p in held]
        first = order[:len(taken)]
        if sorted(taken) != sorted(first):
            out.append(("Q9", f"{type(a).__name__} took free pages {taken}, the free "
                              f"order says {first}"))
        out += [("Q9", f"page {p} handed out still registered ({n.pool.page(p).key})")
                for p in taken if n.pool.page(p).key is not None]
    if isinstance(a, Truncate) and isinstance(r, Count):
        freed = m.num_free(n) - m.num_free(s)
        if r.n != freed:
            out.append(("Q11", f"truncate says {r.n} pages freed, {freed} became free"))
    if isinstance(a, MatchPrefix) and isinstance(r, Count) and (
            r.n % ps or r.n > max(len(a.tokens) - 1, 0)):
        out.append(("Q11", f"{r.n} tokens attached for {len(a.tokens)} asked"))
    return out


def violations(m: SharingModel, s: State, a: object = None, r: object = None,
               prev: State | None = None) -> list[Check]:
    out = state_violations(m, s)
    if prev is not None:
        out += transition_violations(m, prev, a, r, s)
    return out


# ------------------------------------------------------ interesting cases

Pred = Callable[[SharingModel, State, object, object, State], bool]


def _cow_of(kind: str) -> Pred:
    """An append that copied the page it writes first: shared, or registered."""
    def pred(m: SharingModel, s: State, a: object, r: object, n: State) -> bool:
        if not isinstance(a, Append) or not isinstance(r, Ok):
            return False
        h = m.holder(a.rid, a.label)
        st, table = s.streams[h], s.table(h)
        if st is None or st.n // m.scope.page_size >= len(table):
            return False
        i = st.n // m.scope.page_size
        if n.table(h)[i] == table[i]:
            return False
        pg = s.pool.page(table[i])
        return len(pg.holders) > 1 if kind == "shared" else pg.key is not None
    return pred


def _fork(part: bool) -> Pred:
    def pred(m: SharingModel, s: State, a: object, r: object, n: State) -> bool:
        if not isinstance(a, Fork) or not isinstance(r, Ok):
            return False
        src = s.streams[m.holder(a.rid, a.src)]
        return src is not None and bool(src.n % m.scope.page_size) == part and src.n > 0
    return pred


def _fork_reuses(m: SharingModel, s: State, a: object, r: object, n: State) -> bool:
    if not isinstance(a, Fork) or not isinstance(r, Ok):
        return False
    hd = m.holder(a.rid, a.dst)
    return any(m.private(s, hd, p) for p in n.table(hd) if p in s.table(hd))


def _fork_drops(m: SharingModel, s: State, a: object, r: object, n: State) -> bool:
    if not isinstance(a, Fork) or not isinstance(r, Ok):
        return False
    hd = m.holder(a.rid, a.dst)
    return any(not m.private(s, hd, p) for p in s.table(hd))


def _dedup(m: SharingModel, s: State, a: object, r: object, n: State) -> bool:
    if not isinstance(a, CachePrefix) or not isinstance(r, Count):
        return False
    h = m.holder(a.rid, a.label)
    st, before = n.streams[h], s.streams[h]
    if st is None:
        return False
    # the pages the chain grew by (the count is only those newly keyed, S23)
    grown = len(st.chain) - (len(before.chain) if before is not None else 0)
    return any(n.pool.page(n.table(h)[i]).key != st.chain[i]
               for i in range(len(st.chain) - grown, len(st.chain)))


def _hit(where: str) -> Pred:
    def pred(m: SharingModel, s: State, a: object, r: object, n: State) -> bool:
        if not isinstance(a, MatchPrefix) or not isinstance(r, Count) or not r.n:
            return False
        hit = n.table(m.holder(a.rid, a.label))[:r.n // m.scope.page_size]
        if where == "cached":
            return any(p in s.pool.lru for p in hit)
        return any(m.rid_of(g) != a.rid for p in hit for g in s.pool.page(p).holders)
    return pred


def _capped(m: SharingModel, s: State, a: object, r: object, n: State) -> bool:
    if not isinstance(a, MatchPrefix) or not isinstance(r, Count) or not a.tokens:
        return False
    ps = m.scope.page_size
    whole = len(a.tokens) // ps
    index = s.pool.index()
    return (len(a.tokens) % ps == 0 and r.n == (whole - 1) * ps
            and all(k in index for k in m.keys(
                a.rid, m.space(s.streams[m.holder(a.rid, a.label)], a.label), a.tokens)))


def _salt_miss(m: SharingModel, s: State, a: object, r: object, n: State) -> bool:
    if not isinstance(a, MatchPrefix) or not isinstance(r, Count) or r.n:
        return False
    space = m.space(s.streams[m.holder(a.rid, a.label)], a.label)
    return any(m.pool.hits(s.pool, a.tokens, m.extras(q, space))
               for q in range(m.scope.requests))


def _spare_append(m: SharingModel, s: State, a: object, r: object, n: State) -> bool:
    if not isinstance(a, Append) or not isinstance(r, Ok):
        return False
    h = m.holder(a.rid, a.label)
    st = s.streams[h]
    return (st is not None and st.n % m.scope.page_size == 0
            and len(s.table(h)) > st.n // m.scope.page_size)


def _reclaim_shared(m: SharingModel, s: State, a: object, r: object, n: State) -> bool:
    if not isinstance(a, Reclaimable) or not isinstance(r, Count):
        return False
    held = {p for h in m.holders_of(a.rid) for p in s.table(h)}
    return r.n < len(held)


# the interesting case of each mechanism: the checker reports how often it arose
def _again(kind: str) -> Pred:
    """A reload that shares again (S29) a page that was free-cached, or held
    by another request, before it."""
    def pred(m: SharingModel, s: State, a: object, r: object, n: State) -> bool:
        if not isinstance(a, Reload) or not isinstance(r, Count) or n is s:
            return False
        mine = {p for h in m.holders_of(a.rid) for p in n.table(h)}
        was = (set(s.pool.lru) if kind == "cached" else
               {p for p, pg in enumerate(s.pool.pages, 1) if pg.holders})
        return bool(mine & was)
    return pred


INTERESTING: dict[str, Pred] = {
    "append copies a shared page (copy-on-write)": _cow_of("shared"),
    "append copies a registered page it holds alone": _cow_of("registered"),
    "append writes into a spare page (no allocation)": _spare_append,
    "append evicts a cached page": lambda m, s, a, r, n: isinstance(a, Append)
        and n is not s and any(n.pool.page(p).holders for p in s.pool.lru),
    "append refused: pages short": lambda m, s, a, r, n: isinstance(a, Append)
        and isinstance(r, pages.AllocationFailed),
    "fork copies the source's part page": _fork(True),
    "fork of whole pages only (nothing copied)": _fork(False),
    "fork reuses the target's private pages": _fork_reuses,
    "fork drops the target's shared pages": _fork_drops,
    "fork refused: pages short": lambda m, s, a, r, n: isinstance(a, Fork)
        and isinstance(r, pages.AllocationFailed),
    "truncate frees fewer pages than it releases": lambda m, s, a, r, n: isinstance(
        a, Truncate) and isinstance(r, Count) and n is not s
        and r.n < len(s.table(m.holder(a.rid, a.label))) - len(n.table(m.holder(
            a.rid, a.label))),
    "reset keeps private pages as spare": lambda m, s, a, r, n: isinstance(a, Reset)
        and not a.free and isinstance(r, Ok) and any(
            n.table(h) for h in m.holders_of(a.rid)),
    "cache_prefix deduplicates onto another page": _dedup,
    "cache_prefix refused: ids disagree with the chain": lambda m, s, a, r, n: isinstance(
        a, CachePrefix) and isinstance(r, Misuse) and r.kind == "TokenMismatchError",
    "hit on a free-cached page": _hit("cached"),
    "hit on a page another request holds": _hit("other request"),
    "hit capped below a fully cached prompt": _capped,
    "hit missed: another request's salt": _salt_miss,
    "match on a non-empty stream refused": lambda m, s, a, r, n: isinstance(
        a, MatchPrefix) and isinstance(r, Misuse),
    "reclaimable below the pages the request holds": _reclaim_shared,
    "reset_prefix_cache refused while held": lambda m, s, a, r, n: isinstance(
        a, ResetPrefixCache) and isinstance(r, pages.ResetRefused),
    "reset_prefix_cache refused: a stream on the host": lambda m, s, a, r, n: isinstance(
        a, ResetPrefixCache) and isinstance(r, pages.ResetRefused)
        and r.streams_offloaded > 0,
    "reset_prefix_cache dropped cached pages": lambda m, s, a, r, n: isinstance(
        a, ResetPrefixCache) and isinstance(r, Count) and r.n > 0,
    "remove leaves a cached prefix": lambda m, s, a, r, n: isinstance(a, Remove)
        and n is not s and len(n.pool.lru) > len(s.pool.lru),
    "reload shares again a free-cached page": _again("cached"),
    "reload shares again a page another request holds": _again("held"),
}

# the action each interesting case is about (the checker asks only its predicates)
_ABOUT = {"append": Append, "fork": Fork, "truncate": Truncate, "reset": Reset,
          "cache_prefix": CachePrefix, "hit": MatchPrefix, "match": MatchPrefix,
          "reclaimable": Reclaimable, "reset_prefix_cache": ResetPrefixCache,
          "remove": Remove, "reload": Reload}
CASE_ACTION: dict[str, type] = {name: _ABOUT[name.split()[0].rstrip(":")]
                                for name in INTERESTING}


# arises only where requests have different salts (Scope.salts)
NEEDS_TWO_SALTS = ("hit missed: another request's salt",)
