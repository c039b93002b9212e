"""CUDA-graph slot-leased addressing over windowed labels (R68; issue 19).

A captured graph writes through static buffers that hold the step's write
addressing. For a windowed stream the new tokens always land in retained
pages, so nothing about the buffers changes, but they are restaged at every
plan. A buffer that kept the last step's addressing would write into a page
the window has just released. Decode and a prefill run across several
releases through the static buffers here, checking each staged row against
the view and the stream's retained pages, and reading back every byte.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
import torch

from kvref import KVStep, RetentionPolicy, Segment, StepContext
from kvref.attention.flashinfer import graph_window_left
from kvref.core.errors import KVShapeError
from kvref.core.resource import CGSlotSpec
from kvref.manager import KVManager
from kvref.stepping.graph_staging import GraphStaging
from kvref.stepping.plan import SINK_PAGE, KVPlanOutputs, KVPlanState
from kvref.stepping.step import BucketKey, SlotLease
from kvref.testing.page_checks import check_device_pages
from tests.unit._manager_fixtures import make_manager, token_values

PS, W, LAYERS, HEADS, DIM = 4, 10, 2, 2, 4
BUCKET = BucketKey(batch_size=4, num_tokens=16)
PAD = -7.0


def manager() -> KVManager:
    mgr = make_manager(page_size=PS, layers=LAYERS, heads=HEADS, head_dim=DIM, pages=64,
                       retention={"w": RetentionPolicy(W)})
    mgr.build_cuda_graph_buffers([CGSlotSpec(0), CGSlotSpec(1)], max_bs=4, max_seq_len=16)
    return mgr


def tag(rid: str, label: str) -> int:
    return (ord(rid) - ord("a") + 1) * 2 + (label == "main")


def check_staged(mgr: KVManager, outputs: KVPlanOutputs) -> None:
    """Each plan label's static buffer: its real rows are the view's slots in
    pages the stream holds now, and the rest of the bucket aims at the sink."""
    for plan_label, out in outputs.items():
        state = mgr._current_plan_states[plan_label]
        assert state.write_len == BUCKET.num_tokens
        pages = state.token_to_page[: state.write_len].tolist()
        offs = state.token_to_cache[: state.write_len].tolist()
        i = 0
        for v in out.views:
            held = mgr._streams[v.request_id][v.label].page_indices
            for j in range(v.length - v.to_compute, v.length):
                assert pages[i] in held, (
                    f"row {i} of {plan_label!r} writes page {pages[i]}, which "
                    f"{v.request_id}/{v.label} does not hold (released: its window passed it)")
                assert (pages[i], offs[i]) == (v.page_idxs[j // PS], j % PS), (plan_label, i)
                i += 1
        assert i == state.total_tokens
        assert pages[i:] == [SINK_PAGE] * (state.write_len - i)
        assert offs[i:] == [0] * (state.write_len - i)


def write_bucket(mgr: KVManager, outputs: KVPlanOutputs) -> None:
    """Write the bucket's rows, the padding included, as a replayed graph does."""
    for plan_label, out in outputs.items():
        state = mgr._current_plan_states[plan_label]
        for layer in range(LAYERS):
            rows = torch.full((state.write_len, 2, HEADS, DIM), PAD)
            i = 0
            for v in out.views:
                for j in range(v.length - v.to_compute, v.length):
                    rows[i] = token_values(tag(v.request_id, v.label), v.offset + j, layer,
                                           HEADS, DIM)
                    i += 1
            mgr.write_kv(rows[:, 0].contiguous(), rows[:, 1].contiguous(), layer_idx=layer,
                         label=plan_label)
            got = mgr.read_kv(layer_idx=layer, plan_label=plan_label)
            assert torch.equal(got[:i], rows[:i])


def check_window(mgr: KVManager, rid: str, label: str) -> None:
    n = mgr.stored_len(rid, label)
    first = max(0, n - W) if label == "w" else 0
    got = mgr.read_stream(rid, label)
    assert got.shape[1] == n - first
    for j, pos in enumerate(range(first, n)):
        for layer in range(LAYERS):
            assert torch.equal(got[layer, j],
                               token_values(tag(rid, label), pos, layer, HEADS, DIM)), (
                rid, label, pos)


def leased_step(mgr: KVManager, segs: list[tuple[str, str, int]], slot: int = 0) -> None:
    step = KVStep([Segment(*s) for s in segs])
    ctx = StepContext(tuple(sorted({s[0] for s in segs})), slot_lease=SlotLease(slot, BUCKET))
    assert mgr.admit(step, ctx).ok
    outputs = mgr.plan(step, ctx)
    check_staged(mgr, outputs)
    write_bucket(mgr, outputs)
    mgr.commit(step, ctx)
    check_device_pages(mgr)
    for rid, label, _ in segs:
        check_window(mgr, rid, label)


def decode_across_releases(mgr: KVManager) -> None:
    """Prefill a and b (both labels) under the lease, then decode both across
    several window releases; c's prefill chunk joins a decode step mid-way."""
    for r in "ab":
        mgr.ingest_request(r)
    mgr.ingest_request("c")
    leased_step(mgr, [("a", "w", 7), ("b", "w", 6)])
    leased_step(mgr, [("a", "main", 7), ("b", "main", 6)])
    buffers: dict[str, KVPlanState] = {}
    for i in range(30):
        segs = [("a", "w", 1), ("b", "w", 1), ("a", "main", 1)]
        if i == 11:
            segs.append(("c", "w", 13))  # a packed (mixed) step: c's prefill
        elif i > 11:
            segs.append(("c", "w", 1))
        leased_step(mgr, segs)
        for label in ("w", "main"):
            # one static buffer per (slot, label), the same object every step
            assert buffers.setdefault(label, mgr._static_plan_states[(0, label)]) is (
                mgr._static_plan_states[(0, label)])
    bound = -(-W // PS) + 1
    for r in "abc":
        s = mgr._streams[r]["w"]
        assert s.released >= 4 * PS and len(s.page_indices) <= bound
    assert mgr._streams["a"]["main"].released == 0


def test_windowed_decode_through_static_buffers_across_releases() -> None:
    decode_across_releases(manager())


def test_preplan_on_another_slot_over_windowed_decode() -> None:
    """Overlap and graphs together: N on one slot, N+1 preplanned on the
    other (R41), its views projected past N's release (R67)."""
    mgr = manager()
    mgr.ingest_request("a")
    leased_step(mgr, [("a", "w", 9)])
    segs = [("a", "w", 1)]
    step = KVStep([Segment(*s) for s in segs])
    ctx = StepContext(("a",), slot_lease=SlotLease(0, BUCKET))
    assert mgr.admit(step, ctx).ok
    outputs = mgr.plan(step, ctx)
    for i in range(20):
        slot = (i + 1) % 2
        nxt = KVStep([Segment(*s) for s in segs])
        nctx = StepContext(("a",), slot_lease=SlotLease(slot, BUCKET))
        assert mgr.admit(nxt, StepContext(("a",), is_preplan=True,
                                          slot_lease=nctx.slot_lease)).ok
        staged = mgr.plan(nxt, StepContext(("a",), is_preplan=True, slot_lease=nctx.slot_lease))
        check_staged(mgr, outputs)
        write_bucket(mgr, outputs)
        mgr.commit(step, ctx)
        check_device_pages(mgr)
        check_window(mgr, "a", "w")
        assert mgr.admit(nxt, nctx).ok
        assert mgr.plan(nxt, nctx) is staged
        step, ctx, outputs = nxt, nctx, staged
    check_staged(mgr, outputs)
    write_bucket(mgr, outputs)
    mgr.commit(step, ctx)
    check_window(mgr, "a", "w")
    assert mgr._streams["a"]["w"].released >= 3 * PS


def test_graph_wrapper_keeps_its_window() -> None:
    """A FlashInfer graph replays the window it was captured with: a plan with
    another on the same wrapper is refused, not silently run unwindowed."""
    assert graph_window_left(None, -1) == -1
    assert graph_window_left(None, W - 1) == W - 1
    assert graph_window_left(W - 1, W - 1) == W - 1
    with pytest.raises(KVShapeError, match="window"):
        graph_window_left(-1, W - 1)
    with pytest.raises(KVShapeError, match="window"):
        graph_window_left(W - 1, -1)


# -- plant: the check above fails on its defect ------------------------------


def restage_only_when_the_batch_changes(mp: pytest.MonkeyPatch) -> None:
    """(ii) The static buffer is restaged only when the step's token count
    changed (a copy saved on steady decode): the graph keeps writing the slots
    of the step that staged it, which become pages the window released."""
    orig = GraphStaging.leased

    def lazy(self: GraphStaging, state: KVPlanState, lease: SlotLease | None,
             label: str) -> KVPlanState:
        if lease is not None:
            static = self.static_plan_states.get((lease.slot, label))
            if static is not None and static.total_tokens == state.total_tokens:
                return static
        return orig(self, state, lease, label)

    mp.setattr(GraphStaging, "leased", lazy)


@pytest.mark.parametrize("plant", [restage_only_when_the_batch_changes])
@pytest.mark.parametrize("check", ["staged rows", "bytes only"])
def test_plant_stale_static_buffer_is_caught(plant: Callable[[pytest.MonkeyPatch], None],
                                            check: str) -> None:
    """Caught by the staged-row check, and by the bytes read back alone."""
    decode_across_releases(manager())  # clean
    with pytest.MonkeyPatch.context() as mp:
        plant(mp)
        if check == "bytes only":
            mp.setattr(sys.modules[__name__], "check_staged", lambda *_: None)
        with pytest.raises(AssertionError):
            decode_across_releases(manager())
