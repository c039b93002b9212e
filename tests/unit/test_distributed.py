"""JointGroups over real gloo process groups, and the manager's post-warmup check."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.multiprocessing.spawn import spawn

from kvref.parallel.groups import CommGroup, DistributedConfigError, JointGroups

# spawned ranks import their body by module name; make it one name however
# pytest imported this file
sys.path.insert(0, os.path.dirname(__file__))
import _dist_workers as workers

DEADLINE_S = 60.0


def run_ranks(fn: Callable[..., None], world: int, tmp_path: Path, *args: Any) -> None:
    """``fn(rank, world, init_file, *args)`` in ``world`` spawned processes.

    A file:// rendezvous: no TCP port to race other tests for. A rank's
    exception comes back as ProcessRaisedException with its traceback.
    """
    init_file = str(tmp_path / "rendezvous")
    ctx = spawn(  # type: ignore[no-untyped-call]
        fn, args=(world, init_file, *args), nprocs=world, join=False
    )
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__} ranks still running after {DEADLINE_S}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


def test_single_needs_no_process_group() -> None:
    groups = JointGroups.single()
    assert (groups.rank, groups.world_size) == (0, 1)
    for group in (groups.tp_group, groups.sp_group):
        assert (group.rank, group.world_size, group.ranks) == (0, 1, (0,))
        t = torch.tensor([3], dtype=torch.int64)
        out = group.all_gather(t, dim=0)
        assert torch.equal(out, t)
        out[0] = 4  # a fresh tensor, as a real gather returns
        assert t.item() == 3


def test_groups_that_do_not_make_the_world_are_rejected() -> None:
    with pytest.raises(DistributedConfigError, match="do not make the world of 4"):
        JointGroups(0, 4, CommGroup.single(), CommGroup.single())
    with pytest.raises(DistributedConfigError, match="needs a process group"):
        CommGroup(None, [0, 1], 0)
    with pytest.raises(DistributedConfigError, match="outside"):
        JointGroups(1, 1, CommGroup.single(), CommGroup.single())


# each run spawns processes that import torch (seconds apiece), so one run
# covers several cases; a failing rank's traceback names the case


def test_all_gather_across_two_gloo_ranks(tmp_path: Path) -> None:
    # all ranks in TP (SP singletons), then all ranks in SP (TP singletons)
    run_ranks(workers.all_gather_grids, 2, tmp_path, [(2, 1), (1, 2)])


@pytest.mark.slow  # four processes importing torch: 5-20 s on a two-core box
def test_all_gather_on_a_two_by_two_grid(tmp_path: Path) -> None:
    # TP groups {0,1} {2,3}, SP groups {0,2} {1,3}: several groups per axis,
    # each rank must keep its own
    run_ranks(workers.all_gather_grids, 4, tmp_path, [(2, 2)])


def test_post_warmup_validate_across_two_ranks(tmp_path: Path) -> None:
    # symmetric passes; a per-rank max_num_pages and a request admitted on one
    # rank only must raise on both ranks, naming both counts
    run_ranks(workers.validate, 2, tmp_path, ["none", "max_num_pages", "request", "none"])
