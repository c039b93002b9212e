"""Per-(request, label) bookkeeping the manager keeps under its lock."""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

# the empty page array a new stream starts with (never written: a stream's
# first pages allocate a buffer of its own)
_NO_PAGES: np.ndarray[Any, Any] = np.empty(0, dtype=np.int32)


class OffloadState(enum.Enum):
    """Where a stream's KV is, as the offload mechanism sees it."""

    RESIDENT = "resident"  # on device pages, usable by steps
    CLAIMED = "claimed"  # an open offload claimed it (between claim and commit/abandon)
    OFFLOADED = "offloaded"  # committed to the host: `reload` brings it back


class RetrieveState(enum.Enum):
    """A stream's retrieve (`admit_retrieve`), as the next admit would see it."""

    IDLE = "idle"  # none running, none failed
    PENDING = "pending"  # a copy is still writing its pages
    FAILED = "failed"  # a copy failed: latched until reset or removal (I11)


class CacheStream:
    """One stream of one request: its pages, its length, and what may touch it.

    ``page_indices`` is a high-water list of the slots from ``released //
    page_size`` on (all of them but for a windowed label): it may hold more
    pages than ``stored_len`` needs (a reset that kept them, a step that was admitted
    and never committed), and those pages are reused before new ones.
    Every change to the pages or the length bumps ``generation``, which is
    how an offload's commit notices a stream changed behind its copy.
    """

    __slots__ = (
        "_pages_arr",
        "_pages_buf",
        "_pages_n",
        "_pages_src",
        "generation",
        "key_tokens",
        "keys",
        "offloaded",
        "page_indices",
        "position",
        "read_error",
        "read_future",
        "read_pending",
        "received",
        "released",
        "space",
        "step_in_flight",
        "stored_len",
        "tail_maybe_shared",
    )

    def __init__(self) -> None:
        self.page_indices: list[int] = []
        self.stored_len = 0
        # the reference's counters (W4 of specs/retention.md): ``position`` is
        # the next token's absolute position (= stored_len); ``released`` the
        # tokens a windowed label (KVConfig.retention) let go of, whole pages
        # from the front. ``page_indices`` holds slot ``released // page_size``
        # onward: a released slot holds no page and is in no list
        self.position = 0
        self.released = 0
        self.read_pending = False
        # declared lock-free (R31): the future itself is polled through done()
        # outside the manager's lock (it has its own); which future the stream
        # holds is read and written only under the manager's lock
        self.read_future: Future[Any] | None = None
        # a failed retrieve, latched: the future is read once, but every
        # later readiness check has to keep reporting the stream unusable
        self.read_error: BaseException | None = None
        # from an offload's claim until reload: the pages are leaving (or
        # gone), so only reload may give the stream pages again
        self.offloaded = False
        self.generation = 0
        # the prefix-cache keys of the first len(keys) full pages, a chain
        # (kvref.prefix.keys): what `cache_prefix` registered or `match_prefix`
        # attached. A later `cache_prefix` continues the chain from its last
        # key, and one naming other tokens for a keyed page is refused
        self.keys: list[bytes] = []
        # the ids of those pages' tokens (signed 64-bit little endian, as
        # hashed): a later call naming them otherwise is caught by a compare,
        # not by hashing the whole prefix again
        self.key_tokens = bytearray()
        # False guarantees the partial last page is private to the stream, so
        # the admit of every decode step skips the pool; only a truncate into
        # a shared page sets it (R52), and a check of the pool answers then
        self.tail_maybe_shared = False
        # the label whose KV this stream holds, for the prefix cache's keys
        # (None: its own). A fork target holds its source's KV, so it takes
        # the source's: a sample forked from ``main`` keys its pages as main's
        self.space: str | None = None
        # filled by a retrieve: its pages are never registered (a peer's KV,
        # whose tokens this manager never saw computed; vllm-ascend PR 2083)
        self.received = False
        # from admit until commit: the step already holds addressing into
        # these pages, so an offload must not claim them
        self.step_in_flight = False
        # `pages_array`'s cache: the list it mirrors, and an int32 buffer whose
        # first ``_pages_n`` entries are that list's pages, so a plan copies a
        # stream's page table with one memcpy, not one Python int per page
        self._pages_src: list[int] | None = None
        self._pages_buf: np.ndarray[Any, Any] = _NO_PAGES
        self._pages_n = 0
        self._pages_arr: np.ndarray[Any, Any] = _NO_PAGES  # buf[:n], kept

    @property
    def retrieve(self) -> RetrieveState:
        """The stream's retrieve (`admit_retrieve`) as the next admit would
        see it, from ``read_error`` and ``read_future``; reading it latches
        nothing (`kvref.stepping.admission.retrieve_state` does)."""
        if self.read_error is not None:
            return RetrieveState.FAILED
        fut = self.read_future
        if fut is None:
            return RetrieveState.IDLE
        if not fut.done():
            return RetrieveState.PENDING
        # done: a failure not yet latched (the next admit latches it) is a failure
        return RetrieveState.FAILED if fut.exception() is not None else RetrieveState.IDLE

    def pages_array(self) -> np.ndarray[Any, Any]:
        """``page_indices`` as int32, kept across steps: written again only
        when the list is replaced, and extended by the pages appended since
        (kvref changes a stream's list in place only by an admit's ``+=``;
        every other change assigns a new list). Valid until the stream's
        pages next change: a plan copies from it at once."""
        pages = self.page_indices
        n = len(pages)
        have = self._pages_n if self._pages_src is pages else 0
        if have == n and n:
            return self._pages_arr  # the common step: no page added since
        if have != n:
            if have > n:
                have = 0  # shrunk in place: written afresh
            buf = self._pages_buf
            if n > buf.shape[0]:
                # room to grow: a decode stream appends a page every page_size steps
                grown = np.empty(max(2 * n, 16), dtype=np.int32)
                grown[:have] = buf[:have]
                buf = self._pages_buf = grown
            buf[have:n] = pages[have:]
            self._pages_n = n
        self._pages_src = pages
        arr = self._pages_arr = self._pages_buf[:n]
        return arr

    def reset(self, freed: bool = False) -> None:
        self.stored_len = 0
        self.position = 0
        self.released = 0
        self.generation += 1
        self.read_error = None
        self.read_pending = False
        self.read_future = None
        self.keys = []
        self.key_tokens = bytearray()
        self.tail_maybe_shared = False
        self.space = None
        self.received = False
        if freed:
            self.page_indices = []

    def __repr__(self) -> str:
        flags = [
            name
            for name, on in (
                ("in_flight", self.step_in_flight),
                ("offloaded", self.offloaded),
                ("read_pending", self.read_pending),
                ("read_error", self.read_error is not None),
            )
            if on
        ]
        return (
            f"CacheStream(len={self.stored_len}, pages={self.page_indices}, "
            f"gen={self.generation}{', ' if flags else ''}{', '.join(flags)})"
        )


@dataclass(frozen=True)
class ClaimedStream:
    """A stream an in-progress offload owns, and the state its host copy is made from."""

    label: str
    pages: list[int]
    generation: int
    stored_len: int
    position: int
    released: int
