"""Rank bodies of the multi-process distributed tests (spawned; see test_distributed.py).

Each body asserts in its own process: `torch.multiprocessing.spawn` re-raises
a rank's exception, with its traceback, in the parent.
"""

from __future__ import annotations

import datetime
import re

import torch
import torch.distributed as dist

from kvref.core.config import KVConfig
from kvref.core.errors import AsymmetricStateError
from kvref.parallel.groups import JointGroups
from kvref.stepping.step import KVStep, Segment, StepContext
from kvref.transfer.engine import TransferEngineInfo

# a rank that never reaches a collective makes the others fail, not hang
TIMEOUT = datetime.timedelta(seconds=20)


def _init(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=TIMEOUT
    )


def all_gather_grids(rank: int, world: int, init_file: str, grids: list[tuple[int, int]]) -> None:
    """For each ``(tp_size, sp_size)``, in one rendezvous (spawning costs seconds)."""
    _init(rank, world, init_file)
    try:
        for tp_size, sp_size in grids:
            _check_grid(rank, world, tp_size, sp_size)
    finally:
        dist.destroy_process_group()


def _check_grid(rank: int, world: int, tp_size: int, sp_size: int) -> None:
    groups = JointGroups.from_grid(tp_size, sp_size)
    assert (groups.rank, groups.world_size) == (rank, world)
    tp_members = [rank // tp_size * tp_size + i for i in range(tp_size)]
    sp_members = [s * tp_size + rank % tp_size for s in range(sp_size)]
    for group, members in ((groups.tp_group, tp_members), (groups.sp_group, sp_members)):
        assert list(group.ranks) == members, (group, members)
        assert group.world_size == len(members)
        assert group.rank == members.index(rank)
        # distinct per rank, so order and membership both show
        mine = torch.tensor([[rank * 10, rank * 10 + 1]], dtype=torch.int64)
        rows = group.all_gather(mine, dim=0)
        want = torch.tensor([[m * 10, m * 10 + 1] for m in members], dtype=torch.int64)
        assert rows.dtype == torch.int64 and torch.equal(rows, want), (rows, want)
        cols = group.all_gather(mine, dim=1)
        assert torch.equal(cols, want.reshape(1, -1)), cols
        # a non-contiguous input gathers by value
        strided = torch.arange(6, dtype=torch.float32).view(2, 3).t()[:, :1] + rank
        got = group.all_gather(strided, dim=0)
        assert torch.equal(got, torch.cat([strided - rank + m for m in members])), got


def _config(max_num_pages: int) -> KVConfig:
    return KVConfig(
        num_layers=1,
        num_kv_heads=2,
        head_dim=4,
        max_seq_len=64,
        max_num_pages=max_num_pages,
        page_size=4,
        num_qo_heads=4,
    )


def validate(rank: int, world: int, init_file: str, asymmetries: list[str]) -> None:
    """Each scenario in turn, over one rendezvous: a fresh manager per scenario."""
    _init(rank, world, init_file)
    try:
        groups = JointGroups.from_grid(tp_size=world)
        for asymmetry in asymmetries:
            _validate(rank, groups, asymmetry)
    finally:
        dist.destroy_process_group()


def _validate(rank: int, groups: JointGroups, asymmetry: str) -> None:
    """Every rank builds a manager; ``asymmetry`` says how rank 1 differs, if at all."""
    from kvref.manager import KVManager

    pages = 9 if asymmetry == "max_num_pages" and rank == 1 else 8
    cpu = torch.device("cpu")
    manager = KVManager(_config(pages), "kv", groups, TransferEngineInfo(), cpu, torch.float32)
    if asymmetry == "request" and rank == 1:
        # a request that takes pages on one rank only before warmup returns
        manager.ingest_request("r0")
        outcome = manager.admit(KVStep([Segment("r0", "main", 9)]), StepContext())
        assert outcome.ok, outcome
    # usable pages: max_num_pages - 1 (the sink), minus what r0 took
    expect = {"none": [7, 7], "max_num_pages": [7, 8], "request": [7, 4]}[asymmetry]
    if asymmetry == "none":
        manager.post_warmup_validate()
    else:
        try:
            manager.post_warmup_validate()
        except AsymmetricStateError as e:
            message = str(e)
        else:
            raise AssertionError(f"rank {rank}: asymmetric {asymmetry} passed validation")
        # both ranks' counts, whichever rank raised
        for count in expect:
            assert re.search(rf"\b{count}\b", message), message
    manager.cleanup()
