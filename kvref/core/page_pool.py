"""Reference-counted device pages with a chained-hash prefix cache (issue 18).

`PagePool` holds the manager's device pages: it hands them out, counts
who holds each, keeps full pages of committed tokens findable by their
chained key (`kvref.core.page_keys`), and evicts free cached pages least
recently used first.  Its executable spec is `kvref_model.pages`; the rules are
specs/shared-pages.md (S1..).

Holders.  A page is held by *owners*: any hashable value naming one holder
of references, such as a stream's page table ``(rid, label)`` or a pin
``("lease", rid)``.  An owner holds a page at most once, so a page's
reference count is its number of owners, and a release by an owner that
does not hold the page (a double free through a second release path) is
refused at the call that makes it, not found pages later.

Results.  A refusal is a value (`AllocationFailed`, `ResetRefused`); a
misuse raises a `KVRefError` subclass naming what was wrong, and changes
nothing.  Every call is one critical section under the pool's own lock,
taken from the runtime seam (kvref.core.runtime), as `PageAllocator` does.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvref.core import page_keys
from kvref.core.errors import InvalidArgumentError, KVRefError
from kvref.core.page_keys import SHA256, ExtraKeys, KeyHash, PageKey, Tokens
from kvref.core.refusals import AllocationFailed
from kvref.core.runtime import Runtime, default_runtime, shared

# Page 0 never belongs to a stream. Padded slots of a captured graph write
# here, so the scatter the graph recorded cannot land in a live request's KV.
# The manager's pool reserves it (``reserved=SINK_PAGE + 1``).
SINK_PAGE = 0

Owner = Hashable
_O = TypeVar("_O", bound=Hashable)

__all__ = [
    "SINK_PAGE",
    "AllocationFailed",
    "Owner",
    "PageNotWritableError",
    "PagePool",
    "PagePoolCorruptedError",
    "PageRefError",
    "PageRegisterError",
    "PoolSnapshot",
    "PrefixHit",
    "Registered",
    "ResetRefused",
]


class PageRefError(KVRefError, ValueError):
    """A reference call naming pages wrongly: a page out of range, listed
    twice in one call, not held by the owner releasing it, or free (share)."""


class PageNotWritableError(KVRefError):
    """A write into a page the writer does not hold alone, or one registered
    in the prefix cache: copy it into a private page first (S10)."""


class PageRegisterError(KVRefError, ValueError):
    """A register of a free page, of less than a full page of tokens, or of a
    registered page under other tokens (a registered page is immutable)."""


class PagePoolCorruptedError(KVRefError, AssertionError):
    """`PagePool.sanity_check` found the pool's structures out of agreement."""


@dataclass(frozen=True)
class PrefixHit:
    """Cached pages at the head of a prompt: whole pages, at most
    ``len(tokens) - 1`` tokens, so the last token is always computed (S8).
    ``keys[i]`` is page i's key: the parent of the next page to register."""

    pages: tuple[int, ...] = ()
    keys: tuple[PageKey, ...] = ()
    num_tokens: int = 0


@dataclass(frozen=True)
class Registered:
    """The page `key` names now: the caller's page, or (``deduplicated``) the
    page that held the key already; the caller's page then stays its own,
    held and unregistered (S11)."""

    page: int
    key: PageKey
    deduplicated: bool = False


@dataclass(frozen=True)
class ResetRefused:
    """`reset_prefix_cache` changes nothing while any page is held (S14), or,
    at the manager, while any stream is offloaded or claimed for offload
    (S30): ``streams_offloaded`` counts those."""

    pages_held: int
    message: str = ""
    streams_offloaded: int = 0


@dataclass(frozen=True)
class PoolSnapshot:
    """The pool as `kvref_model.pages` sees it; index ``i`` is page ``first + i``."""

    first: int
    holders: tuple[frozenset[Owner], ...]
    keys: tuple[PageKey | None, ...]
    lru: tuple[int, ...]  # free-cached, least recently used first
    blank: tuple[int, ...]  # free-blank, in allocation order


class _LRU:
    """A doubly linked list over page ids in two arrays: O(1) append, remove
    and pop of the oldest.  Slot ``size`` is the sentinel; ``next[p] == -1``:
    `p` is not in the list.  (Lists, not an OrderedDict, so the race
    detector's `shared` can trace them.)"""

    def __init__(self, size: int, rt: Runtime, name: str) -> None:
        self._head = size
        self._prev: list[int] = shared(rt, [-1] * size + [size], f"{name}.prev")
        self._next: list[int] = shared(rt, [-1] * size + [size], f"{name}.next")
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, p: int) -> bool:
        return self._next[p] != -1

    def push_back(self, p: int) -> None:
        last = self._prev[self._head]
        self._next[last] = p
        self._prev[p] = last
        self._next[p] = self._head
        self._prev[self._head] = p
        self._len += 1

    def remove(self, p: int) -> None:
        before, after = self._prev[p], self._next[p]
        self._next[before] = after
        self._prev[after] = before
        self._prev[p] = self._next[p] = -1
        self._len -= 1

    def pop_front(self) -> int:
        p = self._next[self._head]
        self.remove(p)
        return p

    def extend(self, pages: Sequence[int]) -> None:
        """`push_back` of each page in order, as one splice: the pages are
        linked to each other, then the chain to the tail (a release of a
        whole request is one call, not one per page)."""
        if not pages:
            return
        prev, nxt, head = self._prev, self._next, self._head
        last = prev[head]
        for p in pages:
            nxt[last] = p
            prev[p] = last
            last = p
        nxt[last] = head
        prev[head] = last
        self._len += len(pages)

    def __iter__(self) -> Iterator[int]:
        """Oldest first; stops after len + 1 steps, so a corrupt list cannot loop."""
        p, steps = self._next[self._head], 0
        while p != self._head and p != -1 and steps <= self._len:
            yield p
            p, steps = self._next[p], steps + 1


class PagePool:
    """Pages ``[reserved, num_pages)`` of a device cache (page 0, the sink, is
    reserved), shared by reference count, with a prefix cache.

    Invariant (`sanity_check` runs it; kvref_model.pages_invariants P1-P5): every
    page is exactly one of
      *held*: ``_holders[p]`` not None (its reference count is `_count`);
      *free-cached*: unheld, ``_key[p]`` set, in ``_lru`` exactly once;
      *free-blank*: unheld, unregistered, in ``_blank`` exactly once.
    ``_index[k] == p`` exactly when ``_key[p] == k``: one page per key, and
    an evicted page leaves the index before it is handed out again.

    ``_holders[p]`` is None (unheld), the owner itself (one holder, the
    common case), or a set of two or more owners: a sole holder costs no
    set, so a request's release drops most pages with one comparison and
    one store, not a set's hash and probe (issue 28, free). `_owners`,
    `_holds`, `_add` and `_count` read and write it whatever its form.
    """

    def __init__(self, num_pages: int, page_size: int, *, reserved: int = 1,
                 runtime: Runtime | None = None, name: str = "pages",
                 key_hash: KeyHash = SHA256) -> None:
        if page_size <= 0 or not 0 <= reserved < num_pages:
            raise InvalidArgumentError(
                f"PagePool needs page_size > 0 and 0 <= reserved < num_pages, got "
                f"page_size={page_size}, reserved={reserved}, num_pages={num_pages}")
        rt = runtime if runtime is not None else default_runtime()
        self.num_pages, self.page_size, self.first = num_pages, page_size, reserved
        # the hash of every key this pool holds (`KVConfig.page_key_hash`): the
        # prefix cache's callers hash with it too, so a key is one hash's only
        self.key_hash = key_hash
        self._lock = rt.lock()
        # None, one bare owner, or a set of two or more (Any: an owner is any
        # hashable, and mypy cannot tell a bare one from a set by `type(h) is set`)
        self._holders: list[Any] = shared(
            rt, [None] * num_pages, f"{name}.holders")
        self._key: list[PageKey | None] = shared(rt, [None] * num_pages, f"{name}.key")
        self._index: dict[PageKey, int] = shared(rt, {}, f"{name}.index")
        self._lru = _LRU(num_pages, rt, f"{name}.lru")
        self._blank: deque[int] = shared(rt, deque(range(reserved, num_pages)),
                                         f"{name}.blank")

    # ------------------------------------------------------------ queries

    @property
    def capacity(self) -> int:
        return self.num_pages - self.first

    @property
    def num_free(self) -> int:
        """Pages an allocation can take: free-blank plus free-cached."""
        with self._lock:
            return len(self._blank) + len(self._lru)

    @property
    def num_cached(self) -> int:
        with self._lock:
            return len(self._lru)

    def holders(self, page: int) -> frozenset[Owner]:
        with self._lock:
            self._check_page(page, PageRefError)
            return frozenset(self._owners(page))

    def refcount(self, page: int) -> int:
        return len(self.holders(page))

    def writable(self, owner: Owner, page: int) -> bool:
        """Whether `owner` alone holds `page` and it is unregistered: the
        `check_writable` test as a value, for the admit that decides whether
        a write needs a private copy first (S10)."""
        with self._lock:
            h = self._holders[page]
            return type(h) is not set and h == owner and self._key[page] is None

    def private_pages(self, owner: Owner, pages: Sequence[int]) -> list[bool]:
        """`writable` of each page, under one acquisition of the lock."""
        with self._lock:
            holders, key = self._holders, self._key
            return [type(h) is not set and h == owner and key[p] is None
                    for p, h in zip(pages, map(holders.__getitem__, pages), strict=True)]

    def key_of(self, page: int) -> PageKey | None:
        with self._lock:
            self._check_page(page, PageRefError)
            return self._key[page]

    def lookup(self, tokens: Tokens, extras: ExtraKeys = ()) -> PrefixHit:
        """What `match` would attach, taking nothing."""
        with self._lock:
            pages, keys = self._hits(tokens, extras)
        return PrefixHit(tuple(pages), tuple(keys), len(pages) * self.page_size)

    def reclaimable(self, released: Mapping[_O, Sequence[int]]) -> int:
        """Pages that would be free if each owner released the pages listed
        for it: those whose every reference is among them, each counted once
        (S13; SGLang 35270 counted shared pages twice)."""
        with self._lock:
            going: Counter[int] = Counter()
            for owner, pages in released.items():
                pages = list(pages)
                self._check_release(owner, pages)
                going.update(pages)
            return sum(1 for p, k in going.items() if self._count(p) == k)

    # ------------------------------------------------------------ references

    def allocate(self, owner: Owner, n: int) -> list[int] | AllocationFailed:
        """`n` pages held by `owner` alone: free-blank first, then the least
        recently used free-cached, each unregistered before it is handed out
        (S3, S4).  Short: `AllocationFailed`, and nothing taken."""
        self._check_owner(owner)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidArgumentError(f"cannot allocate {n!r} pages")
        with self._lock:
            free = len(self._blank) + len(self._lru)
            if n > free:
                return AllocationFailed(pages_short=n - free,
                                        message=f"{n} pages asked for, {free} free")
            return self._take(owner, n)

    def take_counted(self, owner: Owner, n: int) -> list[int]:
        """`allocate` for a caller that counted the ``n`` pages free under
        the lock it holds (an admission's reserve) and names its own stream's
        key: none of `allocate`'s argument checks, which are most of a
        prefill chunk's page take (issue 42); short is a broken count, an
        assertion, not a refusal."""
        with self._lock:
            assert n <= len(self._blank) + len(self._lru), (
                f"{n} pages counted free, {len(self._blank) + len(self._lru)} are")
            return self._take(owner, n)

    def allocate_each(self, owners: Sequence[Owner], counts: Sequence[int]
                      ) -> list[list[int]] | AllocationFailed:
        """`allocate` of ``counts[i]`` pages for each ``owners[i]``, in order,
        in one critical section: every owner gets its pages, or (short)
        `AllocationFailed` and nothing is taken. The pages each owner gets
        are the ones that `allocate` called for each in turn hands out (a
        decode step's admit gives a page to each stream crossing into a new
        one: one call, not one per stream)."""
        if len(owners) != len(counts):
            raise InvalidArgumentError(
                f"{len(owners)} owners and {len(counts)} page counts")
        check = self._check_owner
        for owner, n in zip(owners, counts, strict=True):
            check(owner)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:  # as `allocate`
                raise InvalidArgumentError(f"cannot allocate {n!r} pages")
        with self._lock:
            blank = self._blank
            need = sum(counts)
            free = len(blank) + len(self._lru)
            if need > free:
                return AllocationFailed(pages_short=need - free,
                                        message=f"{need} pages asked for, {free} free")
            take, holders = self._take, self._holders
            out: list[list[int]] = []
            for owner, n in zip(owners, counts, strict=True):
                if n == 1 and blank:
                    # a decode stream's next page, as `_take` gives it, inline
                    p = blank.popleft()
                    holders[p] = owner
                    out.append([p])
                else:
                    out.append(take(owner, n))
            return out

    def _take(self, owner: Owner, n: int) -> list[int]:
        """``n`` pages, counted free under the lock held, now ``owner``'s:
        free-blank first, then the least recently used free-cached."""
        blank = self._blank
        take = min(n, len(blank))
        # a whole deque taken at once is a copy and a clear, not n pops
        if take == len(blank):
            out = list(blank)
            blank.clear()
        elif take == 1:
            out = [blank.popleft()]  # a decode stream's next page: no loop
        else:
            # the pops in C: a chunk's few pages each step (issue 42), no
            # comprehension's frame
            out = list(itertools.starmap(blank.popleft, itertools.repeat((), take)))
        holders = self._holders
        for p in out:
            holders[p] = owner  # a free page: no holder before
        if take < n:
            out += self._evict_many(n - take, owner)
        return out

    def peek(self, n: int) -> list[int]:
        """The pages `allocate` of ``n`` would hand out, in order, nothing taken
        and no key dropped: a caller that must name its pages to a call that
        can still fail (a retrieve's copy) takes them only once it succeeded,
        so a failure leaves the prefix cache as it was."""
        with self._lock:
            if n > len(self._blank) + len(self._lru):
                raise InvalidArgumentError(f"cannot peek {n} pages: "
                                           f"{len(self._blank) + len(self._lru)} free")
            out = list(itertools.islice(self._blank, n))
            return out + list(itertools.islice(self._lru, n - len(out)))

    def match(self, owner: Owner, tokens: Tokens, extras: ExtraKeys = (), *,
              encoded: bytes | None = None) -> PrefixHit:
        """The longest run of cached pages at the head of `tokens` under
        `extras`, each now also held by `owner` (a free-cached one leaves the
        LRU).  The keys are hashed under the lock, page by page, up to the
        first miss.  `PageRefError` if `owner` holds one of them already.
        ``encoded``: `page_keys.token_bytes` of `tokens`, if the caller has it."""
        self._check_owner(owner)
        with self._lock:
            pages, keys = self._hits(tokens, extras, encoded)
            holders = self._holders
            # `_add` inlined, in one pass that takes each reference as it
            # checks the page (a hit attaches a whole prompt's pages). A
            # free-cached page leaves the LRU once every page passed, so a
            # refusal gives back the references taken and changes nothing
            touched: list[int] = []
            for p in pages:
                h = holders[p]
                if h is None:
                    holders[p] = owner
                    touched.append(p)
                elif type(h) is set:
                    if owner in h:
                        break
                    h.add(owner)
                elif h == owner:
                    break
                else:
                    holders[p] = {h, owner}
            else:
                for p in touched:
                    self._touch(p)
                return PrefixHit(tuple(pages), tuple(keys), len(pages) * self.page_size)
            i = pages.index(p)  # distinct: each page holds one key
            for q in pages[:i]:
                self._unhold(q, owner)  # a page this pass took is free again
            raise PageRefError(f"{owner!r} already holds cached page {pages[i]}: a hit "
                               "goes to a stream that does not hold its prefix")

    def share(self, owner: Owner, pages: Sequence[int]) -> None:
        """`owner` takes a reference on pages others hold: a fork's full
        pages, a lease's or an offload's pin (S2)."""
        self._check_owner(owner)
        pages = list(pages)
        with self._lock:
            self._check_distinct(pages, PageRefError, "share")
            holders = self._holders
            # `_holds` and `_add` inlined, in one pass that takes each
            # reference as it checks its page (a fork shares every full
            # page, so a separate checking pass is paid per page). The first
            # page that fails stops it, and the references taken before it
            # are given back: the refusal changes nothing
            for p in pages:
                h = holders[p]
                if type(h) is set:
                    if owner in h:
                        break
                    h.add(owner)
                elif h is None or h == owner:
                    break
                else:
                    holders[p] = {h, owner}
            else:
                return
            i = pages.index(p)  # the pages are distinct (checked above)
            for q in pages[:i]:
                got = holders[q]
                got.remove(owner)
                if len(got) == 1:  # a set this pass made: the holder bare again
                    holders[q] = next(iter(got))
            bad = pages[i]
            if holders[bad] is None:
                raise PageRefError(f"share of page {bad}: it is free (a cached page is "
                                   "taken by match, a blank one by allocate)")
            raise PageRefError(f"share of page {bad}: {owner!r} holds it already")

    def cached_page(self, key: PageKey) -> int | None:
        """The page registered under ``key`` now, held or free-cached; None if
        no page is (never registered, or evicted since)."""
        with self._lock:
            return self._index.get(key)

    def attach(self, owner: Owner, pages: Sequence[int]) -> None:
        """`owner` takes a reference on registered pages by key, held or
        free-cached (a free-cached one leaves the LRU in the same critical
        section, S5): a reload sharing again the pages whose keys its host
        copy remembers (S29). Refused whole, changing nothing
        (`PageRefError`), if a page is unregistered, listed twice or held by
        `owner` already."""
        self._check_owner(owner)
        pages = list(pages)
        with self._lock:
            self._check_distinct(pages, PageRefError, "attach")
            for p in pages:
                if self._key[p] is None:
                    raise PageRefError(f"attach of page {p}: it is not in the prefix cache")
                if self._holds(p, owner):
                    raise PageRefError(f"attach of page {p}: {owner!r} holds it already")
            for p in pages:
                if self._holders[p] is None:
                    self._touch(p)
                self._add(p, owner)

    def release(self, owner: Owner, pages: Sequence[int]) -> int:
        """`owner` drops its reference on each page; returns how many became
        free.  A registered page becomes free-cached at the LRU's tail in the
        order given (pass a stream's pages tail first: its prefix is evicted
        last), an unregistered one free-blank (S6).  Refused whole if a page
        is listed twice or not held by `owner` (S9)."""
        pages = list(pages)
        with self._lock:
            return self._drop(owner, pages)

    def release_table(self, owner: Owner, pages: list[int]) -> int:
        """`release` of a list kvref built from `allocate`, `match` and `share`
        results (a stream's page table): its items are non-negative ints
        already, so the pass checks only that each is held by `owner` (a page
        past the end, or a reserved one, is held by nobody); the refusal and
        its message are `release`'s."""
        with self._lock:
            return self._drop_table(owner, pages)

    def release_blank(self, owner: Owner, pages: list[int]) -> int:
        """`release_table`, but a page this frees goes back blank, its key
        dropped, never onto the LRU (H3 of specs/retention.md: what a
        window passes at a commit is read by no later hit worth keeping, and
        cached it would push other prefixes toward eviction, vLLM 42948). A
        page another holder keeps keeps its key. Refused whole as `release`."""
        with self._lock:
            self._check_release(owner, pages)  # before a key goes: nothing changes
            key, index = self._key, self._index
            for p in pages:
                k = key[p]
                if k is not None and self._count(p) == 1:
                    del index[k]
                    key[p] = None
            return self._drop_table(owner, pages)

    def release_blank_each(self, owners: Sequence[Owner], pages: Sequence[list[int]]) -> int:
        """`release_blank` of ``pages[i]`` for each ``owners[i]``, in order, in
        one critical section; returns how many pages became free. Every list
        is checked before any page goes: a refusal (as `release` words it,
        or an owner listed twice) leaves the pool as it was (a decode
        step's commit lets go of each window's passed page: one call, not
        one per window)."""
        if len(owners) != len(pages):
            raise InvalidArgumentError(f"{len(owners)} owners and {len(pages)} page lists")
        if len(set(owners)) != len(owners):
            # a second list of one owner would be checked against what the
            # first left: refused, not released in part
            raise PageRefError("release_blank_each lists an owner twice")
        with self._lock:
            holders, key, index = self._holders, self._key, self._index
            flat = [p for got in pages for p in got]
            n = len(flat)
            # the usual lists (a page each, distinct ints in range) checked by
            # C-level passes over all at once; any other list by itself, as
            # `release` checks it (a page two owners hold is in two lists)
            if not (n and list(map(type, flat)).count(int) == n and min(flat) >= self.first
                    and max(flat) < self.num_pages and len(set(flat)) == n):
                for got in pages:
                    self._check_distinct(got, PageRefError, "a release")
            for owner, got in zip(owners, pages, strict=True):
                for p in got:
                    h = holders[p]
                    if not (owner in h if type(h) is set else h is not None and h == owner):
                        self._check_release(owner, got)  # raises, naming the page
                        raise AssertionError(f"release of {got!r} failed a check that passed")
            # every page checked: nothing below refuses. A page its owner
            # holds alone goes back blank, its key dropped (as
            # `release_blank`); one another holder keeps keeps its key
            blank: list[int] = []
            for owner, got in zip(owners, pages, strict=True):
                for p in got:
                    h = holders[p]
                    if type(h) is set:
                        h.remove(owner)
                        if len(h) == 1:
                            holders[p] = next(iter(h))
                        continue
                    k = key[p]
                    if k is not None:
                        del index[k]
                        key[p] = None
                    holders[p] = None
                    blank.append(p)
            self._blank.extend(blank)
            return len(blank)

    # ------------------------------------------------------------ contents

    def check_writable(self, owner: Owner, page: int) -> None:
        """Raise `PageNotWritableError` unless `owner` alone holds `page` and it
        is not registered: no write lands in a shared or cached page (S10)."""
        with self._lock:
            self._check_page(page, PageNotWritableError)
            holders = self._owners(page)
            if owner not in holders:
                raise PageNotWritableError(f"page {page}: {owner!r} does not hold it")
            if len(holders) > 1:
                raise PageNotWritableError(
                    f"page {page} is shared by {len(holders)} holders: copy it first")
            if self._key[page] is not None:
                raise PageNotWritableError(
                    f"page {page} is registered in the prefix cache: copy it first")

    def register(self, page: int, parent: PageKey | None, tokens: Tokens,
                 extras: ExtraKeys = (), *, key: PageKey | None = None) -> Registered:
        """Make the held `page`, a full page of committed `tokens` after the
        page keyed `parent`, findable by `match` (S7).  If another page has
        the key, that page wins and `page` stays as it is (S11).  ``key``:
        the page's key as the caller already computed it from these same
        arguments (`page_keys.iter_page_keys` over a chain), not hashed
        again."""
        self._check_page(page, PageRegisterError)
        page_keys.check_ids(tokens)  # before its length is read
        if len(tokens) != self.page_size:
            raise PageRegisterError(f"page {page}: {len(tokens)} tokens; only a full page "
                                    f"({self.page_size}) is registered")
        if key is None:
            key = page_keys.page_key(parent, tokens, extras, key_hash=self.key_hash)
        with self._lock:
            if self._holders[page] is None:
                raise PageRegisterError(f"page {page} is free: it holds nothing committed")
            have = self._key[page]
            if have is not None:
                if have == key:
                    return Registered(page, key)
                raise PageRegisterError(f"page {page} is registered under other tokens; "
                                        "a registered page is immutable")
            owner_of_key = self._index.get(key)
            if owner_of_key is not None:
                return Registered(owner_of_key, key, deduplicated=True)
            self._index[key] = page
            self._key[page] = key
            return Registered(page, key)

    def register_chain(self, pages: Sequence[int], keys: Sequence[PageKey],
                       took: list[bool] | None = None
                       ) -> tuple[int, int, KVRefError | None]:
        """`register` of ``pages[i]`` under ``keys[i]`` for each i in order,
        the keys a chain the caller hashed (`page_keys.iter_page_keys`) from
        full pages of its tokens: one acquisition of the lock and no record
        per page. Returns how many were done, how many of those took their
        key here (findable because of this call: not a page keyed before, nor
        one whose key another page holds), and the error that stopped the
        rest (None: all), so the caller keeps what a loop of `register` calls
        would have kept before it raised. ``took`` gets, per page done,
        whether it took its key here."""
        n = len(pages)
        # every page checked before any is keyed: by C-level passes (a
        # prompt's 128 pages), each page again only when one fails
        if n and (list(map(type, pages)).count(int) != n or min(pages) < self.first
                  or max(pages) >= self.num_pages):
            for page in pages:
                self._check_page(page, PageRegisterError)
        if len(keys) != n:
            raise ValueError(f"register_chain: {n} pages, {len(keys)} keys")
        with self._lock:  # the pages were checked above: not again per page
            got, err = self._take_keys(pages, keys)
        if took is not None:
            took += map(bool, got)
        return len(got), sum(got), err

    def register_filled(self, pages: list[int], keys: list[PageKey]
                        ) -> tuple[list[int], KVRefError | None]:
        """`register_chain` of pages that each just filled, one per stream (a
        decode step's): ``pages[i]`` under ``keys[i]``, in order, under one
        acquisition of the lock. Returns per page done 1 if it took its key
        here, 0 if it had that key already or another page has it (S11),
        and the error that stopped the rest (None: all), a page that is no
        page among them: the pages before it are done."""
        n = len(pages)
        if len(keys) != n:
            raise ValueError(f"register_filled: {n} pages, {len(keys)} keys")
        lo, hi = self.first, self.num_pages
        # the pages before the first that is no page are done, as a loop of
        # `register` calls would: found by C-level passes, each page again
        # only when one fails
        bad = n
        if n and (list(map(type, pages)).count(int) != n or min(pages) < lo
                  or max(pages) >= hi):
            bad = next(i for i, p in enumerate(pages)
                       if type(p) is not int or not lo <= p < hi)
        with self._lock:
            took, err = (self._take_keys(pages, keys) if bad == n
                         else self._take_keys(pages[:bad], keys[:bad]))
        if err is None and bad < n:
            err = PageRegisterError(f"no page {pages[bad]!r}: pages are [{lo}, {hi})")
        return took, err

    def _take_keys(self, pages: Sequence[int], keys: Sequence[PageKey]
                   ) -> tuple[list[int], KVRefError | None]:
        """The keying pass of `register_chain` and `register_filled` over
        pages the caller checked (ints in range, by C-level passes), under the
        lock the caller holds."""
        took: list[int] = []
        put = took.append
        holders, have_keys, setdefault = self._holders, self._key, self._index.setdefault
        for page, key in zip(pages, keys, strict=True):
            have = have_keys[page]
            # an unkeyed page is in no entry of the index (`_index[k] == p`
            # exactly when `_key[p] == k`): `setdefault` giving the page
            # back put it there, one probe for the lookup and the store
            if have is None and holders[page] is not None and setdefault(key, page) == page:
                have_keys[page] = key
                put(1)
                continue
            if holders[page] is None:
                return took, PageRegisterError(
                    f"page {page} is free: it holds nothing committed")
            if have is not None and have != key:
                return took, PageRegisterError(
                    f"page {page} is registered under other tokens; a registered "
                    "page is immutable")
            put(0)  # keyed so before, or deduplicated: that page keeps the key
        return took, None

    def reset_prefix_cache(self) -> int | ResetRefused:
        """Forget every cached page (after a weight update, say); returns how
        many.  Refused, changing nothing, while any page is held: a held
        registered page would keep its key, or lose it under a stream that
        goes on registering pages computed before the reset (S14)."""
        with self._lock:
            held = self.capacity - len(self._blank) - len(self._lru)
            if held:
                return ResetRefused(held, f"{held} pages are still held")
            n = len(self._lru)
            for _ in range(n):
                self._blank.append(self._evict())
            return n

    # ------------------------------------------------------------ checks

    def snapshot(self) -> PoolSnapshot:
        with self._lock:
            r = range(self.first, self.num_pages)
            return PoolSnapshot(self.first, tuple(frozenset(self._owners(p)) for p in r),
                                tuple(self._key[p] for p in r), tuple(self._lru),
                                tuple(self._blank))

    def sanity_check(self) -> None:
        """Raise `PagePoolCorruptedError` naming every broken part of the invariant."""
        bad = self.problems()
        if bad:
            raise PagePoolCorruptedError("; ".join(bad))

    def problems(self) -> list[str]:
        """Every broken part of the pool's invariant, one line each (empty:
        consistent): each page held, cached or blank exactly once, the LRU
        list and its count, the key index against the pages' keys."""
        with self._lock:
            bad: list[str] = []
            lru = list(self._lru)
            if len(lru) != len(self._lru):
                bad.append(f"the LRU list walks {len(lru)} pages, counts {len(self._lru)}")
            where = Counter([*lru, *self._blank])
            for p in range(self.num_pages):
                h, key = self._holders[p], self._key[p]
                held = h is not None
                if type(h) is set and len(h) < 2:
                    bad.append(f"page {p}: a holder set of {len(h)}: one holder is "
                               "held bare, none as None")
                n = where[p] + held
                if p < self.first and (n or key is not None):
                    bad.append(f"reserved page {p} is in use")
                elif p >= self.first and n != 1:
                    bad.append(f"page {p}: {'held, ' if held else ''}{where[p]} time(s) "
                               "free: it must be exactly one of held/cached/blank")
                if (p in self._lru) != (p in where and key is not None and not held):
                    bad.append(f"page {p}: LRU membership disagrees with its state")
                if key is not None and self._index.get(key) != p:
                    bad.append(f"page {p}'s key is not indexed to it")
            bad += [f"free-blank page {p} is registered" for p in set(self._blank)
                    if self._key[p] is not None]
            bad += [f"the index names page {p} for a key it does not have"
                    for k, p in self._index.items() if self._key[p] != k]
            return bad

    # ------------------------------------------------------------ internals

    def _owners(self, p: int) -> set[Owner] | frozenset[Owner]:
        """Page `p`'s holders as a set, whatever form `_holders` keeps them in."""
        h = self._holders[p]
        if h is None:
            return frozenset()
        return h if type(h) is set else frozenset((h,))

    def _holds(self, p: int, owner: Owner) -> bool:
        h = self._holders[p]
        return owner in h if type(h) is set else h is not None and h == owner

    def _count(self, p: int) -> int:
        h = self._holders[p]
        return 0 if h is None else len(h) if type(h) is set else 1

    def _add(self, p: int, owner: Owner) -> None:
        """`owner` (not a holder of `p` yet: the callers checked) holds `p`."""
        h = self._holders[p]
        if h is None:
            self._holders[p] = owner
        elif type(h) is set:
            h.add(owner)
        else:
            self._holders[p] = {h, owner}

    def _unhold(self, p: int, owner: Owner) -> bool:
        """`owner` lets `p` go; whether `p` is free now. KeyError if `owner`
        does not hold it. A set left with one holder keeps it bare."""
        holders = self._holders
        h = holders[p]
        if type(h) is set:
            h.remove(owner)
            if len(h) == 1:
                holders[p] = next(iter(h))
            return False
        if h is None or h != owner:
            raise KeyError(p)
        holders[p] = None
        return True

    def _check_owner(self, owner: Owner) -> None:
        try:
            hash(owner)
        except TypeError:
            raise InvalidArgumentError(f"an owner must be hashable, got {owner!r}") from None
        if owner is None:
            raise InvalidArgumentError("an owner must not be None")

    def _check_page(self, p: int, err: type[KVRefError]) -> None:
        if isinstance(p, bool) or not isinstance(p, int) or not (
                self.first <= p < self.num_pages):
            raise err(f"no page {p!r}: pages are [{self.first}, {self.num_pages})")

    def _check_distinct(self, pages: list[int], err: type[KVRefError], what: str) -> None:
        n = len(pages)
        # the usual list (a stream's table: a fork shares every full page):
        # plain ints in range, none twice, found by C-level passes; anything
        # else is looked at page by page, for the message naming it
        if n and list(map(type, pages)).count(int) == n and min(pages) >= self.first and (
                max(pages) < self.num_pages and len(set(pages)) == n):
            return
        seen: set[int] = set()
        for p in pages:
            self._check_page(p, err)
            if p in seen:
                raise err(f"{what} lists page {p} twice")
            seen.add(p)

    def _check_release(self, owner: Owner, pages: list[int]) -> None:
        self._check_distinct(pages, PageRefError, "a release")
        for p in pages:
            if not self._holds(p, owner):
                state = "free" if self._holders[p] is None else "held by others"
                raise PageRefError(f"release of page {p}: {owner!r} does not hold it "
                                   f"({state}); a second release of the same page?")

    def _drop(self, owner: Owner, pages: list[int]) -> int:
        """Release as one pass that checks each page as it drops it (an int
        in range, held by `owner`, not listed before), then hands the freed
        pages to the blank queue and the LRU in one call each, in the order
        given (S6). A page that fails puts back what the pass took, and
        `_check_release` raises naming what is wrong: nothing changes."""
        key, unhold = self._key, self._unhold
        lo, hi = self.first, self.num_pages
        blank: list[int] = []
        cached: list[int] = []
        i = 0
        try:
            for i, p in enumerate(pages):  # noqa: B007 (i is read in the except)
                if type(p) is not int or not lo <= p < hi:
                    raise KeyError(p)
                # the check and the drop in one: KeyError if `owner` does not
                # hold it (a page listed twice: its first mention took the owner)
                if unhold(p, owner):
                    (blank if key[p] is None else cached).append(p)
        except KeyError:
            for q in pages[:i]:  # distinct: a repeat is where the pass stops
                self._add(q, owner)
            self._check_release(owner, pages)
            raise AssertionError(f"release of {pages!r} failed a check that passed") from None
        if blank:
            self._blank.extend(blank)
        if cached:
            self._lru.extend(cached)
        return len(blank) + len(cached)

    def _drop_table(self, owner: Owner, pages: list[int]) -> int:
        """`_drop` of a table's ints (`release_table`): no range scan (a cold
        min/max over a long table cost more than the pass; issue 28, free):
        a page past the end fails the index (IndexError), a reserved one has
        no holder (KeyError), and a negative one cannot be in a table, whose
        ints came from `allocate`, `match` and `share`. A page `owner` holds alone (the
        common case) dropped by one comparison and one store (`_unhold`
        inlined), and each freed cached page linked onto a chain as it is
        freed, the chain spliced onto the LRU's tail at the end (one pass,
        not a second one over the freed pages). A page that fails puts back
        the references and unlinks the chain, and `_check_release` raises:
        nothing changes."""
        holders, key = self._holders, self._key
        lru = self._lru
        nxt, prev, head = lru._next, lru._prev, lru._head
        blank: list[int] = []
        tail = last = prev[head]
        kept = 0  # pages others still hold; the rest are freed: blank or linked
        # a tuple owner (a stream's key) never equals a set of holders: one
        # comparison per page, not two
        plain = type(owner) is tuple
        try:
            # no index kept per page (a tenth of the pass): a failure counts
            # the pages done from what they left
            for p in pages:
                h = holders[p]
                # the type test second: a set equals a frozenset owner
                if h == owner and (plain or type(h) is not set):
                    holders[p] = None
                    if key[p] is not None:
                        nxt[last] = p
                        prev[p] = last
                        last = p
                    else:
                        blank.append(p)
                elif type(h) is set:
                    h.remove(owner)  # KeyError if `owner` does not hold it, as in `_drop`
                    if len(h) == 1:
                        holders[p] = next(iter(h))
                    kept += 1
                else:
                    raise KeyError(p)
        except (KeyError, IndexError):
            # the pages done: the kept, the blank, and the chain linked from
            # the tail to `last` (each once: a repeat is where the pass stops)
            i, q = kept + len(blank), tail
            while q != last:
                q = nxt[q]
                i += 1
            for q in pages[:i]:  # distinct: a repeat is where the pass stops
                self._add(q, owner)
                prev[q] = nxt[q] = -1  # held again: in no list
            nxt[tail] = head
            self._check_release(owner, pages)
            raise AssertionError(f"release of {pages!r} failed a check that passed") from None
        linked = len(pages) - kept - len(blank)  # counted once, not per page
        if linked:
            nxt[last] = head
            prev[head] = last
            lru._len += linked
        if blank:
            self._blank.extend(blank)
        return len(blank) + linked

    def _evict(self) -> int:
        """The least recently used free-cached page, its key dropped first (S4)."""
        p = self._lru.pop_front()
        key = self._key[p]
        assert key is not None
        del self._index[key]
        self._key[p] = None
        return p

    def _evict_many(self, n: int, owner: Owner) -> list[int]:
        """`_evict` ``n`` times, the LRU unlinked in one splice, each page
        then held by ``owner`` (`allocate`), all in one pass."""
        lru = self._lru
        nxt, prev, head = lru._next, lru._prev, lru._head
        index, holders = self._index, self._holders
        keys: list[Any] = self._key  # each page here has a key: no None test per page
        out: list[int] = []
        add = out.append
        p = nxt[head]
        # the LRU's oldest unlinked, unregistered and held in one loop
        for _ in range(n):
            add(p)
            q = nxt[p]
            prev[p] = nxt[p] = -1
            del index[keys[p]]  # a free-cached page has a key (KeyError on None)
            keys[p] = None
            holders[p] = owner
            p = q
        nxt[head] = p
        prev[p] = head
        lru._len -= n
        return out

    def _touch(self, p: int) -> None:
        """A hit on a free-cached page takes it out of the LRU (S5)."""
        self._lru.remove(p)

    def _cacheable_pages(self, num_tokens: int) -> int:
        """Whole pages a hit may attach: at most num_tokens - 1 tokens (S8)."""
        return max(num_tokens - 1, 0) // self.page_size

    def _hits(self, tokens: Tokens, extras: ExtraKeys, encoded: bytes | None = None
              ) -> tuple[list[int], list[PageKey]]:
        if encoded is None:  # else `token_bytes` checked them
            page_keys.check_ids(tokens)  # before its length is read
        return page_keys.cached_head(self._index, tokens, self.page_size, extras,
                                     pages=self._cacheable_pages(len(tokens)),
                                     encoded=encoded, key_hash=self.key_hash)
