"""The control-plane baseline: the reference manager's step, written straightforwardly.

Same API as kvref for what a step needs (``ingest_request``, ``admit``,
``plan``, ``commit``, ``remove_request``) and the same bookkeeping the
reference (``/work/shared/reference/kv_manager.seed.txt``) does per step:

- admit: the preplan test, ``_label_growth`` when the step commits, the fork
  reservations, then one critical section in which every segment with a span
  gets ``_ensure_label`` and ``_alloc`` (itself locked, re-entrantly: the
  offload test, the page top-up, a generation bump when pages are taken),
  then a second pass marking each stream ``step_in_flight``;
- plan: the cursor reset, pre-forks, ``group_by_plan_label``, one
  ``SequenceView`` per segment (sliced to its length), ``build_paged_indptrs``,
  then the write slots: for a decode label ``torch.tensor([pages, offsets])``
  sent to the device, for any other the page table sent to the device and
  unpacked per token by the reference's dozen torch ops;
- commit: one critical section clearing each mark, then the offload test,
  ``stored_len += span`` and a generation bump, then post-forks.

The page table is built the straightforward way (`paged_indptrs`: a list per
field, one ``torch.tensor`` each). Where the reference calls a helper kvref
has with the same contract and no step-specific optimisation
(``group_by_plan_label``, ``SequenceView``, ``PageAllocator``,
``PagedIndptrs.to_device``) this uses kvref's, which is at least as fast, so
the ratio kvref / baseline errs against kvref. Offload, retrieve, retention and CUDA
graphs are not exercised by the benchmark and are left out.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvref.core.allocator import PageAllocator
from kvref.stepping.plan import (
    KVPlanOutput,
    KVPlanOutputs,
    KVPlanState,
    PagedIndptrs,
    SequenceView,
    group_by_plan_label,
)
from kvref.stepping.step import (
    ADMIT_OK,
    AdmitOutcome,
    AllocationFailed,
    KVStep,
    RequestOffloading,
    Segment,
    StepContext,
)


@dataclass
class _Stream:
    """The reference's per-(request, label) record, every field it keeps."""

    page_indices: list[int] = field(default_factory=list)
    stored_len: int = 0
    position: int = 0
    released: int = 0
    retention: object | None = None
    read_pending: bool = False
    read_future: object | None = None
    read_error: BaseException | None = None
    offloaded: bool = False
    generation: int = 0
    step_in_flight: bool = False


@dataclass
class _Alloc:
    success: bool = True
    error: AllocationFailed | RequestOffloading | None = None


def paged_indptrs(views: Sequence[SequenceView], page_size: int) -> PagedIndptrs:
    """The CSR page table built the straightforward way: four lists, four tensors.

    kvref's `build_paged_indptrs` builds the same table through one numpy
    buffer (an optimisation of kvref's, not the reference's design).
    """
    qo = [0]
    kv = [0]
    indices: list[int] = []
    last: list[int] = []
    for v in views:
        qo.append(qo[-1] + v.to_compute)
        indices.extend(v.page_idxs)
        kv.append(len(indices))
        last.append(v.last_page_len(page_size))
    i32 = torch.int32
    return PagedIndptrs(
        qo_indptr=torch.tensor(qo, dtype=i32),
        paged_kv_indptr=torch.tensor(kv, dtype=i32),
        paged_kv_indices=torch.tensor(indices, dtype=i32),
        paged_kv_last_page_len=torch.tensor(last, dtype=i32),
    )


class ReferenceManager:
    """A straightforward KV manager stepping as the reference does (see module doc)."""

    def __init__(self, num_pages: int, page_size: int, device: str = "cpu") -> None:
        self.page_size = page_size
        self._device = torch.device(device)
        self._arena = PageAllocator(num_pages + 1)
        self._arena.try_allocate(1)  # page 0 is the sink, as in kvref
        self._lock = threading.RLock()
        self._streams: dict[str, dict[str, _Stream]] = {}
        self._preplanned = False
        self._current_plan_states: dict[str, KVPlanState] = {}
        self._default_layer_idx = 0
        self._default_label: str | None = None

    def ingest_request(self, rid: str) -> None:
        with self._lock:
            self._streams[rid] = {}

    def remove_request(self, rid: str) -> None:
        with self._lock:
            for stream in self._streams.pop(rid, {}).values():
                self._arena.free(stream.page_indices)

    # -- admit -----------------------------------------------------------------

    def admit(self, step: KVStep, ctx: StepContext) -> AdmitOutcome:
        if self._preplanned and not ctx.is_preplan:
            return ADMIT_OK
        growth = self._label_growth(step) if step.commit else {}
        no_growth: dict[tuple[str, str], int] = {}
        forks = [(pre, no_growth) for pre in step.pre_forks] + [
            (post, growth) for post in step.post_forks
        ]
        with self._lock:
            for (src, dst), extra in forks:
                for rid in ctx.padded_request_ids:
                    res = self._reserve_fork(rid, src, dst, extra.get((rid, src), 0))
                    if not res.success:
                        return AdmitOutcome(ok=False, reason=res.error)
            for seg in step.segments:
                if seg.span == 0:
                    continue
                stream = self._ensure_label(seg.request_id, seg.label)
                res = self._alloc(seg.request_id, seg.label, seg.span + stream.stored_len)
                if not res.success:
                    return AdmitOutcome(ok=False, reason=res.error)
            for seg in step.segments:
                marked = self._streams.get(seg.request_id, {}).get(seg.label)
                if marked is not None:
                    marked.step_in_flight = True
        return ADMIT_OK

    @staticmethod
    def _label_growth(step: KVStep) -> dict[tuple[str, str], int]:
        growth: dict[tuple[str, str], int] = {}
        for seg in step.segments:
            key = (seg.request_id, seg.label)
            growth[key] = growth.get(key, 0) + seg.span
        return growth

    def _ensure_label(self, rid: str, label: str) -> _Stream:
        if label not in self._streams[rid]:
            self._streams[rid][label] = _Stream()
        return self._streams[rid][label]

    def _reserve_fork(self, rid: str, src: str, dst: str, extra: int) -> _Alloc:
        if src not in self._streams[rid]:
            if extra <= 0:
                return _Alloc()
            self._ensure_label(rid, dst)
            return self._alloc(rid, dst, extra)
        source = self._streams[rid][src]
        if source.offloaded:
            return _Alloc(False, RequestOffloading(request_id=rid, label=src))
        self._ensure_label(rid, dst)
        return self._alloc(rid, dst, source.stored_len + extra)

    def _alloc(self, rid: str, label: str, seq_len: int) -> _Alloc:
        with self._lock:
            self._ensure_label(rid, label)
            stream = self._streams[rid][label]
            if stream.offloaded:
                return _Alloc(False, RequestOffloading(request_id=rid, label=label))
            needed = (seq_len + self.page_size - 1) // self.page_size
            new = needed - len(stream.page_indices)
            if new > 0:
                pages = self._arena.try_allocate(new)
                if pages is None:
                    short = new - self._arena.num_free
                    return _Alloc(False, AllocationFailed(
                        pages_short=short, request_id=rid, label=label,
                        message=f"Not enough free pages: requested {new}, available "
                                f"{self._arena.num_free} for request {rid}, label {label}.",
                    ))
                stream.page_indices.extend(pages)
                stream.generation += 1
            return _Alloc()

    # -- plan ------------------------------------------------------------------

    def plan(self, step: KVStep, ctx: StepContext) -> KVPlanOutputs:
        self._default_layer_idx = 0  # reset_default_cursors
        self._default_label = None
        for src, dst in step.pre_forks:
            for rid in ctx.padded_request_ids:
                self._apply_fork(rid, src, dst)
        res = KVPlanOutputs(
            {
                label: self._plan_output(self._views(segs))
                for label, segs in group_by_plan_label(
                    step.segments, step.combined_labels
                ).items()
            },
            pre_forks=step.pre_forks,
            post_forks=step.post_forks,
        )
        self._setup_plan_states(res)
        return res

    def _views(self, segments: Sequence[Segment]) -> list[SequenceView]:
        views = []
        ps = self.page_size
        for s in segments:
            stream = self._streams[s.request_id][s.label]
            length = s.span + stream.stored_len
            num_pages = -(-length // ps)
            views.append(SequenceView(s.request_id, s.label, stream.page_indices[:num_pages],
                                      length, s.span, stream.generation))
        return views

    def _plan_output(self, views: list[SequenceView]) -> KVPlanOutput:
        return KVPlanOutput(cpu_indptrs=paged_indptrs(views, self.page_size), views=views)

    def _setup_plan_states(self, outputs: KVPlanOutputs) -> None:
        for label, out in outputs.items():
            if out.is_decode:
                state = self._decode_plan_state(out.views)
            else:
                out.cuda_indptrs = out.cpu_indptrs.to_device(self._device)
                state = self._compute_plan_state(out.cuda_indptrs, out.get_total_len())
            self._current_plan_states[label] = state

    def _decode_plan_state(self, views: list[SequenceView]) -> KVPlanState:
        pages: list[int] = []
        offsets: list[int] = []
        for view in views:
            pages.append(view.page_idxs[-1])
            offsets.append((view.last_page_len(self.page_size) or self.page_size) - 1)
        loc = torch.tensor([pages, offsets], dtype=torch.long).to(self._device, non_blocking=True)
        return KVPlanState(token_to_page=loc[0], token_to_cache=loc[1], total_tokens=len(views))

    def _compute_plan_state(self, ind: PagedIndptrs, total: int) -> KVPlanState:
        """The reference's per-token unpacking, op for op (int32 on the device)."""
        qo, kv, last = ind.qo_indptr, ind.paged_kv_indptr, ind.paged_kv_last_page_len
        n_req = qo.shape[0] - 1
        starts = qo[:-1].to(torch.int32)
        lens = (qo[1:] - qo[:-1]).to(torch.int32)
        num_pages = (kv[1:] - kv[:-1]).to(torch.int32)
        kv_len = (num_pages - 1) * self.page_size + last
        dev = self._device
        seg = torch.repeat_interleave(torch.arange(n_req, dtype=torch.int32, device=dev), lens,
                                      output_size=total)
        intra = torch.arange(total, dtype=torch.int32, device=dev) - torch.repeat_interleave(
            starts, lens, output_size=total)
        g = kv_len[seg] - lens[seg] + intra
        page_off = torch.div(g, self.page_size, rounding_mode="floor").to(torch.int32)
        off = (g - page_off * self.page_size).to(torch.int32)
        ptr = kv[:-1][seg] + page_off
        return KVPlanState(token_to_page=ind.paged_kv_indices[ptr].to(torch.long),
                           token_to_cache=off.to(torch.long), total_tokens=total)

    def _apply_fork(self, rid: str, src: str, dst: str) -> None:
        with self._lock:
            if src not in self._streams[rid]:
                return
            source = self._streams[rid][src]
            target = self._ensure_label(rid, dst)
            target.stored_len = source.stored_len  # page copy: not benchmarked
            target.generation += 1

    # -- commit ----------------------------------------------------------------

    def commit(self, step: KVStep, ctx: StepContext) -> None:
        with self._lock:
            for seg in step.segments:
                stream = self._streams[seg.request_id][seg.label]
                stream.step_in_flight = False
                if step.commit and seg.span > 0:
                    if stream.offloaded:
                        continue
                    stream.stored_len += seg.span
                    stream.generation += 1
            for src, dst in step.post_forks:
                for rid in ctx.padded_request_ids:
                    self._apply_fork(rid, src, dst)
