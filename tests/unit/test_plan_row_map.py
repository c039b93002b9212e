"""`KVPlanOutputs.locate`: from a step's segment to its plan label, view and
query rows (R47).

Plan views are label-major within a combined group and leave out segments
whose stream is empty after the step, so an engine cannot assume view ``i``
is segment ``i``. Each test writes K/V the way an engine would, placing each
segment's tokens at the rows `locate` gives, in the step's segment order,
then reads every stream back: a wrong row map puts tokens in the wrong
stream or position.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from _manager_fixtures import Driver, fill, make_manager

from kvref import KVManager, KVPlanOutputs, KVStep, Segment, StepContext, ViewRows


def value(rid: str, label: str, pos: int) -> float:
    """Exact in float32; names the stream and position a token belongs to."""
    return float(ord(rid[0]) * 10_000 + ord(label[0]) * 100 + pos)


def check_locate(outputs: KVPlanOutputs, step: KVStep) -> dict[tuple[str, str], ViewRows]:
    """locate agrees with the views and their CSR rows, and the rows of each
    plan label are covered exactly once."""
    found: dict[tuple[str, str], ViewRows] = {}
    for seg in step.segments:
        where = outputs.locate(seg.request_id, seg.label)
        if where is None:
            continue
        out = outputs[where.plan_label]
        view = out.views[where.view_index]
        assert (view.request_id, view.label) == (seg.request_id, seg.label), where
        qo = out.cpu_indptrs.qo_indptr.tolist()
        assert (where.row_start, where.row_stop) == (qo[where.view_index],
                                                      qo[where.view_index + 1])
        assert where.row_stop - where.row_start == seg.span == view.to_compute
        found[(seg.request_id, seg.label)] = where
    for plan_label, out in outputs.items():
        mine = sorted((w.view_index, w.row_start, w.row_stop) for w in found.values()
                      if w.plan_label == plan_label)
        assert [i for i, _, _ in mine] == list(range(len(out.views))), (
            f"{plan_label}: views {mine} located, of {len(out.views)}")
        # back to back from row 0 to the label's last row
        edges = [0] + [e for _, a, b in mine for e in (a, b)] + [out.get_total_len()]
        assert edges[0::2] == edges[1::2], f"{plan_label}: rows {mine} leave gaps or overlap"
    return found


def run_engine_step(mgr: KVManager, step: KVStep, ctx: StepContext) -> KVPlanOutputs:
    """Admit, plan, write each segment's tokens where `locate` says, commit,
    and check every written token reads back in its own stream and position."""
    assert mgr.admit(step, ctx).ok
    outputs = mgr.plan(step, ctx)
    where = check_locate(outputs, step)
    cfg = mgr.config
    start = {(s.request_id, s.label): mgr.stored_len(s.request_id, s.label)
             if s.label in mgr.labels(s.request_id) else 0 for s in step.segments}
    for v in (v for out in outputs.values() for v in out.views):
        # a pre-fork target starts the step at its source's length
        start[(v.request_id, v.label)] = v.length - v.to_compute
    rows = {pl: torch.full((out.get_total_len(),), -1.0) for pl, out in outputs.items()}
    for seg in step.segments:  # the engine's order: the step's, not the plan's
        w = where.get((seg.request_id, seg.label))
        if w is None:
            assert seg.span == 0, f"{seg} has tokens but no rows"
            continue
        first = start[(seg.request_id, seg.label)]
        rows[w.plan_label][w.row_start:w.row_stop] = torch.tensor(
            [value(seg.request_id, seg.label, first + i) for i in range(seg.span)])
    for plan_label, r in rows.items():
        assert not (r == -1).any(), f"{plan_label}: rows no segment was located at"
        kv = r.view(-1, 1, 1).expand(-1, cfg.num_kv_heads, cfg.head_dim).contiguous()
        for layer in range(cfg.num_layers):
            mgr.write_kv(kv, kv, layer_idx=layer, label=plan_label)
    mgr.commit(step, ctx)
    for seg in step.segments:
        if not seg.span:
            continue
        first = start[(seg.request_id, seg.label)]
        got = mgr.read_stream(seg.request_id, seg.label)[0, first:first + seg.span, 0, 0, 0]
        want = torch.tensor([value(seg.request_id, seg.label, first + i)
                             for i in range(seg.span)])
        assert torch.equal(got, want), f"{seg}: read {got.tolist()}, wrote {want.tolist()}"
    return outputs


def _manager() -> tuple[KVManager, Driver]:
    mgr = make_manager(pages=40, page_size=4)
    drv = Driver(mgr)
    drv.ingest("a", "b", "c")
    fill(drv, "a", 6)
    fill(drv, "b", 3)
    fill(drv, "a", 2, "cfg")
    return mgr, drv


def test_mixed_step() -> None:
    mgr, _ = _manager()
    step = KVStep([Segment("c", "main", 5), Segment("a", "main", 1), Segment("b", "main", 1)])
    out = run_engine_step(mgr, step, StepContext(["a", "b", "c"]))
    assert out.locate("c", "main") == ViewRows("main", 0, 0, 5)
    assert out.locate("b", "main") == ViewRows("main", 2, 6, 7)
    assert out.locate("a", "cfg") is None  # not in the step


def test_combined_labels_are_label_major() -> None:
    mgr, _ = _manager()
    step = KVStep([Segment("a", "cfg", 1), Segment("b", "main", 2), Segment("a", "main", 1),
                   Segment("b", "cfg", 3)], combined_labels=[("main", "cfg")])
    out = run_engine_step(mgr, step, StepContext(["a", "b"]))
    assert list(out) == ["main"]
    # main's segments first, in the batch's order, then cfg's
    assert [out.locate(r, lb) for r, lb in (("b", "main"), ("a", "main"), ("a", "cfg"),
                                            ("b", "cfg"))] == [
        ViewRows("main", 0, 0, 2), ViewRows("main", 1, 2, 3), ViewRows("main", 2, 3, 4),
        ViewRows("main", 3, 4, 7)]


def test_forked_step() -> None:
    mgr, _ = _manager()
    # a's main (6 tokens) forked onto two samples that each decode one token
    step = KVStep([Segment("a", "s1", 1), Segment("a", "s0", 1), Segment("b", "main", 1)],
                  pre_forks=[("main", "s0"), ("main", "s1")])
    out = run_engine_step(mgr, step, StepContext(["a"]))
    assert out.locate("a", "s0") == ViewRows("s0", 0, 0, 1)
    assert out.locate("a", "s1") == ViewRows("s1", 0, 0, 1)
    assert mgr.stored_len("a", "s0") == mgr.stored_len("a", "s1") == 7


def test_zero_length_segments_have_no_view() -> None:
    mgr, _ = _manager()
    # c is empty and stays empty: no view; a/main holds tokens: a view with no rows
    step = KVStep([Segment("c", "main", 0), Segment("a", "main", 0), Segment("b", "main", 2),
                   Segment("c", "new", 0)])
    out = run_engine_step(mgr, step, StepContext(["a", "b", "c"]))
    assert out.locate("c", "main") is None and out.locate("c", "new") is None
    assert out.locate("a", "main") == ViewRows("main", 0, 0, 0)
    assert out.locate("b", "main") == ViewRows("main", 1, 0, 2)
    assert [(v.request_id, v.label) for v in out["main"].views] == [("a", "main"),
                                                                    ("b", "main")]


def test_combined_forked_with_zero_length() -> None:
    mgr, _ = _manager()
    step = KVStep([Segment("c", "cfg", 0), Segment("a", "cfg", 2), Segment("c", "main", 3),
                   Segment("a", "main", 1)],
                  pre_forks=[("main", "cfg")], combined_labels=[("main", "cfg")])
    out = run_engine_step(mgr, step, StepContext(["a", "c"]))
    # c's main is empty at the fork: its cfg starts empty, and with span 0 has no view
    assert out.locate("c", "cfg") is None
    assert out.locate("a", "cfg") == ViewRows("main", 2, 4, 6)


# -- a planted row map: the engine's tempting assumption, rows in segment order ----------


@contextmanager
def planted(bad: Callable[..., ViewRows | None]) -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    mp.setattr(KVPlanOutputs, "locate", bad)
    try:
        yield
    finally:
        mp.undo()


def test_plant_segment_order_rows_are_caught() -> None:
    segments: list[Segment] = []

    def segment_order(self: KVPlanOutputs, rid: str, label: str) -> ViewRows | None:
        """Views and rows counted in the step's segment order (wrong)."""
        row = 0
        for i, seg in enumerate(segments):
            if (seg.request_id, seg.label) == (rid, label):
                return ViewRows(next(iter(self)), i, row, row + seg.span)
            row += seg.span
        return None

    step = KVStep([Segment("a", "cfg", 1), Segment("b", "main", 2), Segment("a", "main", 1)],
                  combined_labels=[("main", "cfg")])
    segments.extend(step.segments)
    with planted(segment_order), pytest.raises(AssertionError):
        run_engine_step(_manager()[0], step, StepContext(["a", "b"]))
    run_engine_step(_manager()[0], step, StepContext(["a", "b"]))  # the real map passes
