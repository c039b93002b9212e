"""Misuse of the manager raises a `KVRefError`; refusals are values instead.

A refusal (`AdmitOutcome(ok=False)`) is an answer the engine plans around:
evict, retry, drop the request. An error is a bug in the caller: the state
is left exactly as it was, and the message names the request and label so
the log line alone says which call was wrong.
"""

from __future__ import annotations


class KVRefError(Exception):
    """Base of every misuse kvref reports."""

    def __init__(
        self, message: str, *, request_id: str | None = None, label: str | None = None
    ) -> None:
        parts = []
        if request_id is not None:
            parts.append(f"request {request_id!r}")
        if label is not None:
            parts.append(f"label {label!r}")
        where = " ".join(parts) + ": " if parts else ""
        super().__init__(where + message)
        self.request_id = request_id
        self.label = label


class UnknownRequestError(KVRefError, KeyError):
    """A request id that was never ingested, or was already removed."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class InvalidStepError(KVRefError, ValueError):
    """A step that cannot be run as written: a negative span, a fork onto itself."""


class StepNotAdmittedError(KVRefError):
    """plan or commit of a step whose streams were never admitted."""


class StepInFlightError(KVRefError):
    """A call that must not overlap an admitted step: of the same request, or
    a second step while one is admitted (one step runs at a time)."""


class StepOrderError(KVRefError):
    """A step call out of its order: a step planned a second time."""


class ForkCopyError(KVRefError):
    """A fork's page copy failed. Its target was left empty (length 0), never
    half old and half new; the call's other work was done."""


class ReloadCopyError(KVRefError):
    """A host-to-device copy failed during reload; nothing was reloaded and
    the host copies are kept."""


class PreplanPendingError(KVRefError):
    """A second preplan while one is staged."""


class PublishedInfoError(KVRefError, ValueError):
    """Published KV info that names pages or lengths this cache cannot hold."""


class KVShapeError(KVRefError, ValueError):
    """K/V handed to `write_kv` with the wrong token count, shape or dtype."""


class OffloadCopyError(KVRefError):
    """A host copy failed; every claim of that offload was undone."""


class OffloadStateError(KVRefError):
    """An offload handle used after it was committed or abandoned."""


class AsymmetricStateError(KVRefError, RuntimeError):
    """Tensor-parallel ranks disagree on allocator state after warmup."""


class InvalidConfigError(KVRefError, ValueError):
    """A `KVConfig` (or `KVReqConfig`) field of the wrong type or out of range."""


class InvalidArgumentError(KVRefError, ValueError):
    """A call argument of the wrong type or out of range: a request id that is
    not a ``str``, a layer index outside ``[0, num_layers)``."""


class KVDeviceError(KVShapeError):
    """K/V handed to `write_kv` on another device than the cache."""


class ReleasedPrefixError(KVRefError, ValueError):
    """A truncate of a windowed stream whose new length's window would reach
    into tokens the window already released (W6 of specs/retention.md):
    ``max(0, new_len - W) < released``. Nothing changed."""


class WindowUnsupportedError(KVRefError, NotImplementedError):
    """A mechanism kvref does not implement for a windowed label
    (``KVConfig.retention``). No call raises it today: every mechanism over a
    windowed label is implemented (R63-R69), and a preplan whose forks name
    one is refused as a value (``PreplanRefused``). Kept exported so that
    callers that catch it keep importing."""


class StreamUnavailableError(KVRefError):
    """A call that needs a settled, resident stream met one that is not: an
    offload claims it or holds it on the host, or a retrieve is still copying
    into it or failed (reset or remove the request)."""


class PublishLeasedError(KVRefError):
    """A call that would take or change pages a `publish` leased to a peer
    (reset, remove, truncate): release it first (`release_published`), or let it
    expire (`KVConfig.publish_lease_s`)."""


class PreplanStaleError(KVRefError):
    """The staged preplan was built over a running step that did not commit as
    admitted (a stream it shares holds another length): promotion refused,
    nothing changed; clear_preplan and admit the step afresh (R42)."""
