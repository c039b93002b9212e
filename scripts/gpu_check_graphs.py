"""GPU checks: CUDA graphs over kvref, and the offload/reload bandwidth.

Each function runs one check and returns a detail line, raises
``AssertionError`` on a wrong result, or `Skip` when it cannot run here.
`scripts/gpu_check.py` runs them and prints the table.

- `graph_step`: one captured graph holding every layer's ``write_kv`` and
  attention, replayed over several steps (decode or prefill buckets) after
  re-planning each; attention is the SDPA path on a static table (no
  FlashInfer needed) or FlashInfer's graph wrappers. Checked against the
  torch reference over the same cache, and the written K/V byte-exact.
- `bandwidth`: offload and reload through the manager, byte-exact, timed
  as a ratio to a plain pinned copy of the same bytes in the same run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvref import (
    BucketKey,
    CGSlotSpec,
    KVConfig,
    KVManager,
    KVStep,
    Segment,
    SlotLease,
    StepContext,
    TransferEngineInfo,
)
from kvref.attention.flashinfer import FlashInferPagedAttention, flashinfer_available
from kvref.attention.paged import paged_attention_reference
from kvref.attention.sdpa import StaticDenseTable
from kvref.core.config import KVLayout
from kvref.stepping.plan import SINK_PAGE


class Skip(Exception):
    """The check cannot run on this machine (the message says why)."""


def need_cuda() -> None:
    if not torch.cuda.is_available():
        raise Skip("no CUDA device")


def need_flashinfer() -> None:
    need_cuda()
    if not flashinfer_available():
        raise Skip("flashinfer is not importable")


LAYERS, HQ, HKV, D, PS = 2, 8, 2, 128, 16
DTYPE = torch.bfloat16

# per bucket kind: (batch, rows), then each step's new tokens per request r0, r1, ...
DECODE_BUCKET = (8, 8)
DECODE_STEPS = [[1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]]
PREFILL_BUCKET = (4, 96)
PREFILL_STEPS = [[37, 5, 30], [20, 51], [1, 16, 9, 40]]


def _manager(max_seq_len: int, device: str) -> KVManager:
    cfg = KVConfig(num_layers=LAYERS, num_kv_heads=HKV, head_dim=D, max_seq_len=4096,
                   max_num_pages=96, page_size=PS, num_qo_heads=HQ)
    kv = KVManager(cfg, "kv", None, TransferEngineInfo(), device, dtype=DTYPE)
    kv.build_cuda_graph_buffers([CGSlotSpec(0)], max_bs=8, max_seq_len=max_seq_len)
    return kv


class _Attention:
    """The attention the graph captures: SDPA on a static table, or FlashInfer."""

    def __init__(self, backend: str, batch: int, rows: int, prefill: bool, device: str) -> None:
        self.backend = backend
        if backend == "sdpa":
            self.static = StaticDenseTable(batch, 4096 // PS, rows if prefill else 1, rows,
                                           device)
        else:
            self.fi = FlashInferPagedAttention(
                "cuda", KVLayout.NHD, cuda_graph_batch_size=batch,
                cuda_graph_num_rows=rows if prefill else None, max_num_pages=96, page_size=PS,
            )

    def plan(self, indptrs: Any) -> None:
        if self.backend == "sdpa":
            self.static.update(indptrs, PS)
        else:
            self.fi.plan(indptrs, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PS,
                         q_dtype=DTYPE, decode=None)

    def run(self, q: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
        if self.backend == "sdpa":
            return self.static.run(q, layer, KVLayout.NHD)
        return self.fi.run(q, layer)


def graph_step(backend: str, prefill: bool, device: str = "cuda") -> str:
    """``device="cpu"``: the same steps and checks with ``body`` called, not replayed
    (a dry run of everything but the capture)."""
    if device == "cuda":
        need_cuda()
    if backend == "flashinfer":
        need_flashinfer()
    batch, rows = PREFILL_BUCKET if prefill else DECODE_BUCKET
    plan_steps = PREFILL_STEPS if prefill else DECODE_STEPS
    kv = _manager(rows, device)
    attn = _Attention(backend, batch, rows, prefill, device)
    lease = SlotLease(0, BucketKey(batch_size=batch, num_tokens=rows))
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.zeros(rows, HQ, D, dtype=DTYPE, device=device)
    k = torch.zeros(LAYERS, rows, HKV, D, dtype=DTYPE, device=device)
    v = torch.zeros_like(k)
    outs: list[torch.Tensor] = []

    def body() -> None:
        outs.clear()
        for layer in range(LAYERS):
            kv.write_kv(k[layer], v[layer], layer_idx=layer)
            outs.append(attn.run(q, kv.layer_view(layer)))

    graph: torch.cuda.CUDAGraph | None = None
    worst = 0.0
    ingested: set[str] = set()
    for n_step, reqs in enumerate(plan_steps):
        rids = [f"r{i}" for i in range(len(reqs))]
        for rid in set(rids) - ingested:
            kv.ingest_request(rid)
            ingested.add(rid)
        step = KVStep([Segment(rid, "main", new) for rid, new in zip(rids, reqs, strict=True)])
        ctx = StepContext(rids, slot_lease=lease)
        outcome = kv.admit(step, ctx)
        assert outcome.ok, outcome.reason
        table = kv.plan(step, ctx)["main"].cpu_indptrs
        attn.plan(table)
        n = int(table.qo_indptr[-1])
        for t in (q, k, v):  # padding rows too: they must not leak anywhere
            t.copy_(torch.randn(t.shape, generator=gen, device=device).to(DTYPE))
        before = kv.kv_cache.tensor.clone()
        if device == "cpu":
            body()
        elif graph is None:
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                body()  # warm-up (and FlashInfer's JIT) outside the capture
            torch.cuda.current_stream().wait_stream(side)
            kv.kv_cache.tensor.copy_(before)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                body()
        if graph is not None:
            graph.replay()
            torch.cuda.synchronize()
        # writes: only the step's pages and the sink changed, and hold k/v
        changed = (kv.kv_cache.tensor != before).flatten(2).any(2).any(0).nonzero()
        allowed = {int(p) for p in table.paged_kv_indices.tolist()} | {SINK_PAGE}
        stray = set(changed.flatten().tolist()) - allowed
        assert not stray, f"step {n_step}: graph wrote pages {sorted(stray)} outside the step"
        for layer in range(LAYERS):
            want = paged_attention_reference(q[:n], kv.layer_view(layer), table, KVLayout.NHD)
            err = (outs[layer][:n].float() - want.float()).abs().max().item()
            worst = max(worst, err)
            assert err < 3e-2, f"step {n_step} layer {layer}: max abs err {err:.3g}"
            if outs[layer].shape[0] > n and backend == "sdpa":
                assert not outs[layer][n:].any(), "padding rows of the output are not zero"
        kv.commit(step, ctx)
        _check_written(kv, rids, reqs, k, v)
    ran = "replayed" if graph is not None else "run without capture"
    return f"{len(plan_steps)} steps {ran}, max abs err {worst:.3g}"


def _check_written(
    kv: KVManager, rids: list[str], reqs: list[int], k: torch.Tensor, v: torch.Tensor
) -> None:
    """Each request's newest tokens are this step's K/V rows, bit for bit."""
    row = 0
    for rid, new in zip(rids, reqs, strict=True):
        tokens = kv.read_stream(rid)[:, -new:]  # [layers, new, 2, H, D]
        assert torch.equal(tokens[:, :, 0], k[:, row : row + new]), f"{rid}: K not as written"
        assert torch.equal(tokens[:, :, 1], v[:, row : row + new]), f"{rid}: V not as written"
        row += new


# -- bandwidth ------------------------------------------------------------------


def _timed(fn: Callable[[], Any], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def bandwidth(pages: int = 1024, reps: int = 5) -> str:
    """Offload/reload of ``pages`` pages vs a plain pinned copy of the same bytes."""
    need_cuda()
    cfg = KVConfig(num_layers=4, num_kv_heads=8, head_dim=128, max_seq_len=pages * PS + PS,
                   max_num_pages=pages + 2, page_size=PS, num_qo_heads=8,
                   cpu_offload_pages=pages)
    kv = KVManager(cfg, "kv", None, TransferEngineInfo(), "cuda", dtype=DTYPE)
    assert kv._cpu_pool is not None and kv._cpu_pool.tensor.is_pinned()
    kv.ingest_request("r")
    tokens = pages * PS
    step, ctx = KVStep([Segment("r", "main", tokens)]), StepContext(["r"])
    assert kv.admit(step, ctx).ok
    kv.plan(step, ctx)
    for layer in range(cfg.num_layers):
        x = torch.randn(tokens, 8, 128, device="cuda").to(DTYPE)
        kv.write_kv(x, -x, layer_idx=layer)
    kv.commit(step, ctx)
    want = kv.read_stream("r").clone()
    nbytes = pages * kv.kv_cache.bytes_per_page
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2h = _timed(lambda: host.copy_(dev, non_blocking=True), reps)
    h2d = _timed(lambda: dev.copy_(host, non_blocking=True), reps)
    off, rel = [], []
    for _ in range(reps):
        off += _timed(lambda: kv.offload("r"), 1)
        kv.kv_cache.tensor.fill_(3.0)  # reload must bring every byte back
        rel += _timed(lambda: kv.reload("r"), 1)
        assert torch.equal(kv.read_stream("r"), want), "reload is not byte-exact"
    gb = nbytes / 1e9
    med = statistics.median
    return (
        f"{nbytes / 2**20:.0f} MiB: offload {gb / med(off):.1f} GB/s = "
        f"{med(d2h) / med(off):.2f} of plain D2H ({gb / med(d2h):.1f}); reload "
        f"{gb / med(rel):.1f} GB/s = {med(h2d) / med(rel):.2f} of plain H2D "
        f"({gb / med(h2d):.1f}); median of {reps}"
    )
