"""The benchmarks run and return well-formed rows (tiny sizes; no timing is asserted)."""

from __future__ import annotations

import math

from benchmarks import Spread, md_table, spread
from benchmarks import control_plane as cp
from benchmarks import data_plane as dp
from benchmarks.__main__ import control_report, data_report


def _ok(s: Spread) -> None:
    assert s.n > 0
    assert all(math.isfinite(x) and x > 0 for x in (s.p10, s.median, s.p90))
    assert s.p10 <= s.median <= s.p90


def test_spread_and_table() -> None:
    s = spread([3.0, 1.0, 2.0])
    assert (s.p10, s.median, s.p90, s.n) == (1.2, 2.0, 2.8, 3)
    table = md_table(["a", "b"], [[1, 2.5]]).splitlines()
    assert table == ["| a | b |", "|---|---|", "| 1 | 2.50 |"]


def test_decode_rows() -> None:
    for batch in (1, 4):
        row = cp.bench_decode(batch, steps=3, warmup=1)
        assert row.batch == batch and row.steps == 3
        for s in (row.step_us, row.naive_step_us, row.req_us, row.naive_req_us):
            _ok(s)
        assert row.ratio > 0


def test_prefill_and_profile() -> None:
    pre = cp.bench_prefill(requests=2, tokens=40, steps=2, warmup=1)
    _ok(pre.step_us)
    _ok(pre.token_us)
    entries = cp.profile_decode(2, steps=3, top=5)
    assert 0 < len(entries) <= 5
    assert all(e.calls_per_step > 0 and e.cum_us_per_step >= 0 for e in entries)


def test_data_rows() -> None:
    small = {"layers": 1, "kv_heads": 1, "head_dim": 8}
    rows = [dp.bench_copy_pages(4, 2, False, **small),
            dp.bench_copy_pages(4, 2, True, **small),
            *dp.bench_offload_reload(4, reps=2, **small),
            *dp.bench_index_vs_runs(4, reps=2, shuffled=True, **small)]
    assert len(rows) == 6
    for r in rows:
        assert r.pages == 4 and r.bytes == 4 * 2 * 16 * 8 * 4
        for s in (r.gbps, r.plain_gbps, r.ratio):
            _ok(s)


def test_reports_are_markdown() -> None:
    text = control_report(quick=True, batches=(1,))
    assert "| batch |" in text and "Profile, decode at batch 1" in text
    text = data_report(quick=True, page_counts=(4,))
    assert "| path |" in text and text.count("\n| ") >= 9
