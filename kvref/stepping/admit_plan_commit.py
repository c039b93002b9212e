"""Stepping: admit, plan and commit of one step at a time, plus one preplanned (R23).

`admission` decides (a pure computation to a grant or a refusal); this
module applies the decision to the stream table, builds the step's page
tables and write addressing, and commits its spans. Forks are `kvref.stepping.forks`,
slot-leased addressing is `kvref.stepping.graph_staging`. Every method runs under the
stream table's lock, which `KVManager` holds around each call.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Mapping, Sequence
from typing import cast

import torch

from kvref import validate
from kvref.core.errors import (
    ForkCopyError,
    InvalidArgumentError,
    PreplanPendingError,
    PreplanStaleError,
    StepInFlightError,
    StepNotAdmittedError,
    StepOrderError,
)
from kvref.core.labels import LabelBehaviour
from kvref.core.stream_table import Key, StreamTable
from kvref.core.streams import CacheStream, StreamBatch
from kvref.prefix import follow
from kvref.stepping import admission
from kvref.stepping.decode_table import DecodeTable, DecodeTables
from kvref.stepping.forks import Forks
from kvref.stepping.graph_staging import GraphStaging
from kvref.stepping.plan import (
    KVPlanOutput,
    KVPlanOutputs,
    KVPlanState,
    SequenceView,
    group_by_plan_label,
    plan_tables,
)
from kvref.stepping.running_step import (
    RunningStep,
    StagedPreplan,
    same_step,
    settled_lengths,
    settled_table,
    stale,
    where,
)
from kvref.stepping.step import (
    ADMIT_OK,
    AdmitFailedReason,
    AdmitOutcome,
    KVStep,
    PreplanRefused,
    PreplanStale,
    Segment,
    StepContext,
)

logger = logging.getLogger(__name__)

_span = operator.attrgetter("span")
# `_end_plain`'s mark for a label whose behaviour it has not asked yet
_UNASKED = cast(LabelBehaviour, object())

# from this many streams short of pages (a large batch crossing into new
# pages: 16 a step at B = 256), one pool call for all (`take_each`)
_BATCHED_TAKE = 4

# from this many rows a decode batch's streams are moved as one
# (`StreamBatch`); below it the per-row pass costs less than its numpy set-up
BATCH_ROWS = 32
# the decode steps of the same streams committed row by row, after the
# first, before they are made a batch
_BATCH_AFTER = 2


class Stepping:
    """The running step, the staged preplan, and the plan states attention reads."""

    def __init__(self, table: StreamTable, forks: Forks, staging: GraphStaging,
                 device: torch.device, name: str, max_seq_len: int,
                 decode_table: DecodeTables | None = None) -> None:
        self._table = table
        self._forks = forks
        self._staging = staging
        self._device = device
        self._name = name  # the manager's, for the log
        self._max_seq_len = max_seq_len
        self.running: RunningStep | None = None
        self.preplan: StagedPreplan | None = None
        # plan label -> this step's write addressing, from plan until commit (R27)
        self.current_plan_states: dict[str, KVPlanState] = {}
        # the last decode step's page table, updated by the next (issue 28)
        # (a hybrid config's: one per attention group, `kvref.hybrid.decode`)
        self.decode_table: DecodeTables = (
            decode_table if decode_table is not None else DecodeTable(table.page_size, device))
        # the decode batch (`StreamBatch`) the last steps ran, and the streams
        # of the last decode step the general path committed: the same ones
        # committed twice in a row are made a batch
        self._decode_batch: StreamBatch | None = None
        self._last_rows: list[CacheStream] | None = None
        self._repeats = 0  # how many steps before decoded ``_last_rows`` again
        self.batch_rows = BATCH_ROWS  # read once: the tests lower it

    # -- admit ---------------------------------------------------------------

    def admit(self, step: KVStep, ctx: StepContext) -> AdmitOutcome:
        """See `KVManager.admit`."""
        staged = self.preplan
        running = self.running
        # a plain step (no forks, no preplan: every decode step) with nothing
        # admitted or staged goes to admission.plain_grant, which checks the
        # lengths in its one pass
        # (nor a step whose commit may release a leased request's pages, or
        # whose copy-on-write may give them back: R70 and R71 ask of it below)
        releasing = self._table.releasing
        plain = staged is None and running is None and not (
            ctx.is_preplan or step.pre_forks or step.post_forks or step.combined_labels
        ) and not ((releasing or self._table.tails_maybe_shared)
                   and self._table.leases.leased())
        settled: dict[Key, int] = {}
        if ctx.is_preplan and running is not None:
            # R41: step N+1 is planned while step N runs, from the lengths N
            # leaves once committed (bounded by max_seq_len from there too);
            # promotion checks it did (R42)
            settled = settled_lengths(self._table.streams, running)
        if not plain:
            # malformed input first, whatever the lifecycle state: it is the
            # caller's bug in any state
            validate.step_lengths(
                step, ctx, settled_table(self._table.streams, settled) if settled
                else self._table.streams, self._max_seq_len)
        if staged is not None:
            if ctx.is_preplan:
                raise PreplanPendingError(
                    "a preplan is already staged; clear_preplan before preplanning again"
                )
            if not same_step(step, ctx, staged, tuple(staged.ctx.padded_request_ids)):
                raise PreplanPendingError(
                    "admit of a different step than the staged preplan; "
                    "clear_preplan first"
                )
            validate.padded_known(ctx.padded_request_ids, self._table.streams)
            if self.running is None:
                moved = stale(self._table.streams, staged)
                if moved is not None:
                    return AdmitOutcome(ok=False, reason=self._stale_reason(staged, moved))
            return ADMIT_OK  # the preplan pass already reserved and marked
        if running is not None and not ctx.is_preplan:
            if same_step(step, ctx, running, running.padded):
                validate.padded_known(ctx.padded_request_ids, self._table.streams)
                return ADMIT_OK  # admitted again: everything is reserved already
            # R23: a second step would be planned against lengths the
            # first has not committed, and its commit would clear the
            # first one's marks
            raise StepInFlightError(
                "a step is already admitted; commit it before admitting another"
            )
        all_streams = self._table.streams
        padded = tuple(ctx.padded_request_ids)
        behaviour = self._table.behaviour
        for from_label, to_label in (*step.pre_forks, *step.post_forks):
            if behaviour(from_label) != behaviour(to_label):
                # W5: a fork keeps the label's behaviour; a source that
                # released tokens cannot give them to a target that reads them
                raise InvalidArgumentError(
                    f"fork {from_label!r} -> {to_label!r} between labels of different "
                    "retention windows or rollback margins", label=to_label)
        free = self._table.pages.num_free
        sharing = self._table.sharing
        if plain:
            batch = self._decode_batch
            # (a row's tail is private: `StreamBatch.join` checked it, and
            # only a truncate, which takes the row out, makes one shared)
            if batch is not None and batch.intact and (
                    not padded or all(map(all_streams.__contains__, padded))) and (
                    self._admit_batch(batch, step, padded, free)):
                return ADMIT_OK
            # no stream's tail can be shared until a truncate made one so
            grant = admission.plain_grant(
                all_streams, step, self._table.page_size, free, self._max_seq_len,
                padded=padded, sharing=sharing if self._table.tails_maybe_shared else None)
            if isinstance(grant, AdmitFailedReason):
                return AdmitOutcome(ok=False, reason=grant)
            created, streams, grown = self._apply_plain(grant)
            self.running = RunningStep(step, padded, set(created), streams=streams, grown=grown)
            return ADMIT_OK
        validate.step_streams(all_streams, step, padded)
        # refusals after every misuse is ruled out (an unknown request first)
        if ctx.is_preplan and releasing:
            unplanned = self._release_forks_pending(step, padded)
            if unplanned is not None:
                return AdmitOutcome(ok=False, reason=unplanned)
        if ctx.is_preplan:
            unplannable = self._views_would_move(step, padded, settled)
            if unplannable is not None:
                return AdmitOutcome(ok=False, reason=unplannable)
        keys = admission.named_keys(step, padded)
        refused = admission.refusal(all_streams, keys) or admission.leased_fork_target(
            step, padded, self._table.leases.held) or (admission.leased_release(
                step, all_streams, settled, behaviour, self._table.page_size,
                self._table.leases.held) if releasing else None) or (admission.leased_cow(
                    step, all_streams, sharing, self._table.leases.held)
                    if self._table.tails_maybe_shared else None)
        if refused is not None:
            return AdmitOutcome(ok=False, reason=refused)
        grant = admission.reserve(all_streams, step, padded, keys,
                                  self._table.page_size, free, settled, sharing,
                                  copy_forks=ctx.is_preplan,
                                  behaviour=behaviour if releasing else None)
        if isinstance(grant, AdmitFailedReason):
            return AdmitOutcome(ok=False, reason=grant)
        created = self._apply(grant)
        if ctx.is_preplan:
            basis = {k: settled[k] for k in keys if k in settled}
            self.preplan = StagedPreplan(step, ctx, created, list(keys), basis=basis,
                                         released=projected_released(self._table, basis))
        else:
            self.running = RunningStep(step, padded, set(created))
        return ADMIT_OK

    def _admit_batch(self, batch: StreamBatch, step: KVStep, padded: tuple[str, ...],
                     free: int) -> bool:
        """`plain_grant` and `_apply_plain` of a step of the batch's streams,
        from its arrays; False (nothing changed) where the step is not one
        of the batch, or may be refused or misuse: the general path decides.
        A batch is at rest and every row resident, retrieve-free, with a
        private tail (`StreamBatch.join`, and any transition since made it
        not intact): what is left to ask is each row's pages and length."""
        if batch.in_flight or not batch.matches(step.segments):
            return False
        if batch.max_len + batch.ticks + 1 >= self._max_seq_len:
            return False  # `validate.step_lengths` decides
        at, short = batch.short(self._table.page_size)
        rows: list[int] = at.tolist()
        if rows:
            counts: list[int] = short.tolist()
            if sum(counts) > free:
                return False  # refused: `settle` says by whom
            keys = batch.keys
            if len(rows) < _BATCHED_TAKE:
                got = [self._table.take(keys[i], k) for i, k in zip(rows, counts, strict=True)]
            else:
                got = self._table.take_each([keys[i] for i in rows], counts)
            batch.grow(at, short, got)
        batch.mark()
        self.running = RunningStep(step, padded, set(), streams=batch.streams, grown=rows)
        return True

    def _views_would_move(self, step: KVStep, padded: tuple[str, ...],
                          settled: Mapping[Key, int]) -> PreplanRefused | None:
        """R57: a preplan's views are built before it runs, from the page
        tables then; with shared pages a fork (or a copy-on-write the running
        step cannot see) gives a stream other pages in between, and the views
        would address pages the stream no longer holds."""
        running = self.running
        why = None
        sharing = self._table.sharing
        # the targets whose pages a fork shares: none where forks copy
        targets, _ = sharing.fork_targets((*step.pre_forks, *step.post_forks), padded)
        busy = admission.named_keys(running.step, running.padded) if running else {}
        if targets & busy.keys():
            # its forks' targets are made private (copied) at this admit, which
            # would move pages the running step's own views name
            why = "a stream its forks copy into is one the running step names"
        elif running is not None and sharing.forks_move_pages(
                (*running.step.post_forks, *(() if running.forked else running.step.pre_forks))):
            why = "the running step's forks would give their targets other pages"
        else:
            for seg in step.segments:
                key = (seg.request_id, seg.label)
                stream = self._table.streams.get(key[0], {}).get(key[1])
                if (seg.span and key in settled and stream is not None
                        and sharing.cow_needed(key, stream)):
                    why = (f"{key[0]!r}/{key[1]!r} writes into a shared page the running "
                           "step still reads")
                    break
        if why is None:
            return None
        return PreplanRefused(message=f"not preplanned with shared pages: {why}; admit it "
                                      "once the running step committed")

    def _release_forks_pending(self, step: KVStep,
                               padded: tuple[str, ...]) -> PreplanRefused | None:
        """R67: a fork gives its target its source's released prefix and pages
        (W5) only when it runs, after the views were built; so a preplan whose
        forks name a label that releases, or whose stream of such a label a
        fork of the running step still has to write, is not planned ahead."""
        behaviour = self._table.behaviour
        why = None
        if any(behaviour(lb).releases for fk in (*step.pre_forks, *step.post_forks)
               for lb in fk):
            why = "its forks name a windowed label"
        running = self.running
        if why is None and running is not None:
            pending = (*running.step.post_forks,
                       *(running.step.pre_forks if not running.forked else ()))
            targets = {(rid, to) for _, to in pending if behaviour(to).releases
                       for rid in running.padded}
            if any((seg.request_id, seg.label) in targets for seg in step.segments):
                why = "a windowed stream it names is the target of a fork the running step " \
                      "has still to apply"
        if why is None:
            return None
        return PreplanRefused(message=f"not preplanned: {why}, and a fork moves the window's "
                                      "released prefix only when it runs; admit it once the "
                                      "running step committed")

    def fork_targets(self) -> frozenset[tuple[str, str]]:
        """Every stream a fork still to run writes into (a staged preplan's,
        R57; the running step's pre-forks before its plan ran them, and its
        post-forks, S32): nothing may register its pages meanwhile, or the
        fork would write into a page the prefix cache names, or find the
        private page its admit counted on keyed and none left to write into
        (`PageSharing.unkeyable`). Found once: a batch of `cache_prefixes`
        asks of many streams in one call."""
        staged, running = self.preplan, self.running
        pending = [((*staged.step.pre_forks, *staged.step.post_forks),
                    staged.ctx.padded_request_ids)] if staged else []
        if running is not None:
            pending.append(((*(() if running.forked else running.step.pre_forks),
                             *running.step.post_forks), running.padded))
        return frozenset((rid, to) for forks, padded in pending for rid in padded
                         for _, to in forks)

    def forks_pending(self, rid: str) -> bool:
        """Whether the running or the staged step still has forks to apply to
        ``rid``: `publish` waits for them (R50). Called under the table's lock."""
        running, staged = self.running, self.preplan
        if running is not None and rid in running.padded and (
                running.step.post_forks or (running.step.pre_forks and not running.forked)):
            return True
        return staged is not None and rid in staged.ctx.padded_request_ids and bool(
            staged.step.pre_forks or staged.step.post_forks)

    def release_pending(self, rid: str) -> bool:
        """Whether the running or the staged step's commit would release
        pages of ``rid`` holding committed tokens (a window's, W2; the staged
        one from the lengths the running step leaves, R41): `publish` waits
        for it (R70). Called under the table's lock."""
        if not self._table.releasing:
            return False
        running, staged = self.running, self.preplan
        streams, ps = self._table.streams, self._table.page_size
        behaviour = self._table.behaviour
        if running is not None and admission.releases_published(
                running.step, streams, {}, behaviour, ps, rid):
            return True
        settled = settled_lengths(streams, running) if running is not None else {}
        return staged is not None and admission.releases_published(
            staged.step, streams, settled, behaviour, ps, rid)

    def copy_page_head(self, src: int, dst: int, slots: int) -> None:
        """The first ``slots`` tokens of the shared page ``src`` into the
        stream's own ``dst``, where a retrieve writes the tokens after them
        (R52; `KVCache.copy_page_head`). Called under the table's lock."""
        self._forks.copy_page_head(src, dst, slots)

    def _stale_reason(self, staged: StagedPreplan, key: Key) -> PreplanStale:
        stream = self._table.streams.get(key[0], {}).get(key[1])
        if stream is not None and stream.stored_len == staged.basis[key]:
            return PreplanStale(
                message=(f"the staged preplan was planned with {staged.released[key]} tokens "
                         f"released, but the stream released {stream.released}: its views "
                         "start elsewhere; clear_preplan and admit afresh"),
                request_id=key[0], label=key[1])
        return _stale(key, staged.basis[key], stream.stored_len if stream else None)

    def _apply(self, grant: admission.Grant) -> list[Key]:
        """Make a grant real: create each named stream that is missing, give it
        the pages it is short, and mark it in flight. Returns the created keys."""
        self._copy_first(grant)
        marked = [self._claim(claim) for claim in grant.claims]
        CacheStream.mark_step(marked)
        return [(rid, label) for rid, _, label, stream, _ in grant.claims if stream is None]

    def _apply_plain(self, grant: admission.Grant
                     ) -> tuple[list[Key], list[CacheStream], list[int]]:
        """`_apply` of a `plain_grant`: only the claims that create a stream
        or take pages one by one. Returns the created keys, each claim's
        stream, and the claims that took pages (what the kept decode table is
        told of)."""
        assert grant.streams is not None
        self._copy_first(grant)
        claims, found = grant.claims, grant.streams
        created: list[Key] = []
        grown: list[int] = []
        for i in grant.work:
            rid, streams, label, stream, short = claims[i]
            if stream is None:
                created.append((rid, label))
                found[i] = streams[label] = CacheStream()
            if short > 0:
                grown.append(i)
        made = cast("list[CacheStream]", found)  # every None filled above
        if len(grown) < _BATCHED_TAKE:
            # a few streams (a small batch, a chunk): the pool's one-owner
            # call, the same path a decode step of the batch takes
            for i in grown:
                rid, _, label, _, short = claims[i]
                made[i].append_pages(self._table.take((rid, label), short))
        else:
            # the pages of every stream short of some in one call to the
            # pool, in claim order: the pages `take` would give each in turn
            rows = [claims[i] for i in grown]
            got = self._table.take_each([(c[0], c[2]) for c in rows], [c[4] for c in rows])
            for i, pages in zip(grown, got, strict=True):
                made[i].append_pages(pages)
        CacheStream.mark_step(made)
        return created, made, grown

    def _copy_first(self, grant: admission.Grant) -> None:
        # first, while nothing else changed: a copy that raises leaves the
        # streams as they were, each copied one private and as it read
        for rid, label in grant.cow:
            self._forks.copy_on_write(rid, label)
        for (rid, label), _ in grant.privatise:
            self._forks.privatise(rid, label)

    def _claim(self, claim: admission.Claim) -> CacheStream:
        """One claim's stream, created if missing, with the pages it is short."""
        rid, streams, label, stream, short = claim
        if stream is None:
            stream = streams[label] = CacheStream()
        if short > 0:
            # admission counted these under the same lock
            stream.append_pages(self._table.take((rid, label), short))
        return stream

    def clear_preplan(self) -> None:
        """See `KVManager.clear_preplan`."""
        staged, self.preplan = self.preplan, None
        if staged is None:
            return
        all_streams = self._table.streams
        # labels the staged step invented are removed with their pages:
        # a stream at length 0 that nothing asked for still holds them
        for rid, label in reversed(staged.created):
            stream = all_streams.get(rid, {}).pop(label, None)
            if stream is not None:
                self._table.give_back((rid, label), stream.page_indices)
        # or the request stays unevictable for a step that never runs; a mark
        # the running step also owns stays until it commits (R43)
        running = self.running
        owned = admission.named_keys(running.step, running.padded) if running else {}
        for rid, label in staged.marked:
            stream = all_streams.get(rid, {}).get(label)
            if stream is not None and (rid, label) not in owned:
                stream.clear_in_flight()

    # -- plan ----------------------------------------------------------------

    def plan(self, step: KVStep, ctx: StepContext) -> KVPlanOutputs:
        """See `KVManager.plan`."""
        staged = self.preplan
        if ctx.is_preplan:
            if staged is None or not staged.matches(step):
                raise StepNotAdmittedError("preplan of a step that was not preplan-admitted",
                                           **where(step))
            if staged.outputs is not None:
                raise PreplanPendingError("the staged preplan was already planned")
            validate.padded_known(ctx.padded_request_ids, self._table.streams)
            # over a running step: from the lengths it leaves (R41)
            outputs, states = self._build_plan(step, ctx, self._forks.lengths_after_pre_forks(
                step, staged.ctx.padded_request_ids, staged.created, staged.basis),
                staged.released)
            staged.outputs, staged.states = outputs, states
            return outputs
        running = self.running
        if running is None:
            if staged is None or not staged.matches(step):
                raise StepNotAdmittedError("plan of a step that was not admitted (or was "
                                           "changed in place since)",
                                           **where(step))
            validate.padded_known(ctx.padded_request_ids, self._table.streams)
            moved = stale(self._table.streams, staged)
            if moved is not None:
                reason = self._stale_reason(staged, moved)
                raise PreplanStaleError(reason.message, request_id=moved[0], label=moved[1])
            # promotion, not abandonment: its reservations and marks stay
            self.preplan = None
            running = self.running = RunningStep(
                staged.step, tuple(staged.ctx.padded_request_ids), set(staged.created),
                shape=staged.shape)
            # R57: its admit made its fork targets private and reserved their
            # whole length, so its forks copy, planned ahead or not (a view
            # built before they run names those pages)
            running.copy_forks = True
            if staged.outputs is not None:
                self._forks.run_pre(running)
                # the views were built before the forks ran: what they
                # report now is what the step runs against
                for out in staged.outputs.values():
                    for view in out.views:
                        stream = self._table.streams[view.request_id][view.label]
                        view.generation = stream.generation
                running.planned = True
                self.current_plan_states = staged.states
                return staged.outputs
        elif not running.matches(step):
            raise StepNotAdmittedError("plan of a step other than the admitted one (or the "
                                       "admitted step changed in place since its admit)",
                                       **where(step, running.step))
        elif running.planned:
            raise StepOrderError("the admitted step was already planned; commit it",
                                 **where(step))
        else:
            validate.padded_known(ctx.padded_request_ids, self._table.streams)
        self._forks.run_pre(running)
        # a plain step (decode or mixed) from the decode table, any other
        # from its views
        kept = self._decode_plan(running, ctx) if running.streams is not None else None
        outputs, states = kept if kept is not None else self._build_plan(step, ctx, {})
        running.planned = True
        self.current_plan_states = states
        return outputs

    def _decode_plan(self, running: RunningStep, ctx: StepContext
                     ) -> tuple[KVPlanOutputs, dict[str, KVPlanState]] | None:
        """A plain step's plan from the decode table (`DecodeTable`): a decode
        step from its kept rows, a mixed one (a decode batch plus prefill
        chunks) afresh from the admit's streams in one pass; None when the
        step is not one it plans (several labels, a row with no view)."""
        assert running.streams is not None
        segments = running.shape[0] if running.shape is not None else running.step.segments
        plans = self.decode_table.plans(segments, running.streams, running.grown)
        if plans is None:
            return None
        running.table_planned = any(p.kept for p in plans)
        outputs: dict[str, KVPlanOutput] = {}
        states: dict[str, KVPlanState] = {}
        # a mixed step's table also on the device (``cuda``), as `mixed_tables` gives it
        for got in plans:  # one per plan label: a hybrid config's per group
            label = got.segments[0].label
            outputs[label] = KVPlanOutput(cpu_indptrs=got.indptrs, views=got.views,
                                          cuda_indptrs=got.cuda)
            states[label] = self._staging.leased(got.state, ctx.slot_lease, label)
        return KVPlanOutputs(outputs), states

    def _build_plan(
        self, step: KVStep, ctx: StepContext, fork_len: Mapping[Key, int],
        starts: Mapping[Key, int] | None = None,
    ) -> tuple[KVPlanOutputs, dict[str, KVPlanState]]:
        ps = self._table.page_size
        outputs: dict[str, KVPlanOutput] = {}
        states: dict[str, KVPlanState] = {}
        for plan_label, segments in group_by_plan_label(
            step.segments, step.combined_labels
        ).items():
            views = self._sequence_views(segments, fork_len, starts)
            # decode and mixed steps each from one host buffer (plan.plan_tables)
            indptrs, state, cuda_indptrs = plan_tables(views, ps, self._device)
            out = KVPlanOutput(cpu_indptrs=indptrs, views=views, cuda_indptrs=cuda_indptrs)
            outputs[plan_label] = out
            states[plan_label] = self._staging.leased(state, ctx.slot_lease, plan_label)
        return KVPlanOutputs(outputs, step.pre_forks, step.post_forks), states

    def _sequence_views(
        self, segments: Sequence[Segment], fork_len: Mapping[Key, int],
        starts: Mapping[Key, int] | None = None,
    ) -> list[SequenceView]:
        """``starts``: a preplan's projected released counts (R67), which the
        running step's commit may not have reached yet."""
        ps = self._table.page_size
        all_streams = self._table.streams
        views: list[SequenceView] = []
        append = views.append
        of_stream = SequenceView.of_stream
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
            # unsliced view would report them as resident context. A view
            # starts at the stream's first retained page (W1, W4): its length
            # is relative to that page, ``offset`` (released) tokens in
            off = stream.released
            # a preplan's view starts where the running step's commit leaves
            # the stream (``starts``): the pages before that are skipped
            skip = (starts.get((rid, label), off) - off) // ps if starts else 0
            off += skip * ps
            # the stream's page list and kept array, sliced only when read
            append(of_stream(rid, label, stream.page_indices, stream.pages_array(), skip,
                             skip + -(-(length - off) // ps), length - off, span,
                             stream.generation, off))
        return views

    # -- commit --------------------------------------------------------------

    def commit(self, step: KVStep, ctx: StepContext) -> None:
        """See `KVManager.commit`."""
        running = self.running
        if running is None or not running.matches(step):
            staged = self.preplan
            if staged is not None and staged.matches(step):
                raise StepNotAdmittedError("commit of a step that is only preplanned",
                                           **where(step))
            raise StepNotAdmittedError(
                "commit of a step that was not admitted (or was changed in place since)",
                **where(step, running.step if running is not None else None))
        validate.padded_known(ctx.padded_request_ids, self._table.streams)
        fault: ForkCopyError | None = None
        try:
            self._forks.run_pre(running)
        except ForkCopyError as err:
            fault = err
        self.running = None
        self.current_plan_states = {}
        all_streams = self._table.streams
        # a staged preplan may own a mark this step also set (a stream
        # both name): it stays until the preplan is promoted or cleared
        staged_marks = (
            {all_streams[r][lb] for r, lb in self.preplan.marked
             if lb in all_streams.get(r, {})}
            if self.preplan is not None else None
        )
        # S33: the followed streams whose length reached a page to key (None:
        # the cache is off, and no stream is followed)
        due: list[CacheStream] | None = [] if self._table.sharing.shares else None
        batch = self._decode_batch
        if batch is not None and running.streams is batch.streams and (
                staged_marks is not None or not batch.intact):
            batch.dissolve()  # the general path below ends the step row by row
        if running.streams is not None and staged_marks is None:
            # a plain admit's streams, one per segment (R2), looked up once:
            # marks cleared and spans added by one transition over them all
            self._end_plain(step, running.streams, due)
            if step.commit and running.table_planned:
                self.decode_table.committed()
        else:
            self._last_rows = None
            named = running.streams if running.streams is not None else [
                all_streams[rid][label]
                for rid, label in admission.named_keys(step, running.padded)]
            for stream in named:
                # cleared whether or not the step keeps its tokens: a step
                # with commit=False still read these pages, and a mark left
                # set would make the request unevictable
                if staged_marks is None or stream not in staged_marks:
                    stream.clear_in_flight()
            if step.commit:
                self._add_spans(step, running.streams, due)
                if running.table_planned:
                    self.decode_table.committed()
        # post-forks copy what this step just wrote, so after the spans land
        try:
            self._forks.run(running, step.post_forks)
        except ForkCopyError as err:
            fault = fault or err
        if step.post_forks and step.commit and due is not None:
            # a post-fork may have cut a chain the spans' compare passed over:
            # every followed stream the step grew is looked at
            due = [st for seg in step.segments if seg.span
                   for st in (all_streams.get(seg.request_id, {}).get(seg.label),)
                   if st is not None and st.follow is not None]
        if due:
            # after the forks, as the model keys after them; before a fault is
            # raised, as the model's Commit keys whether or not a copy failed
            # S32: only a staged preplan's forks can still write into a stream
            # now (the running step's ran), and admit refuses a preplan whose
            # fork target the running step names (R57): asked, as the model
            # asks, but found only where a preplan is staged
            follow.key_followed(self._table, due, self._table.sharing.unkeyable(
                self.fork_targets) if self.preplan is not None else frozenset())
        if fault is not None:
            raise fault

    def _end_plain(self, step: KVStep, streams: list[CacheStream],
                   due: list[CacheStream] | None) -> None:
        """`commit` of a plain admit's step whose marks no staged preplan
        shares: what the general path's clear and `_add_spans` do."""
        segments = step.segments
        batch = self._decode_batch
        if batch is not None and streams is batch.streams and batch.intact:
            # the batch's step: every row one token on at once, and the
            # rows whose window passed a page release it
            rows = batch.end(step.commit, due is not None)
            if rows and due is not None:
                due.extend([streams[i] for i in rows])
            if step.commit:
                self._release_batch(batch)
            return
        dropped = CacheStream.end_step(
            streams, map(_span, segments) if step.commit else None, due)
        for stream in dropped:
            self._dropped_span(segments[streams.index(stream)])
        if self._table.releasing and step.commit:
            self._retire_plain(segments, streams)
        # last: a batch made here starts from the rows as this commit
        # leaves them, their windows' releases included (made before them,
        # each row's next release was asked of its count before this one)
        if len(streams) >= self.batch_rows:
            self._maybe_batch(step, streams)
        else:
            self._last_rows = None

    def _retire_plain(self, segments: Sequence[Segment], streams: list[CacheStream]) -> None:
        """W2 at a plain commit the general path ends: each stream whose
        window (or chunk) moved past a page releases it."""
        ps, behaviour = self._table.page_size, self._table.behaviour
        # a step names few labels (a hybrid one: one per group), each
        # asked once, and held only where it releases (None: it does
        # not); a stream is retired only where its window moved past a
        # page, not every step (W2)
        of_label: dict[str, LabelBehaviour | None] = {}
        # equal behaviours (a hybrid config's window groups of one W) as
        # one object, so rows in lockstep are told by identity
        alike: list[LabelBehaviour] = []
        # a hybrid request's groups of one type are in lockstep (the same
        # length and released count, one after another): asked once
        last_b: LabelBehaviour | None = None
        last_r = last_n = -1
        moved = False
        keys: list[Key] = []
        retiring: list[CacheStream] = []
        get = of_label.get
        for seg, stream in zip(segments, streams, strict=True):
            label = seg.label
            b = get(label, _UNASKED)
            if b is None:
                continue  # a label that releases nothing: most rows ask no more
            if b is _UNASKED:
                got = behaviour(label)
                if not got.releases:
                    of_label[label] = None
                    continue
                # asked once per label a step: a scan of the few kept
                b = of_label[label] = next((a for a in alike if a == got), got)
                if b is got:
                    alike.append(got)
            if not seg.span or stream.offloaded:
                continue
            r, n = stream.released, stream.stored_len
            if b is not last_b or r != last_r or n != last_n:
                last_b, last_r, last_n = b, r, n
                moved = b.released_after(r, n, ps) != r
            if moved:
                keys.append((seg.request_id, label))
                retiring.append(stream)
        if retiring:
            # each stream's release as `retire` makes it, the pages the
            # windows pass given back in one pool call
            self._table.retire_each(keys, retiring)

    def _maybe_batch(self, step: KVStep, streams: list[CacheStream]) -> None:
        """After a plain step the general path committed: the same streams
        decoded `_BATCH_AFTER` + 1 times in a row make a batch for the next.
        (A batch another step breaks up soon costs more than it saves: each
        row leaves it one by one, as in a decode batch interleaved with
        mixed steps, `benchmarks.control_plane.bench_mixed`.)"""
        segments = step.segments
        n = len(streams)
        if not (step.commit and list(map(_span, segments)).count(1) == n):
            self._last_rows = None
            return
        if streams != self._last_rows:
            self._last_rows, self._repeats = streams, 0
            return
        self._last_rows = streams
        self._repeats += 1
        if self._repeats < _BATCH_AFTER:
            return
        self._last_rows = None
        ps, behaviour = self._table.page_size, self._table.behaviour
        release_at = None
        if self._table.releasing:
            release_at = []
            for seg, s in zip(segments, streams, strict=True):
                ask = getattr(behaviour(seg.label), "next_release", None)
                if ask is None:
                    # an attention type of an engine's own from before
                    # `LabelBehaviour.next_release`: its rows step row by row
                    return
                release_at.append(ask(s.released, ps))
        self._decode_batch = StreamBatch.join(streams, tuple(segments), ps, release_at)

    def _release_batch(self, batch: StreamBatch) -> None:
        """W2 at a batch's commit: the rows whose length reached the next
        release of their window (or chunk) retire as `_end_plain`'s pass
        retires them, in one call, and are told where the next one is. What
        goes is `released_after`'s answer (`StreamTable.retire_each`); the
        batch only asks when."""
        rows = batch.passing()
        if not rows:
            return
        batch.retire(rows, self._table.retire_each)
        keys, streams = batch.keys, batch.streams
        ps, behaviour = self._table.page_size, self._table.behaviour
        batch.rearm(rows, [behaviour(keys[i][1]).next_release(streams[i].released, ps)
                           for i in rows])

    def _dropped_span(self, seg: Segment) -> None:
        # unreachable under R2-R5; kept as the last defence, loudly, because
        # it drops a committed span (I15)
        logger.error("KV %s: dropping %d committed tokens for request %r label %r; "
                     "the stream was offloaded mid-step",
                     self._name, seg.span, seg.request_id, seg.label)

    def _add_spans(self, step: KVStep, streams: list[CacheStream] | None,
                   due: list[CacheStream] | None) -> None:
        """``streams``: the segments' streams, as a plain admit found them;
        ``due``: the followed ones a page may have filled in (S33)."""
        all_streams = self._table.streams
        # asked once per commit, not per segment: most caches release
        # nothing, and this loop runs for every request of every decode step
        releasing = self._table.releasing
        for i, seg in enumerate(step.segments):
            span = seg.span
            if not span:
                continue
            stream = streams[i] if streams is not None else all_streams[seg.request_id][seg.label]
            if stream.offloaded:
                self._dropped_span(seg)
                continue
            stream.append_tokens(span)  # W4: the next token's position moves with it
            if due is not None and stream.stored_len >= stream.key_at:
                due.append(stream)
            if releasing:
                # W2: the label's behaviour lets go of what it no longer keeps
                self._table.retire((seg.request_id, seg.label), stream)


def projected_released(table: StreamTable, basis: Mapping[Key, int]) -> dict[Key, int]:
    """R67: the released count of each stream of a preplan's ``basis`` that
    releases, as the running step's commit leaves it (its length there), so
    the preplan's views start past the pages that commit lets go of."""
    if not table.releasing:
        return {}
    ps, streams = table.page_size, table.streams
    projected = {}
    for key, n in basis.items():
        behaviour = table.behaviour(key[1])
        if behaviour.releases:
            projected[key] = behaviour.released_after(streams[key[0]][key[1]].released, n, ps)
    return projected


def _stale(key: Key, planned: int, holds: int | None) -> PreplanStale:
    return PreplanStale(
        message=(f"the staged preplan was planned over length {planned}, but the stream "
                 f"holds {holds}: the step running under it committed otherwise; "
                 "clear_preplan and admit afresh"),
        request_id=key[0], label=key[1])
