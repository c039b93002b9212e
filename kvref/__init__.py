"""kvref: a paged KV-cache manager for LLM inference, verified against a model.

The public names are the reference manager's, so engine code written
against it ports unchanged.
"""

from kvref import _moved
from kvref.core.allocator import PageAllocator
from kvref.core.cache import KVCache
from kvref.core.config import KVConfig, KVLayout, KVReqConfig, KVSpec, RetentionPolicy
from kvref.core.errors import (
    AsymmetricStateError,
    ForkCopyError,
    InvalidStepError,
    KVRefError,
    KVShapeError,
    OffloadCopyError,
    OffloadStateError,
    PreplanPendingError,
    PreplanStaleError,
    PublishedInfoError,
    PublishLeasedError,
    ReleasedPrefixError,
    ReloadCopyError,
    StepInFlightError,
    StepNotAdmittedError,
    StepOrderError,
    StreamUnavailableError,
    UnknownRequestError,
    WindowUnsupportedError,
)
from kvref.core.groups import AttentionGroup, groups_for
from kvref.core.page_pool import ResetRefused
from kvref.core.resource import (
    AttentionResource,
    CGSlotSpec,
    EngineResourceInfo,
    PublishedInfo,
    Resource,
)
from kvref.core.runtime import Runtime, ThreadingRuntime, default_runtime, set_default_runtime
from kvref.manager import KVManager
from kvref.observation import (
    HostCopyObservation,
    HostPoolObservation,
    KVObservation,
    OffloadObservation,
    OffloadState,
    PageObservation,
    PageState,
    PreplanObservation,
    RequestConfigObservation,
    RetrieveState,
    StreamObservation,
)
from kvref.offload.handle import Offload
from kvref.offload.host_pool import CPUPagePool
from kvref.offload.outcomes import (
    HostPoolView,
    OffloadOutcome,
    OffloadReason,
    ReloadOutcome,
    ReloadReason,
)
from kvref.parallel.groups import JointGroups
from kvref.stepping.plan import (
    SINK_PAGE,
    KVPlanOutput,
    KVPlanOutputs,
    KVPlanState,
    PagedIndptrs,
    SequenceView,
    ViewRows,
    build_paged_indptrs,
    group_by_plan_label,
)
from kvref.stepping.step import (
    ADMIT_OK,
    AdmitFailedReason,
    AdmitOutcome,
    AdmitRuntimeError,
    AllocationFailed,
    BucketKey,
    KVStep,
    PreplanRefused,
    PreplanStale,
    RequestOffloading,
    RetrieveInProgress,
    Segment,
    SlotLease,
    StepContext,
)
from kvref.transfer.engine import KVTransferManager, TransferEngineInfo
from kvref.transfer.published import (
    KVSequenceInfo,
    PublishedKVInfo,
    PublishRefused,
    RetrieveStale,
    UnknownRequest,
)

__all__ = [
    "ADMIT_OK",
    "SINK_PAGE",
    "AdmitFailedReason",
    "AdmitOutcome",
    "AdmitRuntimeError",
    "AllocationFailed",
    "AsymmetricStateError",
    "AttentionGroup",
    "AttentionResource",
    "BucketKey",
    "CGSlotSpec",
    "CPUPagePool",
    "EngineResourceInfo",
    "ForkCopyError",
    "HostCopyObservation",
    "HostPoolObservation",
    "HostPoolView",
    "InvalidStepError",
    "JointGroups",
    "KVCache",
    "KVConfig",
    "KVLayout",
    "KVManager",
    "KVObservation",
    "KVPlanOutput",
    "KVPlanOutputs",
    "KVPlanState",
    "KVRefError",
    "KVReqConfig",
    "KVSequenceInfo",
    "KVShapeError",
    "KVSpec",
    "KVStep",
    "KVTransferManager",
    "Offload",
    "OffloadCopyError",
    "OffloadObservation",
    "OffloadOutcome",
    "OffloadReason",
    "OffloadState",
    "OffloadStateError",
    "PageAllocator",
    "PageObservation",
    "PageState",
    "PagedIndptrs",
    "PreplanObservation",
    "PreplanPendingError",
    "PreplanRefused",
    "PreplanStale",
    "PreplanStaleError",
    "PublishLeasedError",
    "PublishRefused",
    "PublishedInfo",
    "PublishedInfoError",
    "PublishedKVInfo",
    "ReleasedPrefixError",
    "ReloadCopyError",
    "ReloadOutcome",
    "ReloadReason",
    "RequestConfigObservation",
    "RequestOffloading",
    "ResetRefused",
    "Resource",
    "RetentionPolicy",
    "RetrieveInProgress",
    "RetrieveStale",
    "RetrieveState",
    "Runtime",
    "Segment",
    "SequenceView",
    "SlotLease",
    "StepContext",
    "StepInFlightError",
    "StepNotAdmittedError",
    "StepOrderError",
    "StreamObservation",
    "StreamUnavailableError",
    "ThreadingRuntime",
    "TransferEngineInfo",
    "UnknownRequest",
    "UnknownRequestError",
    "ViewRows",
    "WindowUnsupportedError",
    "build_paged_indptrs",
    "default_runtime",
    "group_by_plan_label",
    "groups_for",
    "set_default_runtime",
]

# the import paths from before the package move, deprecated (kvref._moved)
_moved.install()
