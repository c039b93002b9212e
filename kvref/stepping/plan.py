"""From a step's segments to FlashInfer page tables and per-token write slots."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from kvref.core.page_pool import SINK_PAGE as SINK_PAGE
from kvref.core.steps import Fork
from kvref.core.steps import group_by_plan_label as group_by_plan_label


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``, without blocking the host when that is CUDA.

    A non_blocking copy from pageable memory is staged by the driver and
    waits for it; from pinned memory it is a plain async DMA. torch's
    caching host allocator keeps a pinned block alive until the copy that
    read it finished, so each plan may take a fresh one.
    """
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class SequenceView:
    """One segment's stream as attention sees it this step.

    ``page_idxs`` is sliced to the pages ``length`` needs: a stream may hold
    more (high-water), and an unsliced list would report the spare pages as
    resident context. For a windowed stream (``KVConfig.retention``) the
    view starts at its first retained page: ``length`` counts from there,
    and ``offset`` is the released tokens before it (W1, W4).

    A view the manager builds (`of_stream`) slices its stream's page list
    only when ``page_idxs`` is read: the plan's tables come from the
    stream's kept page array (`CacheStream.pages_array`), so a step copies
    no Python list of a long context's pages.
    """

    __slots__ = ("_arr", "_hi", "_lo", "_pages", "_src", "generation", "label", "length",
                 "offset", "request_id", "to_compute")

    def __init__(
        self,
        request_id: str,
        label: str,
        page_idxs: list[int],
        length: int,
        to_compute: int,
        generation: int,
        offset: int = 0,
    ) -> None:
        self.request_id = request_id
        self.label = label
        self._pages: list[int] | None = page_idxs
        self._src = page_idxs
        self._lo, self._hi = 0, len(page_idxs)
        self._arr: np.ndarray[Any, Any] | None = None
        self.length = length  # tokens after this step: stored + to_compute
        self.to_compute = to_compute
        self.generation = generation
        # a windowed stream (issue 19): the tokens released before
        # ``page_idxs[0]`` (whole pages), so token j of the view is at
        # absolute position ``offset + j``; 0 for full attention
        self.offset = offset

    @classmethod
    def of_stream(cls, request_id: str, label: str, pages: list[int],
                  array: np.ndarray[Any, Any], lo: int, hi: int, length: int,
                  to_compute: int, generation: int, offset: int = 0) -> SequenceView:
        """The view of ``pages[lo:hi]``, a stream's page list, with ``array``
        its `CacheStream.pages_array`: nothing is sliced until it is read."""
        v = cls.__new__(cls)
        v.request_id, v.label = request_id, label
        v._pages, v._src, v._lo = None, pages, lo
        n = len(pages)
        # a view of the stream's buffer, read by the plan that builds this view
        # (its tables copy it at once); later the buffer may hold other pages.
        # Most views take every page the stream holds: no slice then
        if lo == 0 and hi >= n:
            v._hi, v._arr = n, array
        else:
            v._hi, v._arr = min(hi, n), array[lo:hi]
        v.length, v.to_compute, v.generation, v.offset = length, to_compute, generation, offset
        return v

    @property
    def page_idxs(self) -> list[int]:
        pages = self._pages
        if pages is None:
            pages = self._pages = self._src[self._lo:self._hi]
        return pages

    @page_idxs.setter
    def page_idxs(self, pages: list[int]) -> None:
        self._pages = self._src = pages
        self._lo, self._hi = 0, len(pages)
        self._arr = None

    @property
    def num_pages(self) -> int:
        return self._hi - self._lo

    def page_at(self, i: int) -> int:
        """``page_idxs[i]`` without slicing the stream's list."""
        return self._src[self._lo + i]

    def _page_array(self) -> np.ndarray[Any, Any]:
        """``page_idxs`` as int32, for the tables the plan that made this view
        builds (a manager's view reads its stream's buffer, which a later
        change to the stream's pages rewrites)."""
        arr = self._arr
        if arr is None:
            arr = self._arr = np.array(self.page_idxs, dtype=np.int32)
        return arr

    def last_page_len(self, page_size: int) -> int:
        """Tokens on the last page, in ``[1, page_size]`` (0 for an empty view)."""
        return (self.length - 1) % page_size + 1 if self.length else 0

    def __repr__(self) -> str:
        return (
            f"SequenceView({self.request_id!r}, {self.label!r}, pages={self.page_idxs}, "
            f"length={self.length}, to_compute={self.to_compute})"
        )


@dataclass
class PagedIndptrs:
    """FlashInfer's paged-KV page table in CSR form, int32.

    Request ``i`` attends to pages ``paged_kv_indices[paged_kv_indptr[i]:
    paged_kv_indptr[i+1]]``, all full but the last, which holds
    ``paged_kv_last_page_len[i]`` tokens; its queries are rows
    ``qo_indptr[i]:qo_indptr[i+1]``.
    """

    qo_indptr: torch.Tensor
    paged_kv_indptr: torch.Tensor
    paged_kv_indices: torch.Tensor
    paged_kv_last_page_len: torch.Tensor

    def to_device(self, device: torch.device) -> PagedIndptrs:
        return PagedIndptrs(
            *(host_to_device(t, device) for t in (
                self.qo_indptr,
                self.paged_kv_indptr,
                self.paged_kv_indices,
                self.paged_kv_last_page_len,
            ))
        )

    @property
    def batch_size(self) -> int:
        return int(self.qo_indptr.shape[0]) - 1


def _int32_tensors(values: list[int], bounds: Sequence[int]) -> list[torch.Tensor]:
    """Split one host int32 buffer into tensors at ``bounds``.

    One numpy array and zero-copy views cost a fraction of one
    ``torch.tensor`` call per field, which is most of a batch-1 decode plan.
    """
    buf = np.array(values, dtype=np.int32)
    out: list[torch.Tensor] = []
    start = 0
    for end in bounds:
        out.append(torch.from_numpy(buf[start:end]))
        start = end
    return out


def build_paged_indptrs(views: Sequence[SequenceView], page_size: int) -> PagedIndptrs:
    """FlashInfer's CSR page table (int32, on the host) for ``views``, in their order.

    Per view: ``to_compute`` query rows, its pages, and how many tokens its
    last page holds (0 for an empty view).
    """
    n = len(views)
    qo = [0] * (n + 1)
    kv = [0] * (n + 1)
    last = [0] * n
    indices: list[int] = []
    q = 0
    for i, v in enumerate(views):
        q += v.to_compute
        qo[i + 1] = q
        indices += v.page_idxs
        kv[i + 1] = len(indices)
        last[i] = (v.length - 1) % page_size + 1 if v.length else 0
    b = (n + 1, 2 * n + 2, 3 * n + 2, 3 * n + 2 + len(indices))
    t = _int32_tensors(qo + kv + last + indices, b)
    return PagedIndptrs(
        qo_indptr=t[0], paged_kv_indptr=t[1], paged_kv_last_page_len=t[2], paged_kv_indices=t[3]
    )


class KVPlanOutput:
    """One plan label's page table, on the host and (after plan) on device.

    ``views`` may be given as a function building them: a decode step's plan
    (`kvref.stepping.decode_table`) makes them from its own table when first
    read, since most steps never read them.

    The tables do not change after `plan` hands them out, and are read-only
    to the engine: a decode step's ``paged_kv_indices`` is the manager's
    kept array, shared with later plans that change no page.
    """

    __slots__ = ("_make_views", "_views", "cpu_indptrs", "cuda_indptrs")

    def __init__(self, cpu_indptrs: PagedIndptrs,
                 views: list[SequenceView] | Callable[[], list[SequenceView]],
                 cuda_indptrs: PagedIndptrs | None = None) -> None:
        self.cpu_indptrs = cpu_indptrs
        self.cuda_indptrs = cuda_indptrs
        if callable(views):
            self._views: list[SequenceView] | None = None
            self._make_views: Callable[[], list[SequenceView]] | None = views
        else:
            self._views, self._make_views = views, None

    @property
    def views(self) -> list[SequenceView]:
        views = self._views
        if views is None:
            assert self._make_views is not None
            views = self._views = self._make_views()
            self._make_views = None
        return views

    @views.setter
    def views(self, views: list[SequenceView]) -> None:
        self._views, self._make_views = views, None

    @property
    def is_decode(self) -> bool:
        return bool(self.views) and all(v.to_compute == 1 for v in self.views)

    def get_total_len(self) -> int:
        return sum(v.to_compute for v in self.views)

    def __repr__(self) -> str:
        return (f"KVPlanOutput(cpu_indptrs={self.cpu_indptrs!r}, views={self.views!r}, "
                f"cuda_indptrs={self.cuda_indptrs!r})")


class ViewRows(NamedTuple):
    """Where one segment sits in a plan: ``outputs[plan_label].views[view_index]``,
    and the query rows ``[row_start, row_stop)`` of that plan label's batch
    (``qo_indptr[view_index]:qo_indptr[view_index + 1]``: the rows `write_kv`
    and attention take for it; empty for a zero-span segment)."""

    plan_label: str
    view_index: int
    row_start: int
    row_stop: int


class KVPlanOutputs(dict[str, KVPlanOutput]):
    """Plan label -> its output, plus the forks the step applies around it.

    The views are not in the step's segment order: each plan label's are
    label-major within a combined group (every ``main`` segment, then every
    ``cfg`` one) and a segment whose stream is empty after the step (length
    0) has no view. `locate` maps a segment to its view and rows (R47).
    """

    def __init__(
        self,
        outputs: dict[str, KVPlanOutput],
        pre_forks: Sequence[Fork] = (),
        post_forks: Sequence[Fork] = (),
    ) -> None:
        super().__init__(outputs)
        self.pre_forks = tuple(pre_forks)
        self.post_forks = tuple(post_forks)
        # built on the first `locate`: most steps never ask
        self._rows: dict[tuple[str, str], ViewRows] | None = None

    def locate(self, request_id: str, label: str) -> ViewRows | None:
        """The view and query rows of segment ``(request_id, label)``; None when
        the step has no view of it (a zero-length segment, or not in the step)."""
        rows = self._rows
        if rows is None:
            rows = self._rows = {}
            for plan_label, out in self.items():
                row = 0
                for i, v in enumerate(out.views):
                    rows[(v.request_id, v.label)] = ViewRows(plan_label, i, row,
                                                             row + v.to_compute)
                    row += v.to_compute
        return rows.get((request_id, label))


@dataclass
class KVPlanState:
    """Per-token write slots of one plan label: ``(token_to_page, token_to_cache)``."""

    token_to_page: torch.Tensor
    token_to_cache: torch.Tensor
    total_tokens: int
    # rows `write_kv` takes: the real tokens, or a whole capture bucket under
    # a slot lease (the rows past ``total_tokens`` go to the sink)
    write_len: int = -1

    def __post_init__(self) -> None:
        if self.write_len < 0:
            self.write_len = self.total_tokens

    def copy_(self, other: KVPlanState, capture_len: int) -> None:
        """Stage ``other`` into this static (graph-captured) state.

        Slots ``[n, capture_len)`` are the padding the graph scatters past the
        real tokens: aim them at the sink, or they overwrite whatever page the
        previous replay left there, another request's KV.
        """
        n = other.total_tokens
        if n > capture_len or capture_len > self.token_to_page.shape[0]:
            raise ValueError(
                f"{n} tokens do not fit a bucket of {capture_len} "
                f"(buffers hold {self.token_to_page.shape[0]}); "
                "build_cuda_graph_buffers with a larger max_seq_len"
            )
        self.token_to_page[:n].copy_(other.token_to_page, non_blocking=True)
        self.token_to_cache[:n].copy_(other.token_to_cache, non_blocking=True)
        self.token_to_page[n:capture_len].fill_(SINK_PAGE)
        self.token_to_cache[n:capture_len].fill_(0)
        self.total_tokens = n


def decode_plan_state(
    views: Sequence[SequenceView], page_size: int, device: torch.device
) -> KVPlanState:
    """Write slots for one new token per view: the end of each stream.

    Built in the same host pass as the views and sent as one host-to-device
    copy, instead of unpacking the page table per token on device.
    """
    n = len(views)
    slots = [0] * (2 * n)  # pages, then offsets
    for i, v in enumerate(views):
        last = v.length - 1
        slots[i] = v.page_idxs[last // page_size]
        slots[n + i] = last % page_size
    return decode_slots(np.array(slots, dtype=np.int64), device)


def _table(head: list[int], views: Sequence[SequenceView]) -> np.ndarray[Any, Any]:
    """The int32 page table: ``head`` (qo, kv indptrs, last page lengths),
    then the indices copied from each view's page array by one concatenate."""
    return np.concatenate((np.array(head, dtype=np.int32), *[
        v._arr if v._arr is not None else v._page_array() for v in views]))


def table_indptrs(table: np.ndarray[Any, Any], n: int) -> PagedIndptrs:
    """The page table of ``n`` requests over one int32 host buffer laid out
    qo indptr (n + 1), kv indptr (n + 1), last page lengths (n), indices:
    numpy slices wrapped by from_numpy, cheaper than slicing a torch tensor."""
    b = (n + 1, 2 * n + 2, 3 * n + 2)
    return PagedIndptrs(
        qo_indptr=torch.from_numpy(table[:b[0]]),
        paged_kv_indptr=torch.from_numpy(table[b[0]:b[1]]),
        paged_kv_last_page_len=torch.from_numpy(table[b[1]:b[2]]),
        paged_kv_indices=torch.from_numpy(table[b[2]:]),
    )


def decode_slots(host: np.ndarray[Any, Any], device: torch.device) -> KVPlanState:
    """The write slots of one token per request from int64 ``host``: the
    requests' pages, then their offsets; on a device, in one copy."""
    n = host.shape[0] // 2
    if device.type == "cpu":
        # numpy slices wrap for less than torch slices cost
        pages, offsets = torch.from_numpy(host[:n]), torch.from_numpy(host[n:])
    else:
        both = host_to_device(torch.from_numpy(host), device)  # the one H2D copy
        pages, offsets = both[:n], both[n:]
    return KVPlanState(token_to_page=pages, token_to_cache=offsets, total_tokens=n)


def decode_tables(
    views: Sequence[SequenceView], page_size: int, device: torch.device
) -> tuple[PagedIndptrs, KVPlanState]:
    """`build_paged_indptrs` and `decode_plan_state` of a decode step, in one pass.

    The page table's indices are copied from each stream's kept page array
    (`CacheStream.pages_array`), so a step's Python work is per view, not
    per page held: a 2k-token context costs what a 128-token one does.
    Same results as the two functions (tests compare them).
    """
    n = len(views)
    qo = list(range(n + 1))  # one query per view
    kv = [0] * (n + 1)
    last = [0] * n
    slots = [0] * (2 * n)  # pages, then offsets
    held = 0
    for i, v in enumerate(views):
        lo = v._lo
        held += v._hi - lo
        kv[i + 1] = held
        end = v.length - 1
        off = end % page_size
        last[i] = off + 1
        slots[i] = v._src[lo + end // page_size]  # `page_at`, inlined: once per request
        slots[n + i] = off
    table = _table(qo + kv + last, views)
    return table_indptrs(table, n), decode_slots(np.array(slots, dtype=np.int64), device)


def packed_plan_state(
    indptrs: PagedIndptrs, page_size: int, total_tokens: int, device: torch.device
) -> KVPlanState:
    """Write slots for any step, vectorised over tokens from the page table.

    Token ``j`` of request ``i`` lands at position ``length_i - to_compute_i + j``
    of its stream: page ``pos // page_size`` of its page list, offset
    ``pos % page_size``.
    """
    qo = indptrs.qo_indptr.long()
    kv = indptrs.paged_kv_indptr.long()
    n_req = qo.shape[0] - 1
    lens = qo[1:] - qo[:-1]
    num_pages = kv[1:] - kv[:-1]
    length = (num_pages - 1).clamp(min=0) * page_size + indptrs.paged_kv_last_page_len.long()
    seg = torch.repeat_interleave(torch.arange(n_req), lens, output_size=total_tokens)
    intra = torch.arange(total_tokens) - qo[:-1][seg]
    pos = (length - lens)[seg] + intra
    page = indptrs.paged_kv_indices.long()[kv[:-1][seg] + pos // page_size]
    both = torch.stack((page, pos % page_size))
    if both.device != device:
        both = host_to_device(both, device)
    return KVPlanState(token_to_page=both[0], token_to_cache=both[1], total_tokens=total_tokens)


# chunks of at least this many tokens get their write slots from numpy
# vector ops; shorter ones from `_chunk_slots`, cheaper below the set-up cost
_VECTOR_CHUNK = 64


def _chunk_slots(
    pages: list[int], pos: int, end: int, page_size: int,
    pages_out: list[int], offsets_out: list[int],
) -> None:
    """Append the page and offset of stream positions ``[pos, end)``.

    One slice and one ``range`` per page the chunk touches, not per token:
    the Python work is per page, the list fill per token runs in C.
    """
    while pos < end:
        page_i, off = divmod(pos, page_size)
        run = min(page_size - off, end - pos)
        pages_out += [pages[page_i]] * run
        offsets_out += range(off, off + run)
        pos += run


def _long_chunk_slots(pages: np.ndarray[Any, Any], start: int, end: int, page_size: int
                      ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The page and offset of stream positions ``[start, end)`` (end > start)
    from two kept runs sliced at the chunk's first position: each position's
    page (0 .. 0, 1 .. 1, ...: one gather from ``pages``) and its offset in
    it. Two numpy calls, no division or repeat count per chunk (issue 42:
    the repeat took half of a 64-token chunk's slots). The pages come out in
    ``pages``' int32; the caller's int64 buffer widens them."""
    runs = _RUNS.get(page_size)
    lo = start % page_size
    need = lo + end - start
    if runs is None or runs[0].shape[0] < need:
        # grown to the longest chunk seen
        size = -(-max(need, 4096) // page_size) * page_size
        runs = _RUNS[page_size] = (np.arange(size, dtype=np.int64) // page_size,
                                   np.arange(size, dtype=np.int64) % page_size)
    page_of, offset = runs
    return pages[start // page_size:][page_of[lo:need]], offset[lo:need]


# page size -> (each position's page from the first, its offset in it):
# `_long_chunk_slots`' runs
_RUNS: dict[int, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]] = {}


def mixed_tables(
    views: Sequence[SequenceView], page_size: int, device: torch.device
) -> tuple[PagedIndptrs, KVPlanState, PagedIndptrs]:
    """`build_paged_indptrs` + `packed_plan_state` of any step, in one host pass.

    A mixed step (a decode batch plus a prefill chunk) would otherwise pay
    for a dozen small torch ops unpacking the page table per token; here the
    slots come from the same pass as the table, in Python work linear in
    the pages the chunk touches. One host buffer holds the table and the
    slots, so a device gets them in one copy. Returns the host table, the
    slots, and the table on ``device`` (what `KVPlanOutput.cuda_indptrs`
    carries for a non-decode step). Tests compare it with the two builders.
    """
    n = len(views)
    qo = [0] * (n + 1)
    kv = [0] * (n + 1)
    last = [0] * n
    # the write slots as Python ints in row order (one-token rows, short
    # chunks), and where the long chunks' go among them (`joined_slots`)
    slot_pages: list[int] = []
    slot_offsets: list[int] = []
    cuts: list[LongChunk] = []
    q = held = 0
    for i, v in enumerate(views):
        span = v.to_compute
        q += span
        qo[i + 1] = q
        held += v._hi - v._lo
        kv[i + 1] = held
        end = v.length - 1
        if span == 1:
            last[i] = end % page_size + 1
            slot_pages.append(v.page_at(end // page_size))
            slot_offsets.append(end % page_size)
        else:
            last[i] = end % page_size + 1 if end >= 0 else 0
            # a view's pages from its first
            chunk_slots(v.page_idxs, v._page_array(), v.length - span, v.length, page_size,
                        slot_pages, slot_offsets, cuts)
    # the table from each view's page array (`_table`), not a list of pages
    table = _table(qo + kv + last, views)
    slots = joined_slots(slot_pages, slot_offsets, cuts, page_size)
    return mixed_outputs(table, n, 3 * n + 2 + held, slots, q, device)


# a long chunk of a mixed step: how many of the step's Python-int slots come
# before its own, its view's pages (int32), and the view positions
# ``[start, end)`` it writes
LongChunk = tuple[int, np.ndarray[Any, Any], int, int]


def chunk_slots(pages: list[int], array: np.ndarray[Any, Any], start: int, end: int,
                page_size: int, slot_pages: list[int], slot_offsets: list[int],
                cuts: list[LongChunk]) -> None:
    """The write slots of a row that is not one token (a chunk, or span 0),
    view positions ``[start, end)`` of ``pages`` (``array``: them as
    int32), after the step's slots so far: a short chunk's appended to
    ``slot_pages``/``slot_offsets`` as Python ints, a long one's place
    marked in ``cuts`` for `joined_slots`. Shared by `mixed_tables` and the
    decode table's fresh plan of a mixed step, so both give the same bytes
    by construction."""
    if end - start < _VECTOR_CHUNK:
        _chunk_slots(pages, start, end, page_size, slot_pages, slot_offsets)
    else:
        cuts.append((len(slot_pages), array, start, end))


def joined_slots(slot_pages: list[int], slot_offsets: list[int], cuts: Sequence[LongChunk],
                 page_size: int) -> np.ndarray[Any, Any]:
    """A step's write slots (int64: every token's page, then every offset,
    request-major as the query rows): the Python-int slots converted in one
    call, as a decode step's are; where there are long chunks, one int64
    buffer written in row order: each run of Python ints between chunks
    (numpy converts them as it writes) and each long chunk's vector-built
    slots (`_long_chunk_slots`). Issue 42: converting the ints first, then
    slicing that array and joining the slices and the chunks' in one
    concatenate, cost more in numpy calls than the chunk's slots."""
    if not cuts:
        return np.array(slot_pages + slot_offsets, dtype=np.int64)
    m = len(slot_pages)
    if len(cuts) == 1 and cuts[0][0] == m:
        # one long chunk after every Python-int slot (a mixed step's chunk
        # in its last row): the two runs whole, with no slicing of the
        # lists and no pass over the cuts
        _, array, start, end = cuts[0]
        q = m + end - start
        out = np.empty(2 * q, dtype=np.int64)
        out[:m] = slot_pages
        out[q:q + m] = slot_offsets
        out[m:q], out[q + m:] = _long_chunk_slots(array, start, end, page_size)
        return out
    q = m + sum(end - start for _, _, start, end in cuts)  # the step's tokens
    out = np.empty(2 * q, dtype=np.int64)
    at = w = 0  # Python-int slots taken, tokens written
    for cut, array, start, end in cuts:
        if cut > at:
            k = w + cut - at
            out[w:k] = slot_pages[at:cut]
            out[q + w:q + k] = slot_offsets[at:cut]
            w = k
        k = w + end - start
        out[w:k], out[q + w:q + k] = _long_chunk_slots(array, start, end, page_size)
        w, at = k, cut
    if m > at:  # rows after the last long chunk
        out[w:q] = slot_pages[at:]
        out[q + w:] = slot_offsets[at:]
    return out


def mixed_outputs(table: np.ndarray[Any, Any], n: int, table_len: int,
                  slots: np.ndarray[Any, Any], q: int, device: torch.device
                  ) -> tuple[PagedIndptrs, KVPlanState, PagedIndptrs]:
    """The host table (int32 ``table``, laid out as `table_indptrs` reads it,
    ``table_len`` long), the ``q`` tokens' write slots, and the table on
    ``device``: one host buffer, table then slots, so a device takes them in
    one copy."""
    cpu_indptrs = table_indptrs(table, n)
    if device.type == "cpu":
        # no copy to make: the slots as they are (issue 42: the host buffer
        # cost a widening and a concatenate for nothing on the CPU)
        page_t = torch.from_numpy(slots[:q])
        offset_t = torch.from_numpy(slots[q:])
        # its own record over the same tensors, as `to_device` gave on the host
        # (positional: the fields' order, qo, kv, indices, last page lengths)
        c = cpu_indptrs
        device_indptrs = PagedIndptrs(c.qo_indptr, c.paged_kv_indptr, c.paged_kv_indices,
                                      c.paged_kv_last_page_len)
    else:
        host = np.concatenate((table.astype(np.int64), slots))
        b = (0, n + 1, 2 * n + 2, 3 * n + 2, table_len)
        q_end = table_len + q
        whole = host_to_device(torch.from_numpy(host), device)  # the one H2D copy
        dev_table = whole[:table_len].to(torch.int32)
        device_indptrs = PagedIndptrs(
            qo_indptr=dev_table[b[0] : b[1]],
            paged_kv_indptr=dev_table[b[1] : b[2]],
            paged_kv_last_page_len=dev_table[b[2] : b[3]],
            paged_kv_indices=dev_table[b[3] : b[4]],
        )
        page_t, offset_t = whole[table_len:q_end], whole[q_end:]
    state = KVPlanState(token_to_page=page_t, token_to_cache=offset_t, total_tokens=q)
    return cpu_indptrs, state, device_indptrs


def plan_tables(
    views: Sequence[SequenceView], page_size: int, device: torch.device
) -> tuple[PagedIndptrs, KVPlanState, PagedIndptrs | None]:
    """Host page table, write slots, and device page table of one plan label.

    A decode step's device table stays ``None``: attention reads its host
    table (as the reference does); any other step carries it on ``device``.
    """
    if views and all(v.to_compute == 1 for v in views):
        indptrs, state = decode_tables(views, page_size, device)
        return indptrs, state, None
    return mixed_tables(views, page_size, device)
