"""Slot leases (CUDA-graph replay): static addressing, padding aimed at the sink."""

from __future__ import annotations

import pytest
import torch
from _manager_fixtures import Driver, fill, make_manager, token_values

from kvref.core.errors import KVRefError, KVShapeError
from kvref.core.resource import CGSlotSpec
from kvref.stepping.plan import SINK_PAGE
from kvref.stepping.step import BucketKey, KVStep, Segment, SlotLease, StepContext


def _lease_step(mgr, rids, bucket, slot=0):  # type: ignore[no-untyped-def]
    step = KVStep([Segment(r, "main", 1) for r in rids])
    ctx = StepContext(tuple(rids), slot_lease=SlotLease(slot, bucket))
    assert mgr.admit(step, ctx).ok
    return step, ctx, mgr.plan(step, ctx)


def test_slot_lease_pads_to_sink_only() -> None:
    mgr = make_manager(pages=32, page_size=4)
    cfg = mgr.config
    drv = Driver(mgr)
    drv.ingest("a", "b", "c")
    fill(drv, "a", 6)
    fill(drv, "b", 4)
    fill(drv, "c", 9)
    mgr.build_cuda_graph_buffers([CGSlotSpec(0, 8)], max_bs=8, max_seq_len=16)
    bucket = BucketKey(batch_size=8, num_tokens=8)
    step, ctx, _ = _lease_step(mgr, ["a", "b"], bucket)
    state = mgr._current_plan_states["main"]
    assert state.write_len == 8 and state.total_tokens == 2
    assert state.token_to_page.shape[0] == 16  # sized by build_cuda_graph_buffers
    pages = state.token_to_page[:8].tolist()
    offs = state.token_to_cache[:8].tolist()
    a_pages = mgr._streams["a"]["main"].page_indices
    b_pages = mgr._streams["b"]["main"].page_indices
    assert pages[:2] == [a_pages[1], b_pages[1]] and offs[:2] == [2, 0]
    assert pages[2:] == [SINK_PAGE] * 6 and offs[2:] == [0] * 6
    before = mgr.kv_cache.tensor.clone()
    # write_kv takes the bucket's rows, not the real token count
    real = torch.zeros(2, cfg.num_kv_heads, cfg.head_dim)
    with pytest.raises(KVShapeError):
        mgr.write_kv(real, real, layer_idx=0)
    for layer in range(cfg.num_layers):
        k = torch.full((8, cfg.num_kv_heads, cfg.head_dim), -7.0)
        v = torch.full((8, cfg.num_kv_heads, cfg.head_dim), -9.0)
        for i, rid in enumerate(("a", "b")):
            tag = drv.tag((rid, "main"))
            pos = mgr.stored_len(rid)
            tv = token_values(tag, pos, layer, cfg.num_kv_heads, cfg.head_dim)
            k[i], v[i] = tv[0], tv[1]
        mgr.write_kv(k, v, layer_idx=layer)
    after = mgr.kv_cache.tensor
    # the padding landed on the sink, offset 0 ...
    assert torch.all(after[:, SINK_PAGE, 0, 0] == -7.0)
    assert torch.all(after[:, SINK_PAGE, 1, 0] == -9.0)
    # ... and every other page changed only in the two real slots
    changed = (after != before).any(dim=(2, 4, 5)).nonzero().tolist()  # [layer, page, offset]
    want = {(layer, p, o) for layer in range(cfg.num_layers)
            for p, o in ((a_pages[1], 2), (b_pages[1], 0))}
    assert {tuple(x) for x in changed if x[1] != SINK_PAGE} == want
    mgr.commit(step, ctx)
    drv.model[("a", "main")].append((drv.tag(("a", "main")), 6))
    drv.model[("b", "main")].append((drv.tag(("b", "main")), 4))
    drv.check("a")
    drv.check("b")
    drv.check("c")
    # the static buffer is the same object next step, re-staged for the new batch
    step2, ctx2, _ = _lease_step(mgr, ["c"], bucket)
    state2 = mgr._current_plan_states["main"]
    assert state2 is state
    c_pages = mgr._streams["c"]["main"].page_indices
    assert state2.token_to_page[:8].tolist() == [c_pages[2]] + [SINK_PAGE] * 7
    assert state2.token_to_cache[:8].tolist() == [1] + [0] * 7
    mgr.commit(step2, ctx2)


def test_slot_lease_packed_prefill_pads_to_sink() -> None:
    mgr = make_manager(pages=32, page_size=4)
    drv = Driver(mgr)
    drv.ingest("a")
    mgr.build_cuda_graph_buffers([CGSlotSpec(1)], max_bs=4, max_seq_len=32)
    step = KVStep([Segment("a", "main", 5)])
    ctx = StepContext(("a",), slot_lease=SlotLease(1, BucketKey(1, 12)))
    assert mgr.admit(step, ctx).ok
    mgr.plan(step, ctx)
    state = mgr._current_plan_states["main"]
    pages = mgr._streams["a"]["main"].page_indices
    assert state.token_to_page[:12].tolist() == [pages[0]] * 4 + [pages[1]] + [SINK_PAGE] * 7
    assert state.token_to_cache[:12].tolist() == [0, 1, 2, 3, 0] + [0] * 7
    mgr.commit(step, ctx)


def test_slot_lease_without_buffers_is_refused() -> None:
    mgr = make_manager()
    mgr.ingest_request("a")
    step = KVStep([Segment("a", "main", 1)])
    ctx = StepContext(("a",), slot_lease=SlotLease(0, BucketKey(1, 1)))
    assert mgr.admit(step, ctx).ok
    with pytest.raises(KVRefError, match="build_cuda_graph_buffers"):
        mgr.plan(step, ctx)


def test_slots_and_labels_have_their_own_buffers() -> None:
    mgr = make_manager(pages=32, page_size=4)
    drv = Driver(mgr)
    drv.ingest("a", "b")
    fill(drv, "a", 3)
    fill(drv, "b", 5)
    mgr.build_cuda_graph_buffers([CGSlotSpec(0), CGSlotSpec(1)], max_bs=4, max_seq_len=8)
    _, ctx0, _ = _lease_step(mgr, ["a"], BucketKey(4, 4), slot=0)
    s0 = mgr._current_plan_states["main"]
    mgr.commit(KVStep([Segment("a", "main", 1)]), ctx0)
    _, ctx1, _ = _lease_step(mgr, ["b"], BucketKey(4, 4), slot=1)
    s1 = mgr._current_plan_states["main"]
    assert s0 is not s1
    # slot 0's buffer still holds what slot 0's graph recorded
    assert int(s0.token_to_page[0]) == mgr._streams["a"]["main"].page_indices[0]
    assert int(s1.token_to_page[0]) == mgr._streams["b"]["main"].page_indices[1]
    mgr.commit(KVStep([Segment("b", "main", 1)]), ctx1)


def test_bucket_larger_than_buffers_refused() -> None:
    mgr = make_manager(pages=32, page_size=4)
    drv = Driver(mgr)
    drv.ingest("a")
    mgr.build_cuda_graph_buffers([CGSlotSpec(0)], max_bs=1, max_seq_len=4)
    step = KVStep([Segment("a", "main", 3)])
    ctx = StepContext(("a",), slot_lease=SlotLease(0, BucketKey(1, 8)))
    assert mgr.admit(step, ctx).ok
    with pytest.raises(ValueError, match="bucket"):
        mgr.plan(step, ctx)


def test_buffers_cannot_grow_after_capture() -> None:
    mgr = make_manager(pages=32, page_size=4)
    drv = Driver(mgr)
    drv.ingest("a")
    mgr.build_cuda_graph_buffers([CGSlotSpec(0)], max_bs=1, max_seq_len=8)
    mgr.build_cuda_graph_buffers([CGSlotSpec(0)], max_bs=1, max_seq_len=16)  # before any plan
    step, ctx, _ = _lease_step(mgr, ["a"], BucketKey(1, 1))
    assert mgr._current_plan_states["main"].token_to_page.shape[0] == 16
    mgr.commit(step, ctx)
    mgr.build_cuda_graph_buffers([CGSlotSpec(0)], max_bs=1, max_seq_len=8)  # smaller: fine
    with pytest.raises(KVRefError):
        mgr.build_cuda_graph_buffers([CGSlotSpec(0)], max_bs=1, max_seq_len=32)
