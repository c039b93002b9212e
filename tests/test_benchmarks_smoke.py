"""The benchmarks run and return well-formed rows (tiny sizes; no timing is asserted)."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import Spread, md_table, spread
from benchmarks import control_plane as cp
from benchmarks import data_plane as dp
from benchmarks.__main__ import control_report, data_report
from kvref import KVStep, Segment, StepContext


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
        for s in (row.step_us, row.ref_step_us, row.req_us, row.ref_req_us):
            _ok(s)
        assert row.ratio > 0


def test_mixed_rows() -> None:
    # 9 steps: the prompt (8 chunks) is swapped for a fresh one mid-run
    row = cp.bench_mixed(2, steps=9, warmup=1)
    assert row.batch == 2 and row.steps == 9
    for s in (row.decode_us, row.mixed_us, row.ref_decode_us, row.ref_mixed_us):
        _ok(s)
    for d in (row.extra_us, row.ref_extra_us):  # a difference: any sign, ordered
        # one per pair of iterations (one each way round); the odd one is dropped
        assert d.n == 4 and d.p10 <= d.median <= d.p90
    assert row.ratio > 0


def test_mixed_extra_cancels_the_first_steps_cold_penalty() -> None:
    """A mixed step 5 µs over a decode step of 10, the one that goes first
    20 µs slower: per iteration the difference is 25 or -15 (benchmarks'
    old estimator took the median of those), per pair of iterations 5."""
    decode = [10.0, 30.0, 10.0, 30.0, 10.0]  # mixed first, then decode first, ...
    mixed = [35.0, 15.0, 35.0, 15.0, 35.0]
    assert cp.paired_extras(decode, mixed) == [5.0, 5.0]


def test_reference_baseline_plans_what_kvref_plans() -> None:
    """The baseline is only a baseline if it does the same work: on the same
    streams, its decode and mixed steps give kvref's page tables and slots."""
    mgr, step, lengths = cp.decode_setup(3, 40)
    ref = cp.reference_setup(lengths, 40)
    ctx = StepContext()
    for m in (mgr, ref):
        m.ingest_request("p")
    for mixed in (False, True, True, False):
        run = KVStep([*step.segments, Segment("p", "main", 64)]) if mixed else step
        outs, states = [], []
        for m in (mgr, ref):
            assert m.admit(run, ctx).ok
            outs.append(m.plan(run, ctx))
            states.append(m._current_plan_states["main"])  # commit clears it
            m.commit(run, ctx)
        ours, theirs = outs
        assert ours.keys() == theirs.keys() == {"main"}
        a, b = ours["main"].cpu_indptrs, theirs["main"].cpu_indptrs
        for name in ("qo_indptr", "paged_kv_indptr", "paged_kv_indices",
                     "paged_kv_last_page_len"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        sa, sb = states
        assert torch.equal(sa.token_to_page, sb.token_to_page)
        assert torch.equal(sa.token_to_cache, sb.token_to_cache)
        assert (ours["main"].cuda_indptrs is None) == (theirs["main"].cuda_indptrs is None)


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


def test_reports_are_markdown(monkeypatch: pytest.MonkeyPatch) -> None:
    # the report's shape, not its figures: a few steps a row (quick's 400
    # made this the suite's slowest smoke test, about 16 s)
    monkeypatch.setattr(cp, "steps_for", lambda batch, quick: 4)
    text = control_report(quick=True, batches=(1,), mixed_batches=(1,))
    assert "| batch |" in text and "Profile, decode at batch 1" in text
    assert "| batch | steps | decode µs | mixed µs |" in text
    text = data_report(quick=True, page_counts=(4,))
    assert "| path |" in text and text.count("\n| ") >= 9


def test_decode_alone_times_kvref_and_the_reference() -> None:
    from benchmarks.decode_alone import decode_alone

    ours, theirs = decode_alone(3, steps=4)
    assert all(math.isfinite(x) and x > 0 for x in (ours, theirs))
