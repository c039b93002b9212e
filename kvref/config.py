"""Static shape of a KV cache and per-request label routing."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field


class KVLayout(enum.Enum):
    """Order of the (page_size, heads) axes inside a page.

    NHD: ``[layers, pages, 2, page_size, heads, head_dim]``
    HND: ``[layers, pages, 2, heads, page_size, head_dim]``
    FlashInfer takes either, per layer, as ``kv_layout="NHD" | "HND"``.
    """

    NHD = "NHD"
    HND = "HND"


@dataclass
class KVConfig:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_seq_len: int
    # includes the sink page: a cache of N pages hands out N - 1
    max_num_pages: int
    page_size: int
    num_qo_heads: int
    layout: KVLayout = KVLayout.NHD
    cpu_offload_pages: int = 0
    # the tensor-parallel degree the head counts were divided by; 1 = unsharded
    sharded_by: int = field(default=1, init=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size", "num_qo_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVConfig.{name} must be positive, got {getattr(self, name)}")
        if self.max_num_pages < 2:
            # page 0 is the sink, so one page leaves nothing to allocate
            raise ValueError(f"KVConfig.max_num_pages must be >= 2, got {self.max_num_pages}")
        if self.cpu_offload_pages < 0:
            raise ValueError("KVConfig.cpu_offload_pages must be >= 0")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(
                f"num_qo_heads {self.num_qo_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )

    def shard(self, n: int) -> KVConfig:
        """Divide the head counts across ``n`` tensor-parallel ranks, once.

        Idempotent: every resource built from one config calls this, and a
        second division would size the cache for heads this rank does not own.
        """
        if n == self.sharded_by:
            return self
        if self.sharded_by != 1:
            raise ValueError(
                f"KVConfig already sharded by {self.sharded_by}; cannot reshard by {n}"
            )
        if self.num_kv_heads % n or self.num_qo_heads % n:
            raise ValueError(
                f"cannot shard {self.num_kv_heads} kv heads / {self.num_qo_heads} "
                f"qo heads across {n} ranks"
            )
        self.num_kv_heads //= n
        self.num_qo_heads //= n
        self.sharded_by = n
        return self

    @property
    def usable_pages(self) -> int:
        return self.max_num_pages - 1


@dataclass(frozen=True)
class KVReqConfig:
    """Which labels of a request a (node, graph walk) reads.

    ``labels`` maps ``(node, walk)`` to its labels; ``(node, "*")`` matches any
    walk of that node. Anything unmapped reads ``default_labels``.
    """

    labels: Mapping[tuple[str, str], tuple[str, ...]] = field(default_factory=dict)
    default_labels: tuple[str, ...] = ("main",)

    def get_labels(self, node: str, walk: str) -> tuple[str, ...]:
        found = self.labels.get((node, walk))
        if found is None:
            found = self.labels.get((node, "*"), self.default_labels)
        return found


@dataclass
class KVSpec:
    """What an engine's resource registry hands `KVManager.build`."""

    config: KVConfig
    resource_key: str = "kv"
