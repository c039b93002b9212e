"""The stream-level model of shared pages: copy-on-write forks, prefix hits
and registration (issue 18, second layer), composed over the pool model.

Porcupine style, as kvref_model.pages: `SharingModel(scope).init()` is the first
state and `SharingModel.step(state, action)` is a pure function to
`(result, next_state)`.  Every action has a result in every state: a value,
a typed refusal (`AllocationFailed`, `ResetRefused`) that changes nothing,
or a `Misuse` (the kvref error the manager raises) that changes nothing.

Each action stands for one KVManager call; the pool operations it makes
(allocate, share, release, register, match, reclaimable, reset) are
`kvref_model.pages.PagesModel.step`, so the pool's own rules (S1-S16) hold here
by construction, and this model only says what a *stream* does with them
(specs/shared-pages.md, S17-S29).

The state is the pool (`kvref_model.pages.State`, whose `tables[h]` is stream h's
page table in stream order), each stream's tokens and prefix-cache chain,
and, as the environment, each page's slot contents: which token each of
its `page_size` slots holds.  A stream `h = (request, label)` is the pool
holder `request * labels + label`.  A slot no stream reads and no key
names holds nothing (`None`): what a page held before is garbage, and
forgetting it keeps equal situations one state.

Page ids are interchangeable up to renaming, and so are the labels of a
request and the requests of one salt; `kvref_model.sharing_check` encodes a state
under those renamings.  The rules are class attributes, as in kvref_model.pages:
a variant with one of them off is the planted defect it prevents
(tests/conformance/test_sharing_plants.py runs the checker on each).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvref_model import pages
from kvref_model.pages import (
    AllocationFailed,
    Count,
    Key,
    Misuse,
    Ok,
    PagesModel,
    ResetRefused,
    Tokens,
)

__all__ = [
    "ACTIONS",
    "ARG",
    "OFFLOADING",
    "RULES",
    "STEP",
    "TOKENS",
    "UNAVAILABLE",
    "UNKNOWN",
    "Action",
    "AllocationFailed",
    "Append",
    "CachePrefix",
    "Count",
    "Fork",
    "Key",
    "MatchPrefix",
    "Misuse",
    "NumFree",
    "Offload",
    "Ok",
    "Reclaimable",
    "Refused",
    "Reload",
    "Remove",
    "Reset",
    "ResetPrefixCache",
    "ResetRefused",
    "Result",
    "Scope",
    "SharingModel",
    "State",
    "Stream",
    "Truncate",
    "variant",
]

Slots = tuple[int | None, ...]  # a page's slots: the token each holds, None: nothing valid


@dataclass(frozen=True)
class Scope:
    pages: int = 4  # usable device pages 1..pages; page 0, the sink, is outside
    page_size: int = 2
    alphabet: int = 2  # token ids: 0 .. alphabet - 1
    labels: int = 2  # streams per request (forks within a request)
    salts: tuple[str, ...] = ("a", "a")  # each request's cache_salt; requests = len(salts)
    max_len: int = 4  # the protocol's bound on a stream's length (the model has none)
    depth: int = 0  # 0: explore until no new state

    @property
    def requests(self) -> int:
        return len(self.salts)


@dataclass(frozen=True)
class Stream:
    tokens: Tokens = ()  # its committed tokens; its length n is len(tokens)
    chain: tuple[Key, ...] = ()  # keys of its first k full pages (registered or hit)
    offloaded: bool = False  # its tokens are on the host; it holds no page
    space: int | None = None  # the label whose KV it holds (a fork's source's); None: own
    # offloaded: the key each of its full pages had as it went (None: not
    # keyed); reload shares again the pages the cache holds under them (S29)
    host_keys: tuple[Key | None, ...] = ()

    @property
    def n(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class State:
    pool: pages.State  # pool.tables[h]: stream h's page table, in stream order
    streams: tuple[Stream | None, ...]  # by holder h; None: no such stream
    slots: tuple[Slots, ...]  # page p's slot contents at index p - 1

    def table(self, h: int) -> tuple[int, ...]:
        return self.pool.tables[h]


# -------------------------------------------------------------- actions
# `rid` is a request 0 .. requests - 1, `label` (src, dst) a label 0 .. labels - 1


@dataclass(frozen=True)
class Append:
    """admit + plan + write + commit of a plain step: one segment on the stream."""

    rid: int
    label: int
    tokens: Tokens


@dataclass(frozen=True)
class Fork:
    """A pre- or post-fork from label `src` onto label `dst` of request `rid`."""

    rid: int
    src: int
    dst: int


@dataclass(frozen=True)
class Truncate:
    rid: int
    label: int
    new_len: int


@dataclass(frozen=True)
class Reset:
    """reset_request(rid, free)."""

    rid: int
    free: bool


@dataclass(frozen=True)
class Remove:
    """remove_request(rid)."""

    rid: int


@dataclass(frozen=True)
class CachePrefix:
    """cache_prefix(rid, label, token_ids) -> keys added to the stream's chain."""

    rid: int
    label: int
    tokens: Tokens


@dataclass(frozen=True)
class MatchPrefix:
    """match_prefix(rid, label, token_ids) -> tokens attached from the cache."""

    rid: int
    label: int
    tokens: Tokens


@dataclass(frozen=True)
class ResetPrefixCache:
    pass


@dataclass(frozen=True)
class NumFree:
    pass


@dataclass(frozen=True)
class Reclaimable:
    """Pages that would become free if every stream of `rid` released all it holds."""

    rid: int


@dataclass(frozen=True)
class Offload:
    """offload_outcome(rid), the host pool with room: every stream holding
    pages goes to the host; only pages whose last holder it was are freed."""

    rid: int


@dataclass(frozen=True)
class Reload:
    """reload_outcome(rid): each offloaded stream back into fresh pages."""

    rid: int


@dataclass(frozen=True)
class Refused:
    """A refusal value that is not about pages: an offload or reload reason
    (``UNKNOWN_REQUEST``, ``NOTHING_ON_DEVICE``, ``NOTHING_ON_HOST``), an
    admit's ``RequestOffloading``."""

    reason: str


Action = (Append | Fork | Truncate | Reset | Remove | CachePrefix | MatchPrefix
          | ResetPrefixCache | NumFree | Reclaimable | Offload | Reload)
ACTIONS: tuple[type, ...] = (Append, Fork, Truncate, Reset, Remove, CachePrefix, MatchPrefix,
                             ResetPrefixCache, NumFree, Reclaimable, Offload, Reload)

# results: kvref_model.pages' classes.  Ok (append, fork, reset, remove); Count (truncate:
# pages freed; cache_prefix: keys added; match_prefix: tokens attached; num_free;
# reclaimable; reset_prefix_cache: cached pages dropped); AllocationFailed
# (append, fork); ResetRefused (reset_prefix_cache); Misuse (kind below, or a pool kind)
Result = Ok | Count | AllocationFailed | ResetRefused | Misuse | Refused

OFFLOADING = Refused("RequestOffloading")  # an admit naming an offloaded stream
UNAVAILABLE = "StreamUnavailableError"  # a call that needs the stream's pages resident
ARG, UNKNOWN, STEP, TOKENS = ("InvalidArgumentError", "UnknownRequestError",
                              "InvalidStepError", "TokenMismatchError")


def _ceil(n: int, d: int) -> int:
    return -(-n // d)


# ---------------------------------------------------------------- model


class SharingModel:
    # the rules (specs/shared-pages.md, S17..); a variant turns one off
    APPEND_COPIES_ON_WRITE = True  # S18: no write into a shared or registered page
    FORK_COPIES_PART_PAGE = True  # S19: a fork shares full pages only
    TRUNCATE_CUTS_CHAIN = True  # S20: the chain names only pages the stream still has
    RESET_KEEPS_ONLY_PRIVATE = True  # S21: a spare page is private
    RECLAIM_COUNTS_LAST_REFERENCE = True  # S26, SGLang 35270 at the stream level
    MATCH_NEEDS_EMPTY_STREAM = True  # S24: a hit only onto an empty stream
    # S30: no reset while a stream is on the host: its copy holds KV computed
    # before the reset, which a reload brings back and cache_prefix keys again
    RESET_REFUSED_WHILE_OFFLOADED = True
    # not a rule but a choice (S19): False (kvref's), a fork takes only the page
    # the part page's copy needs, so forking a long stream under memory pressure
    # needs one free page, not its length; True, it first holds as many private
    # pages as the source's length, as a copying fork reserves at admit, and frees
    # the surplus.  Both end with the same table; they differ in refusals,
    # evictions and free order.
    FORK_RESERVES_TARGET_LENGTH = False

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        extras = tuple(dict.fromkeys(self.extras(r, lb) for r in range(scope.requests)
                                     for lb in range(scope.labels)))
        self.pool = PagesModel(pages.Scope(
            pages=scope.pages, holders=scope.requests * scope.labels,
            page_size=scope.page_size, alphabet=scope.alphabet, extras=extras))

    def init(self) -> State:
        sc = self.scope
        return State(pool=self.pool.init(), streams=(None,) * (sc.requests * sc.labels),
                     slots=((None,) * sc.page_size,) * sc.pages)

    # ------------------------------------------------------------ helpers

    def holder(self, rid: int, label: int) -> int:
        return rid * self.scope.labels + label

    def holders_of(self, rid: int) -> range:
        return range(rid * self.scope.labels, (rid + 1) * self.scope.labels)

    def rid_of(self, h: int) -> int:
        return h // self.scope.labels

    def extras(self, rid: int, label: int) -> pages.Extras:
        """A page's extra keys: its request's salt, and its label (S25): two
        labels may hold different KV for the same tokens (a draft model's
        stream beside the target's), so a hit never crosses labels."""
        return (("salt", self.scope.salts[rid]), ("label", str(label)))

    @staticmethod
    def space(st: Stream | None, label: int) -> int:
        """The label whose KV the stream holds: its own, or its fork source's."""
        return st.space if st is not None and st.space is not None else label

    def keys(self, rid: int, label: int, tokens: Tokens) -> tuple[Key, ...]:
        """The chained keys of the full pages of `tokens` under the stream's extras."""
        ps, out, parent = self.scope.page_size, [], None
        extras = self.extras(rid, label)
        for i in range(len(tokens) // ps):
            parent = self.pool.key_of(parent, tokens[i * ps:(i + 1) * ps], extras)
            out.append(parent)
        return tuple(out)

    @staticmethod
    def private(s: State, h: int, p: int) -> bool:
        pg = s.pool.page(p)
        return pg.holders == {h} and pg.key is None

    @staticmethod
    def num_free(s: State) -> int:
        return len(s.pool.blank) + len(s.pool.lru)

    def _known(self, s: State, rid: int) -> bool:
        return 0 <= rid < self.scope.requests and any(
            s.streams[h] is not None for h in self.holders_of(rid))

    def in_scope(self, rid: int, label: int) -> bool:
        return 0 <= rid < self.scope.requests and 0 <= label < self.scope.labels

    def _pool(self, pool: pages.State, a: pages.Action) -> tuple[pages.Result, pages.State]:
        return self.pool.step(pool, a)

    def _release(self, pool: pages.State, h: int, ps: list[int] | tuple[int, ...]
                 ) -> tuple[int, pages.State]:
        """h releases `ps` (given in the order to release: tail first)."""
        if not ps:
            return 0, pool
        r, pool = self._pool(pool, pages.Release(h, tuple(ps)))
        return (r.n if isinstance(r, Count) else 0), pool

    @staticmethod
    def _with_table(pool: pages.State, h: int, table: list[int] | tuple[int, ...]
                    ) -> pages.State:
        tables = list(pool.tables)
        tables[h] = tuple(table)
        return replace(pool, tables=tuple(tables))

    def _settle(self, pool: pages.State, streams: tuple[Stream | None, ...],
                slots: list[Slots]) -> State:
        """The next state, each slot no stream reads and no key names emptied."""
        ps = self.scope.page_size
        live: dict[int, set[int]] = {}
        for h, st in enumerate(streams):
            n = st.n if st is not None else 0
            for i, p in enumerate(pool.tables[h][:_ceil(n, ps)]):
                live.setdefault(p, set()).update(range(min(ps, n - i * ps)))
        out = []
        for p, sl in enumerate(slots, 1):
            if pool.page(p).key is None:
                keep = live.get(p, set())
                sl = tuple(v if j in keep else None for j, v in enumerate(sl))
            out.append(sl)
        return State(pool, streams, tuple(out))

    def _set_stream(self, s: State, h: int, st: Stream | None) -> tuple[Stream | None, ...]:
        streams = list(s.streams)
        streams[h] = st
        return tuple(streams)

    # ------------------------------------------------------------ step

    def step(self, s: State, a: Action) -> tuple[Result, State]:
        return getattr(self, "_" + type(a).__name__)(s, a)  # type: ignore[no-any-return]

    def _Append(self, s: State, a: Append) -> tuple[Result, State]:
        if not self.in_scope(a.rid, a.label):
            return Misuse(UNKNOWN), s
        if any(not 0 <= t < self.scope.alphabet for t in a.tokens):
            return Misuse(ARG), s  # not a token id of the scope
        ps, h = self.scope.page_size, self.holder(a.rid, a.label)
        st = s.streams[h] or Stream()
        if st.offloaded:
            return OFFLOADING, s  # R2: reload first
        table, n = s.table(h), st.n
        need = [i for i in range(n // ps, _ceil(n + len(a.tokens), ps))
                if i >= len(table) or (self.APPEND_COPIES_ON_WRITE
                                       and not self.private(s, h, table[i]))]
        free = self.num_free(s)
        if len(need) > free:
            return AllocationFailed(len(need) - free), s
        pool = s.pool
        got: tuple[int, ...] = ()
        if need:
            r, pool = self._pool(pool, pages.Allocate(h, len(need)))
            assert isinstance(r, pages.Pages)
            got = r.pages
        new, slots, old = list(table), list(s.slots), []
        for i, p in zip(need, got, strict=True):  # in table order
            if i < len(table):  # copy-on-write: the old page's slots, then let it go
                old.append(table[i])
                slots[p - 1] = slots[table[i] - 1]
                new[i] = p
            else:
                new.append(p)
        for k, t in enumerate(a.tokens, n):
            p = new[k // ps]
            slots[p - 1] = (*slots[p - 1][:k % ps], t, *slots[p - 1][k % ps + 1:])
        pool = self._with_table(pool, h, new)
        _, pool = self._release(pool, h, old[::-1])
        streams = self._set_stream(s, h, Stream(st.tokens + a.tokens, st.chain,
                                                space=st.space))
        return Ok(), self._settle(pool, streams, slots)

    def _Fork(self, s: State, a: Fork) -> tuple[Result, State]:
        if not (self.in_scope(a.rid, a.src) and self.in_scope(a.rid, a.dst)):
            return Misuse(UNKNOWN), s
        if a.src == a.dst:
            return Misuse(STEP), s  # a fork onto itself
        hs, hd = self.holder(a.rid, a.src), self.holder(a.rid, a.dst)
        src = s.streams[hs]
        if any(x is not None and x.offloaded for x in (src, s.streams[hd])):
            return OFFLOADING, s
        if src is None:
            # R20: a request without the source label has nothing to give: the
            # fork copies nothing, and the step that names both ends made them
            made = list(s.streams)
            made[hs] = Stream()
            made[hd] = made[hd] or Stream()
            return Ok(), replace(s, streams=tuple(made))
        ps, src_table, dst_table = self.scope.page_size, s.table(hs), s.table(hd)
        want = _ceil(src.n, ps)
        shared_n = src.n // ps if self.FORK_COPIES_PART_PAGE else want
        part = want - shared_n  # 1: the source's part page, copied into a page of dst's
        privates = [p for p in dst_table if self.private(s, hd, p)]
        drop = [p for p in dst_table if p not in privates]
        # private pages dst must hold first: its whole length (as a copying fork's
        # admission reserves), or only the page the copy needs
        new = max(0, (want if self.FORK_RESERVES_TARGET_LENGTH else part) - len(privates))
        free = self.num_free(s)
        if new > free:
            return AllocationFailed(new - free), s
        pool = s.pool
        got: tuple[int, ...] = ()
        if new:
            r, pool = self._pool(pool, pages.Allocate(hd, new))
            assert isinstance(r, pages.Pages)
            got = r.pages
        _, pool = self._release(pool, hd, drop[::-1])  # (1) what dst shares goes first
        shared = src_table[:shared_n]
        if shared:  # (2) the source's full pages, by reference
            _, pool = self._pool(pool, pages.Share(hd, shared))
        keep = privates + list(got)
        stay = max(part, len(keep) - shared_n)  # dst keeps its high water mark
        slots = list(s.slots)
        if part:  # (3) the part page: a copy
            slots[keep[0] - 1] = slots[src_table[shared_n] - 1]
        _, pool = self._release(pool, hd, keep[stay:][::-1])  # (4) surplus: free-blank
        pool = self._with_table(pool, hd, (*shared, *keep[:stay]))
        space = src.space if src.space is not None else a.src
        streams = self._set_stream(s, hd, Stream(src.tokens, src.chain[:src.n // ps],
                                                 space=space))
        return Ok(), self._settle(pool, streams, slots)

    def _Truncate(self, s: State, a: Truncate) -> tuple[Result, State]:
        if a.new_len < 0:
            return Misuse(ARG), s
        if not self.in_scope(a.rid, a.label):
            return Misuse(UNKNOWN), s
        h = self.holder(a.rid, a.label)
        st = s.streams[h]
        if st is None:
            return Misuse(UNKNOWN), s
        if st.offloaded:
            return Misuse(UNAVAILABLE), s
        if a.new_len > st.n:
            return Misuse(ARG), s
        if a.new_len == st.n:
            return Count(0), s  # spare pages stay
        ps, table = self.scope.page_size, s.table(h)
        keep = _ceil(a.new_len, ps)
        freed, pool = self._release(s.pool, h, table[keep:][::-1])
        chain = st.chain[:a.new_len // ps] if self.TRUNCATE_CUTS_CHAIN else st.chain
        streams = self._set_stream(s, h, Stream(st.tokens[:a.new_len], chain,
                                                space=st.space))
        return Count(freed), self._settle(pool, streams, list(s.slots))

    def _Reset(self, s: State, a: Reset) -> tuple[Result, State]:
        if not self._known(s, a.rid):
            return Misuse(UNKNOWN), s
        pool, streams = s.pool, list(s.streams)
        for h in self.holders_of(a.rid):
            if streams[h] is None:
                continue
            table = s.table(h)
            if a.free:
                go = list(table)
            elif self.RESET_KEEPS_ONLY_PRIVATE:
                go = [p for p in table if not self.private(s, h, p)]
            else:
                go = []
            _, pool = self._release(pool, h, go[::-1])
            streams[h] = Stream()
        return Ok(), self._settle(pool, tuple(streams), list(s.slots))

    def _Remove(self, s: State, a: Remove) -> tuple[Result, State]:
        if not self._known(s, a.rid):
            return Ok(), s  # idempotent, as remove_request
        pool, streams = s.pool, list(s.streams)
        for h in self.holders_of(a.rid):
            _, pool = self._release(pool, h, s.table(h)[::-1])
            streams[h] = None
        return Ok(), self._settle(pool, tuple(streams), list(s.slots))

    def _CachePrefix(self, s: State, a: CachePrefix) -> tuple[Result, State]:
        if not self.in_scope(a.rid, a.label):
            return Misuse(UNKNOWN), s
        h = self.holder(a.rid, a.label)
        st = s.streams[h]
        if st is None:
            return Misuse(UNKNOWN), s
        if st.offloaded:
            return Misuse(UNAVAILABLE), s
        if len(a.tokens) > st.n:
            return Misuse(ARG), s  # names tokens not committed
        ps, keys = self.scope.page_size, self.keys(a.rid, self.space(st, a.label), a.tokens)
        named = tuple(t for k in st.chain for t in k.tokens)  # the tokens its chain names
        if a.tokens[:len(named)] != named[:len(a.tokens)] or any(
                k != c for k, c in zip(keys, st.chain, strict=False)):
            return Misuse(TOKENS), s  # disagrees with what the stream named before
        pool, table, keyed = s.pool, s.table(h), 0
        for i in range(len(st.chain), len(keys)):
            fresh = pool.page(table[i]).key is None
            r, pool = self._pool(pool, pages.Register(
                table[i], keys[i - 1] if i else None, a.tokens[i * ps:(i + 1) * ps],
                self.extras(a.rid, self.space(st, a.label))))
            if isinstance(r, Misuse):
                return r, s
            # S23: only pages findable because of this call (not deduplicated)
            keyed += fresh and isinstance(r, pages.Registered) and r.page == table[i]
        added = max(0, len(keys) - len(st.chain))
        if not added:
            return Count(0), s
        streams = self._set_stream(s, h, replace(st, chain=st.chain + keys[len(st.chain):]))
        return Count(keyed), self._settle(pool, streams, list(s.slots))

    def _MatchPrefix(self, s: State, a: MatchPrefix) -> tuple[Result, State]:
        if not self.in_scope(a.rid, a.label):
            return Misuse(UNKNOWN), s
        h = self.holder(a.rid, a.label)
        st = s.streams[h] or Stream()
        if st.offloaded:
            return Misuse(UNAVAILABLE), s
        if st.n and self.MATCH_NEEDS_EMPTY_STREAM:
            return Misuse(ARG), s  # a hit onto a stream that is not empty
        r, pool = self._pool(s.pool, pages.Match(h, a.tokens,
                                                 self.extras(a.rid, self.space(st, a.label))))
        if not isinstance(r, pages.Hit):
            return (r if isinstance(r, Misuse) else Misuse(ARG)), s
        pool = self._with_table(pool, h, r.pages + s.table(h))  # its spare pages after
        chain = tuple(k for p in r.pages if (k := pool.page(p).key) is not None)
        streams = self._set_stream(s, h, replace(st, tokens=a.tokens[:r.num_tokens],
                                                 chain=chain))
        nxt = self._settle(pool, streams, list(s.slots))
        return Count(r.num_tokens), (s if nxt == s else nxt)

    def _ResetPrefixCache(self, s: State, a: ResetPrefixCache) -> tuple[Result, State]:
        r, pool = self._pool(s.pool, pages.ResetPrefixCache())
        assert isinstance(r, Count | ResetRefused)
        away = sum(1 for st in s.streams if st is not None and st.offloaded)
        if away and self.RESET_REFUSED_WHILE_OFFLOADED:  # S30: the pool's answer unused
            return ResetRefused(r.pages_held if isinstance(r, ResetRefused) else 0, away), s
        if pool is s.pool:
            return r, s
        return r, self._settle(pool, s.streams, list(s.slots))

    def _NumFree(self, s: State, a: NumFree) -> tuple[Result, State]:
        return Count(self.num_free(s)), s

    def _Reclaimable(self, s: State, a: Reclaimable) -> tuple[Result, State]:
        if not self._known(s, a.rid):
            return Misuse(UNKNOWN), s
        released = tuple((h, s.table(h)[::-1]) for h in self.holders_of(a.rid)
                         if s.table(h))
        if not self.RECLAIM_COUNTS_LAST_REFERENCE:  # every page it holds, once
            return Count(len({p for _, t in released for p in t})), s
        r, _ = self._pool(s.pool, pages.Reclaimable(released))
        assert isinstance(r, Count)  # its own pages, each once: never refused
        return r, s


    def _Offload(self, s: State, a: Offload) -> tuple[Result, State]:
        if not self._known(s, a.rid):
            return Refused("UNKNOWN_REQUEST"), s
        claim = [h for h in self.holders_of(a.rid)
                 if (st := s.streams[h]) is not None and not st.offloaded and s.table(h)]
        if not claim:
            return Refused("NOTHING_ON_DEVICE"), s
        pool, streams, freed = s.pool, list(s.streams), 0
        ps = self.scope.page_size
        for h in claim:  # the host copy holds the tokens; the pages go (R53)
            st = streams[h]
            assert st is not None
            keys = tuple(pool.page(p).key for p in s.table(h)[:st.n // ps])
            n, pool = self._release(pool, h, s.table(h)[::-1])
            freed += n
            pool = self._with_table(pool, h, ())
            streams[h] = replace(st, chain=(), offloaded=True, host_keys=keys if any(
                k is not None for k in keys) else ())
        return Count(freed), self._settle(pool, tuple(streams), list(s.slots))

    def _Reload(self, s: State, a: Reload) -> tuple[Result, State]:
        if not self._known(s, a.rid):
            return Refused("UNKNOWN_REQUEST"), s
        back = [h for h in self.holders_of(a.rid)
                if (st := s.streams[h]) is not None and st.offloaded]
        if not back:
            return Refused("NOTHING_ON_HOST"), s
        ps = self.scope.page_size
        index = {pg.key: p for p, pg in enumerate(s.pool.pages, 1) if pg.key is not None}
        # S29: the pages the cache still holds under a remembered key are
        # shared again; a free-cached one costs a free page (once), a held one
        # nothing
        hits = {h: {i: index[k] for i, k in enumerate(st.host_keys) if k in index}
                for h in back if (st := s.streams[h]) is not None}
        cached = {p for hs in hits.values() for p in hs.values() if not s.pool.page(p).holders}
        need = len(cached) + sum(_ceil(st.n, ps) - len(hits[h])
                                 for h in back if (st := s.streams[h]) is not None)
        free = self.num_free(s)
        if need > free:
            return AllocationFailed(need - free), s
        pool, streams, slots = s.pool, list(s.streams), list(s.slots)
        for h in back:  # first every stream shares again, as a hit (S5)
            pages_h = list(pool.pages)
            for p in hits[h].values():
                pages_h[p - 1] = replace(pages_h[p - 1], holders=pages_h[p - 1].holders | {h})
            pool = replace(pool, pages=tuple(pages_h),
                           lru=tuple(p for p in pool.lru if p not in hits[h].values()))
        for h in back:  # then the rest into fresh pages, private and unregistered
            st = streams[h]
            assert st is not None
            fresh: tuple[int, ...] = ()
            if _ceil(st.n, ps) - len(hits[h]):
                r, pool = self._pool(pool, pages.Allocate(h, _ceil(st.n, ps) - len(hits[h])))
                assert isinstance(r, pages.Pages)
                fresh = r.pages
            it = iter(fresh)
            got = tuple(hits[h][i] if i in hits[h] else next(it) for i in range(_ceil(st.n, ps)))
            for k, t in enumerate(st.tokens):
                if k // ps in hits[h]:
                    continue  # the cache's bytes: its key names these tokens
                p = got[k // ps]
                slots[p - 1] = (*slots[p - 1][:k % ps], t, *slots[p - 1][k % ps + 1:])
            pool = self._with_table(pool, h, got)
            streams[h] = replace(st, offloaded=False, host_keys=())
        return Count(need), self._settle(pool, tuple(streams), slots)


RULES = ("APPEND_COPIES_ON_WRITE", "FORK_COPIES_PART_PAGE", "TRUNCATE_CUTS_CHAIN",
         "RESET_KEEPS_ONLY_PRIVATE", "RECLAIM_COUNTS_LAST_REFERENCE",
         "MATCH_NEEDS_EMPTY_STREAM", "RESET_REFUSED_WHILE_OFFLOADED")


def variant(rule: str) -> type[SharingModel]:
    """The model with `rule` switched off: the defect the rule prevents."""
    if rule not in RULES:
        raise ValueError(f"no rule {rule!r}; the rules are {', '.join(RULES)}")
    return type(f"SharingModel_no_{rule}", (SharingModel,), {rule: False})
