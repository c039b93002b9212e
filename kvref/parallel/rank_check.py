"""The post-warmup check that tensor- and sequence-parallel ranks agree on free pages."""

from __future__ import annotations

import torch

from kvref.core.errors import AsymmetricStateError
from kvref.core.resource import ProcessGroups


def check_free_pages_agree(group: ProcessGroups | None, num_free: int, device: torch.device,
                           cache_name: str, rank: int, *, cached: int = 0) -> None:
    """Raise `AsymmetricStateError` if any rank of the tp or sp group holds a
    different number of free pages, or of free pages the prefix cache keeps
    (``cached``: ranks that agree on the free count but not on what is cached
    would hit the cache differently and diverge at the next admit). The
    all_gather synchronises, so no barrier."""
    if group is None or group.world_size == 1:
        return
    local = torch.tensor([num_free * (1 << 32) + cached], dtype=torch.int64, device=device)
    for name, sub in (("tp", group.tp_group), ("sp", group.sp_group)):
        if sub is None:
            continue
        packed = [int(v) for v in sub.all_gather(local, dim=0).cpu().tolist()]
        if any(v != packed[0] for v in packed):
            values = [v >> 32 for v in packed]
            what = "free page counts" if any(v != values[0] for v in values) else (
                "cached page counts")
            if what == "cached page counts":
                values = [v & 0xFFFFFFFF for v in packed]
            raise AsymmetricStateError(
                f"KV cache {cache_name!r} has asymmetric {what} across "
                f"{name} ranks: {values} (this rank {rank}: "
                f"{num_free if what == 'free page counts' else cached}); check per-rank "
                "max_num_pages / cpu_offload_pages and any request added before warmup "
                "finished"
            )
