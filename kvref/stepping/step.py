"""What an engine asks of the manager each step, and how a refusal reads.

The vocabulary lives in the ground floor (`kvref.core.steps`,
`kvref.core.refusals`) so that core, validation and every mechanism can
stand on it; this module keeps the import path engines and the docs use."""

from kvref.core.refusals import (
    ADMIT_OK,
    AdmitFailedReason,
    AdmitOutcome,
    AdmitRuntimeError,
    AllocationFailed,
    ForkPending,
    PreplanRefused,
    PreplanStale,
    PublishLeased,
    RequestOffloading,
    RetrieveInProgress,
    WindowPending,
)
from kvref.core.steps import BucketKey, Fork, KVStep, Segment, SlotLease, StepContext

__all__ = [
    "ADMIT_OK", "AdmitFailedReason", "AdmitOutcome", "AdmitRuntimeError", "AllocationFailed",
    "BucketKey", "Fork", "ForkPending", "KVStep", "PreplanRefused", "PreplanStale",
    "PublishLeased", "RequestOffloading", "RetrieveInProgress", "Segment", "SlotLease",
    "StepContext", "WindowPending",
]
