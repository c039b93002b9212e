"""The invariants of the shared-pages model (kvref_model.pages), checked on every
state and every transition the checker reaches.  IDs P1..P10; each names
the rule of specs/shared-pages.md it holds the model to.

State checks take `(model, state)`; transition checks take `(model, before,
action, result, after)`; both return `[(id, what is wrong), ...]`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from kvref_model.pages import (
    Allocate,
    Count,
    Hit,
    Key,
    Match,
    Misuse,
    Ok,
    Pages,
    PagesModel,
    Reclaimable,
    Register,
    Registered,
    Release,
    ResetPrefixCache,
    State,
    Write,
)

Check = tuple[str, str]

INVARIANTS: dict[str, str] = {
    "P1": "a page's holders are exactly the holders whose table names it (its "
          "reference count is the table entries and pins naming it), once each",
    "P2": "every page is exactly one of held, free-cached (in the LRU) or free-blank, "
          "each free page queued once",
    "P3": "a free-cached page is registered; a free-blank page is not",
    "P4": "a registered page's key is the key of its contents (tokens it really holds)",
    "P5": "no two pages are registered under one key (unless the scope keeps "
          "duplicates)",
    "P6": "allocation takes only free pages, blank ones first, and hands each out "
          "unregistered: an evicted page's key is dropped first",
    "P7": "reclaimable is what the releases would really free: a page whose last "
          "reference goes, counted once",
    "P8": "no leak: with nothing held and the cache reset, every page is free-blank",
    "P9": "a write lands only in a page its writer holds alone and that is not "
          "registered (no write into a shared or cached page)",
    "P10": "a hit attaches whole pages, at most len(tokens) - 1 tokens, and reads back "
           "exactly the tokens asked for",
}


def state_violations(m: PagesModel, s: State) -> list[Check]:
    out: list[Check] = []
    n = m.scope.pages
    named: dict[int, set[int]] = {}
    for h, table in enumerate(s.tables):
        if len(set(table)) != len(table):
            out.append(("P1", f"holder {h} names a page twice: {table}"))
        for p in table:
            named.setdefault(p, set()).add(h)
    for p in range(1, n + 1):
        if s.page(p).holders != named.get(p, set()):
            out.append(("P1", f"page {p}: holders {sorted(s.page(p).holders)}, named by "
                              f"{sorted(named.get(p, set()))}"))
    where = Counter([*s.lru, *s.blank, *(p for p in range(1, n + 1) if s.page(p).holders)])
    for p in range(1, n + 1):
        if where[p] != 1:
            out.append(("P2", f"page {p} is in {where[p]} of held/free-cached/free-blank"
                              f" (lru {s.lru}, blank {s.blank})"))
    out += [("P3", f"free-cached page {p} has no key") for p in s.lru if not s.page(p).key]
    out += [("P3", f"free-blank page {p} is registered") for p in s.blank if s.page(p).key]
    keys: dict[Key, int] = {}
    for p, pg in enumerate(s.pages, 1):
        if pg.key is None:
            continue
        if pg.key != m.chain_key(pg.content):
            out.append(("P4", f"page {p} registered under {pg.key}, holds {pg.content}"))
        if pg.key in keys and not m.scope.duplicates:  # a scope may keep duplicates
            out.append(("P5", f"pages {keys[pg.key]} and {p} share key {pg.key}"))
        keys[pg.key] = p
    if not any(pg.holders or pg.key for pg in s.pages) and sorted(s.blank) != list(
            range(1, n + 1)):
        out.append(("P8", f"nothing held or cached, free-blank is {s.blank}"))
    return out


def _chain(tokens: tuple[int, ...], extras: tuple[tuple[str, str], ...], ps: int,
           pages: int) -> list[Key]:
    """The contents the first `pages` pages of `tokens` must hold (literal)."""
    out: list[Key] = []
    parent = None
    for i in range(pages):
        parent = Key(parent, tokens[i * ps:(i + 1) * ps], extras)
        out.append(parent)
    return out


def transition_violations(m: PagesModel, s: State, a: object, r: object,
                          n: State) -> list[Check]:
    out: list[Check] = []
    if isinstance(a, Allocate) and isinstance(r, Pages):
        blank_first = s.blank[:len(r.pages)] + s.lru[:max(len(r.pages) - len(s.blank), 0)]
        if r.pages != blank_first:
            out.append(("P6", f"allocated {r.pages}, the free order says {blank_first}"))
        out += [("P6", f"page {p} handed out still registered ({n.page(p).key})")
                for p in r.pages if n.page(p).key is not None]
    if isinstance(a, Reclaimable) and isinstance(r, Count):
        t, freed = s, 0
        for h, ps in a.released:
            got, t = m.step(t, Release(h, ps))
            freed += got.n if isinstance(got, Count) else 0
        if freed != r.n:
            out.append(("P7", f"reclaimable {r.n}, the releases free {freed}"))
    if isinstance(a, ResetPrefixCache) and isinstance(r, Count) and (
            n.lru or any(pg.key for pg in n.pages if not pg.holders)):
        out.append(("P8", "a reset left a free page registered"))
    if isinstance(a, Write) and isinstance(r, Ok):
        pg = s.page(a.page)
        if pg.holders != {a.holder} or pg.key is not None:
            out.append(("P9", f"write into page {a.page}: holders {sorted(pg.holders)}, "
                              f"key {pg.key}"))
    if isinstance(a, Match) and isinstance(r, Hit):
        size = m.scope.page_size
        if r.num_tokens != len(r.pages) * size or r.num_tokens > max(len(a.tokens) - 1, 0):
            out.append(("P10", f"{r.num_tokens} tokens attached for {len(a.tokens)} asked"))
        want: list[Key | None] = list(_chain(a.tokens, a.extras, size, len(r.pages)))
        held = [s.page(p).content for p in r.pages]
        if held != want:
            out.append(("P10", f"hit pages {r.pages} hold {[str(k) for k in held]}, asked "
                               f"for {[str(k) for k in want]}"))
    return out


def violations(m: PagesModel, s: State, a: object = None, r: object = None,
               prev: State | None = None) -> list[Check]:
    out = state_violations(m, s)
    if prev is not None:
        out += transition_violations(m, prev, a, r, s)
    return out


def _evicts(m: PagesModel, s: State, a: object, r: object, n: State) -> bool:
    return isinstance(r, Pages) and len(r.pages) > len(s.blank)


def _capped(m: PagesModel, s: State, a: object, r: object, n: State) -> bool:
    """A prompt all of whose whole pages are cached, so the cap takes one off."""
    if not isinstance(a, Match) or not isinstance(r, Hit) or not a.tokens:
        return False
    ps, index, parent = m.scope.page_size, s.index(), None
    whole = len(a.tokens) // ps
    for i in range(whole):
        parent = m.key_of(parent, a.tokens[i * ps:(i + 1) * ps], a.extras)
        if parent not in index:
            return False
    return len(a.tokens) % ps == 0 and len(r.pages) == whole - 1


# the interesting case of each mechanism: the checker reports how often it arose
INTERESTING: dict[str, Callable[[PagesModel, State, object, object, State], bool]] = {
    "eviction of a cached page": _evicts,
    "hit on a free-cached page": lambda m, s, a, r, n: isinstance(r, Hit) and any(
        p in s.lru for p in r.pages),
    "hit capped below a fully cached prompt": _capped,
    "dedup on register": lambda m, s, a, r, n: isinstance(a, Register) and isinstance(
        r, Registered) and r.page != a.page,
    "release of a shared page frees nothing": lambda m, s, a, r, n: isinstance(a, Release)
        and isinstance(r, Count) and r.n < len(a.pages),
    "reclaimable below the references released": lambda m, s, a, r, n: isinstance(
        a, Reclaimable) and isinstance(r, Count)
        and r.n < sum(len(ps) for _, ps in a.released),
    "reset refused while held": lambda m, s, a, r, n: isinstance(a, ResetPrefixCache)
        and not isinstance(r, Count),
    "reset dropped cached pages": lambda m, s, a, r, n: isinstance(a, ResetPrefixCache)
        and isinstance(r, Count) and r.n > 0,
    "write refused (shared or registered)": lambda m, s, a, r, n: isinstance(a, Write)
        and isinstance(r, Misuse),
    "hit with another salt misses": lambda m, s, a, r, n: isinstance(a, Match)
        and isinstance(r, Hit) and not r.pages and any(
            m.hits(s, a.tokens, e) for e in m.scope.extras),
}
