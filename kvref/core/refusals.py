"""How an admit (and a publish) refuses: typed values naming the stream, the
base `AdmitFailedReason` every mechanism's refusal extends, and the admit's
answer. Here, not in `kvref.stepping`, because the page pool, offload and
transfer refuse with them too; `kvref.stepping.step` re-exports them."""

from __future__ import annotations

from dataclasses import dataclass


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
    """The call would overwrite or give back pages of a request whose
    publication a peer still holds: a fork of the step (R50), a commit that
    releases window pages (R70), a copy-on-write of a page it names, or a
    retrieve into it that releases or copies such a page (R71). Nothing
    changed; retry once the peer released it (`release_published`) or the
    lease expired."""


@dataclass(frozen=True, kw_only=True)
class ForkPending(AdmitFailedReason):
    """`publish` while a running or staged step still has forks to apply to
    the request: they would overwrite what the peer copies (R50). Publish
    once that step committed."""


@dataclass(frozen=True, kw_only=True)
class WindowPending(AdmitFailedReason):
    """`publish` while a running or staged step's commit would release window
    pages (W2) of the request that hold committed tokens: the peer would copy
    pages the pool hands to another stream (R70). Publish once it committed."""


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
