"""kvref: a paged KV-cache manager for LLM inference, verified against a model.

The public names are the reference manager's, so engine code written
against it ports unchanged.
"""

from kvref.allocator import PageAllocator
from kvref.base import (
    AttentionResource,
    CGSlotSpec,
    EngineResourceInfo,
    PublishedInfo,
    Resource,
)
from kvref.cache import KVCache
from kvref.config import KVConfig, KVLayout, KVReqConfig, KVSpec
from kvref.distributed import JointGroups
from kvref.errors import (
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
    ReloadCopyError,
    StepInFlightError,
    StepNotAdmittedError,
    StepOrderError,
    StreamUnavailableError,
    UnknownRequestError,
)
from kvref.host_pool import CPUPagePool
from kvref.manager import KVManager
from kvref.offload import Offload
from kvref.outcomes import (
    HostPoolView,
    OffloadOutcome,
    OffloadReason,
    ReloadOutcome,
    ReloadReason,
)
from kvref.page_pool import ResetRefused
from kvref.plan import (
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
from kvref.published import (
    KVSequenceInfo,
    PublishedKVInfo,
    PublishRefused,
    RetrieveStale,
    UnknownRequest,
)
from kvref.runtime import Runtime, ThreadingRuntime, default_runtime, set_default_runtime
from kvref.step import (
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
from kvref.transfer import KVTransferManager, TransferEngineInfo

__all__ = [
    "ADMIT_OK",
    "SINK_PAGE",
    "AdmitFailedReason",
    "AdmitOutcome",
    "AdmitRuntimeError",
    "AllocationFailed",
    "AsymmetricStateError",
    "AttentionResource",
    "BucketKey",
    "CGSlotSpec",
    "CPUPagePool",
    "EngineResourceInfo",
    "ForkCopyError",
    "HostPoolView",
    "InvalidStepError",
    "JointGroups",
    "KVCache",
    "KVConfig",
    "KVLayout",
    "KVManager",
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
    "OffloadOutcome",
    "OffloadReason",
    "OffloadStateError",
    "PageAllocator",
    "PagedIndptrs",
    "PreplanPendingError",
    "PreplanRefused",
    "PreplanStale",
    "PreplanStaleError",
    "PublishLeasedError",
    "PublishRefused",
    "PublishedInfo",
    "PublishedInfoError",
    "PublishedKVInfo",
    "ReloadCopyError",
    "ReloadOutcome",
    "ReloadReason",
    "RequestOffloading",
    "ResetRefused",
    "Resource",
    "RetrieveInProgress",
    "RetrieveStale",
    "Runtime",
    "Segment",
    "SequenceView",
    "SlotLease",
    "StepContext",
    "StepInFlightError",
    "StepNotAdmittedError",
    "StepOrderError",
    "StreamUnavailableError",
    "ThreadingRuntime",
    "TransferEngineInfo",
    "UnknownRequest",
    "UnknownRequestError",
    "ViewRows",
    "build_paged_indptrs",
    "default_runtime",
    "group_by_plan_label",
    "set_default_runtime",
]
