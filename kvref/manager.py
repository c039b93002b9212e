"""KVManager: the paged KV cache of one engine resource, and its stream lifecycle.

Every read-modify-write of stream bookkeeping happens under ``_lock`` (from
`kvref.runtime`, so the concurrency tests can schedule it). Blocking work —
host copies, draining retrieves — happens outside it. The lifecycle and its
invariants are in ``specs/stream-lifecycle.md``; where kvref departs from
the reference manager, ``specs/rules.md`` says why (R1..R13 below).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvref import admission, validate
from kvref.allocator import PageAllocator
from kvref.base import AttentionResource, CGSlotSpec, EngineResourceInfo
from kvref.cache import KVCache
from kvref.config import KVConfig, KVReqConfig, KVSpec
from kvref.errors import (
    AsymmetricStateError,
    ForkCopyError,
    InvalidStepError,
    KVRefError,
    KVShapeError,
    PreplanPendingError,
    PublishedInfoError,
    ReloadCopyError,
    StepInFlightError,
    StepNotAdmittedError,
    StepOrderError,
    UnknownRequestError,
)
from kvref.host_pool import CPUPagePool
from kvref.offload import Offload
from kvref.plan import (
    SINK_PAGE,
    KVPlanOutput,
    KVPlanOutputs,
    KVPlanState,
    SequenceView,
    group_by_plan_label,
    plan_tables,
)
from kvref.published import KVSequenceInfo, PublishedKVInfo
from kvref.runtime import Runtime, default_runtime, shared
from kvref.step import (
    ADMIT_OK,
    AdmitFailedReason,
    AdmitOutcome,
    AdmitRuntimeError,
    AllocationFailed,
    KVStep,
    Segment,
    SlotLease,
    StepContext,
)
from kvref.streams import CacheStream, ClaimedStream
from kvref.transfer import KVTransferManager, TransferEngineInfo, allocate_cache_tensor

if TYPE_CHECKING:
    from kvref.distributed import JointGroups

logger = logging.getLogger(__name__)

Key = tuple[str, str]  # (request id, label)


def _pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def _same(step: KVStep, ctx: StepContext, other: KVStep, padded: tuple[str, ...]) -> bool:
    """The same step admitted again: equal, and padded to the same requests
    (its forks reserved for those)."""
    return (step is other or step == other) and tuple(ctx.padded_request_ids) == padded


def _where(step: KVStep, admitted: KVStep | None = None) -> dict[str, str]:
    """The request and label an error about ``step`` names: its first segment
    that the ``admitted`` step does not have, else its first."""
    segments = list(step.segments) if isinstance(step, KVStep) else []
    known = {(g.request_id, g.label) for g in admitted.segments} if admitted else set()
    stray = [g for g in segments if (g.request_id, g.label) not in known] or segments
    if not stray:
        return {}
    return {"request_id": stray[0].request_id, "label": stray[0].label}


@dataclass
class _Running:
    """The admitted step, from admit (or a preplan's promotion) to commit (R23)."""

    step: KVStep
    padded: tuple[str, ...]  # the admit's padded_request_ids: what its forks reserved
    # streams its admit created and no fork has written since: a fork from
    # one of them that is still empty copies nothing (R20)
    created: set[Key]
    planned: bool = False
    # its pre-forks ran (perhaps at a plan that failed): never twice
    forked: bool = False


class _ForkFailed(Exception):
    """One fork copy failed; `_run_forks` gathers them into a ForkCopyError."""


@dataclass
class _Preplan:
    """A step admitted (and maybe planned) one ahead, not yet promoted."""

    step: KVStep
    ctx: StepContext
    # labels this step's admit created; an abandon removes them with their pages
    created: list[Key]
    marked: list[Key]
    outputs: KVPlanOutputs | None = None
    states: dict[str, KVPlanState] = field(default_factory=dict)


class KVManager(AttentionResource):
    """Pages, streams and steps of one KV cache (see the module docstring)."""

    def __init__(
        self,
        cfg: KVConfig,
        name: str,
        joint_comm_group: JointGroups | None,
        transfer_engine_info: TransferEngineInfo | None,
        device: torch.device | str,
        dtype: torch.dtype = torch.bfloat16,
        *,
        runtime: Runtime | None = None,
    ) -> None:
        super().__init__()
        # a private, validated copy, sharded before the cache is sized off its
        # head counts: the caller's config stays unsharded, and a field the
        # caller changes later does not reach this manager
        cfg = cfg.sharded(joint_comm_group.world_size) if joint_comm_group else cfg.copy()
        self.config = cfg
        self.name = name
        self._device = torch.device(device)
        self._runtime = runtime if runtime is not None else default_runtime()
        info = transfer_engine_info if transfer_engine_info is not None else TransferEngineInfo()
        tensor = allocate_cache_tensor(
            info, KVCache.shape_for(cfg, cfg.max_num_pages), dtype, self._device
        )
        self.kv_cache = KVCache(cfg, self._device, dtype, tensor=tensor)
        self._allocator = PageAllocator(cfg.max_num_pages, self._runtime, name="device pages")
        # take the sink out of circulation before anything else can get it;
        # the allocator is FIFO from page 0
        sink = self._allocator.try_allocate(1)
        assert sink == [SINK_PAGE], f"expected page {SINK_PAGE} first, got {sink}"
        self._transfer = KVTransferManager(info, self.kv_cache, runtime=self._runtime)
        self._lock = self._runtime.lock()
        self._cpu_pool: CPUPagePool | None = None
        if cfg.cpu_offload_pages > 0:
            self._cpu_pool = CPUPagePool(
                cfg, self.kv_cache, cfg.cpu_offload_pages, lock=self._runtime.lock(),
                runtime=self._runtime,
            )
        # the shared containers come through the runtime seam: plain ones in
        # production, the race detector's in the tests
        self._streams: dict[str, dict[str, CacheStream]] = shared(self._runtime, {}, "streams")
        self._overrides: dict[str, KVReqConfig] = {}
        # rid -> the offload between its claim and its commit/abandon (R6)
        self._offloads: dict[str, Offload] = shared(self._runtime, {}, "offloads")
        self._comm_group = joint_comm_group
        self._rank = joint_comm_group.rank if joint_comm_group is not None else 0
        self._world_size = joint_comm_group.world_size if joint_comm_group is not None else 1
        # (slot, label) -> static addressing, sized for the largest capture bucket
        self._static_plan_states: dict[tuple[int, str], KVPlanState] = {}
        self._cg_max_seq_len = 0
        self._current_plan_states: dict[str, KVPlanState] = {}
        self._running: _Running | None = None
        self._preplan: _Preplan | None = None
        self.reset_default_cursors()

    @classmethod
    def build(cls, spec: KVSpec, info: EngineResourceInfo) -> KVManager:
        return cls(
            cfg=spec.config,
            name=spec.resource_key,
            joint_comm_group=info.joint_comm_group,
            transfer_engine_info=info.transfer_engine_info,
            device=info.device,
            dtype=info.kv_dtype,
        )

    # -- requests ---------------------------------------------------------

    def ingest_request(self, rid: str, overrides: KVReqConfig | None = None) -> None:
        validate.request_id(rid, "ingest_request")
        validate.req_config(overrides, rid)
        with self._lock:
            # idempotent: one request reaches a worker once per partition it
            # serves, and replacing the streams on the second ingest dropped
            # the lengths the first partition had already filled
            self._streams.setdefault(rid, {"main": CacheStream()})
            self._overrides.setdefault(rid, overrides if overrides is not None else KVReqConfig())

    def has_request(self, rid: str) -> bool:
        return rid in self._streams

    def labels(self, rid: str) -> list[str]:
        validate.request_id(rid, "labels")
        with self._lock:
            return list(self._request(rid))

    def stored_len(self, rid: str, label: str = "main") -> int:
        validate.request_id(rid, "stored_len")
        validate.label(label, "stored_len", rid)
        with self._lock:
            return self._stream(rid, label).stored_len

    def reset_request(self, rid: str, free: bool = False) -> None:
        """Forget the request's tokens; keep its device pages unless ``free``.

        Raises `StepInFlightError` while a step of the request is admitted
        (R5): the step would write into, and commit onto, a stream that no
        longer holds what it planned against.
        """
        validate.request_id(rid, "reset_request")
        self._refuse_if_in_flight(rid, "reset")
        while True:
            # in-flight retrieves write into these pages: drain them before
            # the pages can be reused, outside the lock (a transfer does not
            # take it)
            self._drain_reads(rid)
            with self._lock:
                streams = self._request(rid)
                self._refuse_if_in_flight(rid, "reset")
                if self._reads_pending(streams):
                    # a retrieve started between the drain and the lock
                    continue
                offloading = self._offloads.get(rid)
                for label, stream in streams.items():
                    claimed = offloading is not None and label in offloading.labels
                    if stream.offloaded and not claimed:
                        # committed to the host: forgotten there too (R12)
                        if self._cpu_pool is not None:
                            self._cpu_pool.discard(rid, label)
                        stream.offloaded = False
                    if free:
                        self._allocator.free(stream.page_indices)
                    # a claim in progress keeps `offloaded`; the bumped
                    # generation fails its commit and the abandon clears it
                    stream.reset(freed=free)
                return

    def remove_request(self, rid: str) -> None:
        """Release everything the request holds, device and host. Idempotent.

        An offload of the request still in progress is cancelled: its later
        copies copy nothing and its commit frees nothing.
        """
        validate.request_id(rid, "remove_request")
        if rid not in self._streams:
            return
        self._refuse_if_in_flight(rid, "remove")
        while True:
            self._drain_reads(rid)
            with self._lock:
                streams = self._streams.get(rid)
                if streams is None:
                    return
                self._refuse_if_in_flight(rid, "remove")
                if self._reads_pending(streams):
                    continue  # a retrieve started between the drain and the lock
                for stream in streams.values():
                    self._allocator.free(stream.page_indices)
                    stream.page_indices = []
                    stream.generation += 1
                offload = self._offloads.pop(rid, None)
                if offload is not None:
                    offload._cancelled = True
                if self._cpu_pool is not None:
                    self._cpu_pool.remove_request(rid)
                del self._streams[rid]
                self._overrides.pop(rid, None)
                return

    @staticmethod
    def _reads_pending(streams: Mapping[str, CacheStream]) -> bool:
        return any(s.read_future is not None and not s.read_future.done()
                   for s in streams.values())

    # -- admit / plan / commit ---------------------------------------------

    def admit(self, step: KVStep, ctx: StepContext) -> AdmitOutcome:
        """Reserve the step's pages and mark its streams in flight, or refuse.

        A refusal changes nothing (R1). Forks reserve here and copy later
        (pre-forks at plan, post-forks at commit). One step is admitted at a
        time, plus one preplanned (R23): admitting the admitted (or staged)
        step again is a no-op, admitting another raises.
        """
        validate.step(step, ctx)
        with self._lock:
            # malformed input first, whatever the lifecycle state: it is the
            # caller's bug in any state
            validate.step_lengths(step, ctx, self._streams, self.config.max_seq_len)
            staged = self._preplan
            if staged is not None:
                if ctx.is_preplan:
                    raise PreplanPendingError(
                        "a preplan is already staged; clear_preplan before preplanning again"
                    )
                if not _same(step, ctx, staged.step, tuple(staged.ctx.padded_request_ids)):
                    raise PreplanPendingError(
                        "admit of a different step than the staged preplan; "
                        "clear_preplan first"
                    )
                return ADMIT_OK  # the preplan pass already reserved and marked
            running = self._running
            if running is not None and not ctx.is_preplan:
                if _same(step, ctx, running.step, running.padded):
                    return ADMIT_OK  # admitted again: everything is reserved already
                # R23: a second step would be planned against lengths the
                # first has not committed, and its commit would clear the
                # first one's marks
                raise StepInFlightError(
                    "a step is already admitted; commit it before admitting another"
                )
            if not (ctx.is_preplan or step.pre_forks or step.post_forks
                    or step.combined_labels):
                return self._admit_segments(step, ctx)
            padded = tuple(ctx.padded_request_ids)
            admission.validate_step(self._streams, step, padded)
            keys = admission.named_keys(step, padded)
            if ctx.is_preplan:
                # R10: the staged plan would be built from lengths a running
                # step has not committed, and its commit would clear these marks
                for rid, label in keys:
                    stream = self._streams[rid].get(label)
                    if stream is not None and stream.step_in_flight:
                        raise StepInFlightError(
                            "preplan names a stream of a step still in flight; "
                            "commit that step first",
                            request_id=rid,
                            label=label,
                        )
            refused = admission.refusal(self._streams, keys)
            if refused is not None:
                return AdmitOutcome(ok=False, reason=refused)
            grant = admission.reserve(self._streams, step, padded, keys,
                                      self.config.page_size, self._allocator.num_free)
            if isinstance(grant, AdmitFailedReason):
                return AdmitOutcome(ok=False, reason=grant)
            created = self._apply_grant(grant)
            for rid, label in keys:
                self._streams[rid][label].step_in_flight = True
            if ctx.is_preplan:
                self._preplan = _Preplan(step, ctx, created, list(keys))
            else:
                self._running = _Running(step, padded, set(created))
            return ADMIT_OK

    def _admit_segments(self, step: KVStep, ctx: StepContext) -> AdmitOutcome:
        """`admit` of a plain step (no forks, no preplan): what every decode step is.

        The decisions of `admission.validate_step`, `refusal` and `reserve`,
        in one pass to decide and one to apply, holding the stream objects in
        between: at batch 256 the dictionary lookups of the general path were
        most of the step's cost.
        """
        ps = self.config.page_size
        all_streams = self._streams
        todo: list[tuple[dict[str, CacheStream], str, CacheStream | None, int]] = []
        seen: set[Key] = set()
        new_pages = 0
        first_short: Key | None = None
        refused: AdmitFailedReason | None = None
        for seg in step.segments:
            rid, label, span = seg.request_id, seg.label, seg.span
            if span < 0:
                raise InvalidStepError(f"negative span {span}", request_id=rid, label=label)
            streams = all_streams.get(rid)
            if streams is None:
                raise UnknownRequestError("unknown request (never ingested, or removed)",
                                          request_id=rid, label=label)
            stream = streams.get(label)
            if stream is None:
                # made even for a zero span, so the mark covers it (R16)
                short = -(-span // ps)
            else:
                if stream.offloaded or stream.read_future is not None or (
                        stream.read_error is not None):
                    # rare: decided by the general rule, which ranks the kinds
                    refused = refused or admission.refusal(all_streams, {(rid, label): None})
                short = -(-(stream.stored_len + span) // ps) - len(stream.page_indices)
            if short > 0:
                new_pages += short
                if first_short is None:
                    first_short = (rid, label)
            todo.append((streams, label, stream, short))
            seen.add((rid, label))
        if len(seen) != len(todo):
            dup = next(k for k in seen
                       if sum((s.request_id, s.label) == k for s in step.segments) > 1)
            # both would be planned from one length and write the same slots
            raise InvalidStepError("stream appears twice in one step",
                                   request_id=dup[0], label=dup[1])
        if refused is not None:
            # rank across every segment: a latched failure before a running
            # retrieve before an offload, whichever segment came first
            refused = admission.refusal(all_streams, dict.fromkeys(seen))
            if refused is not None:
                return AdmitOutcome(ok=False, reason=refused)
        if new_pages > self._allocator.num_free:
            return AdmitOutcome(ok=False, reason=admission.allocation_failed(
                new_pages, self._allocator.num_free, first_short))
        allocate = self._allocator.try_allocate
        for streams, label, stream, short in todo:
            if stream is None:
                stream = streams[label] = CacheStream()
            if short > 0:
                got = allocate(short)
                assert got is not None  # counted above, under the same lock
                stream.page_indices += got
                stream.generation += 1
            stream.step_in_flight = True
        self._running = _Running(step, tuple(ctx.padded_request_ids), set())
        return ADMIT_OK

    def _apply_grant(self, grant: admission.Grant) -> list[Key]:
        created: list[Key] = []
        for (rid, label), pages in grant.pages.items():
            streams = self._streams[rid]
            stream = streams.get(label)
            if stream is None:
                stream = streams[label] = CacheStream()
                created.append((rid, label))
            short = pages - len(stream.page_indices)
            if short > 0:
                got = self._allocator.try_allocate(short)
                # `reserve` counted these under the same lock
                assert got is not None, "allocator lost pages between reserve and apply"
                stream.page_indices.extend(got)
                stream.generation += 1
        return created

    def plan(self, step: KVStep, ctx: StepContext) -> KVPlanOutputs:
        """Page tables per plan label, and this step's write addressing.

        A step is planned once (R27). The real plan after a preplan promotes
        it: the staged page tables are returned and its pre-forks are applied
        now (R11). A fork copy that fails empties its target, leaves the step
        admitted with its forks done, and raises `ForkCopyError`: plan again.
        """
        validate.step(step, ctx)
        validate.slot_lease(step, ctx, self._cg_max_seq_len)
        self.reset_default_cursors()
        with self._lock:
            staged = self._preplan
            if ctx.is_preplan:
                if staged is None or staged.step != step:
                    raise StepNotAdmittedError("preplan of a step that was not preplan-admitted",
                                               **_where(step))
                if staged.outputs is not None:
                    raise PreplanPendingError("the staged preplan was already planned")
                outputs, states = self._build_plan(
                    step, ctx, self._pre_fork_lengths(step, staged.ctx, staged.created))
                staged.outputs, staged.states = outputs, states
                return outputs
            running = self._running
            if running is None:
                if staged is None or (step is not staged.step and step != staged.step):
                    raise StepNotAdmittedError("plan of a step that was not admitted",
                                               **_where(step))
                # promotion, not abandonment: its reservations and marks stay
                self._preplan = None
                running = self._running = _Running(
                    staged.step, tuple(staged.ctx.padded_request_ids), set(staged.created))
                if staged.outputs is not None:
                    self._run_pre_forks(running)
                    # the views were built before the forks ran: what they
                    # report now is what the step runs against
                    for out in staged.outputs.values():
                        for view in out.views:
                            stream = self._streams[view.request_id][view.label]
                            view.generation = stream.generation
                    running.planned = True
                    self._current_plan_states = staged.states
                    return staged.outputs
            elif step is not running.step and step != running.step:
                raise StepNotAdmittedError("plan of a step other than the admitted one",
                                           **_where(step, running.step))
            elif running.planned:
                raise StepOrderError("the admitted step was already planned; commit it",
                                     **_where(step))
            self._run_pre_forks(running)
            outputs, states = self._build_plan(step, ctx, {})
            running.planned = True
            self._current_plan_states = states
            return outputs

    def _build_plan(
        self, step: KVStep, ctx: StepContext, fork_len: Mapping[Key, int]
    ) -> tuple[KVPlanOutputs, dict[str, KVPlanState]]:
        ps = self.config.page_size
        outputs: dict[str, KVPlanOutput] = {}
        states: dict[str, KVPlanState] = {}
        for plan_label, segments in group_by_plan_label(
            step.segments, step.combined_labels
        ).items():
            views = self._sequence_views(segments, fork_len)
            indptrs, state, cuda_indptrs = plan_tables(views, ps, self._device)
            out = KVPlanOutput(cpu_indptrs=indptrs, views=views, cuda_indptrs=cuda_indptrs)
            outputs[plan_label] = out
            states[plan_label] = self._leased(state, ctx.slot_lease, plan_label)
        return KVPlanOutputs(outputs, step.pre_forks, step.post_forks), states

    def _sequence_views(
        self, segments: Sequence[Segment], fork_len: Mapping[Key, int]
    ) -> list[SequenceView]:
        ps = self.config.page_size
        all_streams = self._streams
        views: list[SequenceView] = []
        append = views.append
        for seg in segments:
            rid, label, span = seg.request_id, seg.label, seg.span
            stream = all_streams[rid][label]  # admit made every named stream (R16)
            if fork_len:
                length = fork_len.get((rid, label), stream.stored_len) + span
            else:
                length = stream.stored_len + span
            if length == 0:
                continue  # nothing to attend to and nothing to write
            # sliced to the length: the stream may hold spare pages, and an
            # unsliced view would report them as resident context
            pages = stream.page_indices[: -(-length // ps)]
            append(SequenceView(rid, label, pages, length, span, stream.generation))
        return views

    def _leased(self, state: KVPlanState, lease: SlotLease | None, label: str) -> KVPlanState:
        """Under a slot lease, the step's slots staged into the graph's static buffer."""
        if lease is None:
            return state
        static = self._static_plan_state(lease.slot, label)
        static.copy_(state, lease.bucket.num_tokens)
        static.write_len = lease.bucket.num_tokens
        return static

    def _static_plan_state(self, slot: int, label: str) -> KVPlanState:
        state = self._static_plan_states.get((slot, label))
        if state is None:
            if self._cg_max_seq_len == 0:
                raise KVRefError(
                    "a step planned under a slot lease before build_cuda_graph_buffers",
                    label=label,
                )
            n = self._cg_max_seq_len
            state = KVPlanState(
                token_to_page=torch.full((n,), SINK_PAGE, dtype=torch.long, device=self._device),
                token_to_cache=torch.zeros(n, dtype=torch.long, device=self._device),
                total_tokens=0,
            )
            self._static_plan_states[(slot, label)] = state
        return state

    def build_cuda_graph_buffers(
        self, slots: list[CGSlotSpec], max_bs: int, max_seq_len: int
    ) -> None:
        validate.capture_len(max_seq_len)
        del slots, max_bs
        # the (slot, label) buffers are made on the first plan under that key
        # (the step declares its labels), all at one length so they outlive
        # any bucket; every runner capturing against this cache calls in, so
        # keep the largest
        if self._static_plan_states and max_seq_len > self._cg_max_seq_len:
            raise KVRefError(
                f"graph buffers already built for {self._cg_max_seq_len} tokens; "
                f"a later capture of {max_seq_len} would outgrow addresses a graph recorded"
            )
        self._cg_max_seq_len = max(self._cg_max_seq_len, max_seq_len)

    @property
    def supports_preplan(self) -> bool:
        return True

    def clear_preplan(self) -> None:
        """Abandon the staged step: undo what its admit did to live state (I9)."""
        with self._lock:
            staged, self._preplan = self._preplan, None
            if staged is None:
                return
            # labels the staged step invented are removed with their pages:
            # a stream at length 0 that nothing asked for still holds them
            for rid, label in reversed(staged.created):
                stream = self._streams.get(rid, {}).pop(label, None)
                if stream is not None:
                    self._allocator.free(stream.page_indices)
            # or the request stays unevictable for a step that never runs
            for rid, label in staged.marked:
                stream = self._streams.get(rid, {}).get(label)
                if stream is not None:
                    stream.step_in_flight = False

    def commit(self, step: KVStep, ctx: StepContext) -> None:
        """Clear the step's marks, add its spans, then apply its post-forks.

        A step committed without a plan runs its pre-forks first (R24). The
        write addressing dies here (R27): a late `write_kv` raises instead of
        landing in pages that are committed, or owned by another request. A
        fork copy that fails empties its target and raises `ForkCopyError`
        once the commit is otherwise complete (R26).
        """
        validate.step(step, ctx)
        with self._lock:
            running = self._running
            if running is None or (step is not running.step and step != running.step):
                staged = self._preplan
                if staged is not None and staged.step == step:
                    raise StepNotAdmittedError("commit of a step that is only preplanned",
                                               **_where(step))
                raise StepNotAdmittedError(
                    "commit of a step that was not admitted",
                    **_where(step, running.step if running is not None else None))
            fault: ForkCopyError | None = None
            try:
                self._run_pre_forks(running)
            except ForkCopyError as err:
                fault = err
            self._running = None
            self._current_plan_states = {}
            keep = step.commit
            all_streams = self._streams
            # a staged preplan may own a mark this step also set (a stream
            # both name): it stays until the preplan is promoted or cleared
            staged_marks = (
                {all_streams[r][lb] for r, lb in self._preplan.marked
                 if lb in all_streams.get(r, {})}
                if self._preplan is not None else None
            )
            for rid, label in admission.named_keys(step, running.padded):
                stream = all_streams[rid][label]
                # cleared whether or not the step keeps its tokens: a step
                # with commit=False still read these pages, and a mark left
                # set would make the request unevictable
                if staged_marks is None or stream not in staged_marks:
                    stream.step_in_flight = False
            if keep:
                for seg in step.segments:
                    span = seg.span
                    if not span:
                        continue
                    stream = all_streams[seg.request_id][seg.label]
                    if stream.offloaded:
                        # unreachable under R2-R5; kept as the last defence,
                        # loudly, because it drops a committed span (I15)
                        logger.error(
                            "KV %s: dropping %d committed tokens for request %r label %r; "
                            "the stream was offloaded mid-step",
                            self.name, span, seg.request_id, seg.label,
                        )
                        continue
                    stream.stored_len += span
                    stream.generation += 1
            # post-forks copy what this step just wrote, so after the spans land
            try:
                self._run_forks(running, step.post_forks)
            except ForkCopyError as err:
                fault = fault or err
            if fault is not None:
                raise fault

    def _run_pre_forks(self, running: _Running) -> None:
        if running.forked:
            return
        # done even if a copy fails: a retried plan, or the commit, must not
        # run a chain of forks twice over its own results
        running.forked = True
        self._run_forks(running, running.step.pre_forks)

    def _run_forks(self, running: _Running, forks: Sequence[tuple[str, str]]) -> None:
        """Each fork for each padded request, in order; a failed copy empties its
        target and the rest still run, then the first failure is raised."""
        failed: list[tuple[Key, BaseException]] = []
        for from_label, to_label in forks:
            for rid in running.padded:
                try:
                    self._apply_fork(rid, from_label, to_label, running.created)
                except _ForkFailed as err:
                    failed.append(((rid, to_label), err.__cause__ or err))
        if failed:
            (rid, label), cause = failed[0]
            raise ForkCopyError(
                f"fork copy failed ({type(cause).__name__}: {cause}); the target was left "
                f"empty ({len(failed)} target(s) in this call)",
                request_id=rid, label=label,
            ) from cause

    def _pre_fork_lengths(self, step: KVStep, ctx: StepContext,
                          created: Sequence[Key]) -> dict[Key, int]:
        """Target lengths the pre-forks will give, without applying them (R11)."""
        unfilled = set(created)
        lengths: dict[Key, int] = {}
        for from_label, to_label in step.pre_forks:
            for rid in ctx.padded_request_ids:
                src = self._streams[rid].get(from_label)
                if src is None:
                    continue
                n = lengths.get((rid, from_label), src.stored_len)
                if (rid, from_label) in unfilled and n == 0:
                    continue  # R20
                unfilled.discard((rid, to_label))
                lengths[(rid, to_label)] = n
        return lengths

    def _apply_fork(self, rid: str, from_label: str, to_label: str,
                    created: set[Key]) -> None:
        """Copy a stream onto its fork target, over pages admit reserved."""
        streams = self._streams[rid]
        src = streams[from_label]  # admit made both ends (R16)
        dst = streams[to_label]
        if (rid, from_label) in created and src.stored_len == 0:
            # R20: this step's admit made the source only so a mark covers
            # it; a padded request without the label has nothing to give, and
            # copying the empty stream wiped the target's tokens
            return
        created.discard((rid, to_label))  # a fork wrote it: a source from here on
        # sized off the source's length, not either side's page count: both
        # may hold spare pages, and copying those made the copy lopsided
        n = _pages_for(src.stored_len, self.config.page_size)
        if len(dst.page_indices) < n:
            raise KVRefError(
                f"fork target holds {len(dst.page_indices)} pages, source "
                f"{from_label!r} needs {n}: the step was not admitted with this fork",
                request_id=rid,
                label=to_label,
            )
        if n:
            try:
                self.kv_cache.copy_pages(src.page_indices[:n], dst.page_indices[:n])
            except Exception as err:
                # the target may hold part of the source: nothing of it is
                # trustworthy, so it is emptied rather than left torn (R26)
                dst.stored_len = 0
                dst.generation += 1
                raise _ForkFailed() from err
        dst.stored_len = src.stored_len
        dst.generation += 1

    # -- what attention layers call ------------------------------------------

    def set_default_layer_idx(self, layer_idx: int | None) -> None:
        validate.optional_layer_idx(layer_idx, self.config.num_layers, "set_layer_idx")
        super().set_default_layer_idx(layer_idx)

    # the reference's name for the layer cursor
    set_layer_idx = set_default_layer_idx

    def reset_default_cursors(self) -> None:
        super().reset_default_cursors()
        # unlike attention's, every read here needs a usable index
        self._default_layer_idx = 0

    def layer_view(self, layer_idx: int | None = None) -> torch.Tensor:
        """One layer's pages in the shape FlashInfer's paged attention takes."""
        validate.layer_idx(self._default_layer_idx if layer_idx is None else layer_idx,
                           self.config.num_layers, "layer_view")
        if layer_idx is None:
            layer_idx = self._default_layer_idx
        assert layer_idx is not None
        return self.kv_cache.layer_view(layer_idx)

    def read_kv(self, layer_idx: int | None = None, plan_label: str | None = None) -> torch.Tensor:
        """The slots this step's plan writes: ``[num_tokens, 2, H, D]`` (K, then V)."""
        validate.optional_label(plan_label, "read_kv")
        validate.layer_idx(self._default_layer_idx if layer_idx is None else layer_idx,
                           self.config.num_layers, "read_kv")
        state, _ = self._plan_state_for(plan_label)
        n = state.write_len
        layer = self._default_layer_idx if layer_idx is None else layer_idx
        assert layer is not None
        return self.kv_cache.read_tokens(layer, state.token_to_page[:n], state.token_to_cache[:n])

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_idx: int | None = None,
        label: str | None = None,
        return_tensor: bool = False,
    ) -> torch.Tensor | None:
        """Write K, V ``[num_tokens, num_kv_heads, head_dim]`` into this step's slots.

        Under a slot lease ``num_tokens`` is the bucket's: the padding rows
        land on the sink page.
        """
        validate.optional_label(label, "write_kv")
        validate.layer_idx(self._default_layer_idx if layer_idx is None else layer_idx,
                           self.config.num_layers, "write_kv")
        validate.kv_pair(k, v, self.kv_cache.tensor.device,
                         self._default_label if label is None else label)
        state, plan_label = self._plan_state_for(label)
        n = state.write_len
        want = (n, *self.kv_cache.token_shape)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != want or t.dtype != self.kv_cache.dtype:
                raise KVShapeError(
                    f"write_kv {name} is {tuple(t.shape)} {t.dtype}; this step's plan "
                    f"wants {want} {self.kv_cache.dtype}",
                    label=plan_label,
                )
        layer = self._default_layer_idx if layer_idx is None else layer_idx
        assert layer is not None
        return self.kv_cache.write_tokens(
            layer, k, v, state.token_to_page[:n], state.token_to_cache[:n], return_tensor
        )

    def _plan_state_for(self, label: str | None) -> tuple[KVPlanState, str]:
        plan_label = self._default_label if label is None else label
        state = self._current_plan_states.get(plan_label)
        if state is None:
            raise StepNotAdmittedError(
                f"no step is planned for plan label {plan_label!r} "
                f"(planned: {sorted(self._current_plan_states)})",
                label=plan_label,
            )
        return state, plan_label

    def read_stream(self, rid: str, label: str = "main") -> torch.Tensor:
        """``[layers, stored_len, 2, H, D]``: a resident stream's tokens, for checks."""
        with self._lock:
            stream = self._stream(rid, label)
            if stream.offloaded:
                raise KVRefError("stream is offloaded; reload it to read", request_id=rid,
                                 label=label)
            return self.kv_cache.gather_stream(stream.page_indices, stream.stored_len)

    # -- eviction to host ----------------------------------------------------

    @property
    def supports_eviction(self) -> bool:
        return self._cpu_pool is not None

    def is_offloaded(self, rid: str) -> bool:
        """True from the moment an offload claims the request, not only once
        its pages are on the host: admission and the victim filter must not
        schedule, or pick again, a request already on its way out."""
        if self._cpu_pool is None:
            return False
        with self._lock:
            return any(s.offloaded for s in self._streams.get(rid, {}).values())

    def begin_offload(self, rid: str) -> Offload | None:
        """Claim every stream of ``rid`` that holds pages; None if refused or nothing to claim.

        Refused for the whole request while any of its streams is in flight
        (R4): a step already holds addressing into these pages.
        """
        validate.request_id(rid, "begin_offload")
        if self._cpu_pool is None:
            return None
        with self._lock:
            streams = self._streams.get(rid)
            if streams is None or rid in self._offloads:
                return None
            if any(s.step_in_flight for s in streams.values()):
                return None
            claims: list[ClaimedStream] = []
            reads: dict[str, Future[Any]] = {}
            for label, s in streams.items():
                if s.offloaded or not s.page_indices:
                    continue
                s.offloaded = True
                claims.append(ClaimedStream(label, list(s.page_indices), s.generation,
                                            s.stored_len, s.position, s.released))
                if s.read_future is not None:
                    reads[label] = s.read_future
            if not claims:
                return None
            offload = self._offloads[rid] = Offload(self, rid, claims, reads)
        self._runtime.checkpoint("offload.claimed")
        return offload

    def offload(self, rid: str) -> int:
        """Move every stream of ``rid`` to host memory; returns device pages freed.

        A stream that does not fit on the host keeps its pages, so a partial
        offload still frees what did fit. 0 when refused (a step in flight,
        an offload already running, an unknown request) or nothing moved.
        """
        validate.request_id(rid, "offload")
        offload = self.begin_offload(rid)
        if offload is None:
            return 0
        try:
            offload.copy_all()
            self._runtime.checkpoint("offload.copied")
            return offload.commit()
        finally:
            offload.abandon()  # a no-op once committed

    def _offload_stale(self, offload: Offload) -> bool:
        """The offload was cancelled (request removed), or a claimed stream changed
        since the claim (a reset): its commit can only undo it. Under the lock."""
        if offload._cancelled:
            return True
        streams = self._streams.get(offload.request_id, {})
        return any(
            (s := streams.get(c.label)) is None or s.generation != c.generation
            for c in offload._claims.values()
        )

    def _copy_claim_to_host(self, offload: Offload, claim: ClaimedStream) -> bool:
        """One stream's host copy; False if the offload went stale or it does not fit.

        Decided in one critical section (stale? room on the host?), copied
        outside the lock, recorded in a second: a reset racing the copy fails
        the commit's guard, a removal racing it drops the copy at the record,
        and neither changes what this call answers.
        """
        pool = self._cpu_pool
        assert pool is not None
        rid = offload.request_id
        with self._lock:
            if self._offload_stale(offload):
                # a reset (or removal) since the claim dooms the commit: a
                # copy now would only be thrown away
                return False
            host_pages = pool.reserve(rid, claim.label, claim.stored_len, len(claim.pages))
            if host_pages is None:
                return False
        try:
            pool.copy_out(self.kv_cache.tensor, claim.pages, host_pages)
        except BaseException:
            pool.release(host_pages)
            raise
        with self._lock:
            if offload._cancelled:
                pool.release(host_pages)  # the removal already emptied the host
            else:
                pool.record(rid, claim.label, host_pages, claim.stored_len,
                            claim.position, claim.released)
        return True

    def _commit_offload(
        self, offload: Offload, claims: Mapping[str, ClaimedStream], copied: Sequence[str]
    ) -> int:
        assert self._cpu_pool is not None
        rid = offload.request_id
        # the device pages must not be released before the D2H copy read them
        self._cpu_pool.sync()
        with self._lock:
            if offload._cancelled:
                return 0  # the removal released everything, host copies included
            self._offloads.pop(rid, None)
            streams = self._streams.get(rid, {})
            intact = all(
                (s := streams.get(label)) is not None
                and s.generation == claims[label].generation
                for label in copied
            )
            moved = copied if intact else []
            for label in claims:
                if label in moved:
                    continue
                # did not fit on the host, or the request changed behind us
                self._cpu_pool.discard(rid, label)
                stream = streams.get(label)
                if stream is not None:
                    stream.offloaded = False
            freed = 0
            for label in moved:
                stream = streams[label]
                freed += len(stream.page_indices)
                self._allocator.free(stream.page_indices)
                # the tokens are on the host: the length stays, the pages go
                stream.page_indices = []
                stream.generation += 1
            return freed

    def _abandon_offload(self, offload: Offload, labels: Sequence[str]) -> None:
        assert self._cpu_pool is not None
        rid = offload.request_id
        with self._lock:
            if offload._cancelled:
                return  # the removal released everything, host copies included
            self._offloads.pop(rid, None)
            streams = self._streams.get(rid, {})
            for label in labels:
                # a raise mid-copy leaves a copy behind, and a reload would
                # then hand the stream fresh pages on top of its own
                self._cpu_pool.discard(rid, label)
                stream = streams.get(label)
                if stream is not None:
                    stream.offloaded = False

    def reload(self, rid: str) -> bool:
        """Bring every offloaded stream of ``rid`` back on device, or move nothing.

        False when the device cannot fit them now (evict more, retry), while
        an offload of the request is still in progress (R6), or when nothing
        of ``rid`` is on the host.
        """
        validate.request_id(rid, "reload")
        pool = self._cpu_pool
        if pool is None:
            return False
        with self._lock:
            if rid in self._offloads or rid not in self._streams or not pool.is_offloaded(rid):
                return False
            labels = pool.labels(rid)
            needed = sum(pool.num_pages(rid, label) for label in labels)
            if needed > self._allocator.num_free:
                return False
            taken: list[tuple[str, list[int]]] = []
            try:
                for label in labels:
                    pages = self._allocator.try_allocate(pool.num_pages(rid, label))
                    assert pages is not None  # counted above, under the same lock
                    taken.append((label, pages))
                    pool.copy_in(rid, label, self.kv_cache.tensor, pages)
            except Exception as err:
                # all streams or none (R26): the pages go back, the host copies
                # stay, and a later reload can try again
                for _, pages in taken:
                    self._allocator.free(pages)
                raise ReloadCopyError(
                    f"host-to-device copy failed ({type(err).__name__}: {err}); nothing "
                    "was reloaded", request_id=rid, label=taken[-1][0] if taken else None,
                ) from err
            streams = self._streams[rid]
            for label, pages in taken:
                copy = pool.copy_of(rid, label)
                assert copy is not None
                pool.drop_reloaded(rid, label)
                stream = streams[label]
                stream.page_indices = pages
                stream.stored_len = copy.stored_len
                stream.position = copy.position
                stream.released = copy.released
                stream.offloaded = False
                stream.generation += 1
        # outside the lock: orders the H2D copies before attention reads the
        # pages; the pages are already assigned, so no shared state is touched
        pool.sync()
        return True

    def reclaimable(self, rid: str) -> int:
        """Device pages the request holds; 0 once offloaded."""
        with self._lock:
            return sum(len(s.page_indices) for s in self._streams.get(rid, {}).values())

    def get_offload_priority(self, rid: str) -> float:
        """The most reclaimable request first."""
        return float(self.reclaimable(rid))

    # -- KV transfer between managers ----------------------------------------

    def _own_transfer_info(self) -> Any:
        return self._transfer.get_kv_transfer_info()

    def publish(self, request_id: str) -> PublishedKVInfo | None:
        """What another manager needs to retrieve this request's KV.

        None when the request is gone (a removal can race the engine's
        finalize), any stream is off the device (R13), or any stream is still
        receiving a retrieve or holds a failed one (R21): its pages do not hold
        the tokens its length counts, and the peer would copy them anyway.
        """
        validate.request_id(request_id, "publish")
        transfer_info = self._own_transfer_info()
        with self._lock:
            streams = self._streams.get(request_id)
            if streams is None or any(s.offloaded for s in streams.values()):
                return None
            if any(admission.retrieve_state(s) != admission.IDLE for s in streams.values()):
                return None
            seq_info = {
                label: KVSequenceInfo(
                    seq_len=s.stored_len,
                    latest_kv_transfer_info=transfer_info,
                    page_indices=list(s.page_indices[: _pages_for(s.stored_len,
                                                                  self.config.page_size)]),
                )
                for label, s in streams.items()
            }
        return PublishedKVInfo.build_for_rank(self._rank, self._world_size, seq_info)

    def admit_retrieve(
        self,
        rid: str,
        node_name: str,
        graph_walk: str,
        published: PublishedKVInfo | None,
    ) -> AdmitOutcome:
        """Start copying what another manager published; ready once it landed.

        ``ok=True, ready=False`` while a copy runs; a failed copy is latched
        and reported on every later call (I11) until reset or removal.
        """
        validate.request_id(rid, "admit_retrieve")
        validate.label(node_name, "admit_retrieve", rid, what="node_name")
        validate.label(graph_walk, "admit_retrieve", rid, what="graph_walk")
        validate.published(published, rid, self._rank)
        if published is not None and published.world_size != self._world_size:
            # terminal for this request, not for the worker serving it
            return AdmitOutcome(
                ok=False, ready=False,
                reason=AdmitRuntimeError(
                    "KV transfer across tensor-parallel world sizes is not supported "
                    f"(published {published.world_size}, local {self._world_size})",
                    request_id=rid,
                ),
            )
        own = self._own_transfer_info()
        ps = self.config.page_size
        # one critical section: reading stored_len, comparing it with what was
        # published and starting the copy must not interleave a commit or reset
        with self._lock:
            streams = self._request(rid)
            needed = self._overrides[rid].get_labels(node_name, graph_walk)
            todo: list[tuple[str, KVSequenceInfo, int]] = []
            new_pages = 0
            offered = published.get(self._rank).items() if published is not None else ()
            for label, info in offered:
                if label not in needed:
                    continue
                ready, failed = self._check_ready(rid, label)
                if failed is not None:
                    return AdmitOutcome(ok=False, ready=False, reason=failed)
                if not ready:
                    return AdmitOutcome(ok=True, ready=False)
                stream = streams.get(label)
                old_len = stream.stored_len if stream is not None else 0
                if info.seq_len <= old_len:
                    continue
                if info.latest_kv_transfer_info == own:
                    # the pages already are in this cache; opening our own
                    # IPC handle would fail with an invalid device context
                    logger.warning(
                        "KV %s: skipping self-retrieve for %r label %r (published %d, held %d)",
                        self.name, rid, label, info.seq_len, old_len,
                    )
                    continue
                # every misuse before anything moves: a bad descriptor or an
                # incompatible publisher found at the second label used to
                # leave the first one's pages taken and its copy running
                self._validate_published(rid, label, info, old_len)
                if stream is not None and stream.step_in_flight:
                    # the step planned its writes at the old length; growing
                    # the stream under it would overwrite or lose its tokens
                    raise StepInFlightError(
                        "retrieve into a stream with a step in flight; commit it first",
                        request_id=rid, label=label,
                    )
                if stream is not None and stream.offloaded:
                    return AdmitOutcome(ok=False, reason=admission.request_offloading(
                        rid, label))
                held = len(stream.page_indices) if stream is not None else 0
                new_pages += max(0, _pages_for(info.seq_len, ps) - held)
                todo.append((label, info, old_len))
            free = self._allocator.num_free
            if new_pages > free:
                label = todo[0][0]
                return AdmitOutcome(ok=False, reason=AllocationFailed(
                    pages_short=new_pages - free, request_id=rid, label=label,
                    message=f"retrieve needs {new_pages} new pages, {free} free",
                ))
            for label, info, old_len in todo:
                started = self._start_retrieve(rid, streams, label, info, old_len)
                if started is not None:
                    return AdmitOutcome(ok=False, ready=False, reason=started)
            ready = True
            for label in needed:
                label_ready, failed = self._check_ready(rid, label)
                if failed is not None:
                    return AdmitOutcome(ok=False, ready=False, reason=failed)
                ready = ready and label_ready
            return AdmitOutcome(ok=True, ready=ready)

    def _start_retrieve(self, rid: str, streams: dict[str, CacheStream], label: str,
                        info: KVSequenceInfo, old_len: int) -> AdmitRuntimeError | None:
        """Take the pages and start one label's copy; if the transfer engine
        raises, give back what this label took and refuse (R26). Labels started
        before it keep copying: their pages are theirs, and reset drains them."""
        stream = streams.get(label)
        created = stream is None
        if stream is None:
            stream = streams[label] = CacheStream()
        short = _pages_for(info.seq_len, self.config.page_size) - len(stream.page_indices)
        got: list[int] = []
        if short > 0:
            taken = self._allocator.try_allocate(short)
            assert taken is not None  # counted by the caller, under the same lock
            got = taken
            stream.page_indices.extend(got)
        try:
            fut = self._transfer.start_async_retrieve(
                start_len=old_len, end_len=info.seq_len,
                local_page_indices=list(stream.page_indices),
                remote_page_indices=info.page_indices,
                kv_transfer_info=info.latest_kv_transfer_info,
            )
        except Exception as err:
            if got:
                del stream.page_indices[-len(got):]
                self._allocator.free(got)
            if created:
                del streams[label]
            return AdmitRuntimeError(
                f"KV retrieve could not start: {type(err).__name__}: {err}",
                request_id=rid, label=label,
            )
        stream.read_future = fut
        stream.read_pending = fut is not None
        stream.stored_len = info.seq_len
        stream.generation += 1
        return None

    def _validate_published(self, rid: str, label: str, info: KVSequenceInfo,
                            old_len: int) -> None:
        remote = info.latest_kv_transfer_info
        num_pages = getattr(remote, "num_pages", None)
        page_size = getattr(remote, "page_size", self.config.page_size)
        if page_size != self.config.page_size:
            raise PublishedInfoError(
                f"published page size {page_size}, local {self.config.page_size}",
                request_id=rid, label=label,
            )
        if len(info.page_indices) < _pages_for(info.seq_len, page_size):
            raise PublishedInfoError(
                f"published {info.seq_len} tokens over only {len(info.page_indices)} pages",
                request_id=rid, label=label,
            )
        bad = [p for p in info.page_indices if p <= SINK_PAGE
               or (num_pages is not None and p >= num_pages)]
        if bad:
            raise PublishedInfoError(
                f"published page indices {bad[:4]} are outside [1, {num_pages})",
                request_id=rid, label=label,
            )
        try:
            self._transfer.check_remote(old_len, info.seq_len, info.page_indices, remote)
        except KVRefError as err:
            # a misuse of this call, named as one: it changes nothing
            raise PublishedInfoError(str(err), request_id=rid, label=label) from err

    def _check_ready(self, rid: str, label: str) -> tuple[bool, AdmitRuntimeError | None]:
        """(ready, terminal failure). A failed retrieve is latched on the stream."""
        stream = self._streams[rid].get(label)
        if stream is None:
            return True, None
        fut = stream.read_future
        if fut is not None and fut.done():
            stream.read_future = None
            err = fut.exception()
            if err is not None:
                stream.read_error = err
            else:
                stream.read_pending = False
        if stream.read_error is not None:
            err = stream.read_error
            return False, AdmitRuntimeError(
                f"KV retrieve failed: {type(err).__name__}: {err}", request_id=rid, label=label
            )
        return not stream.read_pending, None

    # -- checks and teardown ---------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        return self._allocator.num_free

    def post_warmup_validate(self) -> None:
        """Raise if tensor- or sequence-parallel ranks disagree on free pages.

        Catches a config that differs per rank (max_num_pages,
        cpu_offload_pages) and anything that took pages on one rank only
        before warmup returned. The all_gather synchronises, so no barrier.
        """
        group = self._comm_group
        if group is None or group.world_size == 1:
            return
        local = torch.tensor([self._allocator.num_free], dtype=torch.int64, device=self._device)
        for name, sub in (("tp", group.tp_group), ("sp", group.sp_group)):
            if sub is None:
                continue
            values = [int(v) for v in sub.all_gather(local, dim=0).cpu().tolist()]
            if any(v != values[0] for v in values):
                raise AsymmetricStateError(
                    f"KV cache {self.name!r} has asymmetric free page counts across "
                    f"{name} ranks: {values} (this rank {self._rank}: "
                    f"{self._allocator.num_free}); check per-rank max_num_pages / "
                    "cpu_offload_pages and any request added before warmup finished"
                )

    def cleanup(self) -> None:
        self._transfer.cleanup()

    # -- helpers -----------------------------------------------------------------

    def _request(self, rid: str) -> dict[str, CacheStream]:
        streams = self._streams.get(rid)
        if streams is None:
            raise UnknownRequestError("unknown request (never ingested, or removed)",
                                      request_id=rid)
        return streams

    def _stream(self, rid: str, label: str) -> CacheStream:
        stream = self._request(rid).get(label)
        if stream is None:
            raise UnknownRequestError("request has no such label", request_id=rid, label=label)
        return stream

    def _refuse_if_in_flight(self, rid: str, what: str) -> None:
        # under the lock also when called before it is taken: an admit may add
        # a label meanwhile, and iterating the labels then raises (R32)
        with self._lock:
            for label, stream in self._streams.get(rid, {}).items():
                if stream.step_in_flight:
                    raise StepInFlightError(
                        f"{what} while a step is in flight; commit it first",
                        request_id=rid, label=label,
                    )

    def _drain_reads(self, rid: str) -> None:
        # the streams are read under the lock (R32), the wait is outside it
        # (R17): a transfer does not take the lock, a reset must not hold it
        with self._lock:
            futures = [s.read_future for s in self._streams.get(rid, {}).values()
                       if s.read_future is not None]
        if futures:
            self._runtime.wait(futures)


