"""KVManager: the paged KV cache of one engine resource, and its stream lifecycle.

The reference's public API, the one lock, and ingest; reset and remove are
`kvref.lifecycle.RequestLifecycle`'s, the manager delegating. Each mechanism
lives in its own module and works on the shared `StreamTable` (streams, page
allocator, lock, runtime), never on the manager:

- `kvref.stepping.admission`: a step and the streams to a grant or a refusal (pure);
- `kvref.stepping.admit_plan_commit`: admit, plan and commit, one step at a time plus one
  preplanned; `kvref.stepping.forks` copies fork targets, `kvref.stepping.graph_staging`
  stages slot-leased addressing for CUDA graphs;
- `kvref.offload.phases`: an offload's claim, copy, commit and abandon
  (the `kvref.offload.handle.Offload` handle drives them), and reload;
- `kvref.transfer.retrieval`: publish and retrieve between managers, under a lease
  (`kvref.transfer.lease`); `kvref.stepping.truncation` cuts a stream back to a prefix.

The public calls of three mechanisms are mixins over the same state:
`kvref.stepping.layer_io` (what attention layers call between plan and commit),
`kvref.offload.calls` (offload, reload and their queries) and
`kvref.transfer.calls` (publish, release, retrieve).

Every read-modify-write of stream bookkeeping happens under ``_lock`` (from
`kvref.core.runtime`, so the concurrency tests can schedule it). Blocking work —
host copies, draining retrieves — happens outside it. The lifecycle and its
invariants are in ``specs/stream-lifecycle.md``; where kvref departs from
the reference manager, ``specs/rules.md`` says why (the rule IDs below cite it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from kvref import observation, validate
from kvref.core.cache import KVCache
from kvref.core.config import KVConfig, KVReqConfig, KVSpec
from kvref.core.errors import StepInFlightError, StreamUnavailableError
from kvref.core.labels import behaviours_of
from kvref.core.page_keys import key_hash_named
from kvref.core.page_pool import PagePool, ResetRefused
from kvref.core.resource import CGSlotSpec, EngineResourceInfo, ProcessGroups
from kvref.core.runtime import Runtime, default_runtime, monotonic, shared
from kvref.core.sharing import page_sharing
from kvref.core.stream_table import StreamTable
from kvref.core.streams import CacheStream
from kvref.hybrid.decode import GroupDecodeTables
from kvref.hybrid.layout import GroupLayout
from kvref.lifecycle import RequestLifecycle
from kvref.offload.calls import EvictionCalls
from kvref.offload.handle import Offload
from kvref.offload.host_pool import CPUPagePool
from kvref.offload.phases import HostOffload
from kvref.parallel.rank_check import check_free_pages_agree
from kvref.prefix import cache as prefix_cache
from kvref.prefix import follow
from kvref.prefix.keys import Tokens
from kvref.stepping import truncation
from kvref.stepping.admit_plan_commit import Stepping
from kvref.stepping.forks import Forks
from kvref.stepping.graph_staging import GraphStaging
from kvref.stepping.layer_io import LayerIO
from kvref.stepping.plan import SINK_PAGE, KVPlanOutputs, KVPlanState
from kvref.stepping.running_step import RunningStep, StagedPreplan
from kvref.stepping.step import AdmitOutcome, KVStep, StepContext
from kvref.transfer.calls import TransferCalls
from kvref.transfer.engine import KVTransferManager, TransferEngineInfo, allocate_cache_tensor
from kvref.transfer.lease import LeaseTable
from kvref.transfer.retrieval import Retrieval


class KVManager(EvictionCalls, TransferCalls, LayerIO):
    """Pages, streams and steps of one KV cache (see the module docstring).

    The manager runs on a private, validated copy of ``cfg``
    (`KVConfig.copy`; `KVConfig.sharded` under a ``joint_comm_group``, its
    head counts divided per rank), exposed as ``config``: changing the
    caller's config after construction (a field reassigned, the object
    reused for another manager) changes nothing here, and the caller's
    config stays unsharded.

    Raises `InvalidConfigError` before anything is allocated when the cache
    cannot fit: ``max_num_pages`` pages on ``device`` past its total memory
    (CUDA) or the host's physical memory (CPU), or a host pool
    (``cpu_offload_pages``) past the host's, each with the byte figures
    (`kvref.validate.cache_fits`).
    """

    def __init__(
        self,
        cfg: KVConfig,
        name: str,
        joint_comm_group: ProcessGroups | None,
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
        # an impossible size is a config error here, not an untyped one from
        # torch's allocator (or the OOM killer) below
        validate.cache_fits(cfg, self._device, dtype)
        self._runtime = runtime if runtime is not None else default_runtime()
        info = transfer_engine_info if transfer_engine_info is not None else TransferEngineInfo()
        tensor = allocate_cache_tensor(
            info, KVCache.shape_for(cfg, cfg.max_num_pages), dtype, self._device
        )
        self.kv_cache = KVCache(cfg, self._device, dtype, tensor=tensor, runtime=self._runtime)
        # page 0, the sink, is reserved: never handed out, never shared
        self._pages = PagePool(cfg.max_num_pages, cfg.page_size, reserved=SINK_PAGE + 1,
                               runtime=self._runtime, name="device pages",
                               key_hash=key_hash_named(cfg.page_key_hash))
        self._transfer = KVTransferManager(info, self.kv_cache, runtime=self._runtime)
        # the shared containers come through the runtime seam: plain ones in
        # production, the race detector's in the tests
        runtime = self._runtime
        # a hybrid model's attention groups (issue 40): each label is one
        # stream per group, mapped here at the API (H1); None: one group
        self._groups = GroupLayout(cfg.groups) if cfg.groups else None
        self._table = StreamTable(self._pages, runtime.lock(), runtime,
                                  cfg.page_size, shared(runtime, {}, "streams"),
                                  leases=LeaseTable(cfg.publish_lease_s,
                                                    lambda: monotonic(runtime)),
                                  sharing=page_sharing(cfg, self._pages),
                                  behaviours=behaviours_of(cfg.retention, cfg.groups))
        # the manager's one lock, and the table every mechanism shares
        self._lock = self._table.lock
        self._streams = self._table.streams
        self._overrides = self._table.overrides
        self._cpu_pool: CPUPagePool | None = None
        if cfg.cpu_offload_pages > 0:
            self._cpu_pool = CPUPagePool(
                cfg, self.kv_cache, cfg.cpu_offload_pages, lock=self._runtime.lock(),
                runtime=self._runtime,
            )
        # rid -> the offload between its claim and its commit/abandon (R6)
        self._offloads: dict[str, Offload] = shared(self._runtime, {}, "offloads")
        self._host_offload: HostOffload | None = None
        if self._cpu_pool is not None:
            self._host_offload = HostOffload(self._table, self._cpu_pool, self.kv_cache,
                                             self._offloads)
        # reset and remove, and what they keep true (kvref.lifecycle)
        self._lifecycle = RequestLifecycle(self._table, self._offloads, self._cpu_pool,
                                           self._runtime)
        self._comm_group = joint_comm_group
        self._rank = joint_comm_group.rank if joint_comm_group is not None else 0
        self._world_size = joint_comm_group.world_size if joint_comm_group is not None else 1
        forks = Forks(self._table, self.kv_cache)
        self._graph_staging = GraphStaging(self._device)
        # admit, plan and commit each check their step; one walk per step object
        self._validate_step = validate.StepValidator()
        self._stepping = Stepping(
            self._table, forks, self._graph_staging, self._device, name, cfg.max_seq_len,
            decode_table=GroupDecodeTables(len(cfg.groups), cfg.page_size, self._device)
            if cfg.groups else None)
        # publish and retrieve ask stepping about forks (R50, R52) through
        # `StepForks`, nothing else of it
        self._retrieval = Retrieval(self._table, self._transfer, self._rank,
                                    self._world_size, name, self._stepping)
        self.reset_default_cursors()

    @classmethod
    def build(cls, spec: KVSpec, info: EngineResourceInfo) -> KVManager:
        """The manager a `KVSpec` names, on the engine's device and groups (the
        reference's resource factory)."""
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
        """Make the request known, with an empty ``main`` stream; idempotent.

        ``overrides``: its label routing and its ``cache_salt`` (R58). A
        second ingest keeps the first one's streams and config. Raises
        `InvalidArgumentError` for a request id that is not a ``str``.
        """
        validate.request_id(rid, "ingest_request")
        validate.req_config(overrides, rid)
        with self._lock:
            # idempotent: one request reaches a worker once per partition it
            # serves, and replacing the streams on the second ingest dropped
            # the lengths the first partition had already filled
            self._streams.setdefault(rid, {lb: CacheStream() for lb in self._labels_of("main")})
            self._overrides.setdefault(rid, overrides if overrides is not None else KVReqConfig())

    def has_request(self, rid: str) -> bool:
        """Whether the request was ingested and not removed."""
        return rid in self._streams

    def labels(self, rid: str) -> list[str]:
        """The request's streams, in creation order; `UnknownRequestError`."""
        validate.request_id(rid, "labels")
        with self._lock:
            got = list(self._request(rid))
        if self._groups is None:
            return got
        return [lb for lb in got if self._groups.is_first(lb)]  # a label, not its groups

    def stored_len(self, rid: str, label: str = "main") -> int:
        """Committed tokens of the stream; `UnknownRequestError` for an unknown
        request or label."""
        validate.request_id(rid, "stored_len")
        validate.label(label, "stored_len", rid)
        with self._lock:
            return self._stream(rid, label).stored_len

    def reset_request(self, rid: str, free: bool = False) -> None:
        """Forget the request's tokens; keep its device pages unless ``free``.

        Raises `StepInFlightError` while a step of the request is admitted
        (R5): the step would write into, and commit onto, a stream that no
        longer holds what it planned against; `PublishLeasedError` while its
        publication is leased (R33).
        """
        validate.request_id(rid, "reset_request")
        self._lifecycle.reset(rid, free)

    def remove_request(self, rid: str) -> None:
        """Release everything the request holds, device and host. Idempotent.

        An offload of the request still in progress is cancelled: its later
        copies copy nothing and its commit frees nothing. Raises
        `PublishLeasedError` while its publication is leased (R33).
        """
        validate.request_id(rid, "remove_request")
        self._lifecycle.remove(rid)

    # -- admit / plan / commit ---------------------------------------------

    def admit(self, step: KVStep, ctx: StepContext) -> AdmitOutcome:
        """Reserve the step's pages and mark its streams in flight, or refuse.

        A refusal changes nothing (R1). Forks reserve here and copy later
        (pre-forks at plan, post-forks at commit). One step is admitted at a
        time, plus one preplanned (R23): admitting the admitted (or staged)
        step again is a no-op, admitting another raises.
        """
        self._validate_step(step, ctx)
        if self._groups is not None:
            step = self._groups.expand(step)  # every group reserves, or none (H1)
        with self._lock:
            return self._stepping.admit(step, ctx)

    def plan(self, step: KVStep, ctx: StepContext) -> KVPlanOutputs:
        """Page tables per plan label, and this step's write addressing.

        A step is planned once (R27). The real plan after a preplan promotes
        it: the staged page tables are returned and its pre-forks are applied
        now (R11). A fork copy that fails empties its target, leaves the step
        admitted with its forks done, and raises `ForkCopyError`: plan again.
        """
        self._validate_step(step, ctx)
        validate.slot_lease(step, ctx, self._graph_staging.max_seq_len)
        self.reset_default_cursors()
        if self._groups is not None:
            step = self._groups.expand(step)
        with self._lock:
            return self._stepping.plan(step, ctx)

    def build_cuda_graph_buffers(
        self, slots: list[CGSlotSpec], max_bs: int, max_seq_len: int
    ) -> None:
        """Allocate the static buffers slot-leased plans stage into, for
        sequences up to ``max_seq_len`` (CUDA-graph capture)."""
        validate.capture_len(max_seq_len)
        del slots, max_bs
        self._graph_staging.build_buffers(max_seq_len)

    @property
    def supports_preplan(self) -> bool:
        """Always: a step may be admitted and planned while another runs (R41)."""
        return True

    def clear_preplan(self) -> None:
        """Abandon the staged step: undo what its admit did to live state (I9)."""
        with self._lock:
            self._stepping.clear_preplan()

    def commit(self, step: KVStep, ctx: StepContext) -> None:
        """Clear the step's marks, add its spans, then apply its post-forks.

        A step committed without a plan runs its pre-forks first (R24). The
        write addressing dies here (R27): a late `write_kv` raises instead of
        landing in pages that are committed, or owned by another request. A
        fork copy that fails empties its target and raises `ForkCopyError`
        once the commit is otherwise complete (R26).
        """
        self._validate_step(step, ctx)
        if self._groups is not None:
            step = self._groups.expand(step)
        with self._lock:
            self._stepping.commit(step, ctx)

    def truncate(self, rid: str, label: str, new_len: int) -> int:
        """Cut the stream back to its first ``new_len`` tokens; returns device pages freed.

        For a speculative verify step: commit every verified token, then
        truncate to the accepted prefix. The pages past ``ceil(new_len /
        page_size)`` are freed and the generation is bumped (R39); truncating
        to the current length changes nothing and returns 0. Raises, changing
        nothing (R38): `StepInFlightError` while a step or a staged preplan
        names the stream; `StreamUnavailableError` while an offload claims or
        holds it, or a retrieve is copying into it or failed;
        `PublishLeasedError` while its publication is leased (R33);
        `InvalidArgumentError` for a ``new_len`` below 0 or past its length;
        `ReleasedPrefixError` on a windowed label when the window at
        ``new_len`` would start before the tokens it already released (W6);
        `UnknownRequestError` for an unknown request or label.
        """
        validate.request_id(rid, "truncate")
        validate.label(label, "truncate", rid)
        validate.new_length(new_len, "truncate", rid, label)
        with self._lock:
            if self._groups is None:
                return truncation.truncate(self._table, rid, label, new_len)
            # every group's stream checked before any is cut (H1)
            labels = self._labels_of(label)
            for lb in labels:
                truncation.check(self._table, rid, lb, new_len)
            return sum(truncation.truncate(self._table, rid, lb, new_len) for lb in labels)

    # -- the prefix cache (kvref.core.sharing: off, it keys and finds nothing) --

    def match_prefix(self, rid: str, label: str, token_ids: Tokens) -> int:
        """Attach cached pages holding the head of ``token_ids`` to an empty
        stream; returns the tokens attached (the stream's new length).

        Whole pages only, at most ``len(token_ids) - 1`` tokens, so the last
        token is always computed (S8); only pages cached under the request's
        ``KVReqConfig.cache_salt`` (S7). The pages are shared: a later write
        past them lands in the stream's own pages. Creates the stream if the
        request lacks it, hit or not, as an admit naming it would (R58). 0
        with the cache off.
        Raises, changing nothing: `InvalidArgumentError` for ids that are not
        a sequence of ids (None, a generator or other iterator, an int, a
        ``str``), or not 64-bit integers (a bool, a bool array or tensor
        included: a mask passed as ids), and for a stream that is not
        empty; `StepInFlightError`
        while a step names the stream; `StreamUnavailableError` while it is
        offloaded or receiving a retrieve; `PublishLeasedError` while the
        request's publication is leased; `UnknownRequestError`.
        """
        validate.request_id(rid, "match_prefix")
        validate.label(label, "match_prefix", rid)
        with self._lock:
            if self._groups is not None:
                # the longest hit every group serves (H2)
                return prefix_cache.match_prefix_groups(self._table, rid,
                                                        self._labels_of(label), token_ids)
            return prefix_cache.match_prefix(self._table, rid, label, token_ids)

    def cache_prefix(self, rid: str, label: str, token_ids: Tokens, start: int = 0) -> int:
        """Make the stream's full pages of ``token_ids`` findable by
        `match_prefix`; returns how many pages were newly keyed (findable
        because of this call: a page passed over under a key another page
        holds is not counted, S23).

        ``token_ids`` are the ids of the stream's tokens ``start ..
        start + len(token_ids) - 1``, committed and final: call it after a
        commit, and for a speculative draft only once its verify step kept it
        (R56). ``start`` is a whole number of pages, at most where the
        stream's keyed pages end: an engine that passes only the tokens past
        them (``start = pages keyed * page_size``) hashes only the new pages.
        Ids of pages already keyed are compared with those they were keyed
        with; a page whose key another page holds stays the stream's own
        (S11). 0 with the cache off; a retrieve's tokens are a peer's KV, so
        the page its first token is in and every page after it key nothing,
        only the pages the stream computed before it do (R55). Raises,
        changing nothing:
        `InvalidArgumentError` for ids past the committed tokens, a ``start``
        that is not a page boundary at or before the keyed pages' end, or ids
        that disagree with those named before for a keyed page, or that are
        not a sequence of 64-bit integers (None, an iterator, an int, a
        ``str``; a bool, a bool array or tensor included);
        `StreamUnavailableError` while offloaded or receiving a retrieve;
        `StepInFlightError` while a fork of an admitted step (preplanned, or
        running and not yet run) will still write into it (R57, S32);
        `UnknownRequestError`.
        """
        with self._keyable(rid, label, "cache_prefix") as targets:
            if self._groups is not None:
                # each group's stream, every one checked before any is keyed (H1, S31)
                return sum(prefix_cache.cache_prefixes(
                    self._table, [(rid, lb, token_ids, start) for lb in self._labels_of(label)],
                    targets))
            return prefix_cache.cache_prefix(self._table, rid, label, token_ids, start)

    @contextlib.contextmanager
    def _keyable(self, rid: str, label: str, call: str) -> Iterator[frozenset[tuple[str, str]]]:
        """Under the lock, a stream whose pages ``call`` may key: its id and
        label checked, and no fork of an admitted step (preplanned, or
        running and not yet run) still to write into it (R57, S32); gives
        the streams such forks name."""
        validate.request_id(rid, call)
        validate.label(label, call, rid)
        with self._lock:
            targets = self._table.sharing.unkeyable(self._stepping.fork_targets)
            if any((rid, lb) in targets for lb in self._labels_of(label)):
                raise StepInFlightError(
                    f"{call} of a stream an admitted fork will still write into; "
                    "commit that step first (R57, S32)", request_id=rid, label=label)
            yield targets

    def cache_prefixes(self, calls: Sequence[tuple[str, str, Tokens, int]]) -> list[int]:
        """`cache_prefix` of each ``(request_id, label, token_ids, start)``, in
        order, under one acquisition of the lock; returns each call's count.

        For an engine that keys pages as they fill: one call per step naming
        the streams whose page just filled, ``start = cached_tokens(...)`` and
        the ids from there, not one call per page (issue 28). Every call is
        checked before any page is keyed (S31), so a misuse in one raises as
        `cache_prefix` would, naming its stream, and changes nothing; so does
        a stream named twice, or an entry that is not a 4-tuple.
        """
        with self._lock:
            stepping = self._stepping
            # only a staged preplan or a running step's copying forks name targets
            targets = self._table.sharing.unkeyable(stepping.fork_targets) if (
                stepping.preplan is not None or stepping.running is not None) else frozenset()
            if self._groups is None:
                return prefix_cache.cache_prefixes(self._table, calls, targets)
            return self._cache_prefixes_groups(calls, targets)

    def _cache_prefixes_groups(self, calls: Sequence[tuple[str, str, Tokens, int]],
                               targets: frozenset[tuple[str, str]]) -> list[int]:
        """`cache_prefixes` of a hybrid config: each call on each of its
        label's groups, all checked before any is keyed (S31, H1); each
        call's count summed over its groups."""
        if isinstance(calls, str | bytes) or not isinstance(calls, Sequence) or not all(
                isinstance(c, tuple) and len(c) == 4 and isinstance(c[1], str) for c in calls):
            # the general path names what is wrong with the batch
            return prefix_cache.cache_prefixes(self._table, calls, targets)
        n = len(self._labels_of("main"))
        got = prefix_cache.cache_prefixes(
            self._table, [(rid, lb, ids, start) for rid, label, ids, start in calls
                          for lb in self._labels_of(label)], targets)
        return [sum(got[i:i + n]) for i in range(0, len(got), n)]

    def follow_tokens(self, rid: str, token_ids: Sequence[int], label: str = "main") -> int:
        """Key the stream's pages as they fill, from ``token_ids``: the
        engine's own list of the stream's token ids, which it goes on
        extending as tokens are decided (S33). Returns what `cache_prefix` of
        the committed ids returns now.

        From this call until the request is removed, each `commit` that
        leaves the stream with full pages of committed tokens past its keyed
        ones keys them from ``token_ids``, as `cache_prefix` would, with no
        call from the engine: a step that fills no page costs one compare
        per stream, and vLLM's request hashes its blocks the same way, as
        tokens are appended. The list holds the tokens the engine kept: a
        page of committed tokens past its end (speculative drafts before
        their verify) is keyed by the first commit after the engine appended
        the kept ones, and ids past the committed tokens (the next step's
        input) are never read; a rejected draft is truncated from the stream
        only. A page whose ids are not 64-bit ints is left unkeyed and logged
        (the step is committed whatever its ids say). Calling it again hands
        over a new list. With the cache off, or for a label that registers
        nothing (W9), it keys nothing and follows nothing.

        Raises as `cache_prefix` does, changing nothing (ids that disagree
        with the stream's keyed pages included), and `InvalidArgumentError`
        for ``token_ids`` that is not a sequence (None, an iterator, an int,
        a ``str``, an array or tensor: the engine's list is read again at
        every commit).
        """
        with self._keyable(rid, label, "follow_tokens"):
            # the groups' streams agree (H1): a refusal is the first group's,
            # before any group follows
            return sum(follow.follow_tokens(self._table, rid, lb, token_ids)
                       for lb in self._labels_of(label))

    def cached_tokens(self, rid: str, label: str = "main") -> int:
        """Tokens of the stream its keyed pages cover: where a `cache_prefix`
        that names only new tokens starts."""
        validate.request_id(rid, "cached_tokens")
        validate.label(label, "cached_tokens", rid)
        with self._lock:
            return len(self._stream(rid, label).keys) * self.config.page_size

    def reset_prefix_cache(self) -> int | ResetRefused:
        """Forget every cached page (after a weight update); returns how many.

        Refused with `ResetRefused`, changing nothing, while any stream holds
        a page (S14): a partial reset would leave stale KV findable, or let
        streams go on keying pages computed before it. Refused too while any
        stream is offloaded or claimed for offload (S30,
        ``streams_offloaded``): a reload would bring back KV computed before
        the reset for `cache_prefix` to key. Drain, then retry.
        """
        return self._lifecycle.reset_prefix_cache()

    @property
    def num_cached_pages(self) -> int:
        """Free pages the prefix cache keeps findable; part of `num_free_pages`."""
        return self._pages.num_cached

    def _labels_of(self, label: str) -> tuple[str, ...]:
        """The streams ``label`` names: one per attention group (H1), or itself."""
        return (label,) if self._groups is None else self._groups.labels(label)

    # what the conformance and unit tests inspect: the stepping mechanism's state
    @property
    def _running(self) -> RunningStep | None:
        return self._stepping.running

    @_running.setter
    def _running(self, running: RunningStep | None) -> None:
        self._stepping.running = running

    @property
    def _preplan(self) -> StagedPreplan | None:
        return self._stepping.preplan

    @property
    def _current_plan_states(self) -> dict[str, KVPlanState]:
        return self._stepping.current_plan_states

    @_current_plan_states.setter
    def _current_plan_states(self, states: dict[str, KVPlanState]) -> None:
        self._stepping.current_plan_states = states

    @property
    def _static_plan_states(self) -> dict[tuple[int, str], KVPlanState]:
        return self._graph_staging.static_plan_states

    @property
    def _cg_max_seq_len(self) -> int:
        return self._graph_staging.max_seq_len

    # -- what attention layers call (the rest is `LayerIO`) -------------------

    def read_stream(self, rid: str, label: str = "main") -> torch.Tensor:
        """``[layers, stored_len, 2, H, D]``: a resident stream's tokens, for checks.

        A windowed stream (``KVConfig.retention``) answers its window only:
        ``[layers, min(stored_len, W), 2, H, D]``, the tokens ``max(0,
        stored_len - W) .. stored_len - 1`` (W1); what the window released,
        and the part of its first retained page before the window, is not
        returned.
        """
        validate.request_id(rid, "read_stream")
        validate.label(label, "read_stream", rid)
        with self._lock:
            stream = self._stream(rid, label)
            if stream.offloaded:
                raise StreamUnavailableError("read_stream: the stream is offloaded; reload it "
                                             "to read", request_id=rid, label=label)
            got = self.kv_cache.gather_stream(stream.page_indices,
                                              stream.stored_len - stream.released)
            # W1: from the first token the label still reads (0: full attention)
            first = self._table.behaviour(label).first_read(stream.stored_len)
            return got[:, first - stream.released:]

    # -- checks and teardown ---------------------------------------------------

    def observe(self) -> observation.KVObservation:
        """A read-only snapshot of the manager's state (`kvref.observation.KVObservation`).

        Every stream (length, position, page table, generation, in-flight
        mark, offload and retrieve state, tokens a window released, the ids
        its keyed pages were keyed with), every request's cache salt and
        extra keys, every device page (its holders, its prefix-cache key,
        held / free-cached / free-blank), the staged preplan and the lengths
        it was planned against, the offloads open, the leases held and the
        host pool's copies. Taken under
        the manager's lock, so it is one consistent state; frozen, and sharing
        no mutable object with the manager, so later calls do not change it.
        Costs a walk of every stream and page: for checks and debugging, not
        for every step. Changes nothing (an expired lease is dropped, as any
        call that reads the leases does).
        """
        with self._lock:
            return observation.take(self._table, self._pages, self._offloads, self._cpu_pool,
                                    self._stepping.preplan)

    def check(self) -> list[str]:
        """What is wrong with the device page pool's own structures, one line
        each; empty when they are consistent (a correct manager: always).

        What `observe` cannot show: each page held, free-cached or free-blank
        exactly once, the LRU list against its count, and the prefix cache's
        key index against the pages' keys (`PagePool.sanity_check`, which
        raises instead). With `observe`, all a check from outside needs.
        Changes nothing; walks every page, so for checks, not every step.
        """
        return self._pages.problems()

    @property
    def num_free_pages(self) -> int:
        """Pages an admit can take now: free ones, and cached ones no stream
        holds (evicted least recently used first when taken)."""
        return self._pages.num_free

    def post_warmup_validate(self) -> None:
        """Raise if tensor- or sequence-parallel ranks disagree on free pages.

        Catches a config that differs per rank (max_num_pages,
        cpu_offload_pages) and anything that took pages on one rank only
        before warmup returned. The all_gather synchronises, so no barrier.
        """
        check_free_pages_agree(self._comm_group, self._pages.num_free, self._device,
                               self.name, self._rank, cached=self._pages.num_cached)

    def cleanup(self) -> None:
        """Close the transfer engine's handles (shared memory, IPC)."""
        self._transfer.cleanup()

    # -- helpers -----------------------------------------------------------------

    def _request(self, rid: str) -> dict[str, CacheStream]:
        return self._table.request(rid)

    def _stream(self, rid: str, label: str) -> CacheStream:
        return self._table.stream(rid, label)
