"""The resource interface an engine drives, and what it hands resources."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kvref.parallel.groups import JointGroups


@dataclass
class PublishedInfo:
    """What one resource publishes about a request for another to retrieve."""


@dataclass(frozen=True)
class CGSlotSpec:
    """One CUDA-graph runner slot that will replay captured steps."""

    slot: int
    max_batch_size: int = 0


@dataclass
class EngineResourceInfo:
    """Per-worker facts a resource is built with (`KVManager.build`)."""

    device: torch.device
    joint_comm_group: JointGroups | None = None
    transfer_engine_info: Any = None
    kv_dtype: torch.dtype = torch.bfloat16


class Resource:
    """Anything an engine step admits, plans and commits against."""

    @property
    def supports_preplan(self) -> bool:
        return False

    @property
    def supports_eviction(self) -> bool:
        return False


class AttentionResource(Resource):
    """A resource attention layers read from between plan and commit.

    Layers do not pass the label and layer index on every call: the model
    runner sets them as cursors (`set_default_label`, `set_default_layer_idx`)
    and `plan` resets them, so a stale cursor from the previous step cannot
    address this step's pages.
    """

    def __init__(self) -> None:
        self._default_label: str = "main"
        self._default_layer_idx: int | None = None

    def set_default_label(self, label: str) -> None:
        """The label calls that name none address (the model runner's cursor)."""
        self._default_label = label

    def set_default_layer_idx(self, layer_idx: int | None) -> None:
        """The layer calls that name none address; None: no cursor set."""
        self._default_layer_idx = layer_idx

    def reset_default_cursors(self) -> None:
        """Both cursors back to their start: label ``"main"``, no layer."""
        self._default_label = "main"
        self._default_layer_idx = None
