"""A hybrid decode step's tables (`kvref.hybrid.decode`) against a scratch build.

A hybrid step plans one table per attention group from kept rows
(`GroupDecodeTables`: every group's rows in one kept `DecodeTable`, split
into a plan per group), or below `SMALL_BATCH` rows in all every group
afresh in one pass (`fresh_plans`). Every plan here is
compared with the tables `plan_tables` builds from the manager's observed
state (`kvref.testing.plan_oracle`), and every earlier plan's tables with
what they were when handed out, over steps that append pages, release
window pages, skip a commit, offload and reload, reset and remove.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvref import KVConfig, KVManager, KVStep, Segment, StepContext, TransferEngineInfo
from kvref.core.config import RetentionPolicy
from kvref.core.groups import AttentionGroup
from kvref.hybrid import decode as hybrid_decode
from kvref.hybrid.decode import GroupDecodeTables
from kvref.stepping import decode_table
from kvref.stepping.plan import KVPlanOutputs
from tests.unit.test_decode_table import PS, Checked

GROUPS = (AttentionGroup("full", (0,)), AttentionGroup("w", (1,), RetentionPolicy(6)),
          AttentionGroup("w2", (2,), RetentionPolicy(6)))


@pytest.fixture(params=[1, 1 << 20], ids=["kept", "fresh"])
def small_batch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(decode_table, "SMALL_BATCH", request.param)
    return int(request.param)


class GroupsChecked(Checked):
    """`Checked` over the step as every group runs it: the scratch build
    reads each group's streams (`GroupLayout.expand`)."""

    def plan(self, step: KVStep, ctx: StepContext) -> KVPlanOutputs:
        assert self.mgr._groups is not None
        plan = self._plan
        self._plan = lambda _, c: plan(step, c)  # type: ignore[method-assign]
        try:
            return super().plan(self.mgr._groups.expand(step), ctx)
        finally:
            self._plan = plan  # type: ignore[method-assign]


def manager() -> KVManager:
    cfg = KVConfig(num_layers=3, num_kv_heads=1, head_dim=2, max_seq_len=512,
                   max_num_pages=200, page_size=PS, num_qo_heads=1, cpu_offload_pages=64,
                   enable_prefix_caching=True, groups=GROUPS)
    return KVManager(cfg, "kv", None, TransferEngineInfo(), torch.device("cpu"),
                     dtype=torch.float32)


def step(m: KVManager, segs: list[tuple[str, int]], commit: bool = True) -> None:
    st = KVStep([Segment(r, "main", n) for r, n in segs], commit=commit)
    ctx = StepContext(tuple(r for r, _ in segs))
    assert m.admit(st, ctx).ok
    out = m.plan(st, ctx)
    assert list(out) == ["main", "main@w", "main@w2"]  # a table per group, in order
    m.commit(st, ctx)


def ids(rid: str) -> list[int]:
    return [ord(rid) * 1000 + i for i in range(512)]


@pytest.mark.parametrize("seed", range(3))
def test_every_groups_table_matches_a_scratch_build(seed: int, small_batch: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    m = manager()
    checked = GroupsChecked(m)
    calls = {"plans": 0, "fresh": 0}
    plans, fresh = GroupDecodeTables.plans, hybrid_decode.fresh_plans

    def counted_plans(self: GroupDecodeTables, *a: object) -> object:
        got = plans(self, *a)  # type: ignore[arg-type]
        calls["plans"] += got is not None
        return got

    def counted_fresh(*a: object) -> object:
        got = fresh(*a)  # type: ignore[arg-type]
        calls["fresh"] += got is not None
        return got

    monkeypatch.setattr(GroupDecodeTables, "plans", counted_plans)
    monkeypatch.setattr(hybrid_decode, "fresh_plans", counted_fresh)
    batch = ["a", "b", "c", "d"]
    for r in batch:
        m.ingest_request(r)
        m.follow_tokens(r, ids(r))  # keyed as pages fill, in every group
        step(m, [(r, rng.randint(1, 9))])
    for _ in range(50):
        op = rng.choice(["decode"] * 5 + ["no-commit", "offload", "reset", "remove",
                                          "prefill"])
        rid = rng.choice(batch)
        if op == "offload":
            if m.offload(rid):
                assert m.reload(rid)
        elif op in ("reset", "remove"):
            if op == "reset":
                m.reset_request(rid, free=rng.random() < 0.5)
            else:
                m.remove_request(rid)
                m.ingest_request(rid)
            m.follow_tokens(rid, ids(rid))
            m.match_prefix(rid, "main", ids(rid)[:rng.randint(2, 30)])
            step(m, [(rid, rng.randint(1, 5))])
        elif op == "prefill":
            step(m, [(rid, rng.randint(2, 5))])
        step(m, [(r, 1) for r in batch], commit=op != "no-commit")
    # the decode steps went through the group tables, as this parameter says
    assert calls["plans"] > 40
    if small_batch == 1:
        assert calls["fresh"] == 0 and checked.kept > 40
    else:
        assert calls["fresh"] == calls["plans"]
