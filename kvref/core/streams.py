"""Per-(request, label) bookkeeping the manager keeps under its lock.

A stream's fields are read by every mechanism and written only by the
stream's own transitions (`claim_offload`, `append_tokens`, `truncate_to`,
...): each transition is the one writer of the fields it changes, bumps
``generation`` where pages or length change, and refuses a source state it
was not written for with `StreamStateError`. Callers validated the request
before (public misuse is refused there), so a refusal here is a broken
internal invariant, never an engine's mistake.

The fields stay plain slots, read-only by rule, not behind properties: a
property read costs a Python call, and the admit/plan/commit of a decode
step reads about nine fields per segment (read-only properties made a
256-request decode step about 60% slower, `benchmarks.decode_alone`).
`tests/unit/test_stream_writers.py` fails if any module under `kvref/` but
this one writes a field, on any path, run or not.

The exception is a decode batch (`StreamBatch`, issue 42): streams decoded
together step after step keep their lengths, page counts and generations
in the batch's arrays, and read them through properties of their class
while in it (`BatchedStream`), so a B = 256 step's admit and commit touch
only the rows that cross into a page. A stream outside a batch keeps its
plain slots; any transition on a row takes it out first.
"""

from __future__ import annotations

import enum
import operator
import sys
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvref.core.errors import KVRefError

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


class StreamStateError(KVRefError, RuntimeError):
    """A stream transition asked of a state it does not leave from: kvref's
    own bug (the calls that reach a transition were validated before)."""


_RESIDENT = OffloadState.RESIDENT
_CLAIMED = OffloadState.CLAIMED
_OFFLOADED = OffloadState.OFFLOADED

# `CacheStream.key_at` of a stream whose pages no commit keys
NEVER = sys.maxsize


@dataclass(frozen=True, slots=True)
class FollowedTokens:
    """`KVManager.follow_tokens`: the engine's own list of a stream's token
    ids, which it extends as tokens are decided; a commit keys the pages
    that fill from it (S33). The request id and label are kept beside it
    because a commit finds the stream, not its key; ``tail`` is the encoded
    extra keys its pages hash with while the stream's ``space`` is
    ``space`` (a fork into the stream changes that, and the general path
    keys it then)."""

    request_id: str
    label: str
    ids: Sequence[int]
    space: str | None
    tail: bytes
    # the ids of the committed tokens past the chain's last full page at
    # hand-over, from token ``head_at``, as checked and packed then
    # (`token_bytes`): the page they begin is keyed from these bytes and the
    # ids appended since, not from all its ids checked and packed again. Any
    # cut of the chain drops them (`CacheStream._chain_cut`): a truncate may
    # let the engine decide those tokens again
    head: bytes = b""
    head_at: int = 0


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
        "_batch",
        "_batch_row",
        "_pages_arr",
        "_pages_buf",
        "_pages_n",
        "_pages_src",
        "follow",
        "generation",
        "key_at",
        "key_tokens",
        "keys",
        "offload",
        "offloaded",
        "page_indices",
        "position",
        "read_error",
        "read_future",
        "read_pending",
        "received_at",
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
        self.offload = _RESIDENT
        # offload is not RESIDENT: the one offload question the hot paths ask
        # (every admit and commit of a segment), a slot beside the state,
        # written by the same transitions
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
        # S33: the ids a commit keys this stream's filled pages from (None:
        # the engine keys them with `cache_prefix`, or not at all), and the
        # length at or past which a commit looks at it: never past the end of
        # the first page after the chain, so a commit that fills a page never
        # misses it; every cut of the chain lowers it (`_chain_cut`), and a
        # commit that looked sets it to where the next page ends. One compare
        # per stream of a commit is all that following costs a step that
        # fills no page
        self.follow: FollowedTokens | None = None
        self.key_at = NEVER
        # False guarantees the partial last page is private to the stream, so
        # the admit of every decode step skips the pool; only a truncate into
        # a shared page sets it (R52), and a check of the pool answers then
        self.tail_maybe_shared = False
        # the label whose KV this stream holds, for the prefix cache's keys
        # (None: its own). A fork target holds its source's KV, so it takes
        # the source's: a sample forked from ``main`` keys its pages as main's
        self.space: str | None = None
        # the first token a retrieve filled (None: none did): the pages from
        # the one that token is in on hold a peer's KV, whose tokens this
        # manager never saw computed, and are never registered (R55;
        # vllm-ascend PR 2083). The pages wholly before it are the stream's
        # own and key as any other's
        self.received_at: int | None = None
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
        # the decode batch (`StreamBatch`) the stream is row ``_batch_row``
        # of, while its class is `BatchedStream`; None otherwise
        self._batch: StreamBatch | None = None
        self._batch_row = 0

    # -- what other modules ask (beside the fields, read-only outside) --

    @property
    def received(self) -> bool:
        """A retrieve filled some of its tokens (R55): the pages from
        ``received_at`` on are a peer's."""
        return self.received_at is not None

    @property
    def retrieve(self) -> RetrieveState:
        """The stream's retrieve (`admit_retrieve`) as the next admit would
        see it, from ``read_error`` and ``read_future``; reading it latches
        nothing (`settle_retrieve` does)."""
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
        (the list changes in place only by `append_pages`; every other
        transition assigns a new list). Valid until the stream's pages next
        change: a plan copies from it at once."""
        pages = self.page_indices
        if self._pages_src is pages and self._pages_n == len(pages) and pages:
            return self._pages_arr  # the common step: no page added since
        return self._write_pages_array()

    def _write_pages_array(self) -> np.ndarray[Any, Any]:
        """`pages_array` where the kept array is not the list's: the pages
        appended since copied in (all of them for a new or shrunk list)."""
        pages = self.page_indices
        n = len(pages)
        have = self._pages_n if self._pages_src is pages else 0
        if have > n:
            have = 0  # shrunk in place: written afresh
        if have != n:
            buf = self._pages_buf
            if n > buf.shape[0]:
                # room to grow: a decode stream appends a page every page_size steps
                grown = np.empty(max(2 * n, 16), dtype=np.int32)
                grown[:have] = buf[:have]
                buf = self._pages_buf = grown
            buf[have:n] = pages[have:]
        # set for an empty list too: a new empty list (a reset that freed
        # the pages) read here, then appended to in place, kept the old
        # count, so the pages it gained were copied from past the first and
        # the plan named the old first page (the seam lockstep, seed 0)
        self._pages_n = n
        self._pages_src = pages
        arr = self._pages_arr = self._pages_buf[:n]
        return arr

    @staticmethod
    def pages_arrays(streams: Sequence[CacheStream]) -> list[np.ndarray[Any, Any]]:
        """`pages_array` of each of ``streams``, its test inline: the kept
        array where no page changed since (most rows of a step), written
        only for the others (a plan's rows: a method call each was about a
        tenth of a B = 16 decode plan)."""
        out: list[np.ndarray[Any, Any]] = []
        put = out.append
        for s in streams:
            pages = s.page_indices
            if s._pages_src is pages and s._pages_n == len(pages) and pages:
                put(s._pages_arr)
            else:
                put(s._write_pages_array())
        return out

    # -- transitions: the only writers of the fields above --------------------

    def _own(self) -> None:
        """Before a transition writes what a decode batch assumed of its rows
        (`StreamBatch`): none here; a `BatchedStream` leaves its batch. A
        transition that writes ``stored_len``, ``position``, ``generation``
        or ``step_in_flight`` leaves it by that write."""

    def _refuse(self, transition: str, why: str) -> StreamStateError:
        return StreamStateError(f"{transition} of {self!r}: {why}")

    def _need_resident(self, transition: str) -> None:
        if self.offloaded:
            raise self._refuse(transition, f"offload state is {self.offload.name}")

    def reset(self, freed: bool = False) -> None:
        """Empty the stream (`reset_prefix_cache`); ``freed``: its pages went
        back too, else they stay as spare. Leaves the offload state alone: a
        claim in progress fails its commit on the bumped generation."""
        self.stored_len = 0
        self.position = 0
        self.released = 0
        self.read_error = None
        self.read_pending = False
        self.read_future = None
        self.keys = []
        self.key_tokens = bytearray()
        self._chain_cut()
        self.tail_maybe_shared = False
        self.space = None
        self.received_at = None
        if freed:
            self.page_indices = []
        self.generation += 1  # I14: pages or length changed

    def drop_pages(self) -> None:
        """`remove_request`: the pages went back; the stream is about to go."""
        self.page_indices = []
        self.generation += 1  # I14: pages or length changed

    def keep_spare(self, pages: list[int]) -> None:
        """An emptied stream keeps only ``pages`` of its spare ones (those
        private to it: a later write must not land in a page another reads)."""
        if self.stored_len:
            raise self._refuse("keep_spare", "the stream holds tokens")
        self.page_indices = pages
        self.generation += 1  # I14: pages or length changed

    # steps

    def append_pages(self, pages: list[int]) -> None:
        """An admit's fresh pages, after the stream's own (in place: the kept
        `pages_array` copies only the new ones)."""
        if self.offloaded:  # asked inline: every admit that takes pages
            self._need_resident("append_pages")
        self.page_indices += pages
        self.generation += 1  # I14: pages or length changed

    def mark_in_flight(self) -> None:
        """An admitted step holds addressing into the pages (until commit)."""
        if self.offloaded:  # asked inline: once per segment of every step
            self._need_resident("mark_in_flight")
        self.step_in_flight = True

    def clear_in_flight(self) -> None:
        self.step_in_flight = False

    def append_tokens(self, span: int) -> None:
        """A committed step's ``span`` tokens (W4: the next token's position)."""
        if self.offloaded:  # asked inline: once per segment of every step
            self._need_resident("append_tokens")
        n = self.stored_len = self.stored_len + span
        self.position = n
        self.generation += 1  # I14: pages or length changed

    # a step's streams at once: `mark_in_flight` over an admit's streams, and
    # `clear_in_flight` + `append_tokens` over a commit's, in one call each
    # (a method call per stream per transition was ~11% of a B=256 decode step)

    @staticmethod
    def mark_step(streams: Sequence[CacheStream]) -> None:
        """`mark_in_flight` of each of ``streams``: all are checked before any
        is marked."""
        if True in map(_offloaded, streams):  # a C-level pass: none, at every step
            for s in streams:
                if s.offloaded:
                    s._need_resident("mark_in_flight")
        for s in streams:
            s.step_in_flight = True

    @staticmethod
    def end_step(streams: Sequence[CacheStream], spans: Iterable[int] | None,
                 due: list[CacheStream] | None) -> list[CacheStream]:
        """A step over ``streams`` ended: each one's in-flight mark is cleared
        and, where ``spans`` is given (the step keeps its tokens; one per
        stream), the stream's span is appended as `append_tokens` does. An
        offloaded stream's span is not appended (`append_tokens` refuses that
        state): those streams are returned, for the caller to report. The
        followed streams that may have a page to key now are added to ``due``
        (S33); None where no stream can be followed (the cache off), so the
        compare is not paid (2% of a B=256 step)."""
        if spans is None:
            for s in streams:
                s.step_in_flight = False
            return []
        dropped: list[CacheStream] = []
        watch = due.append if due is not None else None
        for s, span in zip(streams, spans, strict=True):
            s.step_in_flight = False
            if span:
                if s.offloaded:
                    dropped.append(s)
                    continue
                n = s.stored_len = s.stored_len + span
                s.position = n
                s.generation += 1  # I14: pages or length changed
                if watch and n >= s.key_at:
                    watch(s)
        return dropped

    def truncate_to(self, new_len: int, keep: int, page_size: int) -> list[int]:
        """Cut the stream to ``new_len`` tokens, keeping its first ``keep``
        slots' pages; returns the pages cut (the caller gives them back). A
        key names a full page: the one the cut lands in no longer is; that
        page may be another stream's too (R52), so the next write checks."""
        if new_len > self.stored_len or new_len < self.released:
            raise self._refuse("truncate_to", f"to {new_len} tokens")
        pages = self.page_indices
        cut = pages[keep:]
        # a new list: a slice someone took of the old one keeps what it saw
        self.page_indices = pages[:keep]
        self.stored_len = new_len
        self.position = new_len  # W4: the next commit's window is from the new length
        if not new_len:
            self._holds_no_kv()
        elif self.received_at is not None and new_len <= self.received_at:
            # cut back to its own tokens: no peer's KV is left in it (R55)
            self.received_at = None
        full = new_len // page_size
        del self.keys[full:]
        del self.key_tokens[full * page_size * 8:]
        self._chain_cut()
        self.tail_maybe_shared = bool(new_len % page_size)
        self.generation += 1  # I14: pages or length changed
        return cut

    def release_window_to(self, released: int, page_size: int) -> list[int]:
        """W2: the slots before ``released`` tokens leave the front of the
        list; returns their pages (the caller gives them back)."""
        go = self._drop_front(released, page_size)
        self.generation += 1  # I14: pages or length changed
        return go

    def _drop_front(self, released: int, page_size: int) -> list[int]:
        # `release_window_to` but the generation, which a batch's row moves
        # in the batch (`BatchedStream.release_window_to`)
        if released <= self.released or released % page_size:
            raise self._refuse("release_window_to", f"to {released} tokens")
        drop = (released - self.released) // page_size
        pages = self.page_indices
        go = pages[:drop]
        self.page_indices = pages[drop:]
        if self._pages_src is pages and self._pages_n >= drop:
            # the kept `pages_array` buffer, started ``drop`` entries on, is
            # the new list's: a window releasing a page every page_size steps
            # would otherwise have its whole array written again each time
            self._pages_src = self.page_indices
            self._pages_buf = self._pages_buf[drop:]
            self._pages_n -= drop
            self._pages_arr = self._pages_buf[:self._pages_n]
        self.released = released
        return go

    def rehome_pages(self, pages: list[int]) -> None:
        """The same slots in pages now private to the stream (a copy-on-write
        or a privatise copied the shared ones)."""
        if len(pages) != len(self.page_indices):
            raise self._refuse("rehome_pages", f"{len(pages)} pages for "
                               f"{len(self.page_indices)} slots")
        self.page_indices = pages
        self.tail_maybe_shared = False
        self.generation += 1  # I14: pages or length changed

    # forks

    def adopt_fork_pages(self, pages: list[int]) -> None:
        """A copy-on-write fork's target: the source's full pages, shared,
        then its own private ones (`fork_from` follows, under the same lock)."""
        self.page_indices = pages
        self.generation += 1  # I14: pages or length changed

    def fork_from(self, src: CacheStream, space: str, page_size: int) -> None:
        """The fork's target now holds ``src``'s KV (its pages were copied or
        shared already): its length and, W5, its window's state. ``space``:
        whose KV that is, for the prefix cache's keys."""
        self.stored_len = src.stored_len
        self.released = src.released
        self.position = src.position
        full = src.stored_len // page_size
        self.keys = src.keys[:full]
        self.key_tokens = src.key_tokens[: full * page_size * 8]
        self._chain_cut()
        # the partial page was copied into one of its own (or every page was)
        self.tail_maybe_shared = False
        self.received_at = src.received_at
        self.space = space
        if not src.stored_len:
            self._holds_no_kv()
        self.generation += 1  # I14: pages or length changed

    def empty_torn(self) -> None:
        """A fork target a failed copy left torn: nothing in it is trusted (R26)."""
        self.stored_len = 0
        self.position = 0
        self.released = 0
        self.keys = []
        self.key_tokens = bytearray()
        self._chain_cut()
        self._holds_no_kv()
        self.generation += 1  # I14: pages or length changed

    def _holds_no_kv(self) -> None:
        # an empty stream holds nobody's KV: the tokens it computes next are
        # its own label's, and no peer's (S25, R55). A fork target kept its
        # source's label past a fork from an empty source, a truncate to 0 or
        # a torn copy, and keyed its own tokens under the source's: another
        # page of the same tokens under its own label was never found (the
        # nightly lockstep, 2026-12-05)
        self.space = None
        self.received_at = None

    # prefix cache

    def attach_prefix(self, pages: list[int], n: int, keys: list[bytes],
                      raw: bytes, released: int = 0) -> None:
        """A `match_prefix` hit of ``n`` tokens: its pages before the empty
        stream's spare ones, and their keys and token ids. ``released``: the
        tokens before the pages a window hit attaches (H2), whole pages; the
        keys still cover every page from the first."""
        if self.stored_len:
            raise self._refuse("attach_prefix", "the stream holds tokens")
        self._need_resident("attach_prefix")
        self.page_indices = pages + self.page_indices
        self.released = released
        self.stored_len = n
        self.position = n  # W4: the next token's position
        self.keys = keys
        self.key_tokens = bytearray(raw)
        self._chain_cut()
        self.generation += 1  # I14: pages or length changed

    def extend_chain(self, keys: list[bytes], raw: bytes) -> None:
        """The next full pages' keys, and the ids of the tokens keyed (the
        two may lag: a register that failed part way keeps the keys it gave)."""
        self.keys += keys
        self.key_tokens += raw

    def follow_with(self, followed: FollowedTokens | None, page_size: int) -> None:
        """S33: commits key the stream's filled pages from ``followed`` (None:
        they stop), from the first that fills the page after the chain."""
        self._own()
        self.follow = followed
        self.key_at = NEVER if followed is None else (len(self.keys) + 1) * page_size

    def _chain_cut(self) -> None:
        # the chain may end before ``key_at`` now: the next commit looks
        f = self.follow
        if f is not None and f.head:
            self.follow = replace(f, head=b"")  # may name cut tokens
        self.key_at = NEVER if self.follow is None else 0

    def look_at(self, at: int) -> None:
        """The next commit looks at this followed stream once its length
        reaches ``at`` (the end of the page after its chain): every commit
        that looked at it sets this, whether it filled a page or not."""
        self.key_at = at
        b = self._batch
        if b is not None:
            # what the batch's commit compares: left behind, the row would
            # be looked at by every commit (never missed, but never skipped)
            b.key_at[self._batch_row] = at
            b.next_due = min(b.next_due, at - int(b.lens[self._batch_row]))

    @staticmethod
    def looked(streams: Iterable[CacheStream], page_size: int) -> None:
        """A commit keyed what it could of each followed stream: the next
        commit looks at it once its length reaches the end of the page after
        its chain."""
        for s in streams:
            s.look_at(NEVER if s.follow is None else (len(s.keys) + 1) * page_size)

    @staticmethod
    def extend_chains(streams: Sequence[CacheStream], keys: Sequence[bytes],
                      raws: Sequence[bytes]) -> None:
        """`extend_chain` of one page each: ``streams[i]``'s next key is
        ``keys[i]``, over the ids ``raws[i]`` (a decode step's filled pages)."""
        for s, key, raw in zip(streams, keys, raws, strict=True):
            s.keys.append(key)
            s.key_tokens += raw

    @staticmethod
    def extend_followed(streams: Sequence[CacheStream], keys: Sequence[bytes],
                        raws: Sequence[bytes], done: int, page_size: int) -> None:
        """A commit keyed the page after the chain of each of the first
        ``done`` followed ``streams`` (`extend_chains`), and each is looked
        at again once the next page is full (`look_all`): one pass, where a
        decode step of B = 256 fills about 16 pages."""
        streams = streams[:done]
        ats: list[int] = []
        for s, key, raw in zip(streams, keys, raws, strict=False):
            chain = s.keys
            chain.append(key)
            s.key_tokens += raw
            ats.append((len(chain) + 1) * page_size)
        CacheStream.look_all(streams, ats)

    @staticmethod
    def look_all(streams: Sequence[CacheStream], ats: list[int]) -> None:
        """`look_at` of ``ats[i]`` for each ``streams[i]``; the rows of one
        decode batch by one store into its array, not a store and a read of
        a numpy scalar each (a decode step's filled pages)."""
        b = streams[0]._batch if streams else None
        if b is not None:
            rows = [s._batch_row for s in streams if s._batch is b]
            if len(rows) == len(streams):
                for s, at in zip(streams, ats, strict=True):
                    s.key_at = at
                # `put`: a fancy store from lists first tries each list as
                # an index, raising and catching a formatted TypeError
                b.key_at.put(rows, ats)
                # a lower bound of the rows' ``key_at - lens`` with no read
                # of ``lens`` (a commit that compares finds the exact one)
                b.next_due = min(b.next_due, min(ats) - b.max_len)
                return
        for s, at in zip(streams, ats, strict=True):
            s.look_at(at)

    @staticmethod
    def lengths(streams: Sequence[CacheStream]) -> list[int]:
        """Each stream's ``stored_len``, a batch's row's from its slot and
        the batch's ``ticks``: no property call per row."""
        get = _STORED_LEN.__get__
        out: list[int] = []
        for s in streams:
            kind, b = type(s), s._batch
            if kind is CacheStream:
                out.append(get(s))
            elif kind is BatchedStream and b is not None:
                out.append(get(s) + b.ticks)
            else:
                out.append(s.stored_len)  # a subclass's own
        return out

    # offload

    def claim_offload(self, label: str) -> ClaimedStream:
        """RESIDENT -> CLAIMED; what the host copy is made from."""
        self._need_resident("claim_offload")
        if self.step_in_flight:
            raise self._refuse("claim_offload", "a step is in flight (R4)")
        self._own()
        self.offload, self.offloaded = _CLAIMED, True
        return ClaimedStream(label, list(self.page_indices), self.generation,
                             self.stored_len, self.position, self.released)

    def commit_offload(self) -> None:
        """CLAIMED -> OFFLOADED: the tokens are on the host, the length stays,
        the pages (given back by the caller) go; a reload gives fresh ones."""
        if self.offload is not _CLAIMED:
            raise self._refuse("commit_offload", f"offload state is {self.offload.name}")
        self.offload = _OFFLOADED  # still offloaded: only reload brings it back
        self.page_indices = []
        self.keys = []
        self.key_tokens = bytearray()
        self._chain_cut()
        self.tail_maybe_shared = False
        self.generation += 1  # I14: pages or length changed

    def abandon_offload(self) -> None:
        """CLAIMED -> RESIDENT: the copy did not fit, failed, or the stream
        changed behind it; the pages never left."""
        if self.offload is not _CLAIMED:
            raise self._refuse("abandon_offload", f"offload state is {self.offload.name}")
        self._own()
        self.offload, self.offloaded = _RESIDENT, False

    def forget_offload(self) -> None:
        """OFFLOADED -> RESIDENT: the host copy was discarded (a reset, R12)."""
        if self.offload is not _OFFLOADED:
            raise self._refuse("forget_offload", f"offload state is {self.offload.name}")
        self._own()
        self.offload, self.offloaded = _RESIDENT, False

    def reload(self, pages: list[int], stored_len: int, position: int,
               released: int) -> None:
        """OFFLOADED -> RESIDENT with the host copy's state in ``pages``; only
        full pages are shared again, a part page is fresh: the tail is private."""
        if self.offload is not _OFFLOADED:
            raise self._refuse("reload", f"offload state is {self.offload.name}")
        self.offload, self.offloaded = _RESIDENT, False
        self.page_indices = pages
        self.stored_len = stored_len
        self.position = position
        self.released = released
        self.tail_maybe_shared = False
        self.generation += 1  # I14: pages or length changed

    # retrieve

    def wait_with(self, future: Future[Any]) -> None:
        """IDLE -> PENDING on another stream's copy: a retrieve that copied
        nothing into this one (its range was empty) is pending with the
        copy of its label's other group (H1)."""
        if self.read_future is not None or self.read_error is not None:
            raise self._refuse("wait_with", f"retrieve state is {self.retrieve.name}")
        self.read_future = future
        self.read_pending = True

    def start_retrieve(self, pages: list[int], released: int, future: Future[Any] | None,
                       seq_len: int) -> None:
        """IDLE -> PENDING (IDLE where no copy was needed): a peer's ``seq_len``
        tokens land in ``pages`` (slot ``released // page_size`` on). A peer's
        KV is never registered (R55)."""
        self._need_resident("start_retrieve")
        if self.read_future is not None or self.read_error is not None:
            raise self._refuse("start_retrieve", f"retrieve state is {self.retrieve.name}")
        self.page_indices = pages
        self.released = released
        self.read_future = future
        self.read_pending = future is not None
        # the tokens from the old length on are the peer's (W16 copies only
        # [max(old, released), n), but the slots between hold none of ours)
        old = self.stored_len
        self.received_at = old if self.received_at is None else min(self.received_at, old)
        self.stored_len = seq_len
        self.position = seq_len
        self.generation += 1  # I14: pages or length changed

    def fail_retrieve(self, err: BaseException) -> None:
        """-> FAILED, latched (I11): a publication found stale before any copy."""
        fut = self.read_future
        if fut is not None and not fut.done():
            raise self._refuse("fail_retrieve", "a copy is still writing its pages")
        self._own()
        self.read_error = err

    def abort_retrieve(self, err: BaseException) -> None:
        """-> FAILED, latched (I11), a copy it started possibly still running:
        a hybrid label whose later group's copy could not start (H1). The
        future is kept, so reset and removal drain the copy before its pages
        go."""
        if self.read_error is not None:
            raise self._refuse("abort_retrieve", f"retrieve state is {self.retrieve.name}")
        self._own()
        self.read_error = err

    def settle_retrieve(self) -> RetrieveState:
        """Read a finished copy's outcome off its future once and latch it
        (PENDING -> IDLE or FAILED); returns the state."""
        fut = self.read_future
        if fut is not None and fut.done():
            self._own()
            self.read_future = None
            err = fut.exception()
            if err is not None:
                self.read_error = err
            else:
                self.read_pending = False
        if self.read_error is not None:
            return RetrieveState.FAILED
        return RetrieveState.PENDING if self.read_future is not None else RetrieveState.IDLE

    def __repr__(self) -> str:
        flags = [
            name
            for name, on in (
                ("in_flight", self.step_in_flight),
                ("offload=" + self.offload.name, self.offload is not _RESIDENT),
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


class StreamBatch:
    """The streams of a decode batch, moved as one (issue 42, item 5).

    A decode step names the same streams step after step, each growing by
    one token. Its per-row passes in Python (two lookups and six fields read
    per row at admit, four fields written at commit) were most of a B = 256
    step; while a batch runs, its rows' lengths, page counts and
    generations live here, in arrays, and its admit and commit touch only
    the rows that cross into a new page.

    A row is a `BatchedStream` (the stream's class while it is in a batch):
    its ``stored_len``, ``position`` and ``generation`` read as the stream's
    own plus ``ticks`` (the batch's commits), its ``step_in_flight`` as its
    own or ``in_flight``. A stream outside a batch keeps plain slots, so no
    other path pays for a batch. Any transition on a row first makes its
    fields its own again (`detach`, by writing one of the four or by
    `CacheStream._own`), and from then the batch is no longer ``intact``:
    stepping takes the general path, which detaches the other rows as it
    writes them, and makes a batch again later.

    A batch holds only streams it checked at `join`: resident, no retrieve,
    at rest, a private tail: what the general admit asks of a row beside
    its pages and length.
    """

    __slots__ = ("gens", "in_flight", "intact", "key_at", "keys", "lens", "max_len",
                 "next_due", "next_release", "npages", "release_at", "retiring", "segments",
                 "streams", "ticks")

    def __init__(self, streams: list[CacheStream], segments: tuple[Any, ...],
                 keys: list[tuple[str, str]], page_size: int,
                 release_at: Sequence[int] | None = None) -> None:
        n = len(streams)
        self.streams, self.segments, self.keys = streams, segments, keys
        self.ticks = 0
        self.in_flight = False
        self.intact = True
        # per row, at ticks 0: the length, the pages its slots reach (held
        # plus released), the generation, where its commit looks to key (S33)
        self.lens: np.ndarray[Any, Any] = np.fromiter(
            [s.stored_len for s in streams], np.int64, n)
        self.npages: np.ndarray[Any, Any] = np.fromiter(
            [len(s.page_indices) + s.released // page_size for s in streams], np.int64, n)
        self.gens: np.ndarray[Any, Any] = np.fromiter(
            [s.generation for s in streams], np.int64, n)
        self.key_at: np.ndarray[Any, Any] = np.fromiter(
            [s.key_at for s in streams], np.int64, n)
        self.max_len = int(self.lens.max()) if n else 0
        # the fewest commits before some row's length reaches its key_at: the
        # commits before it compare nothing (a row's later key_at only lowers
        # it, `CacheStream.looked`; a commit that compares finds it again)
        self.next_due = int((self.key_at - self.lens).min()) if n else NEVER
        # per row, the length at which its commit first releases a page (W2:
        # `LabelBehaviour.next_release`; NEVER for full attention), and the
        # fewest commits before some row reaches it; None: no row releases
        self.release_at: np.ndarray[Any, Any] | None = None
        self.next_release = NEVER
        self.retiring = False  # inside `retire`: the one release a row stays a row through
        if release_at is not None and n and min(release_at) < NEVER:
            self.release_at = np.fromiter(release_at, np.int64, n)
            self.next_release = int((self.release_at - self.lens).min())
        for i, s in enumerate(streams):
            s.__class__ = BatchedStream
            s._batch = self
            s._batch_row = i

    @staticmethod
    def join(streams: list[CacheStream], segments: tuple[Any, ...], page_size: int,
             release_at: Sequence[int] | None = None) -> StreamBatch | None:
        """A batch of ``streams`` (one segment of span 1 each, ``segments``,
        each stream named once, none in a batch), or None where a row may
        refuse an admit or copy its tail: the general path decides those.
        ``release_at``: each row's `LabelBehaviour.next_release` from its
        ``released`` (None: no label releases)."""
        for s in streams:
            if type(s) is not CacheStream:
                return None  # a row of another batch, or a test's own subclass
            if (s.offloaded or s.read_future is not None or s.read_error is not None
                    or s.step_in_flight):
                return None
            if s.tail_maybe_shared and s.stored_len % page_size:
                # its next write may land in a shared page (R52), which the
                # general path copies first. From a page's end it writes
                # into pages of its own, as every later step of the batch does
                return None
        keys = [(g.request_id, g.label) for g in segments]
        return StreamBatch(streams, segments, keys, page_size, release_at)

    def detach(self, s: CacheStream) -> None:
        """``s`` leaves: the batch's part of its fields becomes its own."""
        t = self.ticks
        s.__class__ = CacheStream
        s.stored_len += t
        s.position += t
        s.generation += t
        if self.in_flight:
            s.step_in_flight = True
        s._batch = None
        self.intact = False

    def dissolve(self) -> None:
        """Every row leaves (a step the batch does not end by itself)."""
        for s in self.streams:
            if s._batch is self:
                self.detach(s)

    def matches(self, segments: Sequence[Any]) -> bool:
        """``segments`` name the batch's streams in its order, span 1 each."""
        mine = self.segments
        n = len(mine)
        if len(segments) != n:
            return False
        if segments[0] is mine[0]:
            # the same objects (an engine that keeps its step): ==, identity
            # first in C; a segment replaced by an equal one compares equal
            ok = tuple(segments) == mine
        else:
            ok = (list(map(_key_of, segments)) == self.keys
                  and list(map(_span_of, segments)).count(1) == n)
        if ok:
            self.segments = tuple(segments)
        return ok

    def short(self, page_size: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """The rows whose next token lies past the pages they hold, and how
        many pages each is short."""
        short = (self.lens + (self.ticks + page_size)) // page_size - self.npages
        rows = (short > 0).nonzero()[0]
        return rows, short[rows]

    def grow(self, rows: np.ndarray[Any, Any], counts: np.ndarray[Any, Any],
             pages: Sequence[list[int]]) -> None:
        """`append_pages` of ``pages[j]`` (``counts[j]`` of them) to row
        ``rows[j]`` each, the rows staying in the batch."""
        streams = self.streams
        for i, got in zip(rows.tolist(), pages, strict=True):
            s = streams[i]
            s.page_indices += got
            # the slot under the property: the row stays in the batch
            _GENERATION.__set__(s, _GENERATION.__get__(s, CacheStream) + 1)  # I14
        self.npages[rows] += counts
        self.gens[rows] += 1

    def mark(self) -> None:
        """`mark_step` of every row."""
        self.in_flight = True

    def end(self, commit: bool, watch: bool) -> list[int]:
        """`end_step` of every row, one token each where ``commit``; with
        ``watch``, the rows whose length reached their ``key_at`` (S33)."""
        self.in_flight = False
        if not commit:
            return []
        t = self.ticks = self.ticks + 1
        if not watch or t < self.next_due:
            return []
        gap = self.key_at - self.lens
        rows: list[int] = (gap <= t).nonzero()[0].tolist()
        self.next_due = int(gap.min())
        return rows

    def passing(self) -> list[int]:
        """After a commit (`end`): the rows whose length reached their
        ``release_at``, whose window (or chunk) may now pass a page (W2).
        A window moves one page every page_size commits, so most commits
        compare nothing."""
        at = self.release_at
        if at is None or self.ticks < self.next_release:
            return []
        rows: list[int] = ((at - self.lens) <= self.ticks).nonzero()[0].tolist()
        return rows

    def retire(self, rows: list[int],
               release: Callable[[list[tuple[str, str]], list[CacheStream]], None]) -> None:
        """``release`` (`StreamTable.retire_each`) of the ``rows`` at the
        batch's own commit: their windows let go of pages and they stay
        rows. A release anywhere else takes its row out first."""
        self.retiring = True
        try:
            release([self.keys[i] for i in rows], [self.streams[i] for i in rows])
        finally:
            self.retiring = False

    def rearm(self, rows: list[int], ats: list[int]) -> None:
        """Row ``rows[i]`` next releases at length ``ats[i]`` (its
        ``released`` after the commit's release)."""
        at = self.release_at
        assert at is not None
        at.put(rows, ats)
        self.next_release = int((at - self.lens).min())

    def released(self, s: CacheStream) -> None:
        """A row's window released pages at the batch's own commit: its
        generation moves (I14) and it stays a row."""
        _GENERATION.__set__(s, _GENERATION.__get__(s, CacheStream) + 1)
        self.gens[s._batch_row] += 1

    def generations(self) -> np.ndarray[Any, Any]:
        """Every row's ``generation``."""
        return self.gens + self.ticks


# the slots under `BatchedStream`'s properties: the row's own values
_STORED_LEN = CacheStream.__dict__["stored_len"]
_POSITION = CacheStream.__dict__["position"]
_GENERATION = CacheStream.__dict__["generation"]
_IN_FLIGHT = CacheStream.__dict__["step_in_flight"]


class BatchedStream(CacheStream):
    """A stream while it is a row of a `StreamBatch` (its class is swapped
    in and out by the batch): the four fields the batch moves read through
    it, and any write of one, or any other transition, leaves the batch."""

    __slots__ = ()

    def _own(self) -> None:
        b = self._batch
        assert b is not None
        b.detach(self)

    def release_window_to(self, released: int, page_size: int) -> list[int]:
        # W2 at its batch's commit (`StreamBatch.retire`): the released slots
        # leave as they do from any stream, and the row stays; any other
        # release is a transition like the rest, which takes the row out
        b = self._batch
        assert b is not None
        if not b.retiring:
            self._own()
            return self.release_window_to(released, page_size)
        go = self._drop_front(released, page_size)
        b.released(self)
        return go

    @property
    def stored_len(self) -> int:
        b = self._batch
        assert b is not None
        return int(_STORED_LEN.__get__(self, CacheStream)) + b.ticks

    @stored_len.setter
    def stored_len(self, value: int) -> None:
        self._own()
        self.stored_len = value

    @property
    def position(self) -> int:
        b = self._batch
        assert b is not None
        return int(_POSITION.__get__(self, CacheStream)) + b.ticks

    @position.setter
    def position(self, value: int) -> None:
        self._own()
        self.position = value

    @property
    def generation(self) -> int:
        b = self._batch
        assert b is not None
        return int(_GENERATION.__get__(self, CacheStream)) + b.ticks

    @generation.setter
    def generation(self, value: int) -> None:
        self._own()
        self.generation = value

    @property
    def step_in_flight(self) -> bool:
        b = self._batch
        assert b is not None
        return bool(_IN_FLIGHT.__get__(self, CacheStream)) or b.in_flight

    @step_in_flight.setter
    def step_in_flight(self, value: bool) -> None:
        self._own()
        self.step_in_flight = value


_key_of = operator.attrgetter("request_id", "label")
_span_of = operator.attrgetter("span")
_generation = operator.attrgetter("generation")
_offloaded = operator.attrgetter("offloaded")


def generations(streams: list[CacheStream]) -> np.ndarray[Any, Any]:
    """Each stream's ``generation`` (int64): a whole batch's from its array."""
    b = streams[0]._batch if streams else None
    if b is not None and b.intact and b.streams is streams:
        return b.generations()
    return np.fromiter(map(_generation, streams), np.int64, len(streams))
