"""What an engine asks of the manager each step: the step, its segments and
forks, its context, and which segments plan together. Every mechanism and
`kvref.validate` read these; `kvref.stepping.step` re-exports them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

Fork = tuple[str, str]  # (from_label, to_label), applied to each padded request


@dataclass(frozen=True, slots=True)
class Segment:
    """``span`` new tokens of one request's stream computed by this step."""

    request_id: str
    label: str
    span: int


@dataclass(frozen=True)
class KVStep:
    """One forward pass over the cache.

    ``pre_forks`` copy a stream onto another before the step runs (plan);
    ``post_forks`` after its spans are committed. ``combined_labels`` groups
    labels planned as one batch under the group's first label, label-major:
    ``[("main", "cfg")]`` plans every main segment, then every cfg one, and
    the attention layer writes both with ``label="main"``.
    ``commit=False`` runs the step (reads, writes) but keeps no tokens.
    """

    segments: Sequence[Segment]
    commit: bool = True
    pre_forks: Sequence[Fork] = ()
    post_forks: Sequence[Fork] = ()
    combined_labels: Sequence[Sequence[str]] = ()


@dataclass(frozen=True, slots=True)
class BucketKey:
    """A CUDA-graph capture bucket: the padded shape a graph was recorded at."""

    batch_size: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class SlotLease:
    """The graph slot this step replays in, and the bucket it was padded to."""

    slot: int
    bucket: BucketKey


@dataclass(frozen=True)
class StepContext:
    """Per-step facts that are not part of the step itself.

    ``padded_request_ids``: the batch's requests, padding included; forks
    apply to each. ``is_preplan``: this admit/plan prepares the *next* step.
    """

    padded_request_ids: Sequence[str] = ()
    is_preplan: bool = False
    slot_lease: SlotLease | None = None


def group_by_plan_label(
    segments: Iterable[Segment], combined_labels: Sequence[Sequence[str]] = ()
) -> dict[str, list[Segment]]:
    """Segments per plan label; a combined group is label-major under its first label.

    Label-major (every ``main`` segment, then every ``cfg`` one) is what lets
    attention treat a combined batch as one ragged batch with one write.
    """
    if not combined_labels:
        segments = list(segments)
        if len({s.label for s in segments}) <= 1:
            # one label (every plain decode step): one group, in order
            return {segments[0].label: segments} if segments else {}
    plan_label_of: dict[str, str] = {}
    rank_in_group: dict[str, int] = {}
    for group in combined_labels:
        for rank, label in enumerate(group):
            if label in plan_label_of:
                raise ValueError(f"label {label!r} is in two combined groups")
            plan_label_of[label] = group[0]
            rank_in_group[label] = rank
    grouped: dict[str, list[Segment]] = {}
    for s in segments:
        grouped.setdefault(plan_label_of.get(s.label, s.label), []).append(s)
    for plan_label, segs in grouped.items():
        if len(segs) > 1 and plan_label in rank_in_group:
            # stable: within a label, the batch's request order is kept
            segs.sort(key=lambda s: rank_in_group[s.label])
    return grouped


class StepForks(Protocol):
    """What publish and retrieve ask of the step mechanism (`kvref.stepping.
    admit_plan_commit.Stepping` answers): whether a running or staged step
    still forks onto a request (R50), and the copy of the tokens a stream
    holds in its shared last page into the private page a retrieve writes
    after them (R52). Called under the table's lock."""

    def forks_pending(self, rid: str) -> bool: ...

    def release_pending(self, rid: str) -> bool: ...

    def copy_page_head(self, src: int, dst: int, slots: int) -> None: ...
