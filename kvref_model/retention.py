"""The model of sliding-window retention over (possibly shared) pages
(issue 19, first layer): the executable form of specs/retention.md, W1-W14.

Porcupine style, as kvref_model.pages and kvref_model.sharing: `RetentionModel(scope)
.init()` is the first state and `RetentionModel.step(state, action)` is a
pure function to `(result, next_state)`.  Every action has a result in every
state: a value, a typed refusal (`Refused`, `AllocationFailed`) that changes
nothing, or a `Misuse` (the kvref error the manager raises) that changes
nothing.

A stream `h = (request, label)` is the pool holder `request * labels +
label`; its label's retention window W (`Scope.windows[label]`, the
reference's `RetentionPolicy(context_budget=W)`; None: full attention) says
how many of its last committed tokens stay resident.  Its page table keeps
positions: slot i covers positions [i * ps, (i + 1) * ps), and a released
slot holds no page (None).  Every pool operation (allocate, share, release,
register, match) is `kvref_model.pages.PagesModel.step`, so reference counts, the
free-cached LRU and the free-blank queue are the pool model's; a pool call
the manager makes that the pool refuses (a page released twice, or by a
stream that does not hold it) is recorded in `State.fault`, which an
invariant (V2) reports.

The environment: each page's slots hold `(position, token id)` or None, so a
read checks both that the right page is mapped and that it holds the right
token.  A slot no resident stream reads and no key names is emptied (what a
page held before is garbage; forgetting it keeps equal situations one state).

The rules are class attributes; a variant with one off is the defect it
prevents (tests/conformance/test_retention_plants.py runs the checker on
each).  The model says what, never how: it has no free list of its own, no
per-page bookkeeping of the window, nothing a manager's code would keep.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvref_model import pages
from kvref_model.pages import AllocationFailed, Count, Key, Misuse, Ok, PagesModel, Tokens

__all__ = [
    "ACTIONS",
    "ARG",
    "RELEASED",
    "RULES",
    "STEP",
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
    "Offload",
    "Ok",
    "Refused",
    "Reload",
    "Remove",
    "Result",
    "RetentionModel",
    "Retrieve",
    "Scope",
    "State",
    "Stream",
    "Truncate",
    "variant",
]

Slot = tuple[int, int] | None  # (position, token id) a slot holds; None: nothing valid
Slots = tuple[Slot, ...]


@dataclass(frozen=True)
class Scope:
    pages: int = 5  # usable device pages 1..pages; page 0, the sink, is outside
    page_size: int = 2
    # each label's retention window W (context_budget); None: full attention
    windows: tuple[int | None, ...] = (3, 3, None)
    # each windowed label's rollback margin k (RetentionPolicy.rollback_margin):
    # it releases from n - W - k, so a truncate of up to k tokens stays legal
    # (W6 checks W alone). Empty: 0 for every label
    margins: tuple[int, ...] = ()
    requests: int = 1
    alphabet: int = 1  # token ids 0 .. alphabet - 1 (a slot also holds its position)
    max_len: int = 7  # the protocol's bound on a stream's length (the model has none)
    depth: int = 0  # 0: explore until no new state
    # KVConfig.enable_prefix_caching. False: a fork copies the source's retained
    # slots into the target's own pages (no page is shared), and nothing is
    # registered or hit; the windows hold as with sharing (issue 27, defects 1-2)
    sharing: bool = True

    @property
    def labels(self) -> int:
        return len(self.windows)

    def __post_init__(self) -> None:
        if any(w is not None and w < 1 for w in self.windows):
            raise ValueError(f"a retention window is at least one token: {self.windows}")
        if self.margins and (len(self.margins) != len(self.windows) or any(
                k < 0 or (k and w is None) for k, w in zip(self.margins, self.windows,
                                                           strict=True))):
            raise ValueError(f"margins {self.margins}: one per label, >= 0, and 0 for a "
                             f"full-attention label ({self.windows})")


@dataclass(frozen=True)
class Stream:
    tokens: Tokens = ()  # committed tokens 0 .. n - 1
    table: tuple[int | None, ...] = ()  # ceil(n / ps) slots; None: released (or offloaded)
    released: int = 0  # tokens whose pages were released: whole pages, a prefix
    position: int = 0  # the reference's counter: the next token's absolute position (n)
    cached: int = 0  # leading full pages registered under their keys (or hit)
    offloaded: bool = False  # its retained pages are on the host
    retired: tuple[int, ...] = ()  # only RELEASE_FROM_LIVE_SLOTS=False keeps it (vLLM 42571)
    # filled by a retrieve: a peer's KV, never registered (R55); a fork target inherits it
    received: bool = False
    # offloaded: the key each slot's page had as it went (None: not keyed);
    # reload shares again the pages the cache still holds under them (S29)
    host_keys: tuple[Key | None, ...] = ()

    @property
    def n(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class State:
    pool: pages.State  # pool.tables[h]: the pages stream h's table names, in slot order
    streams: tuple[Stream | None, ...]  # by holder h; None: no such stream
    slots: tuple[Slots, ...]  # page p's slot contents at index p - 1
    fault: str = ""  # a pool call the manager made and the pool refused (V2)


# -------------------------------------------------------------- actions


@dataclass(frozen=True)
class Append:
    """admit + write + commit of one segment: `tokens` appended, then the window
    released (W2)."""

    rid: int
    label: int
    tokens: Tokens


@dataclass(frozen=True)
class Fork:
    """A fork from label `src` onto label `dst` of request `rid` (W5)."""

    rid: int
    src: int
    dst: int


@dataclass(frozen=True)
class Truncate:
    rid: int
    label: int
    new_len: int


@dataclass(frozen=True)
class Remove:
    """remove_request(rid)."""

    rid: int


@dataclass(frozen=True)
class Offload:
    """Offload of request `rid` to the host, claim to commit (W8)."""

    rid: int


@dataclass(frozen=True)
class Reload:
    rid: int


@dataclass(frozen=True)
class CachePrefix:
    """cache_prefix(rid, label): register the stream's full committed pages (W9)."""

    rid: int
    label: int


@dataclass(frozen=True)
class MatchPrefix:
    """match_prefix(rid, label, tokens): attach cached pages to an empty stream (W10)."""

    rid: int
    label: int
    tokens: Tokens


@dataclass(frozen=True)
class Retrieve:
    """admit_retrieve(rid, label) of a peer's publication, copy landed (W16): a
    peer manager of the same retention config committed `tokens` to its stream
    in one step (so it released what W2 releases at len(tokens)) and published
    it. Only positions past what the consumer holds are copied."""

    rid: int
    label: int
    tokens: Tokens


Action = (Append | Fork | Truncate | Remove | Offload | Reload | CachePrefix | MatchPrefix
          | Retrieve)
ACTIONS: tuple[type, ...] = (Append, Fork, Truncate, Remove, Offload, Reload, CachePrefix,
                             MatchPrefix, Retrieve)


@dataclass(frozen=True)
class Refused:
    """A typed refusal (kvref.offload.outcomes' OffloadReason / ReloadReason
    name); nothing changed."""

    reason: str


# results: Ok (append, fork, remove, retrieve); Count (truncate: pages freed; offload: pages
# freed; reload: pages allocated; cache_prefix: keys added; match_prefix: tokens
# attached); AllocationFailed (append, fork, reload, retrieve); Refused (offload, reload);
# Misuse (the kinds below, or a pool kind)
Result = Ok | Count | AllocationFailed | Refused | Misuse

ARG, UNKNOWN, STEP, UNAVAILABLE = ("InvalidArgumentError", "UnknownRequestError",
                                   "InvalidStepError", "StreamUnavailableError")
# a truncate whose window would reach into the released prefix (W6): a new
# KVRefError subclass (ValueError) for the lead to add
RELEASED = "ReleasedPrefixError"


def _ceil(n: int, d: int) -> int:
    return -(-n // d)


# ---------------------------------------------------------------- model


class RetentionModel:
    # the rules (specs/retention.md, W1..); a variant turns one off
    RETIRE_WHOLE_PAGES_ONLY = True  # W2: off-by-one at the window's first page
    WINDOW_TRACKS_LENGTH = True  # W4: SGLang PR 27586, a stale window mapping
    FORK_INHERITS_WINDOW = True  # W5: a fork target takes the source's released prefix
    TRUNCATE_KEEPS_WINDOW = True  # W6: no truncate into the released prefix
    RELEASE_FROM_LIVE_SLOTS = True  # W7: vLLM 42571, a retired page released again
    RELOAD_ONLY_RETAINED = True  # W8: only retained pages move
    WINDOW_NEVER_CACHED = True  # W9: vLLM 42948, window pages cached, flushing prefixes
    WINDOW_NEVER_HITS = True  # W10: a hit never attaches pages before a window
    RETRIEVE_ONLY_RETAINED = True  # W16: a retrieve takes the peer's released prefix

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self.pool = PagesModel(pages.Scope(
            pages=scope.pages, holders=scope.requests * scope.labels,
            page_size=scope.page_size, alphabet=scope.alphabet, extras=((),)))

    def init(self) -> State:
        sc = self.scope
        return State(pool=self.pool.init(), streams=(None,) * (sc.requests * sc.labels),
                     slots=((None,) * sc.page_size,) * sc.pages)

    # ------------------------------------------------------------ helpers

    def holder(self, rid: int, label: int) -> int:
        return rid * self.scope.labels + label

    def holders_of(self, rid: int) -> range:
        return range(rid * self.scope.labels, (rid + 1) * self.scope.labels)

    def label_of(self, h: int) -> int:
        return h % self.scope.labels

    def window(self, h: int) -> int | None:
        return self.scope.windows[self.label_of(h)]

    def window_start(self, h: int, n: int) -> int:
        """The window's first token for a stream of length n (W1): max(0, n - W)."""
        w = self.window(h)
        return 0 if w is None else max(0, n - w)

    def margin(self, h: int) -> int:
        """The label's rollback margin k (W15); 0 unless the scope gives one."""
        return self.scope.margins[self.label_of(h)] if self.scope.margins else 0

    def release_start(self, h: int, n: int) -> int:
        """The first token a commit keeps (W2, W15): max(0, n - W - k); the
        window itself still starts at `window_start`."""
        w = self.window(h)
        return 0 if w is None else max(0, n - w - self.margin(h))

    def bound(self, h: int) -> int | None:
        """Pages a settled windowed stream holds at most (W3, W15):
        ceil((W + k) / ps) + 1."""
        w = self.window(h)
        return None if w is None else _ceil(w + self.margin(h), self.scope.page_size) + 1

    def keys(self, tokens: Tokens) -> tuple[Key, ...]:
        """The chained keys of the full pages of `tokens`."""
        ps, out, parent = self.scope.page_size, [], None
        for i in range(len(tokens) // ps):
            parent = self.pool.key_of(parent, tokens[i * ps:(i + 1) * ps], ())
            out.append(parent)
        return tuple(out)

    def in_scope(self, rid: int, label: int) -> bool:
        return 0 <= rid < self.scope.requests and 0 <= label < self.scope.labels

    def offloaded(self, s: State, rid: int) -> bool:
        """Any stream of the request on the host."""
        return any(st is not None and st.offloaded for st in
                   (s.streams[h] for h in self.holders_of(rid)))

    @staticmethod
    def away(st: Stream | None) -> bool:
        """The stream is on the host. An offload moves a request's streams that
        hold pages, one by one, so a sibling that held none stays usable."""
        return st is not None and st.offloaded

    @staticmethod
    def private(s: State, h: int, p: int | None) -> bool:
        if p is None:
            return False
        pg = s.pool.page(p)
        return pg.holders == {h} and pg.key is None

    @staticmethod
    def num_free(s: State) -> int:
        return len(s.pool.blank) + len(s.pool.lru)

    def _alloc(self, pool: pages.State, h: int, n: int) -> tuple[tuple[int, ...], pages.State]:
        if not n:
            return (), pool
        r, pool = self.pool.step(pool, pages.Allocate(h, n))
        assert isinstance(r, pages.Pages)  # the caller checked the free count
        return r.pages, pool

    def _release(self, pool: pages.State, h: int, ps: list[int] | tuple[int, ...],
                 fault: str) -> tuple[int, pages.State, str]:
        """h releases `ps` (in the order given: tail first) as one pool call; a
        refusal is the manager misusing the pool, kept in `fault` (V2)."""
        if not ps:
            return 0, pool, fault
        r, pool = self.pool.step(pool, pages.Release(h, tuple(ps)))
        if isinstance(r, Misuse):
            return 0, pool, fault or f"the pool refused Release({h}, {tuple(ps)})"
        assert isinstance(r, Count)
        return r.n, pool, fault

    def _settle(self, pool: pages.State, streams: tuple[Stream | None, ...],
                slots: list[Slots], fault: str) -> State:
        """The next state: the pool's tables set from the streams' (slot order),
        each slot no resident stream reads and no key names emptied."""
        ps = self.scope.page_size
        tables = tuple(() if st is None else tuple(p for p in st.table if p is not None)
                       for st in streams)
        pool = replace(pool, tables=tables)
        live: dict[int, set[int]] = {}
        for st in streams:
            if st is None:
                continue
            for i, p in enumerate(st.table):
                if p is not None:
                    live.setdefault(p, set()).update(range(min(ps, st.n - i * ps)))
        out = []
        for p, sl in enumerate(slots, 1):
            if pool.page(p).key is None:
                keep = live.get(p, set())
                sl = tuple(v if j in keep else None for j, v in enumerate(sl))
            out.append(sl)
        return State(pool, streams, tuple(out), fault)

    def _write(self, slots: list[Slots], p: int | None, j: int, t: int) -> None:
        """Token `t` at position `j` into page `p` (a page just given to the writer)."""
        assert p is not None
        ps = self.scope.page_size
        slots[p - 1] = (*slots[p - 1][:j % ps], (j, t), *slots[p - 1][j % ps + 1:])

    def _existing(self, s: State, rid: int, label: int) -> tuple[int, Stream] | Misuse:
        """The stream a call names, or why it may not be touched: none such
        (UNKNOWN), or its request is on the host (UNAVAILABLE)."""
        st = s.streams[self.holder(rid, label)] if self.in_scope(rid, label) else None
        if st is None:
            return Misuse(UNKNOWN)
        if st.offloaded:
            return Misuse(UNAVAILABLE)
        return self.holder(rid, label), st

    @staticmethod
    def _set(streams: tuple[Stream | None, ...], h: int, st: Stream | None
             ) -> tuple[Stream | None, ...]:
        out = list(streams)
        out[h] = st
        return tuple(out)

    def _retire(self, h: int, st: Stream, pool: pages.State, fault: str
                ) -> tuple[Stream, pages.State, str]:
        """W2: release every page wholly before the first token kept (the
        window's, less the rollback margin: W15)."""
        ps = self.scope.page_size
        if self.window(h) is None:
            return st, pool, fault
        first = self.release_start(h, st.position)  # from the counter (W4): `position` is n
        upto = first // ps if self.RETIRE_WHOLE_PAGES_ONLY else _ceil(first, ps)
        upto = min(upto, len(st.table))
        go = [p for p in st.table[:upto] if p is not None]
        _, pool, fault = self._release(pool, h, go[::-1], fault)
        table = (None,) * upto + st.table[upto:]
        retired = st.retired if self.RELEASE_FROM_LIVE_SLOTS else st.retired + tuple(go)
        return (replace(st, table=table, released=max(st.released, upto * ps),
                        retired=retired), pool, fault)

    def _drop_list(self, st: Stream) -> list[int]:
        """What an offload or a remove releases for a stream, tail first (W7)."""
        live = [p for p in st.table if p is not None][::-1]
        return live if self.RELEASE_FROM_LIVE_SLOTS else live + list(st.retired)

    # ------------------------------------------------------------ step

    def step(self, s: State, a: Action) -> tuple[Result, State]:
        return getattr(self, "_" + type(a).__name__)(s, a)  # type: ignore[no-any-return]

    def _Append(self, s: State, a: Append) -> tuple[Result, State]:
        if not self.in_scope(a.rid, a.label):
            return Misuse(UNKNOWN), s
        if any(not 0 <= t < self.scope.alphabet for t in a.tokens):
            return Misuse(ARG), s
        if self.away(s.streams[self.holder(a.rid, a.label)]):
            return Misuse(UNAVAILABLE), s
        if not a.tokens:
            return Ok(), s  # a zero-span segment: nothing to write or release
        ps, h = self.scope.page_size, self.holder(a.rid, a.label)
        st = s.streams[h] or Stream()
        n, k, table = st.n, len(a.tokens), list(st.table)
        # the slots the tokens land in: a new page for each, but the stream's own
        # private last page (W11: copy-on-write of a shared or registered one)
        need = [i for i in range(n // ps, _ceil(n + k, ps))
                if i >= len(table) or not self.private(s, h, table[i])]
        free = self.num_free(s)
        if len(need) > free:
            return AllocationFailed(len(need) - free), s
        got, pool = self._alloc(s.pool, h, len(need))
        slots, old = list(s.slots), []
        for i, p in zip(need, got, strict=True):
            if i < len(table):  # copy-on-write: the old page's slots, then let it go
                q = table[i]
                if q is not None:
                    old.append(q)
                    slots[p - 1] = slots[q - 1]
                table[i] = p
            else:
                table.append(p)
        for j, t in enumerate(a.tokens, n):
            self._write(slots, table[j // ps], j, t)
        _, pool, fault = self._release(pool, h, old[::-1], s.fault)
        st = replace(st, tokens=st.tokens + a.tokens, table=tuple(table),
                     position=st.position + k)
        st, pool, fault = self._retire(h, st, pool, fault)
        return Ok(), self._settle(pool, self._set(s.streams, h, st), slots, fault)

    def _Fork(self, s: State, a: Fork) -> tuple[Result, State]:
        if not (self.in_scope(a.rid, a.src) and self.in_scope(a.rid, a.dst)):
            return Misuse(UNKNOWN), s
        if a.src == a.dst:
            return Misuse(STEP), s  # a fork onto itself
        hs, hd = self.holder(a.rid, a.src), self.holder(a.rid, a.dst)
        src = s.streams[hs]
        if src is None:
            return Misuse(UNKNOWN), s
        if (self.window(hs), self.margin(hs)) != (self.window(hd), self.margin(hd)):
            return Misuse(ARG), s  # W5: a fork keeps the retention; labels must agree
        if self.away(src) or self.away(s.streams[hd]):
            return Misuse(UNAVAILABLE), s
        if not self.scope.sharing:
            return self._copy_fork(s, hs, hd, src)
        ps, n = self.scope.page_size, src.n
        full = n // ps
        part = _ceil(n, ps) - full  # 1: the source's part page, copied
        free = self.num_free(s)
        if part > free:
            return AllocationFailed(part - free), s
        got, pool = self._alloc(s.pool, hd, part)
        old = s.streams[hd]
        fault = s.fault
        if old is not None:  # what dst held goes first (tail first)
            _, pool, fault = self._release(pool, hd, self._drop_list(old), fault)
        shared = tuple(p for p in src.table[:full] if p is not None)
        if shared:  # the retained full pages, by reference
            r, pool = self.pool.step(pool, pages.Share(hd, shared))
            if isinstance(r, Misuse):
                fault = fault or f"the pool refused Share({hd}, {shared})"
        slots = list(s.slots)
        table = src.table[:full]
        if part:
            q = src.table[full]  # never released (W >= 1), but in a variant
            slots[got[0] - 1] = (None,) * ps if q is None else slots[q - 1]
            table += got
        released, position = self._inherited(src, old)
        dst = Stream(tokens=src.tokens, table=table, released=released, position=position,
                     cached=src.cached, received=src.received)
        return Ok(), self._settle(pool, self._set(s.streams, hd, dst), slots, fault)

    def _inherited(self, src: Stream, old: Stream | None) -> tuple[int, int]:
        """The target's released count and position after a fork (W5, W4)."""
        released = src.released
        if not self.FORK_INHERITS_WINDOW:  # dst keeps its own count: holes it does not know
            released = 0 if old is None else min(old.released, src.released)
        position = src.position if self.WINDOW_TRACKS_LENGTH else (
            0 if old is None else old.position)
        return released, position

    def _copy_fork(self, s: State, hs: int, hd: int, src: Stream) -> tuple[Result, State]:
        """A fork without sharing: the source's retained slots are copied into
        pages of the target's own, its live pages first (in table order), then
        fresh ones; its released slots hold none (W5), so the fork needs only
        what the window retains, never a page per slot from token 0. kvref
        keeps a target's pages past those as spares, which slot tables (V1)
        cannot hold: here they are released, and the lockstep compares only
        forks that leave a target none."""
        ps, n = self.scope.page_size, src.n
        lo = src.released // ps
        retained = src.table[lo:]
        old = s.streams[hd]
        live: list[int] = [] if old is None else [p for p in old.table if p is not None]
        short = len(retained) - len(live)
        free = self.num_free(s)
        if short > free:
            return AllocationFailed(short - free), s
        got, pool = self._alloc(s.pool, hd, max(0, short))
        own = (live + list(got))[:len(retained)]
        _, pool, fault = self._release(pool, hd, live[len(retained):][::-1], s.fault)
        slots = list(s.slots)
        for p, q in zip(own, retained, strict=True):
            slots[p - 1] = (None,) * ps if q is None else slots[q - 1]
        released, position = self._inherited(src, old)
        dst = Stream(tokens=src.tokens, table=(None,) * lo + tuple(own), released=released,
                     position=position, received=src.received)
        assert len(dst.table) == _ceil(n, ps)
        return Ok(), self._settle(pool, self._set(s.streams, hd, dst), slots, fault)

    def _Truncate(self, s: State, a: Truncate) -> tuple[Result, State]:
        if a.new_len < 0:
            return Misuse(ARG), s
        found = self._existing(s, a.rid, a.label)
        if isinstance(found, Misuse):
            return found, s
        h, st = found
        if a.new_len > st.n:
            return Misuse(ARG), s
        if self.TRUNCATE_KEEPS_WINDOW and self.window_start(h, a.new_len) < st.released:
            return Misuse(RELEASED), s  # W6: its window would reach into released tokens
        if a.new_len == st.n:
            return Count(0), s
        keep = _ceil(a.new_len, self.scope.page_size)
        go = [p for p in st.table[keep:] if p is not None][::-1]
        freed, pool, fault = self._release(s.pool, h, go, s.fault)
        st = replace(st, tokens=st.tokens[:a.new_len], table=st.table[:keep],
                     cached=min(st.cached, a.new_len // self.scope.page_size),
                     position=a.new_len if self.WINDOW_TRACKS_LENGTH else st.position)
        return Count(freed), self._settle(pool, self._set(s.streams, h, st),
                                          list(s.slots), fault)

    def _Remove(self, s: State, a: Remove) -> tuple[Result, State]:
        if not 0 <= a.rid < self.scope.requests or all(
                s.streams[h] is None for h in self.holders_of(a.rid)):
            return Ok(), s  # idempotent, as remove_request
        pool, streams, fault = s.pool, s.streams, s.fault
        for h in self.holders_of(a.rid):
            st = streams[h]
            if st is not None:
                _, pool, fault = self._release(pool, h, self._drop_list(st), fault)
                streams = self._set(streams, h, None)
        return Ok(), self._settle(pool, streams, list(s.slots), fault)

    def _Offload(self, s: State, a: Offload) -> tuple[Result, State]:
        if not 0 <= a.rid < self.scope.requests or all(
                s.streams[h] is None for h in self.holders_of(a.rid)):
            return Refused("UNKNOWN_REQUEST"), s
        # the streams holding pages on the device: the others stay as they are
        hs = [h for h in self.holders_of(a.rid) if (st := s.streams[h]) is not None
              and not st.offloaded and any(p is not None for p in st.table)]
        if not hs:
            return Refused("NOTHING_ON_DEVICE"), s
        pool, streams, fault, freed = s.pool, s.streams, s.fault, 0
        for h in hs:
            st = streams[h]
            assert st is not None
            # full pages only: a part page's key names tokens the stream no
            # longer holds all of (a truncate into it)
            keys = tuple(None if q is None or i >= st.n // self.scope.page_size
                         else pool.page(q).key for i, q in enumerate(st.table))
            got, pool, fault = self._release(pool, h, self._drop_list(st), fault)
            freed += got
            streams = self._set(streams, h, replace(
                st, table=(None,) * len(st.table), cached=0, offloaded=True, retired=(),
                host_keys=keys if any(k is not None for k in keys) else ()))
        return Count(freed), self._settle(pool, streams, list(s.slots), fault)

    def _Reload(self, s: State, a: Reload) -> tuple[Result, State]:
        if not 0 <= a.rid < self.scope.requests or all(
                s.streams[h] is None for h in self.holders_of(a.rid)):
            return Refused("UNKNOWN_REQUEST"), s
        hs = [h for h in self.holders_of(a.rid) if self.away(s.streams[h])]
        if not hs:
            return Refused("NOTHING_ON_HOST"), s
        ps = self.scope.page_size

        def first_slot(st: Stream) -> int:  # W8: released slots stay released
            return st.released // ps if self.RELOAD_ONLY_RETAINED else 0

        index = {pg.key: q for q, pg in enumerate(s.pool.pages, 1) if pg.key is not None}
        # S29: a slot whose remembered key the cache still holds shares that
        # page again (a free-cached one costs a free page, once; a held one
        # nothing); the other retained slots take fresh pages from the host
        hits = {h: {i: index[k] for i, k in enumerate(st.host_keys)
                    if i >= first_slot(st) and k is not None and k in index}
                for h in hs if (st := s.streams[h]) is not None}
        cached = {q for hh in hits.values() for q in hh.values()
                  if not s.pool.page(q).holders}
        need = {h: max(0, len(st.table) - first_slot(st)) - len(hits[h]) for h in hs
                if (st := s.streams[h]) is not None}
        total = sum(need.values()) + len(cached)
        free = self.num_free(s)
        if total > free:
            return AllocationFailed(total - free), s
        pool, streams, slots = s.pool, s.streams, list(s.slots)
        for h in hs:  # first every stream shares again, as a hit does (S5)
            pages_h = list(pool.pages)
            for q in hits[h].values():
                pages_h[q - 1] = replace(pages_h[q - 1], holders=pages_h[q - 1].holders | {h})
            pool = replace(pool, pages=tuple(pages_h),
                           lru=tuple(q for q in pool.lru if q not in hits[h].values()))
        for h in hs:
            st = streams[h]
            assert st is not None
            got, pool = self._alloc(pool, h, need[h])
            lo = first_slot(st)
            it = iter(got)
            table = st.table[:lo] + tuple(hits[h][i] if i in hits[h] else next(it)
                                          for i in range(lo, len(st.table)))
            for j in range(max(st.released, lo * ps), st.n):  # the host copy's tokens
                if j // ps not in hits[h]:  # a shared page holds the cache's bytes
                    self._write(slots, table[j // ps], j, st.tokens[j])
            streams = self._set(streams, h, replace(st, table=table, offloaded=False,
                                                    host_keys=()))
        return Count(total), self._settle(pool, streams, slots, s.fault)

    def _CachePrefix(self, s: State, a: CachePrefix) -> tuple[Result, State]:
        found = self._existing(s, a.rid, a.label)
        if isinstance(found, Misuse):
            return found, s
        h, st = found
        if not self.scope.sharing:
            return Count(0), s  # the cache is off: nothing is registered
        if self.window(h) is not None and self.WINDOW_NEVER_CACHED:
            return Count(0), s  # W9: a windowed label registers nothing
        if st.received:
            return Count(0), s  # R55: a peer's KV is never registered
        ps, keys, pool, fault = self.scope.page_size, self.keys(st.tokens), s.pool, s.fault
        before = done = st.cached
        keyed = 0
        for i in range(st.cached, len(keys)):
            p = st.table[i]
            if p is None:
                break  # a chain cannot continue past a released page
            fresh = pool.page(p).key is None
            r, pool = self.pool.step(pool, pages.Register(
                p, keys[i - 1] if i else None, st.tokens[i * ps:(i + 1) * ps], ()))
            if isinstance(r, Misuse):
                fault = fault or f"the pool refused to register page {p}"
                break
            done = i + 1
            # S23: only pages findable because of this call (not deduplicated)
            keyed += fresh and isinstance(r, pages.Registered) and r.page == p
        if done == before and fault == s.fault:
            return Count(0), s
        return Count(keyed), self._settle(
            pool, self._set(s.streams, h, replace(st, cached=done)), list(s.slots), fault)

    def _MatchPrefix(self, s: State, a: MatchPrefix) -> tuple[Result, State]:
        if not self.in_scope(a.rid, a.label):
            return Misuse(UNKNOWN), s
        h = self.holder(a.rid, a.label)
        st = s.streams[h]
        if self.away(st):
            return Misuse(UNAVAILABLE), s
        if st is not None and st.n:
            return Misuse(ARG), s  # a hit onto a stream that is not empty
        if not self.scope.sharing:
            return Count(0), s  # the cache is off: nothing is found
        if self.window(h) is not None and self.WINDOW_NEVER_HITS:
            return Count(0), s  # W10: a windowed label never hits
        r, pool = self.pool.step(s.pool, pages.Match(h, a.tokens, ()))
        if isinstance(r, Misuse):
            return r, s
        assert isinstance(r, pages.Hit)
        if not r.pages:
            return Count(0), s
        st = Stream(tokens=a.tokens[:r.num_tokens], table=r.pages, position=r.num_tokens,
                    cached=len(r.pages), received=st is not None and st.received)
        return Count(r.num_tokens), self._settle(pool, self._set(s.streams, h, st),
                                                 list(s.slots), s.fault)

    def _Retrieve(self, s: State, a: Retrieve) -> tuple[Result, State]:
        if not self.in_scope(a.rid, a.label):
            return Misuse(UNKNOWN), s
        if any(not 0 <= t < self.scope.alphabet for t in a.tokens):
            return Misuse(ARG), s
        ps, h, n = self.scope.page_size, self.holder(a.rid, a.label), len(a.tokens)
        st = s.streams[h] or Stream()
        if n <= st.n:
            return Ok(), s  # nothing past what it holds: nothing to copy
        if st.offloaded:
            return Misuse(UNAVAILABLE), s
        # what the peer released committing n tokens in one step (same config);
        # the consumer takes it, never less than its own (W16)
        peer = self.release_start(h, n) // ps * ps
        released = max(st.released, peer) if self.RETRIEVE_ONLY_RETAINED else st.released
        lo, start = released // ps, max(st.n, released)
        # a page for each retained slot it lacks, and a copy of its own partial
        # page if shared or registered (W11): the copy writes from `start`
        need = [i for i in range(lo, _ceil(n, ps)) if i >= len(st.table) or st.table[i] is None
                or (i >= start // ps and not self.private(s, h, st.table[i]))]
        free = self.num_free(s)
        if len(need) > free:
            return AllocationFailed(len(need) - free), s
        got, pool = self._alloc(s.pool, h, len(need))
        table = [None] * lo + list(st.table[lo:])
        slots, old = list(s.slots), []
        for i, p in zip(need, got, strict=True):
            if i < len(table):
                q = table[i]
                if q is not None:  # None: a retained slot with no page, only in a variant
                    old.append(q)
                    slots[p - 1] = slots[q - 1]
                table[i] = p
            else:
                table.append(p)
        for j in range(start, n):
            if j >= peer:  # the peer holds no page for what it released
                self._write(slots, table[j // ps], j, a.tokens[j])
        _, pool, fault = self._release(pool, h, old[::-1], s.fault)
        go = [p for p in st.table[:lo] if p is not None]  # slots the peer's prefix released
        _, pool, fault = self._release(pool, h, go[::-1], fault)
        st = replace(st, tokens=st.tokens + a.tokens[st.n:], table=tuple(table),
                     released=released, position=n, received=True)
        return Ok(), self._settle(pool, self._set(s.streams, h, st), slots, fault)


RULES = ("RETIRE_WHOLE_PAGES_ONLY", "WINDOW_TRACKS_LENGTH", "FORK_INHERITS_WINDOW",
         "TRUNCATE_KEEPS_WINDOW", "RELEASE_FROM_LIVE_SLOTS", "RELOAD_ONLY_RETAINED",
         "WINDOW_NEVER_CACHED", "WINDOW_NEVER_HITS", "RETRIEVE_ONLY_RETAINED")


def variant(rule: str) -> type[RetentionModel]:
    """The model with `rule` switched off: the defect the rule prevents."""
    if rule not in RULES:
        raise ValueError(f"no rule {rule!r}; the rules are {', '.join(RULES)}")
    return type(f"RetentionModel_no_{rule}", (RetentionModel,), {rule: False})
