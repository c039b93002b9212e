"""The stream table: what every mechanism of a `KVManager` reads and writes.

One object, built by the manager and handed to each mechanism (stepping,
offload, retrieval), so none of them reaches back into the manager. Every
read-modify-write of ``streams`` and every page taken from or given back
to ``pages`` happens under ``lock``: the manager's one lock, from the
runtime seam so the concurrency tests can schedule it.

Pages are reference counted (`kvref.core.page_pool`): each stream's page table
holds its pages as the owner ``(rid, label)``, so a page two streams share
(a fork's full pages, a prefix hit) goes free only when the last of them
lets it go, and a stream that releases a page it does not hold is caught
at that call. Invariant beside the pool's: a stream's pages past its last
token (its spare pages) are private to it, so a write past the stream's
length never lands in a shared or registered page; only the page holding
its last, partial page may be shared (after a truncate into it), and an
admit copies that one first (`PageSharing.cow_needed`). Whether pages are
shared at all is the ``sharing`` object's to answer (`kvref.core.sharing`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvref.core.config import KVReqConfig
from kvref.core.errors import UnknownRequestError
from kvref.core.labels import FULL_ATTENTION, LabelBehaviour
from kvref.core.page_pool import PagePool
from kvref.core.runtime import Runtime
from kvref.core.sharing import NO_SHARING, PageSharing
from kvref.core.streams import CacheStream

Key = tuple[str, str]  # (request id, label)


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)



class PublishLeases(Protocol):
    """The publish leases every mechanism asks about (R33, R34)."""

    def take(self, rid: str) -> None: ...
    def release(self, rid: str) -> None: ...
    def held(self, rid: str) -> bool: ...
    def leased(self) -> list[str]: ...
    def refuse(self, rid: str, what: str) -> None:
        """Raise `PublishLeasedError` if ``rid`` is leased."""


@dataclass
class StreamTable:
    """Streams per request, the device page pool, and the lock over both."""

    pages: PagePool
    lock: AbstractContextManager[Any]
    runtime: Runtime
    page_size: int
    # rid -> label -> stream; a request is present from ingest until removal.
    # Passed in: the runtime seam may hand a recording container
    streams: dict[str, dict[str, CacheStream]] = field(default_factory=dict)
    overrides: dict[str, KVReqConfig] = field(default_factory=dict)
    # publish leases (R33): offload, reset and remove read them under
    # ``lock``. Passed in (`kvref.transfer.lease.LeaseTable`): a lease is the
    # transfer layer's, and core stands below it
    leases: PublishLeases = field(kw_only=True)
    # shared pages (`kvref.core.sharing.page_sharing`, chosen once from the
    # config): what admission, forks, the prefix cache, offload and reset ask
    sharing: PageSharing = NO_SHARING
    # label -> its attention type (`kvref.core.labels`, from
    # KVConfig.retention); a label absent is full attention
    behaviours: dict[str, LabelBehaviour] = field(default_factory=dict)
    # some stream's `tail_maybe_shared` was ever set (only a truncate into a
    # page sets it): never cleared, so False proves every stream's is False
    # and a decode step's admit skips the per-stream test (issue 28)
    tails_maybe_shared: bool = False

    def behaviour(self, label: str) -> LabelBehaviour:
        """The label's attention type: what its commits release, which
        tokens it reads, its forks join and whether its pages are cached."""
        return self.behaviours.get(label, FULL_ATTENTION)

    @property
    def releasing(self) -> bool:
        """Whether some label's commits may release pages: False (most
        caches), a step skips every release question."""
        return any(b.releases for b in self.behaviours.values())

    def retire(self, key: Key, stream: CacheStream) -> int:
        """W2: release the pages the label's behaviour lets go of once the
        stream holds ``n`` committed tokens (W4: from ``stored_len``, which
        ``position`` mirrors; a sliding window: every page wholly before the
        first token it keeps). The released slots leave the front of
        ``page_indices`` (which holds slot ``released // ps`` onward) and
        ``released`` counts their tokens.
        Only live pages are listed, each once, tail first (W7); a page a fork
        shares stays with its other holders. Returns the pages freed."""
        ps = self.page_size
        released = self.behaviour(key[1]).released_after(stream.released, stream.stored_len, ps)
        if released == stream.released:
            return 0
        gone = stream.release_window_to(released, ps)
        if self.behaviour(key[1]).cacheable:
            # H3: what a cached window passes goes back blank, so it never
            # pushes another stream's prefix toward eviction (vLLM 42948)
            return self.pages.release_blank(key, gone) if gone else 0
        return self.give_back(key, gone)

    def retire_each(self, keys: list[Key], streams: list[CacheStream]) -> None:
        """`retire` of each ``streams[i]`` (the stream ``keys[i]``, each named
        once), the pages the cached windows pass given back blank in one
        pool call (H3). A stream whose window did not move releases nothing."""
        ps = self.page_size
        blank_keys: list[Key] = []
        blank: list[list[int]] = []
        for key, stream in zip(keys, streams, strict=True):
            b = self.behaviour(key[1])
            released = b.released_after(stream.released, stream.stored_len, ps)
            if released == stream.released:
                continue
            gone = stream.release_window_to(released, ps)
            if not b.cacheable:
                if blank:  # the pool hears the releases in `retire`'s order
                    self.pages.release_blank_each(blank_keys, blank)
                    blank_keys, blank = [], []
                self.give_back(key, gone)
            elif gone:
                blank_keys.append(key)
                blank.append(gone)
        if blank:
            self.pages.release_blank_each(blank_keys, blank)

    def take(self, key: Key, n: int) -> list[int]:
        """``n`` fresh pages for the stream ``key``; the caller counted them
        free under the same lock (an admission, a reload's check)."""
        return self.pages.take_counted(key, n)

    def take_each(self, keys: list[Key], counts: list[int]) -> list[list[int]]:
        """`take` of ``counts[i]`` pages for each of ``keys`` in turn, in one
        call to the pool."""
        got = self.pages.allocate_each(keys, counts)
        assert isinstance(got, list), f"pages counted free under the lock went missing: {got}"
        return got

    def head_first(self, label: str) -> bool:
        """H4: a cached window lets go of its pages head first, so its tail,
        what a window hit at its end reads, is evicted last (vLLM 48435);
        every other stream tail first (S6)."""
        b = self.behaviour(label)
        return b.releases and b.cacheable

    def give_back(self, key: Key, pages: list[int]) -> int:
        """The stream ``key`` lets its pages go; returns how many became free.
        Tail first, so a cached prefix is evicted after its own suffix (S6)."""
        if not pages:
            return 0
        if self.head_first(key[1]):
            return self.pages.release_table(key, list(pages))
        # a table's own list: `release_table` skips the per-page type check
        return self.pages.release_table(key, pages[::-1])

    def request(self, rid: str) -> dict[str, CacheStream]:
        streams = self.streams.get(rid)
        if streams is None:
            raise UnknownRequestError("unknown request (never ingested, or removed)",
                                      request_id=rid)
        return streams

    def stream(self, rid: str, label: str) -> CacheStream:
        stream = self.request(rid).get(label)
        if stream is None:
            raise UnknownRequestError("request has no such label", request_id=rid, label=label)
        return stream
