"""A hybrid decode step's tables, one kept table per attention group (issue 40).

`GroupLayout.expand` turns a decode step of B requests into B x G segments,
request-major: request r's stream of group g is segment ``r * G + g``. Each
group is its own plan label, so the step has G page tables; planned from
the views (`plan.plan_tables`) that is G passes over the rows, each
building a view per row. Each group's rows are a plain decode batch of one
label, though, which is what `DecodeTable` plans from the rows the last
step left, re-reading only the rows that changed (a page appended, a
window release). This keeps one `DecodeTable` per group and hands each its
group's rows: every group's table is the same bytes `decode_tables` makes
of its views (the kept table's contract), in the plan labels' order.
Below `SMALL_BATCH` rows a group, where a kept table's numpy set-up costs
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
from kvref.stepping.decode_table import DecodePlan, DecodeTable
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


class GroupDecodeTables:
    """One `DecodeTable` per attention group, answering as one (`plans`)."""

    def __init__(self, groups: int, page_size: int, device: torch.device) -> None:
        self._tables = [DecodeTable(page_size, device) for _ in range(groups)]
        self._ps, self._device = page_size, device
        # the tables whose last plan they keep rows of: only those count a
        # commit (a fresh plan, below SMALL_BATCH rows, keeps nothing)
        self._kept: list[DecodeTable] = []

    def plans(self, segments: Sequence[Segment], streams: list[CacheStream],
              grown: Sequence[int]) -> list[DecodePlan] | None:
        """Each group's decode plan, first group first; None unless every
        group's rows make a plain decode step of one label (any other step
        is planned from its views)."""
        g = len(self._tables)
        n = len(streams)
        if not n or n % g:
            return None
        if n // g < decode_table.SMALL_BATCH:
            # a small batch: every group afresh in one pass (what each
            # group's table would do, with the fixed costs paid once)
            self._kept = []
            return fresh_plans(segments, streams, g, self._ps, self._device)
        rows: list[list[int]] = [[] for _ in range(g)]
        for i in grown:  # row i is request i // g's stream in group i % g
            rows[i % g].append(i // g)
        out: list[DecodePlan] = []
        for k, table in enumerate(self._tables):
            got = table.plan(segments[k::g], streams[k::g], rows[k])
            if got is None:
                # a table that did plan keeps its rows; the generations its
                # streams reach by the commit tell it they moved
                self._kept = []
                return None
            out.append(got)
        self._kept = [t for t, p in zip(self._tables, out, strict=True) if p.kept]
        return out

    def committed(self) -> None:
        """The step last planned was committed, keeping its tokens."""
        for table in self._kept:
            table.committed()


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
