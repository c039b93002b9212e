"""The public import surface is frozen: moving modules into packages (issue
20) must not change what an engine imports. Two lists, written out rather
than computed, so that dropping a name fails here:

- every name the reference manager imports or defines that kvref implements
  (`../shared/reference/kv_manager.seed.txt`), and
- every name ``kvref.__all__`` held before the move.
"""

from __future__ import annotations

import pytest

import kvref

# the reference module's own names, and those it imports from its engine
REFERENCE = (
    # defined in the reference's kv_manager
    "RetentionPolicy", "KVSequenceInfo", "PublishedKVInfo", "KVPlanState", "KVManager",
    # imported by it from the engine's resources, kv and step modules
    "JointGroups", "AttentionResource", "CGSlotSpec", "EngineResourceInfo", "PublishedInfo",
    "KVCache", "PageAllocator", "KVConfig", "KVReqConfig", "KVSpec", "KVStep", "CPUPagePool",
    "SINK_PAGE", "KVPlanOutput", "KVPlanOutputs", "PagedIndptrs", "SequenceView",
    "build_paged_indptrs", "group_by_plan_label", "KVTransferManager", "TransferEngineInfo",
    "ADMIT_OK", "AdmitFailedReason", "AdmitOutcome", "AdmitRuntimeError", "AllocationFailed",
    "RequestOffloading", "Segment", "StepContext",
)

# kvref.__all__ at 6da0c11, before kvref/ moved into packages
EXPORTED = (
    "ADMIT_OK",
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
    "ReleasedPrefixError",
    "ReloadCopyError",
    "ReloadOutcome",
    "ReloadReason",
    "RequestOffloading",
    "ResetRefused",
    "Resource",
    "RetentionPolicy",
    "RetrieveInProgress",
    "RetrieveStale",
    "Runtime",
    "SINK_PAGE",
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
    "WindowUnsupportedError",
    "build_paged_indptrs",
    "default_runtime",
    "group_by_plan_label",
    "set_default_runtime",
)


@pytest.mark.parametrize("name", sorted(set(REFERENCE)))
def test_reference_name_imports(name: str) -> None:
    assert name in kvref.__all__, name
    assert getattr(kvref, name) is not None


@pytest.mark.parametrize("name", EXPORTED)
def test_exported_name_still_exported(name: str) -> None:
    assert name in kvref.__all__, name
    namespace: dict[str, object] = {}
    exec(f"from kvref import {name}", namespace)  # the form engines write
    assert namespace[name] is getattr(kvref, name)


def test_all_names_resolve() -> None:
    missing = [n for n in kvref.__all__ if not hasattr(kvref, n)]
    assert not missing, missing
