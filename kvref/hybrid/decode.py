"""A hybrid decode step's tables: every attention group's rows in one kept table (issue 40).

`GroupLayout.expand` turns a decode step of B requests into B x G segments,
request-major: request r's stream of group g is segment ``r * G + g``. Each
group is its own plan label, so the step has G page tables; planned from
the views (`plan.plan_tables`) that is G passes over the rows, each
building a view per row. Each group's rows are a plain decode batch of one
label, though, which is what `DecodeTable` plans from the rows the last
step left, re-reading only the rows that changed (a page appended, a
window release). `GroupDecodeTables` keeps all G x B rows as one such
table, group-major (group 0's rows, then group 1's, ...), so each group's
page indices are one run of the kept array and a step pays the table's
fixed numpy set-up once, not once per group (a table per group paid it G
times: at B=16 most of the plan). Its plans split the rows back into one
`DecodePlan` per group, the same bytes a group's own `DecodeTable` (and
`decode_tables` of its views) makes, in the plan labels' order.
Below `SMALL_BATCH` rows in all, where the kept table's numpy set-up costs
more than it saves, every group is built afresh in one pass over the rows
with one host buffer (`fresh_plans`), as `fresh_plan` builds one group.
tests/unit/test_hybrid_decode_tables.py holds both to a scratch build.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from operator import getitem
from typing import Any

import numpy as np
import torch

from kvref.core.streams import CacheStream
from kvref.stepping import decode_table
from kvref.stepping.decode_table import DecodePlan, DecodeTable, fresh_plan
from kvref.stepping.plan import KVPlanState, PagedIndptrs, host_to_device
from kvref.stepping.step import Segment

Array = np.ndarray[Any, Any]

_span = operator.attrgetter("span")
_label = operator.attrgetter("label")
_generation = operator.attrgetter("generation")
_stored = operator.attrgetter("stored_len")
_released = operator.attrgetter("released")
_page_indices = operator.attrgetter("page_indices")
_pages_array = operator.methodcaller("pages_array")


class GroupDecodeTables(DecodeTable):
    """Every attention group's rows as one kept `DecodeTable`, group-major,
    answering with one plan per group (`plans`)."""

    def __init__(self, groups: int, page_size: int, device: torch.device) -> None:
        super().__init__(page_size, device)
        self._g = groups
        # the kept rows' streams group-major: the order of the kept arrays
        self._order: list[CacheStream] = []
        # each group's run of the kept indices as a tensor, handed out again
        # while no row's pages change (as `DecodeTable` hands out its one)
        self._runs: list[torch.Tensor] = []
        self._blank: Array = np.zeros((0, 0), dtype=np.int32)  # `_split`'s head, before its rows
        self._perm: Array = np.zeros(0, dtype=np.int64)  # the step's row of each kept row

    def _generations(self, streams: list[CacheStream]) -> Array:
        # the kept rows are the step's group-major: a decode batch's rows
        # (`StreamBatch`, in the step's order) read from its array and put
        # in the table's, not a property call per row
        step = self._streams
        b = step[0]._batch if step else None
        if b is not None and b.intact and b.streams is step and streams is self._order:
            got: Array = b.generations()[self._perm]
            return got
        return super()._generations(streams)

    def plan(self, segments: Sequence[Segment], streams: list[CacheStream],
             grown: Sequence[int]) -> DecodePlan | None:
        """Not for a hybrid step: its rows hold several labels, one per group."""
        raise TypeError("a hybrid step has a table per group: ask `plans`")

    def plans(self, segments: Sequence[Segment], streams: list[CacheStream],
              grown: Sequence[int]) -> list[DecodePlan] | None:
        """Each group's decode plan, first group first; None unless every
        group's rows make a plain step of one label (any other step is
        planned from its views). A mixed step (some span not 1) is each
        group afresh (`fresh_plan`), the kept rows left as they were."""
        g, n = self._g, len(streams)
        if not n or n % g:
            return None
        if n < decode_table.SMALL_BATCH:
            return fresh_plans(segments, streams, g, self._ps, self._device)
        kept = self._streams
        if kept is not None and len(kept) == n and all(map(operator.is_, streams, kept)) and (
                all(map(operator.is_, segments, self._segments))
                or list(map(_span, segments)).count(1) == n):
            # (equal rows, maybe another list: a decode batch's, which
            # `_generations` knows by identity)
            self._streams, self._segments = streams, segments
            b = n // g
            # row i of the step (request i // g, group i % g), group-major
            return self._split(*self._update(self._order, [i % g * b + i // g for i in grown]))
        if list(map(_span, segments)).count(1) != n:
            # a mixed step, as each group's own `DecodeTable` plans one: afresh
            got = [fresh_plan(segments[k::g], streams[k::g], self._ps, self._device)
                   for k in range(g)]
            return None if any(p is None for p in got) else got  # type: ignore[return-value]
        if any(len(set(map(_label, segments[k::g]))) != 1 for k in range(g)):
            return None
        self._streams, self._segments = streams, segments
        self._order = [s for k in range(g) for s in streams[k::g]]
        # the step's row of each kept row: group k's r-th is row r * g + k
        self._perm = np.arange(n).reshape(n // g, g).T.ravel()
        self._qo = np.arange(n // g + 1, dtype=np.int64)
        return self._split(*self._rebuild(self._order))

    def _split(self, gens: Array, view_len: Array, npages: Array, offset: Array,
               indices: Array) -> list[DecodePlan]:
        """Keep the rows, and hand out each group's tables, laid out as
        `DecodeTable._emit` lays out one: its run of ``indices`` (an array
        no one writes), its qo and kv indptrs and last page lengths in a
        fresh buffer, its write slots."""
        g, n, ps = self._g, gens.shape[0], self._ps
        b = n // g
        same = indices is self._indices and len(self._runs) == g
        kv = self._keep(gens, view_len, npages, offset, indices)
        # each row's last page (in its view) and the new token's offset in it
        last_page, off = np.divmod(view_len - 1, ps)
        if self._blank.shape != (g, 3 * b + 2):
            self._blank = np.zeros((g, 3 * b + 2), dtype=np.int32)
            self._blank[:, :b + 1] = self._qo
        # a group's head per row, its qo indptr (and kv indptr's 0) copied
        # from a blank one: a small op costs more than its bytes
        head = self._blank.copy()
        # the kv indptr within each group: the table's, less where the group starts
        np.subtract(kv[1:].reshape(g, b), kv[:-1:b, None], out=head[:, b + 2:2 * b + 2],
                    casting="unsafe")  # int64 sums cast back, as `_emit` casts them
        head[:, 2 * b + 2:] = (off + 1).reshape(g, b)
        ends = kv[::b].tolist()  # where each group's run of indices starts, and the end
        if not same:
            self._runs = [torch.from_numpy(indices[ends[k]:ends[k + 1]]) for k in range(g)]
        host = np.concatenate((indices[kv[:-1] + last_page], off))
        dev = self._device
        # on a device, every group's write slots in one copy; on the host,
        # numpy slices wrap for less than torch slices cost
        slots = host_to_device(torch.from_numpy(host), dev) if dev.type != "cpu" else None
        qo = torch.from_numpy(head[0, :b + 1])  # the same rows in every group's plan
        # a group in lockstep with the one before (a request's windows of one
        # W: the same view lengths) has its head and write offsets, byte for
        # byte: the tensors made for the first serve the rest (none is written)
        vl = view_len.tobytes()  # compared as bytes: a few small numpy ops cost more
        w = len(vl) // g
        alike = [k > 0 and vl[k * w:(k + 1) * w] == vl[(k - 1) * w:k * w] for k in range(g)]
        segs = self._segments
        out = []
        for k in range(g):
            r = slice(k * b, (k + 1) * b)
            if not alike[k]:
                h = head[k]
                kv_t = torch.from_numpy(h[b + 1:2 * b + 2])
                last_t = torch.from_numpy(h[2 * b + 2:])
                o = slice(n + k * b, n + (k + 1) * b)
                cache_t = slots[o] if slots is not None else torch.from_numpy(host[o])
            indptrs = PagedIndptrs(qo_indptr=qo, paged_kv_indptr=kv_t,
                                   paged_kv_last_page_len=last_t, paged_kv_indices=self._runs[k])
            page_t = slots[r] if slots is not None else torch.from_numpy(host[r])
            state = KVPlanState(token_to_page=page_t, token_to_cache=cache_t, total_tokens=b)
            plan = DecodePlan(segs[k::g], h, indices[ends[k]:ends[k + 1]], indptrs, state,
                              gens[r], view_len[r], offset[r])
            plan.kept = True
            out.append(plan)
        return out


def fresh_plans(segments: Sequence[Segment], streams: list[CacheStream], groups: int,
                page_size: int, device: torch.device) -> list[DecodePlan] | None:
    """Every group's decode tables afresh: `decode_table.fresh_plan` of each
    group's rows (the same bytes), in one pass over the rows and one host
    buffer, so the per-plan numpy and torch set-up is paid once, not per
    group. None unless every segment has span 1 and each group's rows one
    label (the general plan decides any other step).

    Groups in lockstep share their arithmetic: a group whose rows have the
    lengths and released counts of the group before (a request's window
    groups of one W, step after step) has its view lengths, page counts
    and last page lengths, and reads only its own pages."""
    n, g, ps = len(streams), groups, page_size
    b = n // g
    head: list[int] = []  # per group: qo indptr, kv indptr, last page lengths
    qo = list(range(b + 1))
    pages: list[int] = []  # every group's write pages, then their offsets
    offsets: list[int] = []
    gens: list[int] = []
    view_len: list[int] = []
    offset: list[int] = []
    arrays: list[Array] = []
    ends = [0]  # where each group's pages start in the indices
    held = 0
    # the last group worked out: its rows' lengths and released counts, and
    # what they gave (kv indptr, last page lengths, each row's last page
    # slot, page count, offset in its last page, view length)
    was: tuple[list[int], list[int]] | None = None
    kv: list[int] = []
    last: list[int] = []
    last_page: list[int] = []
    counts: list[int] = []
    offs: list[int] = []
    lens: list[int] = []
    for k in range(g):
        segs, rows = segments[k::g], streams[k::g]
        label = segs[0].label
        if list(map(_span, segs)).count(1) != b or list(map(_label, segs)).count(label) != b:
            return None
        gens += map(_generation, rows)
        at = (list(map(_stored, rows)), list(map(_released, rows)))
        if at == was:
            # the group before's rows, page for page: its arithmetic stands
            pages += map(getitem, map(_page_indices, rows), last_page)
            arrays += [a if a.shape[0] == m else a[:m]
                       for a, m in zip(map(_pages_array, rows), counts, strict=True)]
        else:
            was = at
            kv, last, last_page, counts, offs, lens = [0], [], [], [], [], []
            in_group = 0
            for s, stored, rel in zip(rows, at[0], at[1], strict=True):
                # a windowed stream's view starts at its first retained page (W1, W4)
                end = stored - rel  # the new token's place in the view
                j = end // ps
                off = end - j * ps
                pages.append(s.page_indices[j])
                last_page.append(j)
                j += 1  # the view's pages
                arr = s.pages_array()
                arrays.append(arr if arr.shape[0] == j else arr[:j])
                counts.append(j)
                in_group += j
                kv.append(in_group)
                last.append(off + 1)
                offs.append(off)
                lens.append(end + 1)
        offsets += offs
        view_len += lens
        offset += at[1]
        head += qo
        head += kv
        head += last
        held += kv[-1]
        ends.append(held)
    w = 3 * b + 2
    table = np.concatenate((np.array(head, dtype=np.int32), *arrays))
    host = np.array(pages + offsets, dtype=np.int64)
    # on a device, every group's write slots in one copy; on the host, numpy
    # slices wrap for less than torch slices cost
    slots = host_to_device(torch.from_numpy(host), device) if device.type != "cpu" else None
    qo_t = torch.from_numpy(table[:b + 1])  # the same rows in every group's plan
    first = g * w  # the indices after every group's head
    out = []
    for k in range(g):
        h = table[k * w:(k + 1) * w]
        idx = table[first + ends[k]:first + ends[k + 1]]
        indptrs = PagedIndptrs(qo_indptr=qo_t, paged_kv_indptr=torch.from_numpy(h[b + 1:2 * b + 2]),
                               paged_kv_last_page_len=torch.from_numpy(h[2 * b + 2:]),
                               paged_kv_indices=torch.from_numpy(idx))
        r, o = slice(k * b, (k + 1) * b), slice(n + k * b, n + (k + 1) * b)
        state = KVPlanState(token_to_page=slots[r], token_to_cache=slots[o], total_tokens=b) \
            if slots is not None else KVPlanState(token_to_page=torch.from_numpy(host[r]),
                                                  token_to_cache=torch.from_numpy(host[o]),
                                                  total_tokens=b)
        out.append(DecodePlan(segments[k::g], h, idx, indptrs, state, gens[r], view_len[r],
                              offset[r]))
    return out
