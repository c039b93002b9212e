"""The admitted step and the staged preplan: what the stepping mechanism
remembers between admit, plan and commit (R23: one running, one staged)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvref.core.stream_table import Key
from kvref.core.streams import CacheStream
from kvref.stepping.admission import named_keys
from kvref.stepping.plan import KVPlanOutputs, KVPlanState
from kvref.stepping.step import Fork, KVStep, Segment, StepContext

Table = Mapping[str, Mapping[str, CacheStream]]


StepShape = tuple[tuple[Segment, ...], bool, tuple[Fork, ...], tuple[Fork, ...],
                  tuple[tuple[str, ...], ...]]


def shape_of(step: KVStep) -> StepShape:
    """What the step held at admit, out of reach of the caller's lists."""
    return (tuple(step.segments), step.commit, tuple(step.pre_forks), tuple(step.post_forks),
            _combined(step.combined_labels))


def _combined(groups: Sequence[Sequence[str]]) -> tuple[tuple[str, ...], ...]:
    # most steps combine nothing: no generator for them (issue 42, a decode
    # step asks at admit, plan and commit)
    return tuple(tuple(c) for c in groups) if groups else ()


def unchanged(step: KVStep, shape: StepShape) -> bool:
    """``step`` still holds what ``shape`` recorded. The admitted step is the
    caller's object, and its lists can change in place between admit and
    commit: a segment appended after plan was committed onto a stream with
    no pages for it (found by the fast-path work, issue 11)."""
    segments = step.segments
    # ==, element identity first (in C: the usual caller hands the same
    # objects back), then equality (issue 42: an identity pass by
    # ``all(map(operator.is_, ...))`` cost more than this whole compare)
    return (len(segments) == len(shape[0]) and tuple(segments) == shape[0]
            and step.commit == shape[1] and tuple(step.pre_forks) == shape[2]
            and tuple(step.post_forks) == shape[3]
            and _combined(step.combined_labels) == shape[4])


@dataclass
class RunningStep:
    """The admitted step, from admit (or a preplan's promotion) to commit (R23)."""

    step: KVStep
    padded: tuple[str, ...]  # the admit's padded_request_ids: what its forks reserved
    # streams its admit created and no fork has written since: a fork from
    # one of them that is still empty copies nothing (R20)
    created: set[Key]
    planned: bool = False
    # its pre-forks ran (perhaps at a plan that failed): never twice
    forked: bool = False
    # with shared pages, the pre-forks of a promoted preplan copy into the
    # target's own pages: the views handed out name them (R57)
    copy_forks: bool = False
    # what the step held at admit (a promoted preplan's: at its admit)
    shape: StepShape | None = None
    # a plain admit's streams, one per segment in order, and the rows it
    # appended pages to: what plan and commit reuse instead of looking up
    # every stream again (issue 28); None after any other admit
    streams: list[CacheStream] | None = None
    grown: list[int] = field(default_factory=list)
    # planned by the kept decode table (`kvref.stepping.decode_table`): its
    # commit tells the table
    table_planned: bool = False

    def __post_init__(self) -> None:
        if self.shape is None:
            self.shape = shape_of(self.step)

    def matches(self, step: KVStep) -> bool:
        """``step`` is the admitted step, as it was admitted."""
        assert self.shape is not None
        return (step is self.step or step == self.step) and unchanged(step, self.shape)


@dataclass
class StagedPreplan:
    """A step admitted (and maybe planned) one ahead, not yet promoted."""

    step: KVStep
    ctx: StepContext
    # labels this step's admit created; an abandon removes them with their pages
    created: list[Key]
    marked: list[Key]
    outputs: KVPlanOutputs | None = None
    states: dict[str, KVPlanState] = field(default_factory=dict)
    # admitted over a running step (R41): for the streams both name, the
    # lengths that step leaves once committed as admitted; what this step
    # was reserved and planned from, and what promotion checks (R42)
    basis: dict[Key, int] = field(default_factory=dict)
    # the streams of its basis whose label releases: the released count the
    # running step's commit leaves (`projected_released`), where its views
    # start (R67)
    released: dict[Key, int] = field(default_factory=dict)
    shape: StepShape = field(init=False)

    def __post_init__(self) -> None:
        self.shape = shape_of(self.step)

    def matches(self, step: KVStep) -> bool:
        """``step`` is the staged step, as it was admitted."""
        return (step is self.step or step == self.step) and unchanged(step, self.shape)


def same_step(step: KVStep, ctx: StepContext, admitted: RunningStep | StagedPreplan,
              padded: tuple[str, ...]) -> bool:
    """The same step admitted again: as it was admitted, and padded to the
    same requests (its forks reserved for those)."""
    return admitted.matches(step) and tuple(ctx.padded_request_ids) == padded


def where(step: KVStep, admitted: KVStep | None = None) -> dict[str, str]:
    """The request and label an error about ``step`` names: its first segment
    that the ``admitted`` step does not have, else its first."""
    segments = list(step.segments) if isinstance(step, KVStep) else []
    known = {(g.request_id, g.label) for g in admitted.segments} if admitted else set()
    stray = [g for g in segments if (g.request_id, g.label) not in known] or segments
    if not stray:
        return {}
    return {"request_id": stray[0].request_id, "label": stray[0].label}


def settled_lengths(streams: Table, running: RunningStep) -> dict[Key, int]:
    """The length of each stream the running step names once it commits as
    admitted, fault-free: its pre-forks (unless they ran), its spans if it
    keeps them, its post-forks, as `kvref.stepping.forks` applies them (R20 included).
    A preplan over it is reserved and planned from these (R41)."""
    unfilled = set(running.created)
    length: dict[Key, int] = {}

    def length_of(key: Key) -> int:
        return length[key] if key in length else streams[key[0]][key[1]].stored_len

    def fork(forks: Sequence[tuple[str, str]]) -> None:
        for from_label, to_label in forks:
            for rid in running.padded:
                src = (rid, from_label)
                if src in unfilled and length_of(src) == 0:
                    continue  # R20: nothing to copy
                unfilled.discard((rid, to_label))
                length[(rid, to_label)] = length_of(src)

    step = running.step
    if not running.forked:
        fork(step.pre_forks)
    if step.commit:
        for g in step.segments:
            key = (g.request_id, g.label)
            length[key] = length_of(key) + g.span
    fork(step.post_forks)
    # admit made every named stream (R16)
    return {key: length_of(key) for key in named_keys(step, running.padded)}


@dataclass(frozen=True, slots=True)
class SettledLength:
    stored_len: int


def settled_table(streams: Table, settled: Mapping[Key, int]
                  ) -> dict[str, dict[str, SettledLength]]:
    """The table's lengths with ``settled`` over them: what the checks that read
    only lengths (max_seq_len) see of a preplan over the running step."""
    return {rid: {label: SettledLength(settled.get((rid, label), s.stored_len))
                  for label, s in labels.items()} for rid, labels in streams.items()}


def stale(streams: Table, staged: StagedPreplan) -> Key | None:
    """The first stream the staged preplan shares with the step it was built
    over that no longer holds the length (or the projected released count)
    it was built from; None when it may be promoted (R42, R67). Its marks
    kept every other change out (R2, R5, R14)."""
    released = staged.released
    for (rid, label), n in staged.basis.items():
        stream = streams.get(rid, {}).get(label)
        if stream is None or stream.stored_len != n or (
                released and stream.released != released.get((rid, label), stream.released)):
            return (rid, label)
    return None
