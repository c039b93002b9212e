"""The process groups a KV manager talks over: tensor-parallel and sequence-parallel.

The manager needs very little from torch.distributed: its rank and world size
(to shard heads and to stamp published info) and an ``all_gather`` per group
(`KVManager.post_warmup_validate` compares free page counts). `CommGroup`
wraps one process group with exactly that; `JointGroups` holds the pair.

Ranks form a ``sp_size x tp_size`` grid, tensor-parallel innermost: rank
``r`` is TP index ``r % tp_size`` of SP index ``r // tp_size``, so a TP group
is consecutive ranks (the GPUs of one NVLink island, in the usual launch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from kvref.core.errors import KVRefError

if TYPE_CHECKING:
    from kvref.core.resource import GatherGroup, ProcessGroups


class DistributedConfigError(KVRefError, ValueError):
    """Process groups that do not form the grid `JointGroups` describes."""


class CommGroup:
    """One process group as this rank sees it: ``rank``, ``world_size``, ``all_gather``.

    ``group=None`` with one rank is a group of this process alone; it needs no
    initialised torch.distributed (unit tests, single-GPU engines).
    """

    def __init__(self, group: dist.ProcessGroup | None, ranks: Sequence[int], rank: int) -> None:
        if not 0 <= rank < len(ranks):
            raise DistributedConfigError(f"rank {rank} outside a group of {len(ranks)}")
        if group is None and len(ranks) != 1:
            raise DistributedConfigError(f"a group of {len(ranks)} ranks needs a process group")
        self.group = group
        # global ranks of the members, in group-rank order
        self.ranks = tuple(ranks)
        self.rank = rank
        self.world_size = len(ranks)

    @classmethod
    def single(cls, global_rank: int = 0) -> CommGroup:
        return cls(None, [global_rank], 0)

    @classmethod
    def from_process_group(cls, group: dist.ProcessGroup) -> CommGroup:
        ranks = dist.get_process_group_ranks(group)
        return cls(group, ranks, dist.get_rank(group))

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every member's ``tensor`` (same shape and dtype on all), concatenated along ``dim``
        in group-rank order, on ``tensor``'s device. A collective: every member calls it."""
        if self.world_size == 1:
            # a copy, as a real gather returns: the caller may write into it
            return tensor.clone()
        send = tensor.contiguous()
        # gloo moves CPU tensors, nccl CUDA ones; meet the backend where it is
        # so a caller can gather a CPU count over NCCL (or the reverse)
        backend = str(dist.get_backend(self.group))
        if backend == "nccl" and not send.is_cuda:
            send = send.cuda()
        elif backend == "gloo" and send.is_cuda:
            send = send.cpu()
        parts = [torch.empty_like(send) for _ in range(self.world_size)]
        dist.all_gather(parts, send, group=self.group)
        return torch.cat(parts, dim=dim).to(tensor.device)

    def __repr__(self) -> str:
        return f"CommGroup(ranks={self.ranks}, rank={self.rank})"


@dataclass(frozen=True)
class JointGroups:
    """This rank's place in the TP x SP grid.

    ``world_size`` is the whole grid (``tp.world_size * sp.world_size``) and
    ``rank`` this process's rank in it.
    """

    rank: int
    world_size: int
    tp_group: CommGroup
    sp_group: CommGroup

    def __post_init__(self) -> None:
        if self.tp_group.world_size * self.sp_group.world_size != self.world_size:
            raise DistributedConfigError(
                f"tp ({self.tp_group.world_size}) x sp ({self.sp_group.world_size}) ranks "
                f"do not make the world of {self.world_size}"
            )
        if not 0 <= self.rank < self.world_size:
            raise DistributedConfigError(f"rank {self.rank} outside a world of {self.world_size}")

    @classmethod
    def single(cls) -> JointGroups:
        """World size 1: no torch.distributed needed."""
        return cls(0, 1, CommGroup.single(), CommGroup.single())

    @classmethod
    def from_process_groups(
        cls,
        tp: dist.ProcessGroup | None = None,
        sp: dist.ProcessGroup | None = None,
        world: dist.ProcessGroup | None = None,
    ) -> JointGroups:
        """Wrap groups the engine already built. ``None`` for tp or sp: this rank
        alone; ``world``: the group the grid spans (default: the default group)."""
        rank, world_size = dist.get_rank(world), dist.get_world_size(world)
        return cls(
            rank,
            world_size,
            CommGroup.from_process_group(tp) if tp is not None else CommGroup.single(rank),
            CommGroup.from_process_group(sp) if sp is not None else CommGroup.single(rank),
        )

    @classmethod
    def from_grid(cls, tp_size: int, sp_size: int = 1) -> JointGroups:
        """Build the TP and SP groups over the default group (which must be
        initialised), ranks laid out as the module docstring says.

        A collective: every rank calls it with the same sizes, because
        ``new_group`` must be entered by all ranks for every group, in order.
        """
        world_size, rank = dist.get_world_size(), dist.get_rank()
        if tp_size < 1 or sp_size < 1 or tp_size * sp_size != world_size:
            raise DistributedConfigError(
                f"a tp {tp_size} x sp {sp_size} grid does not fit a world of {world_size}"
            )
        tp_index, sp_index = rank % tp_size, rank // tp_size
        tp_rows = [[s * tp_size + i for i in range(tp_size)] for s in range(sp_size)]
        sp_columns = [[s * tp_size + i for s in range(sp_size)] for i in range(tp_size)]
        tp_group = _grid_group(rank, tp_rows, sp_index, tp_index)
        sp_group = _grid_group(rank, sp_columns, tp_index, sp_index)
        return cls(rank, world_size, tp_group, sp_group)


def _grid_group(rank: int, groups: list[list[int]], mine: int, index: int) -> CommGroup:
    """This rank's group of ``groups`` (``groups[mine]``, where it stands at
    ``index``): every rank creates every group, in the same order, because
    ``new_group`` is a collective; groups of one rank are not created."""
    if len(groups[mine]) == 1:
        return CommGroup.single(rank)
    group = CommGroup.single(rank)
    for k, members in enumerate(groups):
        pg = dist.new_group(members)
        if k == mine:
            group = CommGroup(pg, members, index)
    return group


if TYPE_CHECKING:
    # what kvref/core names these by (`EngineResourceInfo.joint_comm_group`,
    # the manager, the post-warmup check): mypy fails here if they drift apart
    _groups: ProcessGroups = JointGroups.single()
    _group: GatherGroup = CommGroup.single()
