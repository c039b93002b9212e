#!/usr/bin/env python
"""GPU check: FlashInfer paged attention against kvref's torch reference.

On CUDA with flashinfer: prefill, chunked prefill and decode, NHD and HND,
page sizes 1 and 16, bf16, over page tables built by kvref's own plan code
(shuffled, non-contiguous pages; streams holding spare pages), then a decode
step captured in a CUDA graph and replayed after re-planning a different
batch, then the `PagedAttention` facade picking FlashInfer on its own.

    python scripts/gpu_check_attention.py            # the check; exit 1 on any FAIL
    python scripts/gpu_check_attention.py --dry-run  # CPU: tables + torch reference only

`scripts/gpu_check.py` calls `check_attention()`, which raises `Skip` without
CUDA or flashinfer (run alone, this script then prints SKIP, never PASS).
The first FlashInfer call JIT-compiles its kernels (minutes on a cold
cache): the cases share one head_dim and dtype so that happens once per
wrapper kind (the 7:1 head grouping adds one tensor-core decode kernel).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# a checkout without an install: the repository root on the path
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch
from gpu_check_graphs import Skip

from kvref.attention.paged import (
    FlashInferPagedAttention,
    PagedAttention,
    _graph_padded,
    flashinfer_available,
    paged_attention_reference,
)
from kvref.core.cache import KVCache
from kvref.core.config import KVConfig, KVLayout
from kvref.core.errors import KVShapeError
from kvref.stepping.plan import PagedIndptrs, SequenceView, build_paged_indptrs, packed_plan_state

NUM_QO_HEADS = 8
NUM_KV_HEADS = 2
HEAD_DIM = 128
# bf16 inputs both sides; the reference accumulates in fp32 and rounds once,
# FlashInfer rounds its probabilities to bf16 before P@V: ~1e-2 apart at most
ATOL = 2e-2
RTOL = 2e-2


@dataclass
class Case:
    cache: KVCache
    views: list[SequenceView]  # after this step's tokens are written
    q: torch.Tensor

    def table(self, which: list[int] | None = None) -> PagedIndptrs:
        views = self.views if which is None else [self.views[i] for i in which]
        return build_paged_indptrs(views, self.cache.page_size)

    def q_rows(self, which: list[int]) -> torch.Tensor:
        starts = [0]
        for v in self.views:
            starts.append(starts[-1] + v.to_compute)
        return torch.cat([self.q[starts[i] : starts[i + 1]] for i in which])


def build_case(
    reqs: list[tuple[int, int, int]],
    layout: KVLayout,
    page_size: int,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
) -> Case:
    """``reqs``: (cached tokens, tokens this step, spare pages) per request.

    Pages are shuffled across requests; the cache starts as large finite
    garbage, so a kernel reading a slot outside a request's tokens shows up
    as a mismatch (NaN would, too, but could also poison masked lanes).
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    held_counts = [-(-(c + n) // page_size) + spare for c, n, spare in reqs]
    num_pages = sum(held_counts) + 1 + 3
    cfg = KVConfig(
        num_layers=1,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_seq_len=8192,
        max_num_pages=num_pages,
        page_size=page_size,
        num_qo_heads=NUM_QO_HEADS,
        layout=layout,
    )
    cache = KVCache(cfg, device, dtype)
    cache.tensor.copy_(100 * torch.randn(cache.tensor.shape, generator=gen))
    free = list(range(1, num_pages))
    rng.shuffle(free)
    held = []
    for n in held_counts:
        held.append(free[:n])
        free = free[n:]

    def views_at(prior: bool) -> list[SequenceView]:
        out = []
        for i, ((c, n, _), pages) in enumerate(zip(reqs, held, strict=True)):
            length, comp = (c, c) if prior else (c + n, n)
            out.append(
                SequenceView(f"r{i}", "main", pages[: -(-length // page_size)], length, comp, 0)
            )
        return out

    for prior in (True, False):
        views = [v for v in views_at(prior) if v.to_compute]
        if not views:
            continue
        total = sum(v.to_compute for v in views)
        slots = packed_plan_state(build_paged_indptrs(views, page_size), page_size, total, device)
        k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
        v = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
        cache.write_tokens(0, k, v, slots.token_to_page, slots.token_to_cache)
    views = views_at(False)
    total = sum(v.to_compute for v in views)
    q = torch.randn(total, NUM_QO_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    return Case(cache, views, q)


def dense(case: Case) -> torch.Tensor:
    """Per-request attention without pages, from `gather_stream` (the dry run's oracle)."""
    outs = []
    row = 0
    group = NUM_QO_HEADS // NUM_KV_HEADS
    for v in case.views:
        kv = case.cache.gather_stream(v.page_idxs, v.length)[0].double()  # [len, 2, H, D]
        k = kv[:, 0].repeat_interleave(group, 1)
        val = kv[:, 1].repeat_interleave(group, 1)
        q = case.q[row : row + v.to_compute].double()
        row += v.to_compute
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
        q_pos = torch.arange(v.length - v.to_compute, v.length)
        s = s.masked_fill(torch.arange(v.length)[None] > q_pos[:, None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), val))
    return torch.cat(outs)


CASES: dict[str, list[tuple[int, int, int]]] = {
    "prefill": [(0, 37, 1), (0, 5, 0), (0, 300, 2), (0, 1, 0)],
    "chunked": [(17, 20, 0), (256, 64, 2), (1, 9, 1), (40, 1, 0)],
    "decode": [(0, 1, 0), (30, 1, 1), (999, 1, 0), (15, 1, 2), (16, 1, 0)],
}


class Report:
    def __init__(self) -> None:
        self.failed = 0
        self.total = 0

    def result(self, name: str, ok: bool, detail: str = "") -> None:
        self.failed += not ok
        self.total += 1
        print(f"{'PASS' if ok else 'FAIL'} attention {name}{': ' + detail if detail else ''}")
        sys.stdout.flush()

    def compare(self, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        err = (got.float() - want.float()).abs()
        tol = ATOL + RTOL * want.float().abs()
        ok = bool((err <= tol).all()) and not bool(got.isnan().any())
        self.result(name, ok, f"max abs err {err.max().item():.3g}")


def _dry_run(report: Report) -> None:
    cpu = torch.device("cpu")
    for layout in KVLayout:
        for page_size in (1, 16):
            for kind, reqs in CASES.items():
                case = build_case(reqs, layout, page_size, cpu, torch.float32)
                ref = paged_attention_reference(
                    case.q, case.cache.layer_view(0), case.table(), layout
                )
                report.compare(
                    f"dry-run reference {kind} {layout.value} ps={page_size}", ref, dense(case)
                )
    table = build_case(CASES["decode"], KVLayout.NHD, 16, cpu, torch.float32).table()
    padded = _graph_padded(table, 8, decode=True)
    report.result("dry-run graph padding, decode", padded.batch_size == 8)
    table = build_case(CASES["chunked"], KVLayout.NHD, 16, cpu, torch.float32).table()
    padded = _graph_padded(table, 8, decode=False, num_rows=128, page_size=16)
    ok = padded.batch_size == 9 and int(padded.qo_indptr[-1]) == 128
    report.result("dry-run graph padding, prefill (rows absorbed)", ok)


def _flashinfer_cases(report: Report, device: torch.device) -> None:
    dtype = torch.bfloat16
    for layout in KVLayout:
        fi = FlashInferPagedAttention(device, layout)
        for page_size in (1, 16):
            for kind, reqs in CASES.items():
                name = f"flashinfer {kind} {layout.value} ps={page_size}"
                try:
                    case = build_case(reqs, layout, page_size, device, dtype, seed=page_size)
                    table = case.table()
                    layer = case.cache.layer_view(0)
                    t0 = time.perf_counter()
                    fi.plan(
                        table,
                        num_qo_heads=NUM_QO_HEADS,
                        num_kv_heads=NUM_KV_HEADS,
                        head_dim=HEAD_DIM,
                        page_size=page_size,
                        q_dtype=dtype,
                    )
                    got = fi.run(case.q, layer)
                    torch.cuda.synchronize()
                    secs = time.perf_counter() - t0
                    want = paged_attention_reference(case.q, layer, table, layout)
                    report.compare(f"{name} ({secs:.1f}s incl. any JIT)", got, want)
                except Exception as e:  # one broken variant must not hide the others
                    report.result(name, False, f"{type(e).__name__}: {e}")


def _graph_decode(report: Report, device: torch.device) -> None:
    """Capture decode once, re-plan a different batch, replay: the static buffers carry it."""
    dtype = torch.bfloat16
    bucket = 8
    reqs = [(c, 1, 1) for c in (3, 64, 17, 200, 0, 31)]
    for layout in KVLayout:
        name = f"flashinfer cuda-graph decode {layout.value}"
        try:
            case = build_case(reqs, layout, 16, device, dtype, seed=11)
            layer = case.cache.layer_view(0)
            fi = FlashInferPagedAttention(
                device,
                layout,
                cuda_graph_batch_size=bucket,
                max_num_pages=case.cache.config.max_num_pages,
                page_size=16,
            )
            plan_kw = dict(
                num_qo_heads=NUM_QO_HEADS,
                num_kv_heads=NUM_KV_HEADS,
                head_dim=HEAD_DIM,
                page_size=16,
                q_dtype=dtype,
            )
            static_q = torch.zeros(bucket, NUM_QO_HEADS, HEAD_DIM, dtype=dtype, device=device)
            first, second = [0, 1, 2], [5, 3, 1, 4, 2]
            fi.plan(case.table(first), **plan_kw)  # type: ignore[arg-type]
            static_q[:3].copy_(case.q_rows(first))
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fi.run(static_q, layer)  # warm up (and JIT) outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = fi.run(static_q, layer)
            for which in (first, second):
                fi.plan(case.table(which), **plan_kw)  # type: ignore[arg-type]
                static_q.zero_()
                static_q[: len(which)].copy_(case.q_rows(which))
                graph.replay()
                torch.cuda.synchronize()
                want = paged_attention_reference(
                    case.q_rows(which), layer, case.table(which), layout
                )
                report.compare(f"{name} batch={len(which)}", static_out[: len(which)], want)
        except Exception as e:
            report.result(name, False, f"{type(e).__name__}: {e}")


def _graph_edges(report: Report, device: torch.device) -> None:
    """D1 at a full cache, D3's 7:1 grouping, an empty batch, decode graph vs prefill."""
    dtype = torch.bfloat16
    # D1: every usable page in the batch, plus a sink entry per padded request
    case = build_case([(16 * 6 - 1, 1, 0)], KVLayout.NHD, 16, device, dtype, seed=3)
    pages = case.cache.config.max_num_pages
    fi = FlashInferPagedAttention(device, KVLayout.NHD, cuda_graph_batch_size=pages,
                                  max_num_pages=pages, page_size=16)
    kw = dict(num_qo_heads=NUM_QO_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
              page_size=16, q_dtype=dtype)
    try:
        fi.plan(case.table(), **kw)  # type: ignore[arg-type]
        q = torch.zeros(pages, NUM_QO_HEADS, HEAD_DIM, dtype=dtype, device=device)
        q[:1] = case.q
        got = fi.run(q, case.cache.layer_view(0))[:1]
        want = paged_attention_reference(case.q, case.cache.layer_view(0), case.table(),
                                         KVLayout.NHD)
        report.compare(f"graph decode, full cache, batch padded to {pages} (D1)", got, want)
    except Exception as e:
        report.result("graph decode, full cache (D1)", False, f"{type(e).__name__}: {e}")
    try:
        raised = False
        fi.plan(build_case(CASES["prefill"], KVLayout.NHD, 16, device, dtype).table(),
                **kw)  # type: ignore[arg-type]
    except KVShapeError:
        raised = True
    report.result("decode graph refuses a prefill plan", raised)
    # D3: 7 q heads per kv head has no CUDA-core decode kernel
    try:
        g = torch.Generator().manual_seed(9)
        layer = (torch.randn(12, 2, 16, 1, HEAD_DIM, generator=g)).to(device, dtype)
        views = [SequenceView("a", "main", [3, 5], 20, 1, 0),
                 SequenceView("b", "main", [7], 9, 1, 0)]
        table = build_paged_indptrs(views, 16)
        q = torch.randn(2, 7, HEAD_DIM, generator=g).to(device, dtype)
        plain = FlashInferPagedAttention(device, KVLayout.NHD)
        plain.plan(table, num_qo_heads=7, num_kv_heads=1, head_dim=HEAD_DIM, page_size=16,
                   q_dtype=dtype)
        got = plain.run(q, layer)
        want = paged_attention_reference(q, layer, table, KVLayout.NHD)
        report.compare("decode with 7 q heads per kv head (D3, tensor cores)", got, want)
        empty = build_paged_indptrs([], 16)
        plain.plan(empty, num_qo_heads=7, num_kv_heads=1, head_dim=HEAD_DIM, page_size=16,
                   q_dtype=dtype)
        out = plain.run(q, layer)
        report.result("empty batch runs to zeros", bool((out == 0).all()))
    except Exception as e:
        report.result("7:1 decode / empty batch", False, f"{type(e).__name__}: {e}")


def _graph_prefill(report: Report, device: torch.device) -> None:
    """D2: a prefill bucket captured once, replayed over tables with fewer rows and requests."""
    dtype = torch.bfloat16
    bucket, rows = 4, 128
    reqs = [(0, 37, 1), (10, 20, 0), (0, 5, 0), (64, 40, 1)]
    name = "flashinfer cuda-graph prefill"
    try:
        case = build_case(reqs, KVLayout.NHD, 16, device, dtype, seed=13)
        layer = case.cache.layer_view(0)
        fi = FlashInferPagedAttention(device, KVLayout.NHD, cuda_graph_batch_size=bucket,
                                      cuda_graph_num_rows=rows,
                                      max_num_pages=case.cache.config.max_num_pages,
                                      page_size=16)
        kw = dict(num_qo_heads=NUM_QO_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                  page_size=16, q_dtype=dtype)
        static_q = torch.zeros(rows, NUM_QO_HEADS, HEAD_DIM, dtype=dtype, device=device)
        first, later = [0, 1], [[3, 2, 0, 1], [2]]
        fi.plan(case.table(first), **kw)  # type: ignore[arg-type]
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fi.run(static_q, layer)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = fi.run(static_q, layer)
        for which in [first, *later]:
            fi.plan(case.table(which), **kw)  # type: ignore[arg-type]
            rows_q = case.q_rows(which)
            static_q.zero_()
            static_q[: len(rows_q)].copy_(rows_q)
            graph.replay()
            torch.cuda.synchronize()
            want = paged_attention_reference(rows_q, layer, case.table(which), KVLayout.NHD)
            report.compare(f"{name} requests={which} rows={len(rows_q)}",
                           static_out[: len(rows_q)], want)
    except Exception as e:
        report.result(name, False, f"{type(e).__name__}: {e}")


def _facade(report: Report, device: torch.device) -> None:
    case = build_case(CASES["chunked"], KVLayout.NHD, 16, device, torch.bfloat16, seed=5)
    attn = PagedAttention.from_config(case.cache.config)  # backend="auto"
    table = case.table()
    attn.plan(table)
    got = attn.run(case.q, case.cache.layer_view(0))
    report.result("facade auto picks flashinfer on CUDA", attn.last_backend == "flashinfer")
    want = paged_attention_reference(case.q, case.cache.layer_view(0), table, KVLayout.NHD)
    report.compare("facade auto output", got, want)


def check_attention(*, dry_run: bool = False) -> str:
    """Run the attention checks; a summary line, AssertionError on any failure, or Skip."""
    report = Report()
    if dry_run:
        _dry_run(report)
    else:
        if not torch.cuda.is_available():
            raise Skip("no CUDA device")
        if not flashinfer_available():
            raise Skip("flashinfer is not importable (pip install 'kvref[gpu]')")
        device = torch.device("cuda", torch.cuda.current_device())
        _flashinfer_cases(report, device)
        _graph_decode(report, device)
        _graph_prefill(report, device)
        _graph_edges(report, device)
        _facade(report, device)
    assert report.failed == 0, f"{report.failed} of {report.total} attention cases failed"
    return f"{report.total} cases"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU only: build the page tables, run the torch reference against dense",
    )
    args = parser.parse_args(argv)
    try:
        print(f"PASS attention: {check_attention(dry_run=args.dry_run)}")
    except Skip as e:
        print(f"SKIP attention: {e}")
    except AssertionError as e:
        print(f"FAIL attention: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
