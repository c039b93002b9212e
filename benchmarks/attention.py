"""``python -m benchmarks.attention [--quick] [--threads N] [--json PATH]``: paged attention on CPU.

Three ways to compute the same attention over the same tokens, timed
interleaved (one call of each per round) in one run:

- *reference*: `paged_attention_reference`, the per-request loop (the oracle);
- *sdpa*: `kvref.attention.sdpa`, one gather of the batch's pages and one
  masked ``scaled_dot_product_attention`` (plan built once, as per step);
- *dense*: ``scaled_dot_product_attention`` over K/V already laid out
  contiguously (``[B, H, L, D]``, the same mask; the decodes as one padded
  batch, each longer query alone): what attention costs with no pages at
  all, the floor the ratios are against.

Ratios are path / dense (lower is better; 1.0 is the cost of no paging).
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks import Spread, machine, md_table, no_gc, spread, time_call, write_json
from kvref.attention.paged import paged_attention_reference
from kvref.attention.sdpa import plan_sdpa, run_sdpa_plan
from kvref.core.config import KVLayout
from kvref.stepping.plan import PagedIndptrs, SequenceView, build_paged_indptrs

HQ, HKV, D, PS = 32, 8, 128, 16  # a Llama-3-8B layer


@dataclass(frozen=True)
class Case:
    name: str
    kv_lens: tuple[int, ...]
    q_lens: tuple[int, ...]


def cases(quick: bool) -> list[Case]:
    rng = random.Random(0)

    def ctx(n: int, lo: int, hi: int) -> tuple[int, ...]:
        return tuple(rng.randint(lo, hi) for _ in range(n))

    out = [
        Case("decode, batch 1, 1k context", (1024,), (1,)),
        Case("decode, batch 16, 200-2k", ctx(16, 200, 2000), (1,) * 16),
        Case("prefill chunk 256 on 1k", (1280,), (256,)),
    ]
    if not quick:
        out += [
            Case("decode, batch 64, 200-2k", ctx(64, 200, 2000), (1,) * 64),
            Case("mixed: 16 decodes + chunk 128", (*ctx(16, 200, 2000), 640), (1,) * 16 + (128,)),
        ]
    return out


@dataclass
class DenseGroup:
    """Requests whose K/V sit contiguously, padded to the group's longest."""

    rows: list[tuple[int, int]]  # per request: (first q row in the packed q, q_len)
    k: torch.Tensor  # [B, HKV, Lmax, D]
    v: torch.Tensor
    q: torch.Tensor  # [B, HQ, Qmax, D]
    mask: torch.Tensor  # [B, 1, Qmax, Lmax]


@dataclass
class Built:
    q: torch.Tensor
    layer: torch.Tensor
    table: PagedIndptrs
    # the decodes batched, each longer query alone: how a dense engine runs it
    groups: list[DenseGroup]


def _dense_group(views: list[SequenceView], starts: list[int], q: torch.Tensor,
                 layer: torch.Tensor) -> DenseGroup:
    b = len(views)
    lmax, qmax = max(v.length for v in views), max(v.to_compute for v in views)
    dk, dv = torch.zeros(b, HKV, lmax, D), torch.zeros(b, HKV, lmax, D)
    dq = torch.zeros(b, HQ, qmax, D)
    mask = torch.zeros(b, 1, qmax, lmax, dtype=torch.bool)
    for i, (v, row) in enumerate(zip(views, starts, strict=True)):
        # [L, 2, H, D]: pages [n, 2, ps, H, D] token-major
        tokens = layer[v.page_idxs].transpose(1, 2).reshape(-1, 2, HKV, D)[: v.length]
        dk[i, :, : v.length] = tokens[:, 0].transpose(0, 1)
        dv[i, :, : v.length] = tokens[:, 1].transpose(0, 1)
        dq[i, :, : v.to_compute] = q[row : row + v.to_compute].transpose(0, 1)
        qpos = torch.arange(v.length - v.to_compute, v.length)
        mask[i, 0, : v.to_compute, : v.length] = torch.arange(v.length)[None] <= qpos[:, None]
        mask[i, 0, v.to_compute :, 0] = True  # padded query rows: something to read
    return DenseGroup([(r, v.to_compute) for v, r in zip(views, starts, strict=True)],
                      dk, dv, dq, mask)


def build(case: Case, seed: int = 0) -> Built:
    gen = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // PS) for n in case.kv_lens]
    free = list(range(1, sum(pages_per) + 1))
    random.Random(seed).shuffle(free)  # a long-running cache: pages scattered
    views, starts, start, row = [], [], 0, 0
    for i, (n, q_len, p) in enumerate(zip(case.kv_lens, case.q_lens, pages_per, strict=True)):
        views.append(SequenceView(f"r{i}", "main", free[start : start + p], n, q_len, 0))
        starts.append(row)
        start, row = start + p, row + q_len
    layer = torch.randn(sum(pages_per) + 1, 2, PS, HKV, D, generator=gen)
    q = torch.randn(row, HQ, D, generator=gen)
    decodes = [i for i, v in enumerate(views) if v.to_compute == 1]
    members = ([decodes] if decodes else []) + [
        [i] for i, v in enumerate(views) if v.to_compute > 1
    ]
    groups = [_dense_group([views[i] for i in g], [starts[i] for i in g], q, layer)
              for g in members]
    return Built(q, layer, build_paged_indptrs(views, PS), groups)


def dense(b: Built) -> list[torch.Tensor]:
    """Each group's ``[B, HQ, Qmax, D]`` output (what is timed)."""
    return [F.scaled_dot_product_attention(g.q, g.k, g.v, attn_mask=g.mask, enable_gqa=True)
            for g in b.groups]


def dense_rows(b: Built) -> torch.Tensor:
    """`dense` laid out as the paged paths return it, ``[tokens, HQ, D]`` (for tests)."""
    out = torch.zeros_like(b.q)
    for g, o in zip(b.groups, dense(b), strict=True):
        for i, (row, q_len) in enumerate(g.rows):
            out[row : row + q_len] = o[i, :, :q_len].transpose(0, 1)
    return out


@dataclass
class Row:
    case: Case
    dense_us: Spread
    sdpa_us: Spread
    ref_us: Spread
    sdpa_ratio: float
    ref_ratio: float


def bench(case: Case, rounds: int, warmup: int = 2) -> Row:
    b = build(case)
    plan = plan_sdpa(b.table, PS, "cpu", (HQ, HKV, D))  # once per step, reused by every layer
    paths: dict[str, Callable[[], object]] = {
        "dense": lambda: dense(b),
        "sdpa": lambda: run_sdpa_plan(b.q, b.layer, plan, KVLayout.NHD),
        "ref": lambda: paged_attention_reference(b.q, b.layer, b.table, KVLayout.NHD),
    }
    got = run_sdpa_plan(b.q, b.layer, plan, KVLayout.NHD)
    want = paged_attention_reference(b.q, b.layer, b.table, KVLayout.NHD)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # timing the same result
    samples: dict[str, list[float]] = {k: [] for k in paths}
    ratios: dict[str, list[float]] = {"sdpa": [], "ref": []}
    with no_gc():
        for r in range(warmup + rounds):
            t = {k: time_call(fn) for k, fn in paths.items()}
            if r >= warmup:
                for k in paths:
                    samples[k].append(t[k] * 1e6)
                for k in ratios:
                    ratios[k].append(t[k] / t["dense"])
    return Row(case, spread(samples["dense"]), spread(samples["sdpa"]), spread(samples["ref"]),
               spread(ratios["sdpa"]).median, spread(ratios["ref"]).median)


def run(quick: bool) -> list[Row]:
    rounds = 5 if quick else 20
    return [bench(c, rounds) for c in cases(quick)]


def report(quick: bool) -> str:
    return tables(run(quick))


def tables(rows: list[Row]) -> str:
    """The Markdown table, from rows (a run's, or read back from JSON)."""
    return "\n".join([
        "### Attention on CPU: paged paths vs dense attention over the same tokens",
        "",
        f"{HQ} q heads, {HKV} kv heads, head_dim {D}, page_size {PS}, float32, pages "
        "shuffled. µs per call, median over rounds; ratio = path / dense, the median of "
        "per-round ratios (lower is better).",
        "",
        md_table(
            ["case", "dense µs", "sdpa µs", "reference µs", "sdpa / dense",
             "reference / dense"],
            [[r.case.name, r.dense_us.median, r.sdpa_us.median, r.ref_us.median,
              r.sdpa_ratio, r.ref_ratio] for r in rows],
        ),
    ])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", metavar="PATH", default=None,
                    help="also write the raw rows and the run's conditions to PATH")
    o = ap.parse_args(argv)
    torch.set_num_threads(o.threads)
    print(f"Machine: {machine()}\n")
    load_start, t0 = os.getloadavg()[0], time.perf_counter()
    rows = run(o.quick)
    print(tables(rows))
    if o.json:
        write_json(o.json, {
            "benchmark": "benchmarks.attention", "quick": o.quick, "machine": machine(),
            "cpus": os.cpu_count(), "load_start": load_start,
            "load_end": os.getloadavg()[0], "seconds": time.perf_counter() - t0,
            "rows": rows})


if __name__ == "__main__":
    main()
