"""The abstract model of shared device pages: reference counts, a chained-hash
prefix cache and an LRU of free cached pages (issue 18, first layer).

Porcupine style, as kvref_model.core: `PagesModel(scope).init()` is the first
state and `PagesModel.step(state, action)` is a pure function to
`(result, next_state)`.  Every action has a result in every state: a value,
a typed refusal (`AllocationFailed`, `ResetRefused`) that changes nothing,
or a `Misuse` (the kvref error the pool raises) that changes nothing.

The state is the pool (each page's holders and hash key, the free-cached
LRU order, the free-blank FIFO) and, as the pool's environment, what the
engine holds: each holder's table of page references in stream order, and
each page's contents (the chain of tokens its bytes were written from).  A
holder is a stream's page table or a pin (a lease, an offload claim); it
holds a page at most once, so a page's reference count is its holder count.

Pages are interchangeable up to renaming; `kvref_model.pages_check` encodes a
state under the renaming that numbers pages by first appearance.

The rules are class attributes, as in kvref_model.core: a variant with one of
them off is the planted defect it prevents (tests/conformance/
test_page_pool_plants.py runs the checker on each).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

Tokens = tuple[int, ...]
Extras = tuple[tuple[str, str], ...]  # tagged extra keys: (("lora", "a"), ("salt", "x"))


@dataclass(frozen=True)
class Key:
    """A page's hash key: the parent page's key, its tokens, its extra keys.
    The model keeps the whole chain; kvref.prefix.keys keeps a digest of it."""

    parent: Key | None
    tokens: Tokens
    extras: Extras

    def __str__(self) -> str:  # compact, for messages: [01|10 salt=ab]
        chain: list[str] = []
        k: Key | None = self
        while k is not None:
            chain.append("".join(map(str, k.tokens)))
            k = k.parent
        tags = ",".join(f"{t}={v}" for t, v in self.extras)
        return "[" + "|".join(reversed(chain)) + (f" {tags}" if tags else "") + "]"


@dataclass(frozen=True)
class Scope:
    pages: int = 3  # usable device pages 1..pages; page 0 is the sink, never here
    holders: int = 2
    page_size: int = 1
    alphabet: int = 2  # token ids written: 0 .. alphabet - 1
    # two extra-key tuples whose values join to the same string untagged
    extras: tuple[Extras, ...] = ((("salt", "ab"),), (("lora", "a"), ("salt", "b")))
    depth: int = 0  # 0: explore until no new state
    # Another engine's pool stated as the model (docs/verification/vllm-block-pool.md);
    # each default keeps kvref's rules exactly.
    # One key may name several pages, hits taking the oldest registered (vLLM keeps
    # duplicate blocks so that a block table stays append-only): no dedup on register.
    duplicates: bool = False
    # A release puts freed blank pages at the front of the free-blank queue, in the
    # order given (vLLM prepends them: LIFO reuse, for GPU locality), not at the back.
    blank_to_front: bool = False
    # The pool trusts its caller: careless calls (a double release, a release of a
    # page not held, a repeated register...) are the caller's to refuse, so the
    # protocol leaves them out (vLLM's BlockPool keeps ref counts, not holders).
    # The model still answers one with Misuse; only the write check stays, since
    # vLLM answers it (BlockPool.is_block_writable).
    trusts_caller: bool = False
    # A release may send the pages it frees back blank, their keys dropped (a
    # window passing pages, H3 of specs/retention.md). vLLM's free_blocks has
    # no such release: a freed block keeps its hash until evicted.
    blank_release: bool = True
    # transformers' continuous-batching cache (docs/verification/vllm-block-pool.md,
    # its transformers section): a register whose key another page has makes the
    # registering holder (Register.holder) take that page in its own page's place,
    # in its table, and release its own; kvref keeps the caller's page.
    dedup_adopts: bool = False
    # An allocation may evict free-cached pages (LRU first). Off: cached pages are
    # not free, an allocation takes blank pages only and NumFree counts those
    # (transformers keeps unreferenced hashed blocks in its ledger, out of the pool).
    allocate_evicts: bool = True
    # ResetPrefixCache evicts every free-cached page even while pages are held
    # (transformers evicts all its cached blocks at once under memory pressure);
    # kvref refuses a reset while anything is held (S14).
    reset_while_held: bool = False


@dataclass(frozen=True)
class Page:
    holders: frozenset[int] = frozenset()  # the reference count is len(holders)
    key: Key | None = None  # registered under
    content: Key | None = None  # environment: what its bytes hold (None: nothing valid)


@dataclass(frozen=True)
class State:
    pages: tuple[Page, ...]  # page p at index p - 1
    lru: tuple[int, ...] = ()  # free-cached, least recently used first
    blank: tuple[int, ...] = ()  # free-blank, in allocation order
    tables: tuple[tuple[int, ...], ...] = ()  # environment: each holder's references
    # registered pages, oldest first; kept only under Scope.duplicates, where it says
    # which of a key's pages a hit takes (always () otherwise)
    order: tuple[int, ...] = ()

    def page(self, p: int) -> Page:
        return self.pages[p - 1]

    def index(self) -> dict[Key, int]:
        """Each key's page: under duplicates the oldest registered of its pages."""
        if not self.order:
            return {pg.key: p for p, pg in enumerate(self.pages, 1) if pg.key is not None}
        out: dict[Key, int] = {}
        for p in (*self.order, *range(1, len(self.pages) + 1)):
            key = self.pages[p - 1].key
            if key is not None:
                out.setdefault(key, p)
        return out


# -------------------------------------------------------------- actions


@dataclass(frozen=True)
class Allocate:
    holder: int
    n: int


@dataclass(frozen=True)
class Match:
    """The longest chain of cached pages for `tokens`, referenced for `holder`."""

    holder: int
    tokens: Tokens
    extras: Extras = ()


@dataclass(frozen=True)
class Lookup:
    """What `Match` would attach, taking nothing."""

    tokens: Tokens
    extras: Extras = ()


@dataclass(frozen=True)
class Write:
    """The pool's write check, then (if allowed) the engine fills `page`."""

    holder: int
    page: int
    content: Key


@dataclass(frozen=True)
class Register:
    page: int
    parent: Key | None
    tokens: Tokens
    extras: Extras = ()
    # whose table registers it: read only under Scope.dedup_adopts, where that
    # holder adopts the page that has the key already
    holder: int | None = None


@dataclass(frozen=True)
class Share:
    """`holder` takes a reference on pages others hold (a fork, a pin)."""

    holder: int
    pages: tuple[int, ...]


@dataclass(frozen=True)
class Release:
    """`holder` drops its references, tail of the stream first."""

    holder: int
    pages: tuple[int, ...]
    # a page this frees goes back blank, its key dropped, not free-cached
    # (a window's release at commit: H3 of specs/retention.md)
    blank: bool = False


@dataclass(frozen=True)
class Take:
    """`holder` takes a reference on cached pages a lookup found, held or
    free-cached (a hit that is not one chain from page 0: a window's, H2)."""

    holder: int
    pages: tuple[int, ...]


@dataclass(frozen=True)
class Reclaimable:
    """How many pages these releases together would free (a query)."""

    released: tuple[tuple[int, tuple[int, ...]], ...]


@dataclass(frozen=True)
class NumFree:
    pass


@dataclass(frozen=True)
class ResetPrefixCache:
    pass


Action = (Allocate | Match | Lookup | Write | Register | Share | Release | Take
          | Reclaimable | NumFree | ResetPrefixCache)
ACTIONS: tuple[type, ...] = (Allocate, Match, Lookup, Write, Register, Share, Release, Take,
                             Reclaimable, NumFree, ResetPrefixCache)


# -------------------------------------------------------------- results


@dataclass(frozen=True)
class Ok:
    pass


@dataclass(frozen=True)
class Pages:
    pages: tuple[int, ...]


@dataclass(frozen=True)
class Hit:
    pages: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class Registered:
    page: int  # the page the key names: the caller's, or the one that had it (dedup)


@dataclass(frozen=True)
class Count:
    n: int


@dataclass(frozen=True)
class AllocationFailed:
    pages_short: int


@dataclass(frozen=True)
class ResetRefused:
    pages_held: int
    # streams on the host (the stream-level model, S30); the pool knows none
    streams_offloaded: int = 0


@dataclass(frozen=True)
class Misuse:
    kind: str  # the KVRefError subclass kvref.core.page_pool raises; nothing changed


Result = Ok | Pages | Hit | Registered | Count | AllocationFailed | ResetRefused | Misuse

REF, WRITE, REGISTER, ARG = ("PageRefError", "PageNotWritableError", "PageRegisterError",
                             "InvalidArgumentError")


# ---------------------------------------------------------------- model


class PagesModel:
    # the rules (specs/shared-pages.md); a variant turns one off
    EVICT_DROPS_KEY = True  # S4, vLLM PR 4761
    HIT_LEAVES_LRU = True  # S5, vLLM 16825
    TAGGED_EXTRAS = True  # S7, vLLM 44701
    CAP_BEFORE_LAST_TOKEN = True  # S8, vLLM PR 11186
    RELEASE_REFUSES_DUPLICATES = True  # S9, vLLM 42571
    DEDUP_KEEPS_PAGE = True  # S11, mini-sglang PR 142
    RECLAIM_COUNTS_PAGES_ONCE = True  # S13, SGLang 35270
    RELEASE_CHECKS_HOLDER = True  # S9, SGLang PR 12224
    WRITE_NEEDS_PRIVATE = True  # S10, issue 18: a missing copy-on-write

    def __init__(self, scope: Scope) -> None:
        self.scope = scope

    def init(self) -> State:
        n = self.scope.pages
        return State(pages=(Page(),) * n, blank=tuple(range(1, n + 1)),
                     tables=((),) * self.scope.holders)

    # ------------------------------------------------------------ keys

    def key_of(self, parent: Key | None, tokens: Tokens, extras: Extras) -> Key:
        if not self.TAGGED_EXTRAS:  # the values joined, tags dropped
            extras = (("", "".join(v for _, v in extras)),)
        return Key(parent, tokens, extras)

    def chain_key(self, content: Key | None) -> Key | None:
        """The key a page of this content is registered under."""
        if content is None:
            return None
        return self.key_of(self.chain_key(content.parent), content.tokens, content.extras)

    def hits(self, s: State, tokens: Tokens, extras: Extras) -> tuple[int, ...]:
        ps = self.scope.page_size
        cap = len(tokens) - 1 if self.CAP_BEFORE_LAST_TOKEN else len(tokens)
        index, out, parent = s.index(), [], None
        for i in range(max(cap, 0) // ps):
            parent = self.key_of(parent, tokens[i * ps:(i + 1) * ps], extras)
            p = index.get(parent)
            if p is None:
                break
            out.append(p)
        return tuple(out)

    def cached(self, s: State, tokens: Tokens, extras: Extras) -> tuple[int | None, ...]:
        """Per full page a hit may attach (S8's cap), the page its chain key
        names, or None: a gap does not end the list, as it ends `hits`."""
        ps = self.scope.page_size
        cap = len(tokens) - 1 if self.CAP_BEFORE_LAST_TOKEN else len(tokens)
        index, out, parent = s.index(), [], None
        for i in range(max(cap, 0) // ps):
            parent = self.key_of(parent, tokens[i * ps:(i + 1) * ps], extras)
            out.append(index.get(parent))
        return tuple(out)

    # ------------------------------------------------------------ step

    def step(self, s: State, a: Action) -> tuple[Result, State]:
        return getattr(self, "_" + type(a).__name__)(s, a)  # type: ignore[no-any-return]

    def _bad_pages(self, pages: tuple[int, ...]) -> bool:
        return any(not 1 <= p <= self.scope.pages for p in pages)

    def _Allocate(self, s: State, a: Allocate) -> tuple[Result, State]:
        if a.n < 0:
            return Misuse(ARG), s
        free = len(s.blank) + (len(s.lru) if self.scope.allocate_evicts else 0)
        if a.n > free:
            return AllocationFailed(a.n - free), s
        taken = s.blank[:a.n]
        evicted = s.lru[:a.n - len(taken)]
        pages = list(s.pages)
        for p in taken + evicted:  # an evicted page's key goes before its reuse
            key = None if self.EVICT_DROPS_KEY else pages[p - 1].key
            pages[p - 1] = Page(frozenset({a.holder}), key, None)
        got = taken + evicted
        t = self._with(s, pages, lru=s.lru[len(evicted):], blank=s.blank[len(taken):],
                       add=(a.holder, got))
        if s.order and self.EVICT_DROPS_KEY:
            t = replace(t, order=tuple(p for p in s.order if p not in evicted))
        return Pages(got), t

    def _Match(self, s: State, a: Match) -> tuple[Result, State]:
        hits = self.hits(s, a.tokens, a.extras)
        if any(a.holder in s.page(p).holders for p in hits):
            return Misuse(REF), s  # it holds one of them already
        pages = list(s.pages)
        for p in hits:
            pg = pages[p - 1]
            pages[p - 1] = replace(pg, holders=pg.holders | {a.holder})
        lru = tuple(p for p in s.lru if p not in hits) if self.HIT_LEAVES_LRU else s.lru
        return (Hit(hits, len(hits) * self.scope.page_size),
                self._with(s, pages, lru=lru, add=(a.holder, hits)))

    def _Take(self, s: State, a: Take) -> tuple[Result, State]:
        if (len(set(a.pages)) != len(a.pages) or self._bad_pages(a.pages)
                or any(s.page(p).key is None or a.holder in s.page(p).holders
                       for p in a.pages)):
            return Misuse(REF), s  # twice, not cached, or held by it already
        pages = list(s.pages)
        for p in a.pages:
            pages[p - 1] = replace(pages[p - 1], holders=pages[p - 1].holders | {a.holder})
        lru = tuple(p for p in s.lru if p not in a.pages) if self.HIT_LEAVES_LRU else s.lru
        return Ok(), self._with(s, pages, lru=lru, add=(a.holder, a.pages))

    def _Lookup(self, s: State, a: Lookup) -> tuple[Result, State]:
        hits = self.hits(s, a.tokens, a.extras)
        return Hit(hits, len(hits) * self.scope.page_size), s

    def _Write(self, s: State, a: Write) -> tuple[Result, State]:
        if self._bad_pages((a.page,)):
            return Misuse(WRITE), s
        pg = s.page(a.page)
        if a.holder not in pg.holders or (self.WRITE_NEEDS_PRIVATE and (
                len(pg.holders) > 1 or pg.key is not None)):
            return Misuse(WRITE), s  # not the writer's, shared, or registered
        pages = list(s.pages)
        pages[a.page - 1] = replace(pg, content=a.content)
        return Ok(), replace(s, pages=tuple(pages))

    def _Register(self, s: State, a: Register) -> tuple[Result, State]:
        if self._bad_pages((a.page,)) or len(a.tokens) != self.scope.page_size:
            return Misuse(REGISTER), s  # no such page, or not a full page
        pg = s.page(a.page)
        key = self.key_of(a.parent, a.tokens, a.extras)
        if not pg.holders:
            return Misuse(REGISTER), s  # a free page holds nothing committed
        if pg.key is not None:  # registered once, immutable after
            return (Registered(a.page), s) if pg.key == key else (Misuse(REGISTER), s)
        q = s.index().get(key)
        if self.scope.dedup_adopts:
            if a.holder not in pg.holders:
                return Misuse(REGISTER), s  # the holder must be one of the page's
            if q is not None:
                return self._adopt(s, a, q)
        if self.scope.duplicates:  # registered beside any page that has the key
            pages = list(s.pages)
            pages[a.page - 1] = replace(pg, key=key)
            return Registered(a.page), replace(s, pages=tuple(pages),
                                               order=(*s.order, a.page))
        if q is not None:  # the page that has the key wins; the caller keeps its own
            if self.DEDUP_KEEPS_PAGE:
                return Registered(q), s
            pages = list(s.pages)
            pages[a.page - 1] = Page()
            return Registered(q), replace(s, pages=tuple(pages), blank=(*s.blank, a.page))
        pages = list(s.pages)
        pages[a.page - 1] = replace(pg, key=key)
        return Registered(a.page), replace(s, pages=tuple(pages))

    def _adopt(self, s: State, a: Register, q: int) -> tuple[Result, State]:
        """Scope.dedup_adopts: the holder takes page q (which has the key) where
        its own page was, and releases its own (blank once nobody holds it)."""
        h = a.holder
        assert h is not None
        if h in s.page(q).holders:
            return Misuse(REGISTER), s  # it would hold q twice
        pages, blank = list(s.pages), s.blank
        pages[q - 1] = replace(pages[q - 1], holders=pages[q - 1].holders | {h})
        own = replace(pages[a.page - 1], holders=pages[a.page - 1].holders - {h})
        if not own.holders:  # unregistered: it goes back blank
            own = Page()
            blank = (a.page, *blank) if self.scope.blank_to_front else (*blank, a.page)
        pages[a.page - 1] = own
        tables = list(s.tables)
        tables[h] = tuple(q if p == a.page else p for p in tables[h])
        lru = tuple(p for p in s.lru if p != q) if self.HIT_LEAVES_LRU else s.lru
        return Registered(q), State(tuple(pages), lru, blank, tuple(tables), s.order)

    def _Share(self, s: State, a: Share) -> tuple[Result, State]:
        if (len(set(a.pages)) != len(a.pages) or self._bad_pages(a.pages)
                or any(not s.page(p).holders or a.holder in s.page(p).holders
                       for p in a.pages)):
            return Misuse(REF), s  # twice, free, or held by it already
        pages = list(s.pages)
        for p in a.pages:
            pages[p - 1] = replace(pages[p - 1], holders=pages[p - 1].holders | {a.holder})
        return Ok(), self._with(s, pages, add=(a.holder, a.pages))

    def _release_refused(self, s: State, holder: int, ps: tuple[int, ...]) -> bool:
        return ((self.RELEASE_REFUSES_DUPLICATES and len(set(ps)) != len(ps))
                or self._bad_pages(ps)
                or (self.RELEASE_CHECKS_HOLDER
                    and any(holder not in s.page(p).holders for p in ps)))

    def _Release(self, s: State, a: Release) -> tuple[Result, State]:
        if self._release_refused(s, a.holder, a.pages):
            return Misuse(REF), s
        pages, lru, freed = list(s.pages), s.lru, 0
        blanked: tuple[int, ...] = ()
        for p in a.pages:  # in the order given: the caller passes the tail first
            pg = pages[p - 1]
            pages[p - 1] = pg = replace(pg, holders=pg.holders - {a.holder})
            if not pg.holders:
                freed += 1
                if pg.key is not None and not a.blank:
                    lru += (p,)
                else:
                    blanked += (p,)
                    pages[p - 1] = Page()
        blank = blanked + s.blank if self.scope.blank_to_front else s.blank + blanked
        tables = list(s.tables)
        tables[a.holder] = tuple(p for p in tables[a.holder] if p not in a.pages)
        return Count(freed), State(tuple(pages), lru, blank, tuple(tables), s.order)

    def _Reclaimable(self, s: State, a: Reclaimable) -> tuple[Result, State]:
        holders = [h for h, _ in a.released]
        if len(set(holders)) != len(holders) or any(
                self._release_refused(s, h, ps) for h, ps in a.released):
            return Misuse(REF), s
        if not self.RECLAIM_COUNTS_PAGES_ONCE:  # once per reference released
            going = set(holders)
            return Count(sum(s.page(p).holders <= going for _, ps in a.released
                             for p in ps)), s
        by_page: dict[int, set[int]] = {}
        for h, ps in a.released:
            for p in ps:
                by_page.setdefault(p, set()).add(h)
        return Count(sum(s.page(p).holders <= hs for p, hs in by_page.items())), s

    def _NumFree(self, s: State, a: NumFree) -> tuple[Result, State]:
        return Count(len(s.blank) + (len(s.lru) if self.scope.allocate_evicts else 0)), s

    def _ResetPrefixCache(self, s: State, a: ResetPrefixCache) -> tuple[Result, State]:
        held = sum(1 for pg in s.pages if pg.holders)
        if held and not self.scope.reset_while_held:  # as vLLM, SGLang: S14
            return ResetRefused(held), s
        pages = list(s.pages)
        for p in s.lru:
            pages[p - 1] = Page()
        return Count(len(s.lru)), replace(s, pages=tuple(pages), lru=(),
                                          blank=s.blank + s.lru,
                                          order=tuple(p for p in s.order if p not in s.lru))

    def _with(self, s: State, pages: list[Page], *, lru: tuple[int, ...] | None = None,
              blank: tuple[int, ...] | None = None,
              add: tuple[int, tuple[int, ...]] = (0, ())) -> State:
        h, got = add
        tables = list(s.tables)
        tables[h] = tables[h] + got
        return State(tuple(pages), s.lru if lru is None else lru,
                     s.blank if blank is None else blank, tuple(tables), s.order)


RULES = ("EVICT_DROPS_KEY", "HIT_LEAVES_LRU", "TAGGED_EXTRAS", "CAP_BEFORE_LAST_TOKEN",
         "RELEASE_REFUSES_DUPLICATES", "DEDUP_KEEPS_PAGE", "RECLAIM_COUNTS_PAGES_ONCE",
         "RELEASE_CHECKS_HOLDER", "WRITE_NEEDS_PRIVATE")


def variant(rule: str) -> type[PagesModel]:
    """The model with `rule` switched off: the defect the rule prevents."""
    if rule not in RULES:
        raise ValueError(f"no rule {rule!r}; the rules are {', '.join(RULES)}")
    return type(f"PagesModel_no_{rule}", (PagesModel,), {rule: False})
