"""Process and geometry boundaries (issue 8, blind spot g).

- a tensor-parallel world-size mismatch, in both directions, is the typed
  refusal `AdmitRuntimeError` with nothing changed;
- a transfer descriptor that went through pickle (as over RPC) is still this
  cache's own, so a self-retrieve is still skipped;
- CUDA-graph buffers built by several captures of different sizes: a smaller
  later capture is fine, a larger one after buffers exist is refused, a
  bucket the buffers cannot hold is refused before plan changes anything, and
  a leased step reads and writes the slots its plan gave.
"""

from __future__ import annotations

import logging
import os
import pickle
import uuid
from collections.abc import Iterator

import pytest
import torch
from _manager_fixtures import Driver, assert_same, fill, make_cfg, snapshot, token_values

from kvref.core.config import KVConfig
from kvref.core.errors import InvalidArgumentError, InvalidStepError, KVRefError
from kvref.core.resource import CGSlotSpec
from kvref.manager import KVManager
from kvref.parallel.groups import CommGroup, JointGroups
from kvref.stepping.plan import SINK_PAGE
from kvref.stepping.step import (
    AdmitRuntimeError,
    BucketKey,
    KVStep,
    Segment,
    SlotLease,
    StepContext,
)
from kvref.transfer.engine import KVTransferInfo, TransferEngineInfo
from kvref.transfer.published import PublishedKVInfo


def _manager(cfg: KVConfig | None = None, *, world: int = 1, rank: int = 0,
             kind: str = "local", shm_prefix: str = "kvref_") -> KVManager:
    # cuda_ipc shares a CUDA cache; the other kinds are tested on the CPU
    device = "cuda" if kind == "cuda_ipc" else "cpu"
    groups = None
    if world > 1:
        # CommGroup only needs a process group for collectives, which
        # admit_retrieve never runs: any non-None handle stands in for one
        tp = CommGroup(object(), list(range(world)), rank)  # type: ignore[arg-type]
        groups = JointGroups(rank, world, tp, CommGroup.single(rank))
    return KVManager(cfg if cfg is not None else make_cfg(pages=16, page_size=4, heads=2),
                     "kv", groups, TransferEngineInfo(kind=kind, shm_prefix=shm_prefix),
                     device, dtype=torch.float32)


def _state(mgr: KVManager) -> tuple[object, torch.Tensor]:
    return snapshot(mgr), mgr.kv_cache.tensor.clone()


def _assert_unchanged(before: tuple[object, torch.Tensor], mgr: KVManager) -> None:
    snap, tensor = before
    assert_same(snap, snapshot(mgr))  # type: ignore[arg-type]
    assert torch.equal(tensor, mgr.kv_cache.tensor)


# -- tensor-parallel world size ------------------------------------------------------------


@pytest.mark.parametrize(("published_world", "local_world"), [(2, 1), (1, 2), (4, 2)])
def test_world_size_mismatch_is_a_typed_refusal(published_world: int, local_world: int) -> None:
    heads = 4
    src = _manager(make_cfg(pages=16, page_size=4, heads=heads))
    drv = Driver(src)
    drv.ingest("r")
    fill(drv, "r", 6)
    own = src.publish("r")
    assert own is not None
    # every rank's shard, stamped with the publisher's world size
    pub = PublishedKVInfo.build_for_rank(0, published_world, own.get(0))
    for rank in range(1, published_world):
        pub.update(PublishedKVInfo.build_for_rank(rank, published_world, own.get(0)))
    dst = _manager(make_cfg(pages=16, page_size=4, heads=heads), world=local_world)
    dd = Driver(dst)
    dd.ingest("r")
    fill(dd, "r", 1)  # something already held, so a change would show
    before = _state(dst)
    out = dst.admit_retrieve("r", "n", "w", pub)
    assert not out.ok and not out.ready
    assert isinstance(out.reason, AdmitRuntimeError)
    assert out.reason.request_id == "r"
    assert f"published {published_world}" in out.reason.message
    assert f"local {local_world}" in out.reason.message
    _assert_unchanged(before, dst)
    # still usable: a step runs on the request afterwards
    fill(dd, "r", 2)
    assert dst.stored_len("r") == 3
    dd.check("r")
    dst.cleanup()
    src.cleanup()


def test_sharding_copies_the_config() -> None:
    """The manager shards its own copy: the caller's config keeps the model's head
    counts, so a second resource built from it (or a second manager) is sized right."""
    cfg = make_cfg(pages=16, page_size=4, heads=4)
    a = _manager(cfg, world=2)
    b = _manager(cfg, world=2, rank=1)
    assert (cfg.num_kv_heads, cfg.num_qo_heads, cfg.sharded_by) == (4, 4, 1)
    for mgr in (a, b):
        assert (mgr.config.num_kv_heads, mgr.config.sharded_by) == (2, 2)
        assert mgr.kv_cache.tensor.shape[4] == 2  # NHD: heads this rank owns
        mgr.cleanup()


# -- a descriptor through pickle --------------------------------------------------------------


@pytest.fixture
def shm_prefix() -> Iterator[str]:
    prefix = f"kvref_bound_{uuid.uuid4().hex[:8]}_"
    yield prefix
    assert [n for n in os.listdir("/dev/shm") if n.startswith(prefix)] == []


KINDS = ["local", "shm", pytest.param("cuda_ipc", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="cuda_ipc needs CUDA"))]


@pytest.mark.parametrize("kind", KINDS)
def test_pickled_descriptor_equals_the_original(kind: str, shm_prefix: str) -> None:
    mgr = _manager(kind=kind, shm_prefix=shm_prefix)
    other = _manager(kind=kind, shm_prefix=shm_prefix)
    info = mgr._transfer.get_kv_transfer_info()
    assert isinstance(info, KVTransferInfo) and info.kind == kind
    back = pickle.loads(pickle.dumps(info))
    assert back is not info
    assert back == info and hash(back) == hash(info)
    assert back != other._transfer.get_kv_transfer_info()
    other.cleanup()
    mgr.cleanup()


KINDS = ["local", "shm", pytest.param("cuda_ipc", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="cuda_ipc needs CUDA"))]


# cuda_ipc: the descriptor check above; filling a CUDA cache needs a device-aware driver
@pytest.mark.parametrize("kind", ["local", "shm"])
def test_self_retrieve_recognised_after_pickle(
    kind: str, shm_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A manager handed back its own publication, through pickle, copies nothing."""
    mgr = _manager(kind=kind, shm_prefix=shm_prefix)
    drv = Driver(mgr)
    drv.ingest("r")
    fill(drv, "r", 6)
    pub = mgr.publish("r")
    assert pub is not None
    wire = pickle.loads(pickle.dumps(pub))
    assert wire.get(0)["main"].latest_kv_transfer_info is not pub.get(0)["main"]\
        .latest_kv_transfer_info
    # held < published, so only the self check stands between it and a copy
    mgr.release_published("r")  # publish leased it (R33)
    mgr.reset_request("r")
    before = _state(mgr)
    with caplog.at_level(logging.WARNING, logger="kvref.manager"):
        out = mgr.admit_retrieve("r", "n", "w", wire)
    assert out.ok and out.ready
    assert "self-retrieve" in caplog.text
    _assert_unchanged(before, mgr)
    assert mgr._streams["r"]["main"].read_future is None
    mgr.cleanup()


# -- CUDA-graph buffers over several captures ---------------------------------------------------


def _graph_manager() -> tuple[KVManager, Driver]:
    mgr = _manager(make_cfg(pages=32, page_size=4, heads=2))
    drv = Driver(mgr)
    drv.ingest("a", "b")
    fill(drv, "a", 6)
    fill(drv, "b", 3)
    return mgr, drv


def _leased_decode(mgr: KVManager, drv: Driver, rids: list[str], bucket: BucketKey,
                   slot: int = 0) -> None:
    """One leased decode step, written through write_kv and checked through read_kv."""
    cfg = mgr.config
    step = KVStep([Segment(r, "main", 1) for r in rids])
    ctx = StepContext(tuple(rids), slot_lease=SlotLease(slot, bucket))
    assert mgr.admit(step, ctx).ok
    mgr.plan(step, ctx)
    state = mgr._current_plan_states["main"]
    assert state.write_len == bucket.num_tokens
    # padding is aimed at the sink, every real token at its stream's next slot
    for i, rid in enumerate(rids):
        stream = mgr._streams[rid]["main"]
        pos = stream.stored_len
        assert int(state.token_to_page[i]) == stream.page_indices[pos // cfg.page_size]
        assert int(state.token_to_cache[i]) == pos % cfg.page_size
    assert state.token_to_page[len(rids):bucket.num_tokens].tolist() == \
        [SINK_PAGE] * (bucket.num_tokens - len(rids))
    for layer in range(cfg.num_layers):
        kv = torch.zeros(bucket.num_tokens, 2, cfg.num_kv_heads, cfg.head_dim)
        for i, rid in enumerate(rids):
            kv[i] = token_values(drv.tag((rid, "main")), mgr.stored_len(rid), layer,
                                 cfg.num_kv_heads, cfg.head_dim)
        mgr.write_kv(kv[:, 0].contiguous(), kv[:, 1].contiguous(), layer_idx=layer)
        got = mgr.read_kv(layer_idx=layer)
        assert torch.equal(got[:len(rids)], kv[:len(rids)])
    mgr.commit(step, ctx)
    for rid in rids:
        drv.model[(rid, "main")].append((drv.tag((rid, "main")), mgr.stored_len(rid) - 1))
        drv.check(rid)


def test_captures_of_several_sizes() -> None:
    mgr, drv = _graph_manager()
    slots = [CGSlotSpec(0, 4), CGSlotSpec(1, 4)]
    # captures before the first leased plan: the largest wins
    mgr.build_cuda_graph_buffers(slots, max_bs=4, max_seq_len=8)
    mgr.build_cuda_graph_buffers(slots, max_bs=4, max_seq_len=16)
    mgr.build_cuda_graph_buffers(slots, max_bs=2, max_seq_len=4)
    _leased_decode(mgr, drv, ["a", "b"], BucketKey(4, 4))
    buf = mgr._static_plan_states[(0, "main")]
    assert buf.token_to_page.shape[0] == 16
    # a smaller capture after the buffers exist: fine, nothing resized
    mgr.build_cuda_graph_buffers(slots, max_bs=1, max_seq_len=2)
    mgr.build_cuda_graph_buffers(slots, max_bs=4, max_seq_len=16)
    _leased_decode(mgr, drv, ["b"], BucketKey(1, 2))
    assert mgr._static_plan_states[(0, "main")] is buf
    # a larger one would outgrow addresses a recorded graph holds: refused, nothing changed
    before = _state(mgr)
    buffers = {k: (v, v.token_to_page.clone()) for k, v in mgr._static_plan_states.items()}
    with pytest.raises(KVRefError, match="graph buffers already built for 16"):
        mgr.build_cuda_graph_buffers(slots, max_bs=4, max_seq_len=32)
    _assert_unchanged(before, mgr)
    assert mgr._cg_max_seq_len == 16
    for k, (obj, pages) in buffers.items():
        assert mgr._static_plan_states[k] is obj and torch.equal(obj.token_to_page, pages)
    # a new (slot, label) made after that is sized like the others
    _leased_decode(mgr, drv, ["a"], BucketKey(1, 8), slot=1)
    assert mgr._static_plan_states[(1, "main")].token_to_page.shape[0] == 16
    _leased_decode(mgr, drv, ["a", "b"], BucketKey(2, 16))


@pytest.mark.parametrize("bad", [0, -1, 2.5, "8", None])
def test_capture_size_must_be_a_positive_int(bad: object) -> None:
    mgr, _ = _graph_manager()
    with pytest.raises(InvalidArgumentError, match="max_seq_len"):
        mgr.build_cuda_graph_buffers([CGSlotSpec(0)], max_bs=1, max_seq_len=bad)  # type: ignore[arg-type]
    assert mgr._cg_max_seq_len == 0


def _forking_step(bucket: BucketKey) -> tuple[KVStep, StepContext]:
    # a pre-fork copies at plan: a refusal found after it would leave it applied
    step = KVStep([Segment("a", "cfg", 1)], pre_forks=[("main", "cfg")])
    return step, StepContext(("a",), slot_lease=SlotLease(0, bucket))


@pytest.mark.parametrize(("built", "bucket", "match"), [
    (0, BucketKey(1, 4), "before build_cuda_graph_buffers"),
    (8, BucketKey(1, 16), "larger than the graph buffers"),
    (8, BucketKey(1, 0), "do not fit a bucket of 0"),
])
def test_lease_that_does_not_fit_is_refused_before_plan_changes_anything(
    built: int, bucket: BucketKey, match: str
) -> None:
    mgr, drv = _graph_manager()
    if built:
        mgr.build_cuda_graph_buffers([CGSlotSpec(0)], max_bs=1, max_seq_len=built)
    step, ctx = _forking_step(bucket)
    assert mgr.admit(step, ctx).ok
    before = _state(mgr)
    with pytest.raises(InvalidStepError, match=match):
        mgr.plan(step, ctx)
    _assert_unchanged(before, mgr)
    # the admitted step still runs, under a lease that fits
    if not built:
        mgr.build_cuda_graph_buffers([CGSlotSpec(0)], max_bs=1, max_seq_len=8)
    good = StepContext(("a",), slot_lease=SlotLease(0, BucketKey(1, 4)))
    mgr.plan(step, good)
    drv.apply_pre_forks(step, good)
    cfg = mgr.config
    for layer in range(cfg.num_layers):
        kv = torch.zeros(4, 2, cfg.num_kv_heads, cfg.head_dim)
        kv[0] = token_values(drv.tag(("a", "cfg")), 6, layer, cfg.num_kv_heads, cfg.head_dim)
        mgr.write_kv(kv[:, 0].contiguous(), kv[:, 1].contiguous(), layer_idx=layer,
                     label="cfg")
    mgr.commit(step, good)
    drv.model[("a", "cfg")].append((drv.tag(("a", "cfg")), 6))
    drv.check("a", "cfg")
    drv.check("a")


def test_second_plan_label_too_big_leaves_the_first_buffer_alone() -> None:
    """Two plan labels: the second does not fit the bucket. Found after the first
    label was staged, the first graph's static buffer was already overwritten."""
    mgr, drv = _graph_manager()
    mgr.build_cuda_graph_buffers([CGSlotSpec(0)], max_bs=4, max_seq_len=8)
    _leased_decode(mgr, drv, ["a", "b"], BucketKey(2, 2))
    buf = mgr._static_plan_states[(0, "main")]
    recorded = (buf.token_to_page.clone(), buf.token_to_cache.clone(), buf.total_tokens)
    step = KVStep([Segment("a", "main", 1), Segment("b", "draft", 3)])
    ctx = StepContext(("a", "b"), slot_lease=SlotLease(0, BucketKey(2, 2)))
    assert mgr.admit(step, ctx).ok
    before = _state(mgr)
    with pytest.raises(InvalidStepError, match="3 tokens do not fit a bucket of 2"):
        mgr.plan(step, ctx)
    _assert_unchanged(before, mgr)
    assert torch.equal(buf.token_to_page, recorded[0])
    assert torch.equal(buf.token_to_cache, recorded[1])
    assert buf.total_tokens == recorded[2]
