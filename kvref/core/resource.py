"""The resource interface an engine drives, and what it hands resources."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvref.core.errors import InvalidArgumentError


class GatherGroup(Protocol):
    """One process group as a resource uses it: its size and an
    ``all_gather`` (`kvref.parallel.groups.CommGroup` is kvref's)."""

    @property
    def world_size(self) -> int: ...

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor: ...


class ProcessGroups(Protocol):
    """The engine's process groups as a resource reads them: this rank's
    place in the world, and the tensor- and sequence-parallel groups the
    post-warmup check gathers over (`kvref.parallel.groups.JointGroups` is
    kvref's). A protocol here, so the ground floor names what it needs
    without importing the package that builds it."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def tp_group(self) -> GatherGroup: ...

    @property
    def sp_group(self) -> GatherGroup: ...


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
    joint_comm_group: ProcessGroups | None = None
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
        """The label calls that name none address (the model runner's cursor).
        Raises `InvalidArgumentError` for a label that is not a ``str``: taken
        as is, it surfaced later as an unknown stream, far from the call."""
        if not isinstance(label, str):
            raise InvalidArgumentError(
                f"set_default_label: label must be a str, got {type(label).__name__} {label!r:.40}")
        self._default_label = label

    def set_default_layer_idx(self, layer_idx: int | None) -> None:
        """The layer calls that name none address; None: no cursor set."""
        self._default_layer_idx = layer_idx

    def reset_default_cursors(self) -> None:
        """Both cursors back to their start: label ``"main"``, no layer."""
        self._default_label = "main"
        self._default_layer_idx = None
