"""read_kv: what the attention layers read back (the layer and plan label asked
for, not the cursor's; a slot lease's bucket rows, not its whole buffers).
"""

from __future__ import annotations

import torch
from _manager_fixtures import make_manager

from kvref.core.resource import CGSlotSpec
from kvref.manager import KVManager
from kvref.stepping.step import BucketKey, KVStep, Segment, SlotLease, StepContext


def _running_two_label_step(mgr: KVManager, span: int = 2) -> KVStep:
    mgr.ingest_request("a")
    step = KVStep([Segment("a", "main", span), Segment("a", "cfg", span)])
    ctx = StepContext(("a",))
    assert mgr.admit(step, ctx).ok
    mgr.plan(step, ctx)
    return step


def _rows(mgr: KVManager, n: int, value: float) -> torch.Tensor:
    return torch.full((n, mgr.config.num_kv_heads, mgr.config.head_dim), value)


def test_read_kv_reads_the_layer_it_is_asked_for_not_the_cursor() -> None:
    mgr = make_manager(sharing=False, pages=16, page_size=4, layers=2)
    _running_two_label_step(mgr)
    for layer, value in ((0, 10.0), (1, 20.0)):
        mgr.write_kv(_rows(mgr, 2, value), _rows(mgr, 2, value + 1), layer_idx=layer)
    mgr.set_layer_idx(0)
    got = mgr.read_kv(layer_idx=1)
    assert tuple(got.shape) == (2, 2, mgr.config.num_kv_heads, mgr.config.head_dim)
    assert torch.all(got[:, 0] == 20.0) and torch.all(got[:, 1] == 21.0)
    mgr.set_layer_idx(1)  # no layer given: the cursor's
    assert torch.equal(mgr.read_kv(), got)


def test_read_kv_reads_the_plan_label_it_is_asked_for() -> None:
    mgr = make_manager(sharing=False, pages=16, page_size=4)
    _running_two_label_step(mgr)
    mgr.write_kv(_rows(mgr, 2, 1.0), _rows(mgr, 2, 2.0), layer_idx=0, label="main")
    mgr.write_kv(_rows(mgr, 2, 5.0), _rows(mgr, 2, 6.0), layer_idx=0, label="cfg")
    cfg = mgr.read_kv(layer_idx=0, plan_label="cfg")
    main = mgr.read_kv(layer_idx=0, plan_label="main")
    assert torch.all(cfg[:, 0] == 5.0) and torch.all(cfg[:, 1] == 6.0)
    assert torch.all(main[:, 0] == 1.0) and torch.all(main[:, 1] == 2.0)


def test_read_kv_under_a_slot_lease_returns_the_buckets_rows() -> None:
    mgr = make_manager(sharing=False, pages=32, page_size=4)
    mgr.ingest_request("a")
    # buffers larger than the bucket: read_kv must stop at the bucket
    mgr.build_cuda_graph_buffers([CGSlotSpec(0, 4)], max_bs=4, max_seq_len=16)
    step = KVStep([Segment("a", "main", 1)])
    ctx = StepContext(("a",), slot_lease=SlotLease(0, BucketKey(batch_size=4, num_tokens=4)))
    assert mgr.admit(step, ctx).ok
    mgr.plan(step, ctx)
    mgr.write_kv(_rows(mgr, 4, 3.0), _rows(mgr, 4, 4.0), layer_idx=0)
    got = mgr.read_kv(layer_idx=0)
    assert got.shape[0] == 4
    assert torch.all(got[:, 0] == 3.0) and torch.all(got[:, 1] == 4.0)
