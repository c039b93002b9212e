"""What an engine asks of the manager each step, and how a refusal reads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True, kw_only=True)
class AdmitFailedReason:
    """Why an admit refused: the base of every refusal, naming the stream."""

    message: str = ""
    request_id: str | None = None
    label: str | None = None


@dataclass(frozen=True, kw_only=True)
class AllocationFailed(AdmitFailedReason):
    """Not enough free device pages; evict ``pages_short`` more and retry."""

    pages_short: int = 0


@dataclass(frozen=True, kw_only=True)
class RequestOffloading(AdmitFailedReason):
    """A stream the step names is offloaded or being offloaded; reload first."""


@dataclass(frozen=True, kw_only=True)
class RetrieveInProgress(AdmitFailedReason):
    """A stream the step names is still receiving a retrieve; its pages hold
    no KV yet. Retry once `admit_retrieve` reports the request ready."""


@dataclass(frozen=True, kw_only=True)
class PublishLeased(AdmitFailedReason):
    """A fork of the step would overwrite a stream of a request whose
    publication a peer still holds (R50); retry once the peer released it
    (`release_published`) or the lease expired."""


@dataclass(frozen=True, kw_only=True)
class ForkPending(AdmitFailedReason):
    """`publish` while a running or staged step still has forks to apply to
    the request: they would overwrite what the peer copies (R50). Publish
    once that step committed."""


@dataclass(frozen=True, kw_only=True)
class _AdmitRuntimeErrorFields(AdmitFailedReason):
    pass


class AdmitRuntimeError(_AdmitRuntimeErrorFields):
    """Terminal for the request (not the worker): drop it."""

    def __init__(
        self, message: str = "", *, request_id: str | None = None, label: str | None = None
    ) -> None:
        # positional message, as callers of the reference construct it
        super().__init__(message=message, request_id=request_id, label=label)


@dataclass(frozen=True)
class AdmitOutcome:
    """An admit's answer: ``ok`` (the step is reserved), ``ready`` (its
    retrieves landed) and, when refused, the typed ``reason``."""

    ok: bool = True
    # False while a retrieve is still copying: admitted, but not schedulable
    ready: bool = True
    reason: AdmitFailedReason | None = None


ADMIT_OK = AdmitOutcome()


@dataclass(frozen=True, kw_only=True)
class PreplanRefused(AdmitFailedReason):
    """With shared pages (`KVConfig.enable_prefix_caching`), a preplan whose
    views a fork or a copy-on-write would move before it runs: one with
    pre-forks, one over a running step with forks still to apply, or one
    writing a stream the running step names whose last page is shared. A
    plan's views name pages, and a copy-on-write fork gives its target other
    pages (R57). Nothing changed: admit the step once the running one
    committed, without preplanning it."""


@dataclass(frozen=True, kw_only=True)
class PreplanStale(AdmitFailedReason):
    """The staged preplan was built from the lengths the running step would
    leave, and it committed otherwise (a fork copy failed): nothing changed;
    clear_preplan, then admit the step afresh (R42)."""
