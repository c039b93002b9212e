"""The post-warmup check that tensor- and sequence-parallel ranks agree on free pages."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvref.errors import AsymmetricStateError

if TYPE_CHECKING:
    from kvref.distributed import JointGroups


def check_free_pages_agree(group: JointGroups | None, num_free: int, device: torch.device,
                           cache_name: str, rank: int) -> None:
    """Raise `AsymmetricStateError` if any rank of the tp or sp group holds a
    different number of free pages. The all_gather synchronises, so no barrier."""
    if group is None or group.world_size == 1:
        return
    local = torch.tensor([num_free], dtype=torch.int64, device=device)
    for name, sub in (("tp", group.tp_group), ("sp", group.sp_group)):
        if sub is None:
            continue
        values = [int(v) for v in sub.all_gather(local, dim=0).cpu().tolist()]
        if any(v != values[0] for v in values):
            raise AsymmetricStateError(
                f"KV cache {cache_name!r} has asymmetric free page counts across "
                f"{name} ranks: {values} (this rank {rank}: {num_free}); check per-rank "
                "max_num_pages / cpu_offload_pages and any request added before warmup "
                "finished"
            )
