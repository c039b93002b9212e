"""Runs a model action on a real `KVManager`, and reads the manager back abstractly.

The driver is the one place that knows how a model action maps onto kvref's
API (`apply`) and how kvref's state maps onto the model's (`abstract`). It
reads the manager only through its public calls and `KVManager.observe`,
and injects faults only through the runtime it builds the manager with
(`ManualRuntime.failing`), so a manager that wraps `KVManager` rather than
subclassing it is driven as well.
Everything the lockstep tests compare goes through these two functions, so
a disagreement is either a kvref bug, a model bug, or a bug here — and the
failing rule sequence says which action it was.

Token values: the model tracks, per stored position, which label first wrote
it (retrieved tokens get ``labels + label``). The driver writes
``value(writer, token, position)`` into every K and V element of that slot,
so reading a stream back through its pages checks content (I7). The writer
is the request with sharing off, so the value also checks isolation between
requests (I8); with sharing on it is the request's salt group, since a page
another request of that salt computed and `match_prefix` attached holds
that request's bytes for the same tokens, legitimately (and the token
identity names the label, so a write into a page another label's stream
holds still reads back wrong there).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvref import (
    SINK_PAGE,
    AdmitOutcome,
    HostPoolView,
    KVConfig,
    KVManager,
    KVObservation,
    KVPlanOutputs,
    KVRefError,
    KVReqConfig,
    KVStep,
    Offload,
    OffloadOutcome,
    OffloadReason,
    OffloadState,
    PreplanStaleError,
    PublishedKVInfo,
    PublishRefused,
    ReloadOutcome,
    ReloadReason,
    ResetRefused,
    RetentionPolicy,
    RetrieveState,
    Segment,
    StepContext,
    TransferEngineInfo,
)
from kvref.core.page_keys import key_hash_named, next_page_key, token_bytes
from kvref.testing import observed_state, plan_oracle
from kvref.testing.group_map import GroupMap
from kvref.testing.manual_runtime import ManualRuntime
from kvref.testing.page_checks import check_device_pages
from kvref_model import core as m
from kvref_model import pages as pool_model

if TYPE_CHECKING:  # the offload handle's protocol names it; kvref exports none
    from kvref.core.streams import ClaimedStream


class ManagerUnderTest(Protocol):
    """What the harness calls on the manager it tests: `KVManager`'s public
    calls that the driver issues, and `KVManager.observe`, its one read of
    state. A manager that subclasses `KVManager`, or wraps one and forwards
    these, can be driven; nothing private is read."""

    def ingest_request(self, rid: str, overrides: KVReqConfig | None = None) -> None: ...
    def has_request(self, rid: str) -> bool: ...
    def admit(self, step: KVStep, ctx: StepContext) -> AdmitOutcome: ...
    def plan(self, step: KVStep, ctx: StepContext) -> KVPlanOutputs: ...
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int | None = None,
                 label: str | None = None, return_tensor: bool = False) -> Any: ...
    def read_kv(self, layer_idx: int | None = None,
                plan_label: str | None = None) -> torch.Tensor: ...
    def commit(self, step: KVStep, ctx: StepContext) -> None: ...
    def clear_preplan(self) -> None: ...
    def begin_offload(self, rid: str) -> Offload | None: ...
    def offload_outcome(self, rid: str) -> OffloadOutcome: ...
    def reload(self, rid: str) -> bool: ...
    def reload_outcome(self, rid: str) -> ReloadOutcome: ...
    def reload_pages_needed(self, rid: str) -> int: ...
    def get_offload_priority(self, rid: str) -> float: ...
    def host_pool(self) -> HostPoolView: ...
    def publish(self, request_id: str) -> PublishedKVInfo | PublishRefused: ...
    def release_published(self, request_id: str) -> None: ...
    def admit_retrieve(self, rid: str, node_name: str | None = None,
                       graph_walk: str | None = None,
                       published: PublishedKVInfo | None = None) -> AdmitOutcome: ...
    def reset_request(self, rid: str, free: bool = False) -> None: ...
    def remove_request(self, rid: str) -> None: ...
    def truncate(self, rid: str, label: str, new_len: int) -> int: ...
    def read_stream(self, rid: str, label: str = "main") -> torch.Tensor: ...
    def layer_view(self, layer_idx: int | None = None) -> torch.Tensor: ...
    def cache_prefix(self, rid: str, label: str, token_ids: Sequence[int],
                     start: int = 0) -> int: ...
    def follow_tokens(self, rid: str, token_ids: Sequence[int], label: str = "main"
                      ) -> int: ...
    def match_prefix(self, rid: str, label: str, token_ids: Sequence[int]) -> int: ...
    def reset_prefix_cache(self) -> int | ResetRefused: ...
    def reclaimable(self, rid: str) -> int: ...
    @property
    def num_free_pages(self) -> int: ...
    def observe(self) -> KVObservation: ...
    def check(self) -> list[str]: ...


ManagerFactory = Callable[..., ManagerUnderTest]


def label_name(label: int) -> str:
    return m.LABEL_NAMES[label]


def rid_name(rid: int) -> str:
    return f"r{rid}"


def engine_id(token: int, position: int) -> int:
    """The id the engine names for the token of identity ``token`` (the
    label that computed it, `kvref_model.core.Stream.contents`) at
    ``position``: ids differ along a stream, so a check that reads the ids
    or keyed tokens of one page for another's (cache_prefix's ``start``)
    sees other ids. A page's key chains over every page before it, so two
    pages are keyed alike in kvref exactly when the model keys them alike."""
    return token * 4096 + position


def request_keys(salt: str) -> tuple[str | None, tuple[tuple[str, str], ...]]:
    """kvref's ``(cache_salt, extra_keys)`` for a model salt, which stands for
    the whole tuple (S25): its ``+``-separated parts, ``tag=value`` a typed
    extra key (a LoRA adapter, a multimodal hash), any other the cache salt;
    "" neither. So a scope draws requests told apart by extra keys alone."""
    parts = [p for p in salt.split("+") if p]
    extra = tuple((t, v) for t, _, v in (p.partition("=") for p in parts if "=" in p))
    bare = [p for p in parts if "=" not in p]
    return (bare[0] if bare else None), extra


def value(writer: int, token: int, position: int) -> float:
    """Exact in float32 and bf16-distinguishable for the small scopes used here."""
    return float(writer * 4096 + token * 256 + position + 1)


def writer_of(scope: m.Scope, rid: int) -> int:
    """Whose bytes a position of ``rid`` holds: its own with sharing off;
    with sharing on its salt group's (the first request of its salt), since
    the prefix cache lets requests of one salt share the pages of the same
    tokens, and no others."""
    if not scope.sharing:
        return rid
    if not scope.salts:
        return 0
    return scope.salts.index(scope.salts[rid])


def default_factory(**kwargs: Any) -> ManagerUnderTest:
    return KVManager(**kwargs)


@dataclass
class DriverConfig:
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    factory: ManagerFactory = default_factory
    # called with the manager, the step and its context before each admit
    # the driver issues: kvref's own tests hold admission's fast path to the
    # general rules there (tests/support/admission_check.py)
    before_admit: Callable[[ManagerUnderTest, KVStep, StepContext], None] | None = None
    # `KVConfig.page_key_hash` of the manager under test: the model's keys
    # are abstract, so every hash must pass the same lockstep
    page_key_hash: str = "sha256"
    # a request ingested anew takes the id a removed request went by, the
    # most recently freed first (as an engine reusing its ids does), so a
    # request's config left behind by remove_request is found: the model's
    # requests have fixed salts, kvref's ids then do not
    reuse_ids: bool = True
    # the key kvref gives a page (None: not checked): each keyed page's key
    # is compared with the one its model key names, hashed as S25 and
    # kvref.core.page_keys say (salt, extra keys, label; the ids of
    # `engine_id`). A manager keying otherwise passes its own, or None
    page_key: Callable[[bytes | None, bytes, tuple[tuple[str, Any], ...]], bytes] | None = (
        next_page_key)


# the KVRefError kinds an injected fault surfaces as: a fault, not a misuse
FAULTS = frozenset({"ForkCopyError", "ReloadCopyError", "OffloadCopyError"})
# refusal reasons that latch on the stream: the model's `Latched`, not `Refused`
LATCHED = frozenset({"RetrieveStale", "RetrieveAborted"})
# how far LeaseTimeout moves the clock: past every deadline taken so far
LEASE_S = 60.0


OFFLOAD_STATE = {OffloadState.RESIDENT: m.RESIDENT, OffloadState.CLAIMED: m.CLAIMED,
                 OffloadState.OFFLOADED: m.OFFLOADED}
RETRIEVE_STATE = {RetrieveState.IDLE: m.IDLE, RetrieveState.PENDING: m.PENDING,
                  RetrieveState.FAILED: m.FAILED}


class NeverOpened:
    """The phases of an `Offload` handle the manager never opened: a closed
    handle refuses every phase itself, so none of these is ever reached."""

    def wait(self, futures: Sequence[Future[Any]]) -> None:
        raise AssertionError("a closed offload handle waited")

    def copy_to_host(self, offload: Offload, claim: ClaimedStream) -> OffloadReason | None:
        raise AssertionError("a closed offload handle copied")

    def commit(self, offload: Offload, claims: Mapping[str, ClaimedStream],
               copied: Sequence[str]) -> OffloadOutcome:
        raise AssertionError("a closed offload handle committed")

    def abandon(self, offload: Offload, labels: Sequence[str]) -> None:
        assert not labels, "a handle that claimed nothing abandoned a claim"


class Driver:
    """A kvref manager plus what the test holds between calls (plans, offload handles)."""

    def __init__(self, scope: m.Scope, config: DriverConfig | None = None) -> None:
        self.scope = scope
        # the counts the model states, such as the pages a reload that shares
        # cached pages again takes (`reload_need`, S29)
        self.model = m.Model(scope)
        self.config = config or DriverConfig()
        self.runtime = ManualRuntime()
        # model internal labels and token identities against kvref's stream
        # labels: a hybrid scope's groups (the identity without groups)
        self.groups = GroupMap(scope)
        self.cfg = KVConfig(
            num_layers=self.groups.num_layers, num_kv_heads=1, head_dim=2, max_seq_len=256,
            max_num_pages=scope.device_pages + 1,  # + the sink
            page_size=scope.page_size, num_qo_heads=1,
            cpu_offload_pages=scope.host_pages, publish_lease_s=LEASE_S,
            enable_prefix_caching=scope.sharing,
            # each windowed label of the scope, with its rollback margin
            retention={label_name(i): RetentionPolicy(w, scope.margin(i))
                       for i, w in enumerate(scope.windows) if w is not None},
            page_key_hash=self.config.page_key_hash,
            groups=self.groups.attention_groups(),
        )
        self.kv = self.config.factory(
            cfg=self.cfg, name="kv", joint_comm_group=None,
            transfer_engine_info=TransferEngineInfo(), device=self.config.device,
            dtype=self.config.dtype, runtime=self.runtime,
        )
        # the running step (admitted, maybe planned) and the staged preplan, each
        # as (model step, kvref step, ctx): an admit of the same model step
        # hands kvref the very step it admitted, as an engine retrying would
        self.step: tuple[m.Step, KVStep, StepContext] | None = None
        self.outputs: KVPlanOutputs | None = None
        self.written: dict[str, torch.Tensor] = {}  # plan label -> K/V last written
        # plan label -> rows of the last plan, kept past its step: the shape a
        # careless engine's late write has
        self.last_rows: dict[str, int] = {}
        self.staged: tuple[m.Step, KVStep, StepContext] | None = None
        self.offloads: dict[int, Offload] = {}
        self.closed: dict[int, Offload] = {}  # the last handle of each request, closed
        self.sources: list[KVManager] = []  # publishers of retrieves, kept alive
        # the publisher each running copy reads (by its future):
        # RetrieveComplete(moved) changes it while the copy reads
        self.source_of: dict[Future[Any], KVManager] = {}
        self.last_source: KVManager | None = None
        self.combine = False  # the next admitted step plans its labels combined
        # the typed reason kvref gave for the last action's refusal (a claim or a
        # reload), checked against the model's state by `check_queries`
        self.said: tuple[int, OffloadReason | ReloadReason | None, int] | None = None
        # (rid, label) -> the future of the last retrieve started into it: the
        # task the manager submitted to our runtime (RetrieveComplete runs it)
        self.retrieves: dict[tuple[int, int], list[Future[Any]]] = {}
        self.model_state: m.State | None = None  # what `apply` was handed
        # (rid, label) -> the list handed to `follow_tokens` (S33), kept and
        # extended in place as the engine's own list is
        self.followed: dict[tuple[int, int], list[int]] = {}
        self.model = m.Model(scope)  # its pool answers what a claim would free
        # model request -> the id kvref knows it by while it lives; ids freed
        # by a remove, oldest first (`DriverConfig.reuse_ids`)
        self.names: dict[int, str] = {}
        self.freed: list[str] = []
        self.went_by: dict[str, int] = {}  # id -> the model request it named last
        self.kv_keys: dict[pool_model.Key, bytes] = {}  # `kv_key`'s answers

    # -- model action -> kvref call -> model result ------------------------------

    def apply(self, action: m.Action, state: m.State | None = None) -> m.Result:
        """Run ``action`` on kvref; ``state``: the model's state it runs from,
        which a `CachePrefix` needs (the ids of the tokens the stream holds
        are the engine's knowledge, kept by the model here)."""
        handler = getattr(self, "_" + type(action).__name__)
        self.said = None
        self.publication: tuple[int, PublishedKVInfo] | None = None
        self.model_state = state
        try:
            result: m.Result = handler(action)
        except KVRefError as err:
            kind = type(err).__name__
            return m.Fault(kind) if kind in FAULTS else m.Misuse(kind)
        return result

    def name(self, rid: int) -> str:
        """kvref's id of model request ``rid``: the one it was ingested under
        while it lives, else one no live request goes by (a careless call
        on a request that is gone must not reach another)."""
        got = self.names.get(rid)
        if got is not None:
            return got
        live = set(self.names.values())
        ids = itertools.chain((rid_name(rid),), (f"r{rid}.{k}" for k in itertools.count()))
        return next(n for n in ids if n not in live)

    def rid_of(self, name: str) -> int:
        """The model request kvref's id ``name`` stands for."""
        for rid, n in self.names.items():
            if n == name:
                return rid
        # a snapshot taken before its remove: the request it went by last
        assert name in self.went_by, f"kvref holds request {name!r}, never ingested here"
        return self.went_by[name]

    def _Ingest(self, a: m.Ingest) -> m.Result:
        salt, extra = request_keys(self.scope.salts[a.rid] if self.scope.salts else "")
        # a retrieve names one label through the walk, so readiness is that
        # label's (each of its groups' streams, H1)
        overrides = KVReqConfig(labels={("node", label_name(i)): self.groups.streams(i)
                                        for i in range(self.scope.labels)},
                                cache_salt=salt, extra_keys=extra)
        name = self.names.get(a.rid)
        if name is None:
            live = set(self.names.values())
            reuse = [n for n in self.freed if n not in live] if self.config.reuse_ids else []
            # one another request went by first: a config left behind then
            # shows as another tenant's salt and extra keys
            other = [n for n in reuse if self.went_by.get(n) != a.rid]
            name = (other or reuse)[-1] if reuse else self.name(a.rid)
        self.kv.ingest_request(name, overrides)
        self.names[a.rid] = name
        self.went_by[name] = a.rid
        return m.Ok()

    def to_kvref(self, step: m.Step, combine: bool = False) -> tuple[KVStep, StepContext]:
        """The kvref step; ``combine`` plans all its labels as one batch.

        Combining is invisible to the model (it changes which plan label
        attention writes under, not what lands where), so it is the driver's
        choice, and the byte checks are what say it was done right.
        """
        labels = tuple(dict.fromkeys(label_name(g.label) for g in step.segments))
        kv_step = KVStep(
            segments=[Segment(self.name(g.rid), label_name(g.label), g.span)
                      for g in step.segments],
            commit=step.commit,
            pre_forks=[(label_name(f), label_name(t)) for f, t in step.pre_forks],
            post_forks=[(label_name(f), label_name(t)) for f, t in step.post_forks],
            combined_labels=[labels] if combine and len(labels) > 1 else [],
        )
        return kv_step, StepContext(padded_request_ids=[self.name(r) for r in step.padded])

    # a step no engine admitted: what a careless plan or commit hands in
    STRAY = KVStep(segments=[Segment("r0", "main", 1)])

    def _Admit(self, a: m.Admit) -> m.Result:
        held = self.staged if self.staged is not None else self.step
        if held is not None and held[0] == a.step:
            _, step, ctx = held  # the same step again, as the engine admitted it
            ctx = StepContext(ctx.padded_request_ids, is_preplan=a.preplan)
        else:
            step, ctx = self.to_kvref(a.step, self.combine)
            ctx = StepContext(ctx.padded_request_ids, is_preplan=a.preplan)
        if self.config.before_admit is not None:
            self.config.before_admit(self.kv, step, ctx)
        out = self.kv.admit(step, ctx)
        if out.ok and self.staged is None and not (self.step and not a.preplan):
            if a.preplan:
                self.staged = (a.step, step, ctx)
            else:
                self.step = (a.step, step, ctx)
        return outcome(out)

    def _Plan(self, a: m.Plan) -> m.Result:
        with self.copy_fault(a.fork_error):
            if a.preplan:
                if self.staged is None:
                    self.kv.plan(self.STRAY, StepContext(["r0"], is_preplan=True))
                else:
                    self.kv.plan(self.staged[1], self.staged[2])
                return m.Ok()
            if self.step is None and self.staged is not None:
                # promotion of the staged preplan: from here it is the running
                # step, unless kvref refused it as stale (R42: nothing moved)
                mstep, step, ctx = self.staged
                promoted = (mstep, step, StepContext(ctx.padded_request_ids))
                try:
                    self.outputs = self.kv.plan(promoted[1], promoted[2])
                except PreplanStaleError:
                    raise
                except KVRefError:
                    self.step, self.staged = promoted, None
                    raise
                self.step, self.staged = promoted, None
            elif self.step is None:
                self.kv.plan(self.STRAY, StepContext(["r0"]))
                return m.Ok()
            else:
                self.outputs = self.kv.plan(self.step[1], self.step[2])
                # a kept table's row left stale shows here, before any write
                wrong = plan_oracle.mismatch(self.kv, self.groups.expand(self.step[1]),
                                             self.outputs)
                assert wrong is None, f"plan differs from its tables built from scratch: {wrong}"
            self.written = {}
            self.last_rows = {label: sum(v.to_compute for v in out.views)
                              for label, out in self.outputs.items()}
            return m.Ok()

    def _Write(self, a: m.Write) -> m.Result:
        if self.outputs is None:
            # no slots to write: a late write, shaped as the last plan's, must
            # be refused rather than land in its stale slots (R27)
            for plan_label, n_rows in (self.last_rows or {"main": 1}).items():
                junk = torch.ones(n_rows, self.cfg.num_kv_heads, self.cfg.head_dim)
                junk = junk.to(self.config.device, self.config.dtype)
                self.kv.write_kv(junk, junk, layer_idx=self.groups.layers(
                    self.groups.group(plan_label))[0], label=self.groups.user(plan_label))
            return m.Ok()
        for plan_label, out in self.outputs.items():
            rows: list[float] = []
            for view in out.views:
                writer = writer_of(self.scope, self.rid_of(view.request_id))
                token = self.groups.token_of_view(view.label)
                # a windowed view counts from its first retained page (W1):
                # ``offset`` tokens in, so the positions written are past it
                end = view.offset + view.length
                rows += [value(writer, token, p) for p in range(end - view.to_compute, end)]
            shape = (len(rows), self.cfg.num_kv_heads, self.cfg.head_dim)
            kv = torch.tensor(rows, dtype=torch.float32).view(-1, 1, 1).expand(shape)
            kv = kv.to(self.config.device, self.config.dtype)
            # a group's plan label is written through its layers, under the
            # label the engine names (the layer picks the group)
            for layer in self.groups.layers(self.groups.group(plan_label)):
                self.kv.write_kv(kv, kv, layer_idx=layer, label=self.groups.user(plan_label))
            self.written[plan_label] = kv
        return m.Ok()

    def _Read(self, a: m.Read) -> m.Result:
        if self.outputs is None:
            for plan_label in self.last_rows or {"main": 1}:
                self.kv.read_kv(layer_idx=self.groups.layers(self.groups.group(plan_label))[0],
                                plan_label=self.groups.user(plan_label))
            return m.Ok()
        for plan_label in self.outputs:
            got = self.kv.read_kv(layer_idx=self.groups.layers(self.groups.group(plan_label))[-1],
                                  plan_label=self.groups.user(plan_label))
            want = self.written.get(plan_label)
            if want is not None:
                # what attention reads back is what it wrote, K and V
                assert torch.equal(got[:, 0], want) and torch.equal(got[:, 1], want), (
                    f"read_kv of {plan_label!r} differs from what write_kv wrote")
        return m.Ok()

    def _Commit(self, a: m.Commit) -> m.Result:
        self.follow_ids(a)
        held, self.outputs, self.written = self.step, None, {}
        with self.copy_fault(a.fork_error):
            if held is None:
                staged = self.staged
                step, ctx = (staged[1], staged[2]) if staged else (self.STRAY, StepContext())
                self.kv.commit(step, ctx)
                return m.Ok()
            self.step = None
            self.kv.commit(held[1], held[2])
        return m.Ok()

    def _ClearPreplan(self, a: m.ClearPreplan) -> m.Result:
        self.kv.clear_preplan()
        self.staged = None
        return m.Ok()

    @contextlib.contextmanager
    def copy_fault(self, on: bool) -> Iterator[None]:
        """With ``on``, the next page copy of the cache (a fork's) raises."""
        if not on:
            yield
            return
        with self.runtime.failing("fork.copy", once=True):
            yield

    def handle(self, rid: int) -> Offload:
        """The request's open offload handle, else its last closed one (a careless
        engine's stale handle), else a handle that was never open."""
        off = self.offloads.get(rid) or self.closed.get(rid)
        if off is None:
            off = self.closed[rid] = Offload(NeverOpened(), self.name(rid), [], {})
            off.abandon()
        return off

    def close(self, rid: int) -> None:
        off = self.offloads.pop(rid, None)
        if off is not None:
            self.closed[rid] = off

    def _OffloadClaim(self, a: m.OffloadClaim) -> m.Result:
        off = self.kv.begin_offload(self.name(a.rid))
        if off is None:
            # a refused claim changes nothing, so the typed call refuses too, and why
            out = self.kv.offload_outcome(self.name(a.rid))
            assert out.pages_freed == 0 and not out.moved, f"refused claim, then {out}"
            self.said = (a.rid, out.reason, 0)
            return m.Claimed(())
        self.offloads[a.rid] = off
        # a label is claimed where any of its groups is (H1: a claim answers per label)
        return m.Claimed(tuple(sorted({m.LABEL_NAMES.index(self.groups.user(n))
                                       for n in off.labels})))

    def _OffloadCopy(self, a: m.OffloadCopy) -> m.Result:
        """An engine's copy of a label: each of its groups' streams in turn
        (H1); the host pool full for one leaves that one on the device and
        the label's copy answers False; an injected fault strikes the last."""
        off = self.handle(a.rid)
        # its claimed groups (a chunk at its start holds no page, so a claim
        # leaves it out, H7); none claimed: every one, and the first refuses
        streams = [n for n in self.groups.streams(a.label) if n in off.claims] or list(
            self.groups.streams(a.label))
        copied = True
        for i, label in enumerate(streams):
            if a.copy_error and i == len(streams) - 1:
                try:
                    # no copy runs when the host is full, and then nothing can fail
                    with self.runtime.failing("offload.copy"):
                        copied = off.copy(label) and copied
                except KVRefError as err:
                    if type(err).__name__ in FAULTS:
                        self.close(a.rid)
                    raise
            else:
                copied = off.copy(label) and copied
        return m.Flag(copied)

    def _OffloadCommit(self, a: m.OffloadCommit) -> m.Result:
        off = self.handle(a.rid)
        self.close(a.rid)
        return m.Freed(off.commit())

    def _OffloadAbandon(self, a: m.OffloadAbandon) -> m.Result:
        off = self.handle(a.rid)
        self.close(a.rid)
        off.abandon()
        return m.Ok()

    def _Reload(self, a: m.Reload) -> m.Result:
        # a copy fault is issued only where host copies exist (a host pool);
        # without one no copy runs, so none fails
        with (self.runtime.failing("reload.copy") if a.copy_error
              else contextlib.nullcontext()):
            reloaded = self.kv.reload(self.name(a.rid))
        if not reloaded:
            # a refused reload changes nothing, so the typed call refuses too, and why
            out = self.kv.reload_outcome(self.name(a.rid))
            assert not out.reloaded and out.pages_taken == 0, f"refused reload, then {out}"
            self.said = (a.rid, out.reason, out.pages_short)
        return m.Flag(reloaded)

    def _Publish(self, a: m.Publish) -> m.Result:
        info = self.kv.publish(self.name(a.rid))
        if isinstance(info, PublishRefused):
            return m.Refused(type(info.reason).__name__)
        self.publication = (a.rid, info)  # what the peer reads: `check_publication`
        return m.Published(tuple(sorted(
            (m.LABEL_NAMES.index(label), s.seq_len) for label, s in info.get(0).items()
            if self.groups.is_first(label)  # a label's groups agree (I30)
        )))

    def _ReleasePublished(self, a: m.ReleasePublished) -> m.Result:
        self.kv.release_published(self.name(a.rid))
        return m.Ok()

    def _LeaseTimeout(self, a: m.LeaseTimeout) -> m.Result:
        self.runtime.advance(LEASE_S)
        return m.Ok()

    def published(self, a: m.RetrieveStart) -> PublishedKVInfo | None:
        """What the engine hands `admit_retrieve`: None for length 0 (nothing
        published); for a stale one, a publication whose source then moved on
        (released, and reset: its generation bumped, as a reuse would)."""
        if not a.length:
            return None
        rid = self.name(a.rid)
        src = self.publisher(a.rid, a.label, a.length)
        info = src.publish(rid)
        assert isinstance(info, PublishedKVInfo), info
        self.last_source = src
        if a.stale:
            src.release_published(rid)
            src.reset_request(rid)
        return info

    def _RetrieveStart(self, a: m.RetrieveStart) -> m.Result:
        rid, label = self.name(a.rid), label_name(a.label)
        self.last_source = None
        info = self.published(a)
        # the copy the manager starts is a task submitted to our runtime
        before = {id(t.future) for t in self.runtime.pending}
        # the transfer engine raises at the first copy's start, or (late) at
        # the label's last group's, once the groups before it started theirs:
        # kvref latches every group failed then (H1, `Retrieval._refuse_start`)
        after = self.groups.g - 1 if a.late else 0
        with (self.runtime.failing("retrieve.start", once=True, after=after) if a.start_error
              else contextlib.nullcontext()):
            out = outcome(self.kv.admit_retrieve(rid, "node", label, info))
        started = [t.future for t in self.runtime.pending if id(t.future) not in before]
        assert len(started) <= self.groups.g, (
            f"one retrieve into {rid}/{label} started {len(started)} copies")
        if started:
            self.retrieves[(a.rid, a.label)] = started
        for future in started:
            if future not in self.source_of and self.last_source:
                self.source_of[future] = self.last_source  # this call started that copy
        return out

    def publisher(self, rid: int, label: int, length: int) -> KVManager:
        """Another manager holding ``length`` retrieved tokens of (rid, label)."""
        cfg = KVConfig(
            num_layers=self.cfg.num_layers, num_kv_heads=self.cfg.num_kv_heads,
            head_dim=self.cfg.head_dim, max_seq_len=256,
            max_num_pages=self.groups.g * -(-length // self.scope.page_size) + 2,
            page_size=self.scope.page_size, num_qo_heads=1,
            # a hybrid peer: the same groups, each published as its own stream
            groups=self.cfg.groups,
        )
        src = KVManager(cfg, "publisher", None, TransferEngineInfo(), self.config.device,
                        dtype=self.config.dtype, runtime=self.runtime)
        name = label_name(label)
        src.ingest_request(self.name(rid))
        step = KVStep([Segment(self.name(rid), name, length)])
        ctx = StepContext([self.name(rid)])
        assert src.admit(step, ctx).ok
        src.plan(step, ctx)
        writer = writer_of(self.scope, rid)
        for g, stream in enumerate(self.groups.streams(label)):
            # a peer's token of group g: identity nlab + its internal label
            token = self.groups.nlab + self.groups.internal(stream)
            rows = torch.tensor([value(writer, token, p) for p in range(length)])
            kv = rows.view(-1, 1, 1).expand(length, 1, cfg.head_dim).to(self.config.dtype)
            for layer in self.groups.layers(g):
                src.write_kv(kv.to(self.config.device), kv.to(self.config.device),
                             layer_idx=layer, label=name)
        src.commit(step, ctx)
        self.sources.append(src)
        return src

    def _RetrieveComplete(self, a: m.RetrieveComplete) -> m.Result:
        # the model issues this only while its retrieve is pending, and
        # `abstract` has checked that kvref's stream says pending too
        futures = self.retrieves[(a.rid, a.label)]
        if not a.moved:
            for future in futures:  # every group's copy (H1)
                self.runtime.complete(future, ok=a.ok)
            return m.Ok()
        # the publisher moves between the copy's two reads of its generation:
        # its lease released (a buggy peer, or expired), then reset, as a reuse
        # of its pages would; only the read after the copy can see it (R35).
        # The transfer passes the "retrieve.copied" checkpoint right there
        rid = self.name(a.rid)
        src = self.source_of.pop(futures[0])
        for future in futures[1:]:
            self.source_of.pop(future, None)

        def move() -> None:
            src.release_published(rid)
            src.reset_request(rid)

        with self.runtime.at_checkpoint("retrieve.copied", move):
            for future in futures:
                self.runtime.complete(future, ok=a.ok)
        return m.Ok()

    def _Reset(self, a: m.Reset) -> m.Result:
        self.kv.reset_request(self.name(a.rid), free=a.free)
        return m.Ok()

    def _Remove(self, a: m.Remove) -> m.Result:
        name = self.name(a.rid)
        self.kv.remove_request(name)
        if a.rid in self.names and not self.kv.has_request(name):
            del self.names[a.rid]
            self.freed = [n for n in self.freed if n != name] + [name]
        off = self.offloads.get(a.rid)
        if off is not None and not self.kv.has_request(name):
            # the model forgets an offload whose request was removed; kvref's
            # handle is still open and finds nothing left to undo
            off.abandon()
            self.close(a.rid)
        return m.Ok()

    def _Truncate(self, a: m.Truncate) -> m.Result:
        return m.Freed(self.kv.truncate(self.name(a.rid), label_name(a.label), a.new_len))

    # -- the prefix cache (Scope.sharing) ----------------------------------------

    def engine_ids(self, s: m.State, key: m.Key) -> list[int]:
        """The ids of the tokens the stream committed, as a careful engine names
        them: up to its first page no write filled, whose KV nobody computed
        (the model keys no further, and kvref cannot know it was not written)."""
        v = s.stream_map().get(key)
        tokens = list(v.contents) if v is not None else []
        if m.UNWRITTEN in tokens:
            ps = self.scope.page_size
            tokens = tokens[: tokens.index(m.UNWRITTEN) // ps * ps]
        return [engine_id(self.groups.user_token(t), p) for p, t in enumerate(tokens)]

    def _CachePrefix(self, a: m.CachePrefix) -> m.Result:
        assert self.model_state is not None, "CachePrefix needs the model's state: apply(a, s)"
        ids = self.engine_ids(self.model_state, (a.rid, a.label * self.groups.g))
        # a careless engine's draft ids, past the committed
        ids += [engine_id(a.label, len(ids) + i) for i in range(a.drafts)]
        ps = self.scope.page_size
        if a.start > 0 and not a.drafts:
            # from ``start`` (S34), as an engine keying pages as they fill
            # names them: the full pages from there, no partial one (the
            # one-page call then takes kvref's one-pass path)
            ids = ids[a.start: max(a.start, len(ids) // ps * ps)]
        elif a.start > 0:
            ids = ids[a.start:]
        elif not a.drafts and len(ids) >= ps and not getattr(
                self.model_state.stream_map().get((a.rid, a.label * self.groups.g)),
                "chain", 0):
            # a stream's first pages, named the same way: with every id, a
            # first page that filled took the general path, so a tenant whose
            # one-page keying dropped its extra keys was met under 8 seeds
            # of 10 (issue 41). A re-key from token 0 still hands every id,
            # the partial page's too, which kvref leaves unkeyed
            ids = ids[: len(ids) // ps * ps]
        return m.Count(self.kv.cache_prefix(self.name(a.rid), label_name(a.label), ids,
                                            a.start))

    def _FollowTokens(self, a: m.FollowTokens) -> m.Result:
        # the engine's own list, handed over once and extended in place from
        # then on (`follow_ids`), as an engine appends to its request's ids
        assert self.model_state is not None, "FollowTokens needs the model's state"
        ids = self.followed.setdefault((a.rid, a.label), [])
        ids[:] = self.engine_ids(self.model_state, (a.rid, a.label * self.groups.g))
        return m.Count(self.kv.follow_tokens(self.name(a.rid), ids, label_name(a.label)))

    def follow_ids(self, a: m.Action) -> None:
        """Before a commit: each list handed to `follow_tokens` holds the ids
        of the tokens its stream holds once the commit lands (the model's
        state after it), as an engine's list holds a step's input ids."""
        if not self.followed or self.model_state is None:
            return
        _, after = self.model.step(self.model_state, a)
        for (rid, label), ids in self.followed.items():
            ids[:] = self.engine_ids(after, (rid, label * self.groups.g))

    def _MatchPrefix(self, a: m.MatchPrefix) -> m.Result:
        # the ids of a prompt of the label's own tokens (a token's identity is
        # the label that computes it)
        ids = [engine_id(a.label, p) for p in range(a.length)]
        return m.Count(self.kv.match_prefix(self.name(a.rid), label_name(a.label), ids))

    def _ResetPrefixCache(self, a: m.ResetPrefixCache) -> m.Result:
        got = self.kv.reset_prefix_cache()
        if isinstance(got, ResetRefused):
            if got.streams_offloaded:  # a host copy holds pre-reset KV (S30)
                return m.Refused("RequestOffloading")
            return m.Refused("ResetRefused", got.pages_held)
        return m.Count(got)

    def _NumFree(self, a: m.NumFree) -> m.Result:
        return m.Count(self.kv.num_free_pages)

    def _Reclaimable(self, a: m.Reclaimable) -> m.Result:
        return m.Count(self.kv.reclaimable(self.name(a.rid)))

    # -- kvref state -> model state ---------------------------------------------

    def cache_bytes(self) -> torch.Tensor:
        """A copy of the whole cache, ``[layers, pages, ...]``, read through
        `layer_view` (what attention reads): what I8 and I10 compare."""
        return torch.stack([self.kv.layer_view(i) for i in range(self.cfg.num_layers)])

    def observe(self) -> KVObservation:
        """The manager's state, through its one read-only call. Read between
        calls, as every check here is; each check takes a fresh one unless
        handed the one its caller took after the same call (``seen``)."""
        seen = self.kv.observe()
        assert isinstance(seen, KVObservation), f"observe() answered {type(seen).__name__}"
        return seen

    def abstract(self, model_state: m.State, seen: KVObservation | None = None) -> m.State:
        """kvref's state in the model's terms.

        Contents are taken from the model (the cache bytes are checked against
        them separately, in `check_bytes`); the running and staged steps are the
        test's own bookkeeping, so they are taken from the model as well.
        """
        kv = self.kv
        seen = seen if seen is not None else self.observe()
        contents = model_state.stream_map()
        streams: dict[m.Key, m.Stream] = {}
        for s in seen.streams():
            key = (self.rid_of(s.request_id), self.groups.internal(s.label))
            known = contents.get(key)
            streams[key] = m.Stream(
                pages=len(s.pages), stored_len=s.stored_len,
                contents=known.contents if known is not None else (),
                in_flight=s.in_flight, offload=OFFLOAD_STATE[s.offload],
                retrieve=RETRIEVE_STATE[s.retrieve], chain=s.keyed_pages,
                followed=s.followed,
            )
        host = []
        for c in seen.host.copies if seen.host is not None else ():
            key = (self.rid_of(c.request_id), self.groups.internal(c.label))
            host.append((key, dict(model_state.host).get(key, ())))
        offloads = []
        for rname in seen.offloads:
            rid = self.rid_of(rname)
            mine = model_state.offload_of(rid)
            offloads.append((rid, mine if mine is not None else m.Offload(())))
        leases = tuple(sorted(self.rid_of(r) for r in seen.leases))
        return m.State(
            free=kv.num_free_pages, streams=tuple(sorted(streams.items())),
            host=tuple(sorted(host)), current=model_state.current, staged=model_state.staged,
            offloads=tuple(sorted(offloads)), leases=leases,
        )

    def check_queries(self, model_state: m.State) -> None:
        """The engine's queries (offload priority, reload pages, host pool) and
        the last refusal's typed reason, against the model's state (R44-R46)."""
        kv, ps = self.kv, self.scope.page_size
        model = m.Model(self.scope)

        for rid in range(self.scope.requests):
            open_offload = model_state.offload_of(rid) is not None
            copies = [c for k, c in model_state.host if k[0] == rid]
            # the pages a claim would free; 0 when refused or freeing none (R45)
            claimable = model.offload_priority(model_state, rid)
            got = kv.get_offload_priority(self.name(rid))
            assert got == claimable, f"R45: priority of r{rid} {got}, model says {claimable}"
            # fresh pages, and the free-cached pages it shares again (S29)
            want = 0 if open_offload or not copies else self.model.reload_need(model_state, rid)
            got_pages = kv.reload_pages_needed(self.name(rid))
            assert got_pages == want, f"R46: r{rid} reload needs {got_pages}, model {want}"
        # the model's count: a windowed copy holds its retained pages only (W8)
        used = model.host_used(model_state)
        view = kv.host_pool()
        assert (view.capacity, view.used, view.free) == (
            self.scope.host_pages, used, self.scope.host_pages - used), (
            f"R46: host pool {view} answers other counts than the model's {used} used")
        if self.said is not None:
            rid, reason, short = self.said
            expected, want_short = refusal_in_model(model_state, rid, reason, ps,
                                                    self.scope.host_pages, self.model)
            assert (reason, short) == (expected, want_short), (
                f"R44: r{rid} refused with {reason} (short {short}); "
                f"the model's state says {expected} (short {want_short})")

    def claim_frees(self, s: m.State, rid: int) -> int:
        """The pages a claim of ``rid`` takes now (R45): those of its resident
        streams whose last holder it is (S26: a page another request shares
        stays), each once; the model's pool counts them."""
        resident = [(k, v) for k, v in s.streams if k[0] == rid and v.offload == m.RESIDENT]
        if not self.scope.sharing or s.pool is None:
            return sum(v.pages for _, v in resident)
        model = self.model
        mine = tuple((model.holder(k), tuple(p for p in reversed(v.table) if p))
                     for k, v in resident)
        got, _ = model.pool.step(s.pool, pool_model.Reclaimable(tuple(t for t in mine if t[1])))
        return got.n if isinstance(got, pool_model.Count) else 0

    def check_host_lengths(self, model_state: m.State,
                           seen: KVObservation | None = None) -> None:
        """Each host copy holds exactly the tokens the model put on the host."""
        seen = seen if seen is not None else self.observe()
        if seen.host is None:
            # a scope without host pages: the manager has no host pool, and
            # the model can have put nothing on the host
            assert not model_state.host, f"host copies without a host pool: {model_state.host}"
            return
        for (rid, label), tokens in model_state.host:
            copy = seen.host_copy(self.name(rid), self.groups.kv_label(label))
            assert copy is not None, f"no host copy of {(rid, label)}"
            assert copy.stored_len == len(tokens), (rid, label, copy.stored_len, tokens)

    def generations(self, seen: KVObservation | None = None
                    ) -> dict[tuple[str, str], tuple[int, int, tuple[int, ...]]]:
        """(generation, stored_len, pages) per stream, for the I14 check."""
        seen = seen if seen is not None else self.observe()
        return {(s.request_id, s.label): (s.generation, s.stored_len, s.pages)
                for s in seen.streams()}

    @staticmethod
    def check_generations(
        before: dict[tuple[str, str], tuple[int, int, tuple[int, ...]]],
        after: dict[tuple[str, str], tuple[int, int, tuple[int, ...]]],
    ) -> None:
        """I14: a generation never decreases; a change of pages or length bumps it."""
        for key, (gen, length, pages) in after.items():
            if key not in before:
                continue
            old_gen, old_length, old_pages = before[key]
            assert gen >= old_gen, f"I14: {key} generation {old_gen} -> {gen}"
            if (length, pages) != (old_length, old_pages):
                assert gen > old_gen, f"I14: {key} changed without a generation bump"

    def check_publication(self, model_state: m.State, seen: KVObservation) -> str | None:
        """W17 after a publish: each stream's publication says what its window
        released (the model's released slots, in tokens) and names exactly the
        pages the manager holds for the rest of its tokens, in slot order, so a
        peer reads each page as the slot it is. None when it does, else why."""
        if self.publication is None:
            return None
        ps, st = self.scope.page_size, model_state.stream_map()
        rid, pub = self.publication
        for name, info in pub.get(0).items():
            want = m.Model.released(st[(rid, self.groups.internal(name))]) * ps
            mine = seen.stream(self.name(rid), name)
            held = mine.pages[:-(-info.seq_len // ps) - mine.released // ps]
            if info.released != want or tuple(info.page_indices) != held:
                return (f"W17: r{rid}/{name} published released={info.released} pages "
                        f"{info.page_indices}; the model released {want}, kvref holds {held}")
        return None

    def check_observed(self, model_state: m.State, seen: KVObservation | None = None) -> None:
        """What the model knows beyond streams and pages, on the observation:
        the staged preplan and its basis, request configs, positions and
        keyed ids (`kvref.testing.observed_state`)."""
        seen = seen if seen is not None else self.observe()
        salts = dict(enumerate(self.scope.salts))
        observed_state.check_positions(seen)
        observed_state.check_configs(model_state, seen, salts, self.name, request_keys)
        observed_state.check_staged(model_state, seen, self.name, self.groups.kv_label)
        if self.scope.sharing:
            user = self.groups.user_token
            observed_state.check_keyed_ids(model_state, seen, self.scope.page_size, self.name,
                                           lambda t, p: engine_id(user(t), p),
                                           self.groups.kv_label)

    def check_pages(self, seen: KVObservation | None = None) -> None:
        """I1 and I2 on page ids: every page exactly once in free list, sink or a stream."""
        seen = seen if seen is not None else self.observe()
        check_device_pages(self.kv, seen)
        pool = seen.host
        if pool is not None:
            held = [p for c in pool.copies for p in c.pages]
            assert len(held) == len(set(held)), "I6: a host page in two copies"
            assert pool.free + len(held) + pool.pending_free == pool.capacity, (
                "I6: free, copied and pending host pages do not add up to the capacity")

    def check_page_map(self, model_state: m.State, seen: KVObservation | None = None) -> None:
        """The model's page ids against kvref's, by structure: the slots of the
        streams' tables pair them one to one (each model page is one kvref
        page and back), and paired pages have the same holders and are keyed
        alike; the released slots (W2) agree, and as many free pages are
        cached. The numbering itself is each side's own."""
        pool = model_state.pool
        if pool is None:
            return
        seen = seen if seen is not None else self.observe()
        ps = self.scope.page_size
        to_kv: dict[int, int] = {}
        to_model: dict[int, int] = {}
        for (rid, label), v in model_state.streams:
            mine = seen.stream(self.name(rid), self.groups.kv_label(label))
            where = f"{self.name(rid)}/{self.groups.kv_label(label)}"
            released = m.Model.released(v)
            assert released * ps == mine.released or not v.table, (
                f"W2: {where} released {mine.released} tokens, the model {released * ps}")
            held = tuple(p for p in v.table if p)
            assert len(held) == len(mine.pages), (
                f"{where} holds pages {mine.pages}, the model's table is {v.table}")
            for p, q in zip(held, mine.pages, strict=True):
                assert to_kv.setdefault(p, q) == q and to_model.setdefault(q, p) == p, (
                    f"{where}: model page {p} is kvref page {q}, but elsewhere "
                    f"{to_kv[p]} / {to_model[q]}: a page shared on one side only")
        for p, q in to_kv.items():
            page, theirs = pool.page(p), seen.page(q)
            want = {(self.name(r), lb) for r, lb in map(self.groups.holder, page.holders)}
            assert set(theirs.holders) == want, (
                f"page {q} (model {p}) held by {sorted(map(str, theirs.holders))}, the "
                f"model says {sorted(want)}")
            assert (theirs.key is None) == (page.key is None), (
                f"page {q} (model {p}) keyed {theirs.key is not None}, the model "
                f"{page.key is not None}")
            if page.key is not None and self.config.page_key is not None:
                # the key itself: under the right salt, extra keys, label and
                # ids (a key under another tenant's or label's is a hit lost,
                # or a hit across tenants, that no count shows yet)
                assert theirs.key == self.kv_key(page.key), (
                    f"page {q} (model {p}) keyed otherwise than the model's key "
                    f"{page.key} says (S25)")
        assert len(seen.free_cached) == len(pool.lru), (
            f"{len(seen.free_cached)} free pages cached, the model {len(pool.lru)}")

    def kv_key(self, key: pool_model.Key) -> bytes:
        """The key kvref gives a page the model keys ``key``: its parent's,
        the ids (`engine_id`) of its tokens at its place in the chain, and
        the extra keys of S25: the salt and typed keys its model salt stands
        for (`request_keys`), then the label whose KV it is, which is the
        label that computed the chain's first token (a fork target keys
        under its source's)."""
        got = self.kv_keys.get(key)
        if got is not None:
            return got
        chain: list[pool_model.Key] = []
        k: pool_model.Key | None = key
        while k is not None:
            chain.append(k)
            k = k.parent
        chain.reverse()
        # the stream whose KV it is: a group's stream of the label (H1)
        space = self.groups.kv_label(chain[0].tokens[0])
        salt, extra = request_keys(dict(key.extras).get("salt", ""))
        extras = ((("salt", salt),) if salt is not None else ()) + extra + (("label", space),)
        ps = self.scope.page_size
        parent: bytes | None = None
        for depth, c in enumerate(chain):
            ids = [engine_id(self.groups.user_token(t), depth * ps + i)
                   for i, t in enumerate(c.tokens)]
            parent = self.kv_keys.get(c) or self._page_key(parent, token_bytes(ids), extras)
            self.kv_keys[c] = parent
        assert parent is not None
        return parent

    def _page_key(self, parent: bytes | None, raw: bytes,
                  extras: tuple[tuple[str, Any], ...]) -> bytes:
        """A page's key as the manager under test hashes it: the configured
        `page_key`, with the manager's `KVConfig.page_key_hash` where that is
        kvref's own."""
        pk = self.config.page_key
        assert pk is not None
        if pk is next_page_key:
            return next_page_key(parent, raw, extras,
                                 key_hash=key_hash_named(self.config.page_key_hash))
        return pk(parent, raw, extras)

    def check_free_order(self, before: m.State, seen_before: KVObservation,
                         after: m.State, seen_after: KVObservation,
                         action: m.Action | None = None) -> None:
        """The free queues' order (S6: a stream lets go tail first, so a
        chain's suffix is evicted before its head; a faulted call gives its
        pages back in the order taken, I17), which no count or holder shows
        until an eviction much later. Each free page is named by what it
        was before the call, on each side in its own terms: a place in the
        blank queue, a cached page's key, or the slots of the streams that
        held it. The queues must name the same pages, the blank queue's
        old places and cached keys in the same order, and the pages held by
        the same streams in the same order; how the pages of different
        streams let go in one call interleave (a remove, a reset) is left
        open, as the model releases them by label, kvref in the order they
        were made. A page two streams share goes free with the later one,
        so it is ordered only among the pages those two shared (issue 41),
        and must sit within one of its holders' lists (`check_shared_in_a_list`)."""
        if before.pool is None or after.pool is None:
            return
        ps = self.scope.page_size

        def model_roles(s: m.State) -> dict[int, tuple[Any, ...]]:
            assert s.pool is not None
            roles: dict[int, tuple[Any, ...]] = {
                p: ("blank", i) for i, p in enumerate(s.pool.blank)}
            for p in s.pool.lru:
                key = s.pool.page(p).key
                roles[p] = ("cached", self.kv_key(key) if key is not None and (
                    self.config.page_key is not None) else p)
            held: dict[int, list[tuple[m.Key, int]]] = {}
            for k, v in s.streams:
                for j, p in enumerate(v.table):
                    if p:
                        held.setdefault(p, []).append((k, j))
            roles.update({p: ("held", tuple(sorted(h))) for p, h in held.items()})
            return roles

        def kv_roles(seen: KVObservation) -> dict[int, tuple[Any, ...]]:
            roles: dict[int, tuple[Any, ...]] = {
                p: ("blank", i) for i, p in enumerate(seen.free_blank)}
            for p in seen.free_cached:
                key = seen.page(p).key
                roles[p] = ("cached", key if self.config.page_key is not None else p)
            held: dict[int, list[tuple[m.Key, int]]] = {}
            for st in seen.streams():
                k = (self.rid_of(st.request_id), self.groups.internal(st.label))
                for j, p in enumerate(st.pages, st.released // ps):
                    held.setdefault(p, []).append((k, j))
            roles.update({p: ("held", tuple(sorted(h))) for p, h in held.items()})
            return roles

        if self.config.page_key is None:
            return  # cached pages are then named by id, which differ by side
        mine, theirs = model_roles(before), kv_roles(seen_before)
        was, now = before.stream_map(), after.stream_map()
        moved = {k for k in was.keys() | now.keys()
                 if was.get(k, m.NO_STREAM).table != now.get(k, m.NO_STREAM).table}
        if isinstance(action, m.Reload):  # a faulted one moves no table
            moved |= {k for k, _ in before.host if k[0] == action.rid}
        for name, want_q, got_q in (("free-cached", after.pool.lru, seen_after.free_cached),
                                    ("free-blank", after.pool.blank, seen_after.free_blank)):
            want = [mine.get(p, ("new",)) for p in want_q]
            got = [theirs.get(p, ("new",)) for p in got_q]
            where = f"{name} queue: kvref {got}, the model {want}"
            assert sorted(want, key=repr) == sorted(got, key=repr), f"other pages in the {where}"
            # pages taken from the free queues and given back by one stream
            # come back in the order taken; by several streams in one call
            # (a reload of two labels), in an order the model leaves open
            if len(moved) <= 1:
                assert [r for r in want if r[0] != "held"] == [
                    r for r in got if r[0] != "held"], f"the {where}"
            # each stream lets go tail first, but a page several streams
            # held goes free at its last holder's release, and which of one
            # call's streams goes first is open (issue 41): so the order is
            # compared among the pages the same streams held, each stream's
            # own pages included
            holders = {tuple(h for h, _ in r[1]) for r in want if r[0] == "held"}
            for hs in holders:
                assert ([r for r in want if r[0] == "held" and tuple(h for h, _ in r[1]) == hs]
                        == [r for r in got if r[0] == "held"
                            and tuple(h for h, _ in r[1]) == hs]), (
                    f"{' and '.join(map(str, hs))}'s pages in the {where} (S6: tail first)")
            for side, roles in (("kvref", got), ("the model", want)):
                self.check_shared_in_a_list(side, roles, where)

    def release_head_first(self, label: int) -> bool:
        """H4: a cached window's list runs head first; every other tail first (S6)."""
        return self.scope.window_cache and self.scope.window(label) is not None

    def check_shared_in_a_list(self, side: str, roles: list[tuple[Any, ...]],
                               where: str) -> None:
        """A page several streams held goes free within the list of the one
        that let go of it last (S6, H4, S22), so among that stream's own
        pages it stands where that list's order puts it, whichever stream
        went last. A cached window's list runs head first (H4), so a page it
        shared sits before its own later pages: a release that let the shared
        pages go apart from the lists (after them all, say) is seen here,
        not by the comparison with the model, which orders only the pages
        the same streams held (issue 41, findings (h))."""
        held = [(i, r[1]) for i, r in enumerate(roles) if r[0] == "held"]

        def fits(at: int, k: tuple[int, int], slot: int) -> bool:
            own = sorted([(i, hs[0][1]) for i, hs in held if len(hs) == 1 and hs[0][0] == k]
                         + [(at, slot)])
            slots = [j for _, j in own]
            return slots == sorted(slots, reverse=not self.release_head_first(k[1]))

        for at, hs in held:
            if len({k for k, _ in hs}) > 1 and not any(fits(at, k, j) for k, j in hs):
                raise AssertionError(
                    f"{side}: the page {' and '.join(map(str, hs))} held went free out of "
                    f"each holder's list (S6, H4, S22) in the {where}")

    def check_bytes(self, model_state: m.State) -> None:
        """I7: every resident stream reads back, through its pages, as the
        model's contents; a windowed stream its window (W1), a chunked one
        its chunk (H7), what it released is not read back."""
        for (rid, label), s in model_state.streams:
            if s.offload != m.RESIDENT or s.retrieve != m.IDLE:
                continue
            got = self.kv.read_stream(self.name(rid), self.groups.kv_label(label)).float()
            # (a chunked group reads from its chunk's start: H7)
            first = self.scope.first_read(label, s.stored_len)
            # a position no write filled (committed before it was written) holds
            # unspecified bytes: only the written ones are compared
            written = [p for p, t in enumerate(s.contents) if t != m.UNWRITTEN and p >= first]
            got = got[:, [p - first for p in written]]
            writer = writer_of(self.scope, rid)
            want = torch.tensor([value(writer, s.contents[p], p) for p in written])
            # through the cache dtype, as the writes were: in bf16 the identities
            # round (and may collide), so that variant checks less
            want = want.to(self.config.dtype).float()
            want = want.view(1, -1, 1, 1, 1).expand_as(got).to(got.device)
            if not torch.equal(got, want):
                bad = (got != want).nonzero()[0].tolist()
                raise AssertionError(
                    f"I7: {self.name(rid)}/{self.groups.kv_label(label)} token "
                    f"{written[bad[1]]} reads {got[tuple(bad)].item()} (contents {s.contents})"
                )

    def page_owners(self, seen: KVObservation | None = None) -> dict[int, tuple[str, str]]:
        """Device page -> the stream holding it (I10 compares it across a refusal)."""
        seen = seen if seen is not None else self.observe()
        return {p: (s.request_id, s.label) for s in seen.streams() for p in s.pages}

    def check_views(self) -> None:
        """What plan handed the engine is state too: each view says what the
        step runs against now, with or without a preplan (blind spot e)."""
        assert self.outputs is not None and self.step is not None
        ps = self.cfg.page_size
        spans = {(g.request_id, g.label): g.span for g in self.step[1].segments}
        spans = {(rid, lb): spans[(rid, self.groups.user(lb))]
                 for rid, lb in ((v.request_id, v.label) for out in self.outputs.values()
                                 for v in out.views)}
        seen = self.observe()
        for out in self.outputs.values():
            for v in out.views:
                stream = seen.stream(v.request_id, v.label)
                where = f"view of {v.request_id}/{v.label}"
                assert v.to_compute == spans[(v.request_id, v.label)], where
                # a windowed stream's view starts at its first retained page
                # (W1): its length counts from there, ``offset`` tokens in
                assert v.offset == stream.released, (
                    f"{where}: offset {v.offset}, the stream released {stream.released}")
                assert v.offset + v.length == stream.stored_len + v.to_compute, (
                    f"{where}: length {v.length} from token {v.offset}, stream holds "
                    f"{stream.stored_len} + {v.to_compute}")
                assert tuple(v.page_idxs) == stream.pages[: -(-v.length // ps)], (
                    f"{where}: pages {v.page_idxs} vs {stream.pages}")
                assert v.generation == stream.generation, (
                    f"{where}: generation {v.generation}, stream at {stream.generation}")

    def pages_of_step(self) -> set[int]:
        """Pages the running step's plan may write: its views' pages, and the sink."""
        pages = {SINK_PAGE}
        if self.outputs is not None:
            for out in self.outputs.values():
                for view in out.views:
                    pages.update(view.page_idxs)
        return pages


def refusal_in_model(s: m.State, rid: int, said: OffloadReason | ReloadReason | None,
                     page_size: int, host_pages: int, model: m.Model | None = None
                     ) -> tuple[OffloadReason | ReloadReason, int]:
    """The reason (and pages short) the model's state gives for refusing what
    kvref refused: a claim when ``said`` is an `OffloadReason`, else a reload."""
    if host_pages == 0:  # checked first, as kvref's calls do
        return (OffloadReason.NO_HOST_POOL if isinstance(said, OffloadReason)
                else ReloadReason.NO_HOST_POOL), 0
    mine = [v for k, v in s.streams if k[0] == rid]
    running = s.offload_of(rid) is not None
    if isinstance(said, OffloadReason):
        if not mine:
            return OffloadReason.UNKNOWN_REQUEST, 0
        if running:
            return OffloadReason.OFFLOAD_RUNNING, 0
        if any(v.in_flight for v in mine):
            return OffloadReason.STEP_IN_FLIGHT, 0
        if rid in s.leases:
            return OffloadReason.PUBLISH_LEASED, 0
        return OffloadReason.NOTHING_ON_DEVICE, 0
    copies = [c for k, c in s.host if k[0] == rid]
    if not mine:
        return ReloadReason.UNKNOWN_REQUEST, 0
    if running:
        return ReloadReason.OFFLOAD_RUNNING, 0
    if not copies:
        return ReloadReason.NOTHING_ON_HOST, 0
    # a reload that shares pages again takes fewer: the model counts them (S29)
    needed = (model.reload_need(s, rid) if model is not None
              else sum(-(-len(c) // page_size) for c in copies))
    return ReloadReason.DEVICE_FULL, needed - s.free


def retrieve_state(s: Any) -> str:
    """The model's retrieve state of a stream object (the scheduled tests'
    read of one); the driver itself reads `StreamObservation.retrieve`."""
    return RETRIEVE_STATE[s.retrieve]


def outcome(out: AdmitOutcome) -> m.Result:
    if not out.ok:
        assert out.reason is not None
        kind = type(out.reason).__name__
        if kind in LATCHED:
            return m.Latched(kind)
        short = getattr(out.reason, "pages_short", 0) if kind == "AllocationFailed" else 0
        return m.Refused(kind, short)
    return m.Ok() if out.ready else m.NotReady()
