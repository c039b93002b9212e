"""The GPU check, in one run (budget: 8 minutes on an H200).

    python scripts/gpu_check.py

1. FlashInfer attention against the torch reference on kvref page tables
   (scripts/gpu_check_attention.py), CUDA-graph decode included.
2. CUDA-graph capture and replay of `write_kv` under a slot lease: the padded
   rows land on the sink page, every other page is untouched.
3. Pinned host offload and reload through the manager, byte-exact.
4. A cuda_ipc retrieve between two processes (scripts/gpu_check_transfer.py).
Prints PASS/FAIL per check; exits 1 on any failure, 0 with SKIP lines without CUDA.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

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
from kvref.plan import SINK_PAGE


def _manager(host_pages: int = 0) -> KVManager:
    cfg = KVConfig(num_layers=2, num_kv_heads=2, head_dim=64, max_seq_len=1024,
                   max_num_pages=64, page_size=16, num_qo_heads=8, cpu_offload_pages=host_pages)
    return KVManager(cfg, "kv", None, TransferEngineInfo(), "cuda", dtype=torch.bfloat16)


def check_graph_write() -> bool:
    kv = _manager()
    kv.build_cuda_graph_buffers([CGSlotSpec(0)], max_bs=8, max_seq_len=8)
    rids = ["a", "b"]
    for r in rids:
        kv.ingest_request(r)
    lease = SlotLease(0, BucketKey(batch_size=8, num_tokens=8))
    step = KVStep([Segment(r, "main", 1) for r in rids])
    ctx = StepContext(rids, slot_lease=lease)
    assert kv.admit(step, ctx).ok
    kv.plan(step, ctx)
    k = torch.zeros(8, 2, 64, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kv.write_kv(k, k, layer_idx=0)  # warm up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        kv.write_kv(k, k, layer_idx=0)
    kv.commit(step, ctx)
    # the next decode step re-plans into the same static buffers, then replays
    assert kv.admit(step, ctx).ok
    kv.plan(step, ctx)
    before = kv.kv_cache.tensor.clone()
    k.fill_(7.0)
    graph.replay()
    torch.cuda.synchronize()
    changed = (kv.kv_cache.tensor != before).flatten(2).any(2).any(0).nonzero().flatten().tolist()
    pages = {p for r in rids for p in kv._streams[r]["main"].page_indices} | {SINK_PAGE}
    kv.commit(step, ctx)
    ok = set(changed) <= pages and SINK_PAGE in changed
    got = kv.read_stream("a")[0, 1, 0]
    return ok and bool((got == 7.0).all())


def check_offload_reload() -> bool:
    kv = _manager(host_pages=32)
    kv.ingest_request("r")
    step = KVStep([Segment("r", "main", 100)])
    ctx = StepContext(["r"])
    assert kv.admit(step, ctx).ok
    kv.plan(step, ctx)
    for layer in range(2):
        x = torch.randn(100, 2, 64, device="cuda").to(torch.bfloat16)
        kv.write_kv(x, -x, layer_idx=layer)
    kv.commit(step, ctx)
    before = kv.read_stream("r").clone()
    assert kv._cpu_pool is not None and kv._cpu_pool.tensor.is_pinned()
    freed = kv.offload("r")
    # scribble over the freed pages: reload must bring the bytes back
    kv.kv_cache.tensor.fill_(3.0)
    ok = freed == 7 and kv.reload("r")
    return ok and torch.equal(kv.read_stream("r"), before)


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP gpu_check: CUDA is not available")
        return 0
    import gpu_check_attention
    import gpu_check_transfer

    results = {
        "attention (FlashInfer vs reference, graph decode)": gpu_check_attention.check_attention(),
        "write_kv under CUDA graph, padding to sink": check_graph_write(),
        "pinned offload and reload": check_offload_reload(),
        "cuda_ipc retrieve across processes": gpu_check_transfer.main(["--kind", "cuda_ipc"]) == 0,
    }
    for name, ok in results.items():
        print(("PASS " if ok else "FAIL ") + name)
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
