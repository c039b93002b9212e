"""What a manager publishes about a request for another to retrieve."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvref.base import PublishedInfo


@dataclass
class KVSequenceInfo:
    """One stream as published: its length, where its pages live, and which."""

    seq_len: int
    # the publishing cache's transfer descriptor (`KVTransferManager.get_kv_transfer_info`)
    latest_kv_transfer_info: Any
    page_indices: list[int] = field(default_factory=list)


@dataclass
class PublishedKVInfo(PublishedInfo):
    """``{rank: {label: KVSequenceInfo}}``: each tensor-parallel rank publishes its shard."""

    info: dict[int, dict[str, KVSequenceInfo]] = field(default_factory=dict)
    world_size: int = 1

    @classmethod
    def build_for_rank(
        cls, rank: int, world_size: int, seq_info: dict[str, KVSequenceInfo]
    ) -> PublishedKVInfo:
        return cls(info={rank: seq_info}, world_size=world_size)

    def update(self, other: PublishedKVInfo) -> None:
        """Merge another rank's (or a later) publication; later labels win."""
        for rank, labels in other.info.items():
            self.info[rank] = {**self.info.get(rank, {}), **labels}

    def get(self, rank: int) -> dict[str, KVSequenceInfo]:
        return self.info.get(rank, {})
