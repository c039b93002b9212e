"""A decode batch's page table, kept across steps (issue 28).

`decode_tables` builds a step's table from every view; a decode batch,
step after step, changes few of its rows: each stream's length grows by
one, and a stream crossing into a new page gains one page. This keeps the
rows of the last decode step planned (per row: the stream, its view length,
page count, released offset and pages) and updates only the rows that
changed. Which rows changed is read off ``CacheStream.generation``, which
every change to a stream's pages or length bumps and nothing lowers: a row
whose stream holds the generation the table expects (what it was at the
last plan, plus the bumps the stepping itself made and told the table of:
a commit of the planned step, an admit's appended pages) changed only by
those; any other row (a copy-on-write swap, a window release, a truncate,
an offload, a fork, a reset, a retrieve) is read again from its stream.

The step's Python work is per row changed, not per page held. The kept
page indices are one int32 array that nothing writes after it is made:
the plan hands out that array itself as ``paged_kv_indices``. A step that
appends no page hands out the array of the step before (no copy); a step
that changes rows writes a new array in one pass, from slices of the old
one and the changed rows' streams, which becomes both the kept rows and
the plan's table (one copy, where a buffer written in place would need a
second to keep handed-out tables from changing). The indptrs and last page
lengths are a fresh small buffer per plan. Below `SMALL_BATCH` rows the
numpy set-up of an update costs more than building the table afresh from
the admit's streams (`fresh_plan`), which is done instead. A mixed step
(the decode batch plus a prefill chunk, what continuous batching with
chunked prefill runs most of the time) is built by `fresh_plan` too, in
the same one pass, the chunk one longer row whose write slots join the
one-token rows' as `mixed_tables` joins them (issue 42: it used to try the
decode pass, drop it at the chunk, and build every view for the general
path).

Outputs are the same bytes `decode_tables` (`mixed_tables`) gives over the same state
(tests/unit/test_decode_table.py and the lockstep compare them), and a
caller holding an earlier plan's tables sees them unchanged: arrays a plan
handed out are never written again (the same test holds every plan's
tables to what they were when handed out). The views are built from the
plan's own table on first read: most decode steps never read them.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import repeat
from typing import Any, Protocol

import numpy as np
import torch

from kvref.core.streams import CacheStream, generations
from kvref.stepping.plan import (
    KVPlanState,
    LongChunk,
    PagedIndptrs,
    SequenceView,
    chunk_slots,
    decode_slots,
    joined_slots,
    mixed_outputs,
    table_indptrs,
)
from kvref.stepping.step import Segment

_generation = operator.attrgetter("generation")
_stored = operator.attrgetter("stored_len")
_released = operator.attrgetter("released")
_span = operator.attrgetter("span")

Array = np.ndarray[Any, Any]
# a kept table's rows: generations, view lengths, page counts, released
# offsets, and the page indices of every row in order
Rows = tuple[Array, Array, Array, Array, Array]

# below this many rows, `decode_tables` builds the table afresh in the time
# the kept table's fixed numpy set-up takes (a few dozen small array ops)
SMALL_BATCH = 32


class DecodePlan:
    """What `DecodeTable.plan` hands out: the host table, the write slots,
    and the plan-time rows the views are built from when first read. A
    mixed step's (`fresh_plan`, some span not 1) also carries its table on
    the device (``cuda``), as `plan.mixed_tables` gives it."""

    __slots__ = ("cuda", "gens", "head", "indices", "indptrs", "kept", "offset", "segments",
                 "state", "view_len")

    def __init__(self, segments: Sequence[Segment], head: Array, indices: Array,
                 indptrs: PagedIndptrs, state: KVPlanState, gens: Array | list[int],
                 view_len: Array | list[int], offset: Array | list[int],
                 cuda: PagedIndptrs | None = None) -> None:
        # ``head``: qo and kv indptrs, last page lengths (int32); ``indices``:
        # the page indices, never written after this plan is made
        self.segments, self.head, self.indices = segments, head, indices
        self.indptrs, self.state, self.cuda = indptrs, state, cuda
        self.gens, self.view_len, self.offset = gens, view_len, offset
        # made by the kept table (`DecodeTable`), whose rows it now holds
        self.kept = False

    def views(self) -> list[SequenceView]:
        """The step's views as `_sequence_views` builds them, from this plan's
        table (arrays no later plan writes) and the generations read when it
        was made; each computes its segment's span."""
        n = len(self.segments)
        kv = self.head[n + 1:2 * n + 2].tolist()
        idx = self.indices
        return [SequenceView(seg.request_id, seg.label, idx[kv[i]:kv[i + 1]].tolist(),
                             length, seg.span, gen, off)
                for i, (seg, length, gen, off) in enumerate(zip(
                    self.segments, _ints(self.view_len), _ints(self.gens),
                    _ints(self.offset), strict=True))]


def _ints(rows: Array | list[int]) -> list[int]:
    return rows.tolist() if isinstance(rows, np.ndarray) else rows


def fresh_plan(segments: Sequence[Segment], streams: list[CacheStream], page_size: int,
               device: torch.device) -> DecodePlan | None:
    """A step's tables over ``streams``, its segments' streams as its plain
    admit found them (one label, no forks), built afresh in one pass over
    the rows: what `decode_tables` (every span 1) or `mixed_tables` (a
    decode batch plus prefill chunks, issue 42) makes of the step's views,
    without making the views. Used below `SMALL_BATCH` rows, whose kept
    table would cost more in numpy set-up than this, and for every mixed
    step (the kept table keeps decode rows only). None for a step of several
    labels, or one with a segment whose stream stays empty (no view: the
    general path drops its row)."""
    n = len(streams)
    if not n:
        return None
    label = segments[0].label
    kv = [0]
    last: list[int] = []
    # the write slots: one per one-token row, a chunk's in its place among
    # them (`plan.chunk_slots`: a short one's as Python ints, a long one's
    # marked in ``cuts`` and joined by `plan.joined_slots`), so a mixed step
    # runs this same pass and conversion, its chunk one longer row (issue 42)
    pages: list[int] = []
    offsets: list[int] = []
    cuts: list[LongChunk] = []
    # rows of span other than 1 (mixed steps only): each row's index and the
    # queries it adds past one, by which the query indptr after it moves
    shifts: list[tuple[int, int]] = []
    arrays: list[Array] = []
    view_len: list[int] = []
    held = 0
    ps = page_size
    for seg, s, arr in zip(segments, streams, CacheStream.pages_arrays(streams), strict=True):
        if seg.label != label:
            return None
        # a windowed stream's view starts at its first retained page (W1, W4)
        end = s.stored_len - s.released  # the first new token's place in the view
        span = seg.span
        if span == 1:
            k = end // ps
            off = end - k * ps
            pages.append(s.page_indices[k])
            k += 1  # the view's pages
            last.append(off + 1)
            offsets.append(off)
            view_len.append(end + 1)
        else:
            if not s.stored_len + span:
                return None  # an empty stream that stays empty has no view
            shifts.append((len(last), span - 1))
            length = end + span
            k = -(-length // ps)
            last.append((length - 1) % ps + 1 if length else 0)
            view_len.append(length)
            chunk_slots(s.page_indices, arr, end, length, ps, pages, offsets, cuts)
        arrays.append(arr if len(arr) == k else arr[:k])  # len: no shape tuple per row
        held += k
        kv.append(held)
    # plan-time generations and released offsets for the views, in two
    # C-level passes (most plans never build their views)
    gens = list(map(_generation, streams))
    offset = list(map(_released, streams))
    b = 3 * n + 2
    # qo indptr (one query a row), kv indptr, last page lengths: a decode
    # step's head, whose query indptr a mixed step's chunks then move in C
    # (not an ``accumulate`` over every row's span: about 1 µs at B = 16)
    head = [*range(n + 1), *kv, *last]
    for i, extra in shifts:
        if i == n - 1:
            head[n] += extra  # a chunk in the last row: only the end moves
        else:
            head[i + 1:n + 1] = map(operator.add, head[i + 1:n + 1], repeat(extra))
    table = np.concatenate((np.array(head, dtype=np.int32), *arrays))
    if shifts:
        indptrs, state, cuda = mixed_outputs(table, n, b + held,
                                             joined_slots(pages, offsets, cuts, ps), head[n],
                                             device)
        return DecodePlan(segments, table[:b], table[b:], indptrs, state, gens, view_len,
                          offset, cuda)
    return DecodePlan(segments, table[:b], table[b:], table_indptrs(table, n),
                      decode_slots(np.array(pages + offsets, dtype=np.int64), device),
                      gens, view_len, offset)


class DecodeTables(Protocol):
    """What stepping asks of its kept decode tables: `DecodeTable`, or a
    hybrid config's one per attention group (`kvref.hybrid.decode`)."""

    def plans(self, segments: Sequence[Segment], streams: list[CacheStream],
              grown: Sequence[int]) -> list[DecodePlan] | None: ...

    def committed(self) -> None: ...


class DecodeTable:
    """The rows of the last decode step planned, for the next one to update."""

    def __init__(self, page_size: int, device: torch.device) -> None:
        self._ps = page_size
        self._device = device
        # the rows' streams, in the step's order; None: nothing kept
        self._streams: list[CacheStream] | None = None
        self._segments: Sequence[Segment] = ()
        # per row at the last plan: the stream's generation, the view's length
        # (past its released offset), its pages, the released offset
        self._gens: Array = np.empty(0, dtype=np.int64)
        self._view_len: Array = np.empty(0, dtype=np.int64)
        self._npages: Array = np.empty(0, dtype=np.int64)
        self._offset: Array = np.empty(0, dtype=np.int64)
        self._kv: Array = np.zeros(1, dtype=np.int64)  # row i's pages: indices[kv[i]:kv[i+1]]
        # never written once made: plans hand it out as their indices
        self._indices: Array = np.empty(0, dtype=np.int32)
        self._indices_t: torch.Tensor | None = None  # its tensor, as handed out
        self._qo: Array = np.zeros(1, dtype=np.int64)
        # commits of a step this table planned since its last plan: each added
        # one token to every row and bumped its generation once
        self.commits = 0

    def forget(self) -> None:
        self._streams = None

    def committed(self) -> None:
        """The step this table last planned was committed, keeping its tokens."""
        self.commits += 1

    def plan(self, segments: Sequence[Segment], streams: list[CacheStream],
             grown: Sequence[int]) -> DecodePlan | None:
        """The tables of a decode step (every span 1, one label) over
        ``streams`` (its segments' streams, as its admit found them);
        ``grown``: the rows whose admit appended pages (one generation bump
        each). A step with spans other than 1 (a mixed step) and any step
        below `SMALL_BATCH` rows are built afresh (`fresh_plan`), the kept
        rows left as they were (the plan's ``kept`` is False). None when the
        step has several labels."""
        n = len(streams)
        if n < SMALL_BATCH:
            return fresh_plan(segments, streams, self._ps, self._device)
        kept = self._streams
        # a list's == compares element by element, identity first, in C: a
        # stream has no __eq__ (identity), and an equal segment has the same
        # span (issue 42: ``all(map(operator.is_, ...))`` took 15 µs a
        # compare at 256 rows, == takes well under one where all are the same)
        if kept is not None and len(kept) == n and streams == kept and (
                segments == self._segments or list(map(_span, segments)).count(1) == n):
            self._segments = segments
            return self._emit(*self._update(streams, grown))
        if not n or list(map(_span, segments)).count(1) != n:
            # a mixed step (a decode batch plus chunks, issue 42) afresh; the
            # kept rows stay: the next decode step of them reads again only
            # the rows this step changed (its commit bumps every generation
            # without telling the table, so those are all of them)
            return fresh_plan(segments, streams, self._ps, self._device)
        if len({s.label for s in segments}) != 1:
            return None
        self._streams, self._segments = streams, segments
        self._qo = np.arange(n + 1, dtype=np.int64)
        return self._emit(*self._rebuild(streams))

    def plans(self, segments: Sequence[Segment], streams: list[CacheStream],
              grown: Sequence[int]) -> list[DecodePlan] | None:
        """`plan`, as one plan per plan label (a hybrid config's tables,
        `kvref.hybrid.decode`, answer with one per attention group)."""
        got = self.plan(segments, streams, grown)
        return None if got is None else [got]

    def _generations(self, streams: list[CacheStream]) -> Array:
        """The rows' generations (a decode batch's from its array)."""
        return generations(streams)

    def _rebuild(self, streams: list[CacheStream]) -> Rows:
        """Every row afresh from its stream."""
        n = len(streams)
        gens = self._generations(streams)
        offset = np.fromiter(map(_released, streams), np.int64, n)
        view_len = np.fromiter(map(_stored, streams), np.int64, n) + 1 - offset
        npages = (view_len + (self._ps - 1)) // self._ps  # two ops, not three
        indices = np.concatenate(
            [s.pages_array()[:k] for s, k in zip(streams, npages.tolist(), strict=True)])
        return gens, view_len, npages, offset, indices

    def _update(self, streams: list[CacheStream], grown: Sequence[int]) -> Rows:
        """The kept rows moved on by the commits told since the last plan and
        ``grown``'s appended pages; the rows anything else changed read again."""
        n = len(streams)
        gens = self._generations(streams)
        expect = self._gens + self.commits
        if grown:
            expect[list(grown)] += 1
        dirty = (gens != expect).nonzero()[0]
        if dirty.size == n:
            return self._rebuild(streams)  # every row moved
        view_len = self._view_len + self.commits
        offset = self._offset
        if dirty.size:
            # read again from their streams: what changed them is unknown here
            offset = offset.copy()
            for i in dirty.tolist():
                s = streams[i]
                offset[i] = s.released
                view_len[i] = s.stored_len + 1 - s.released
        npages = (view_len + (self._ps - 1)) // self._ps  # two ops, not three
        moved = npages != self._npages
        if dirty.size:
            moved[dirty] = True  # a mask, not a union1d: that sorts
        changed = np.flatnonzero(moved)
        indices = self._indices
        if not changed.size:
            # no row's pages changed: the kept array, which no plan writes,
            # is this plan's table as it was the last one's
            return gens, view_len, npages, offset, indices
        if not dirty.size and self.commits == 1:
            # a decode step after a decode step: each changed row only gained
            # the one page its admit appended (a row changed otherwise is
            # dirty), so the rows are written by a few vector ops, not a
            # slice and a page array per row (issue 42)
            return gens, view_len, npages, offset, self._grown_rows(streams, changed, npages)
        # a new array, never the kept one written in place (an earlier plan
        # holds it): the unchanged runs of rows as slices of it, the changed
        # rows from their streams' kept page arrays, in one concatenate (only
        # the changed rows' bounds in it made Python ints)
        kv = self._kv
        pieces: list[Array] = []
        prev = 0
        for i, start, end, k in zip(changed.tolist(), kv[changed].tolist(),
                                    kv[changed + 1].tolist(), npages[changed].tolist(),
                                    strict=True):
            pieces.append(indices[prev:start])
            pieces.append(streams[i].pages_array()[:k])
            prev = end
        pieces.append(indices[prev:])
        return gens, view_len, npages, offset, np.concatenate(pieces)

    def _keep(self, gens: Array, view_len: Array, npages: Array, offset: Array,
              indices: Array) -> Array:
        """Keep the rows for the next plan to update; their kv indptr (int64)."""
        kv = np.zeros(gens.shape[0] + 1, dtype=np.int64)
        np.cumsum(npages, out=kv[1:])
        self._gens, self._view_len, self._npages, self._offset = gens, view_len, npages, offset
        self._kv, self._indices = kv, indices
        self.commits = 0
        return kv

    def _grown_rows(self, streams: list[CacheStream], changed: Array, npages: Array) -> Array:
        """The kept indices with one page added at the end of each of the
        ``changed`` rows (each clean, its view one token longer: one page
        more), in a new array: the kept one is never written."""
        new_np = npages[changed]
        # a clean row's first pages are the kept ones (only its admit's
        # append changed its pages); the page it gained is its view's last
        last = [streams[i].page_indices[k - 1]
                for i, k in zip(changed.tolist(), new_np.tolist(), strict=True)]
        old = self._indices
        m = len(last)
        # where each row's new page lands in the new array: after the row's
        # kept pages, shifted by the pages added to the rows before it
        at = self._kv[changed + 1] + np.arange(m)
        out = np.empty(old.shape[0] + m, dtype=np.int32)
        rest = np.empty(out.shape[0], dtype=bool)
        rest.fill(True)  # np.ones goes through a Python wrapper
        rest[at] = False
        out[rest] = old
        out[at] = last
        return out

    def _emit(self, gens: Array, view_len: Array, npages: Array, offset: Array,
              indices: Array) -> DecodePlan:
        """Keep the rows, and hand out their tables: ``indices``, the rows'
        pages in order (int32, an array no one writes), kept and handed out
        as it is; the indptrs and last page lengths in a fresh buffer."""
        n = gens.shape[0]
        ps = self._ps
        if indices is not self._indices or self._indices_t is None:
            self._indices_t = torch.from_numpy(indices)
        kv = self._keep(gens, view_len, npages, offset, indices)
        pos = view_len - 1
        off = pos % ps
        # qo, kv indptrs and last page lengths in one int32 buffer, laid out
        # as the head of `decode_tables`' table
        b = (n + 1, 2 * n + 2, 3 * n + 2)
        head = np.empty(b[2], dtype=np.int32)
        head[:b[0]] = self._qo
        head[b[0]:b[1]] = kv
        head[b[1]:] = off + 1
        indptrs = PagedIndptrs(
            qo_indptr=torch.from_numpy(head[:b[0]]),
            paged_kv_indptr=torch.from_numpy(head[b[0]:b[1]]),
            paged_kv_last_page_len=torch.from_numpy(head[b[1]:]),
            paged_kv_indices=self._indices_t,
        )
        # each row writes on its view's last page, ``kv[1:] - 1``: ``npages``
        # is ``pos // ps + 1`` (a view holds at least its new token)
        state = decode_slots(np.concatenate((indices[kv[1:] - 1], off)), self._device)
        plan = DecodePlan(self._segments, head, indices, indptrs, state, gens, view_len, offset)
        plan.kept = True
        return plan
