"""benchmarks/attention.py runs and its dense baseline computes the same attention."""

from __future__ import annotations

import math

import torch

from benchmarks.attention import Case, bench, build, dense_rows
from kvref.attention.paged import paged_attention_reference
from kvref.core.config import KVLayout


def test_dense_baseline_is_the_same_attention() -> None:
    # the ratio means something only if dense computes what the paged paths do
    b = build(Case("mixed", (40, 17, 3, 9), (1, 5, 1, 3)))
    want = paged_attention_reference(b.q, b.layer, b.table, KVLayout.NHD)
    torch.testing.assert_close(dense_rows(b), want, atol=1e-4, rtol=1e-4)


def test_bench_row() -> None:
    r = bench(Case("tiny", (20, 33), (1, 1)), rounds=2, warmup=1)
    assert r.dense_us.n == r.sdpa_us.n == r.ref_us.n == 2
    assert all(math.isfinite(x) and x > 0 for x in (r.sdpa_ratio, r.ref_ratio))
