"""A manager an engine team might write: it holds a `KVManager` and forwards
to it, by composition, not by subclassing.

It offers exactly what the packaged conformance harness drives
(`kvref.testing.driver.ManagerUnderTest`: public calls and `observe`) and
nothing else; so the harness passing against it shows the harness needs no
private attribute and no subclass. It imports only kvref, so the e2e test
copies this file into a project outside the checkout as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvref import (
    AdmitOutcome,
    HostPoolView,
    KVManager,
    KVObservation,
    KVPlanOutputs,
    KVReqConfig,
    KVStep,
    Offload,
    OffloadOutcome,
    PublishedKVInfo,
    PublishRefused,
    ReloadOutcome,
    ResetRefused,
    StepContext,
)


class ComposedManager:
    """Forwards the harness's surface to the `KVManager` it holds."""

    def __init__(self, **kwargs: Any) -> None:
        self._inner = KVManager(**kwargs)
        self.calls = 0  # what an engine's own bookkeeping might count

    def ingest_request(self, rid: str, overrides: KVReqConfig | None = None) -> None:
        self.calls += 1
        self._inner.ingest_request(rid, overrides)

    def has_request(self, rid: str) -> bool:
        return self._inner.has_request(rid)

    def admit(self, step: KVStep, ctx: StepContext) -> AdmitOutcome:
        self.calls += 1
        return self._inner.admit(step, ctx)

    def plan(self, step: KVStep, ctx: StepContext) -> KVPlanOutputs:
        return self._inner.plan(step, ctx)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int | None = None,
                 label: str | None = None, return_tensor: bool = False) -> Any:
        return self._inner.write_kv(k, v, layer_idx, label, return_tensor)

    def read_kv(self, layer_idx: int | None = None,
                plan_label: str | None = None) -> torch.Tensor:
        return self._inner.read_kv(layer_idx, plan_label)

    def commit(self, step: KVStep, ctx: StepContext) -> None:
        self._inner.commit(step, ctx)

    def clear_preplan(self) -> None:
        self._inner.clear_preplan()

    def begin_offload(self, rid: str) -> Offload | None:
        return self._inner.begin_offload(rid)

    def offload_outcome(self, rid: str) -> OffloadOutcome:
        return self._inner.offload_outcome(rid)

    def reload(self, rid: str) -> bool:
        return self._inner.reload(rid)

    def reload_outcome(self, rid: str) -> ReloadOutcome:
        return self._inner.reload_outcome(rid)

    def reload_pages_needed(self, rid: str) -> int:
        return self._inner.reload_pages_needed(rid)

    def get_offload_priority(self, rid: str) -> float:
        return self._inner.get_offload_priority(rid)

    def host_pool(self) -> HostPoolView:
        return self._inner.host_pool()

    def publish(self, request_id: str) -> PublishedKVInfo | PublishRefused:
        return self._inner.publish(request_id)

    def release_published(self, request_id: str) -> None:
        self._inner.release_published(request_id)

    def admit_retrieve(self, rid: str, node_name: str | None = None,
                       graph_walk: str | None = None,
                       published: PublishedKVInfo | None = None) -> AdmitOutcome:
        return self._inner.admit_retrieve(rid, node_name, graph_walk, published)

    def reset_request(self, rid: str, free: bool = False) -> None:
        self._inner.reset_request(rid, free)

    def remove_request(self, rid: str) -> None:
        self._inner.remove_request(rid)

    def truncate(self, rid: str, label: str, new_len: int) -> int:
        return self._inner.truncate(rid, label, new_len)

    def read_stream(self, rid: str, label: str = "main") -> torch.Tensor:
        return self._inner.read_stream(rid, label)

    def layer_view(self, layer_idx: int | None = None) -> torch.Tensor:
        return self._inner.layer_view(layer_idx)

    def cache_prefix(self, rid: str, label: str, token_ids: Sequence[int],
                     start: int = 0) -> int:
        return self._inner.cache_prefix(rid, label, token_ids, start)

    def follow_tokens(self, rid: str, token_ids: Sequence[int], label: str = "main") -> int:
        return self._inner.follow_tokens(rid, token_ids, label)

    def match_prefix(self, rid: str, label: str, token_ids: Sequence[int]) -> int:
        return self._inner.match_prefix(rid, label, token_ids)

    def reset_prefix_cache(self) -> int | ResetRefused:
        return self._inner.reset_prefix_cache()

    def reclaimable(self, rid: str) -> int:
        return self._inner.reclaimable(rid)

    @property
    def num_free_pages(self) -> int:
        return self._inner.num_free_pages

    def observe(self) -> KVObservation:
        return self._inner.observe()

    def check(self) -> list[str]:
        return self._inner.check()


def make_manager(**kwargs: Any) -> ComposedManager:
    return ComposedManager(**kwargs)
