"""Overlap scheduling over windowed labels (R67, R41, R42; issue 19).

A preplanned step is planned as the stream will be once the running step's
commit has released its window's pages. The same workload runs twice, step
by step (a) and overlapped, step N+1 preplanned while N runs (b). Every plan
view, every byte read back and the page pool must agree. At each preplan,
no view may name a page that the running commit releases. The pool hands
out free pages first in, first out, so with pages to spare both runs take
the same page ids and the views can be compared page for page.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from kvref import KVStep, PreplanRefused, PreplanStale, RetentionPolicy, Segment, StepContext
from kvref.manager import KVManager
from kvref.stepping import admit_plan_commit as stepping_mod
from kvref.stepping.admit_plan_commit import Stepping
from kvref.stepping.plan import KVPlanOutputs
from kvref.testing.page_checks import check_device_pages
from tests.unit._manager_fixtures import make_manager, token_values
from tests.unit.test_retention import step as run_step

PS, W, LAYERS, HEADS, DIM = 4, 10, 2, 2, 4
LABELS = ("w", "main")  # windowed beside full attention
Key = tuple[str, str]
# (rid, label, span) per segment, and whether the step commits
Shape = tuple[tuple[tuple[str, str, int], ...], bool]
View = tuple[str, str, int, int, int, tuple[int, ...]]  # rid, label, offset, length, span, pages


def manager(margin: int = 0, sharing: bool = True) -> KVManager:
    policy = RetentionPolicy(W, rollback_margin=margin) if margin else RetentionPolicy(W)
    return make_manager(page_size=PS, layers=LAYERS, heads=HEADS, head_dim=DIM, pages=320,
                        max_seq_len=512, sharing=sharing, retention={"w": policy})


def seventeen_then_running() -> tuple[KVManager, StepContext, KVStep]:
    """a.w committed at 17 tokens (slots 1-4 held, W = 10), then a running
    step of +3 planned: its commit, at 20 tokens, releases slot 1."""
    mgr = manager()
    run_step(mgr, "a", "w", 17)
    ctx = StepContext(("a",))
    running = KVStep([Segment("a", "w", 3)])
    assert mgr.admit(running, ctx).ok
    mgr.plan(running, ctx)
    return mgr, ctx, running


def tag(key: Key) -> int:
    return (ord(key[0][0]) - ord("a") + 1) * 2 + LABELS.index(key[1])


def kv_rows(mgr: KVManager, outputs: KVPlanOutputs, plan_label: str, layer: int
            ) -> torch.Tensor:
    """K then V of every row the plan label's state writes: token values by
    absolute position (``offset + j``), so a row in the wrong slot shows."""
    n = mgr._current_plan_states[plan_label].write_len
    out = torch.full((n, 2, HEADS, DIM), -5.0)  # a slot lease's padding rows
    i = 0
    for v in outputs[plan_label].views:
        for pos in range(v.offset + v.length - v.to_compute, v.offset + v.length):
            out[i] = token_values(tag((v.request_id, v.label)), pos, layer, HEADS, DIM)
            i += 1
    return out


def write_step(mgr: KVManager, outputs: KVPlanOutputs) -> dict[str, list[torch.Tensor]]:
    """Write every planned token; returns what `read_kv` answers per plan label, per layer."""
    got: dict[str, list[torch.Tensor]] = {}
    for plan_label in outputs:
        for layer in range(LAYERS):
            rows = kv_rows(mgr, outputs, plan_label, layer)
            mgr.write_kv(rows[:, 0].contiguous(), rows[:, 1].contiguous(), layer_idx=layer,
                         label=plan_label)
            real = mgr._current_plan_states[plan_label].total_tokens
            read = mgr.read_kv(layer_idx=layer, plan_label=plan_label)[:real].clone()
            assert torch.equal(read, rows[:real]), (plan_label, layer)
            got.setdefault(plan_label, []).append(read)
    return got


def views_of(outputs: KVPlanOutputs) -> list[View]:
    return [(v.request_id, v.label, v.offset, v.length, v.to_compute, tuple(v.page_idxs))
            for _, out in sorted(outputs.items()) for v in out.views]


def window_of(mgr: KVManager, key: Key) -> torch.Tensor:
    """`read_stream`, checked against the token values of its window (W1)."""
    got = mgr.read_stream(*key)
    n = mgr.stored_len(*key)
    first = max(0, n - W) if key[1] == "w" else 0
    assert got.shape[1] == n - first, (key, got.shape, n, first)
    for j, pos in enumerate(range(first, n)):
        for layer in range(LAYERS):
            assert torch.equal(got[layer, j], token_values(tag(key), pos, layer, HEADS, DIM)), (
                key, pos, layer)
    return got


def to_release(mgr: KVManager, running: KVStep) -> set[int]:
    """The pages the running step's commit releases, worked out here from W2
    (and the retention's rollback margin), not by kvref."""
    if not running.commit:
        return set()
    keep = W + mgr.config.retention["w"].rollback_margin
    out: set[int] = set()
    for seg in running.segments:
        if seg.label != "w":
            continue
        s = mgr._streams[seg.request_id][seg.label]
        upto = max(0, s.stored_len + seg.span - keep) // PS
        out |= set(s.page_indices[: max(0, upto - s.released // PS)])
    return out


@dataclass
class Record:
    views: list[list[View]] = field(default_factory=list)
    reads: list[dict[str, list[torch.Tensor]]] = field(default_factory=list)
    windows: list[dict[Key, torch.Tensor]] = field(default_factory=list)
    # free pages once step N committed and step N+1 was admitted
    free: list[int] = field(default_factory=list)
    released: list[dict[Key, int]] = field(default_factory=list)


def steps_of(shapes: Sequence[Shape]) -> list[tuple[KVStep, StepContext]]:
    out = []
    for segs, commit in shapes:
        step = KVStep([Segment(*s) for s in segs], commit=commit)
        out.append((step, StepContext(tuple(sorted({s[0] for s in segs})))))
    return out


def settle(mgr: KVManager, rec: Record, rids: Sequence[str]) -> None:
    check_device_pages(mgr)
    # streams with tokens: a preplan may already have made the next step's
    live = [(r, lb) for r in rids for lb, s in mgr._streams[r].items() if s.stored_len]
    rec.windows.append({key: window_of(mgr, key) for key in live})
    rec.released.append({key: mgr._streams[key[0]][key[1]].released for key in live})


def run_sequential(mgr: KVManager, shapes: Sequence[Shape], rids: Sequence[str]) -> Record:
    rec = Record()
    for r in rids:
        mgr.ingest_request(r)
    for i, (step, ctx) in enumerate(steps_of(shapes)):
        assert mgr.admit(step, ctx).ok
        if i:
            rec.free.append(mgr.num_free_pages)
        outputs = mgr.plan(step, ctx)
        rec.views.append(views_of(outputs))
        rec.reads.append(write_step(mgr, outputs))
        mgr.commit(step, ctx)
        settle(mgr, rec, rids)
    return rec


def run_overlapped(mgr: KVManager, shapes: Sequence[Shape], rids: Sequence[str]) -> Record:
    """Step N+1 admitted and planned as a preplan while N runs, then N written
    and committed, then N+1 promoted (its real admit and plan)."""
    rec = Record()
    for r in rids:
        mgr.ingest_request(r)
    steps = steps_of(shapes)
    step, ctx = steps[0]
    assert mgr.admit(step, ctx).ok
    outputs = mgr.plan(step, ctx)
    for i in range(len(steps)):
        staged = None
        gone = to_release(mgr, step)
        if i + 1 < len(steps):
            nxt, nctx = steps[i + 1]
            pre = StepContext(nctx.padded_request_ids, is_preplan=True)
            out = mgr.admit(nxt, pre)
            assert out.ok, out.reason
            staged = mgr.plan(nxt, pre)
            named = {p for v in views_of(staged) for p in v[5]}
            assert not named & gone, (
                f"step {i + 1}'s preplanned views name pages {sorted(named & gone)} that "
                f"step {i}'s commit releases")
        rec.views.append(views_of(outputs))
        rec.reads.append(write_step(mgr, outputs))
        held = {p for r in rids for s in mgr._streams[r].values() for p in s.page_indices}
        mgr.commit(step, ctx)
        after = {p for r in rids for s in mgr._streams[r].values() for p in s.page_indices}
        assert held - after == gone, "the commit released other pages than W2 says"
        settle(mgr, rec, rids)
        if staged is None:
            break
        step, ctx = steps[i + 1]
        rec.free.append(mgr.num_free_pages)
        assert mgr.admit(step, ctx).ok  # promotable: not stale
        outputs = mgr.plan(step, ctx)
        assert outputs is staged
        for v in (v for out in outputs.values() for v in out.views):
            s = mgr._streams[v.request_id][v.label]
            # as the stream is now that the running step committed
            assert v.offset == s.released
            assert v.page_idxs == s.page_indices[: len(v.page_idxs)]
    return rec


def assert_same(a: Record, b: Record) -> None:
    assert len(a.views) == len(b.views)
    for i, (va, vb) in enumerate(zip(a.views, b.views, strict=True)):
        assert va == vb, f"step {i}: views differ\n{va}\n{vb}"
    for i, (ra, rb) in enumerate(zip(a.reads, b.reads, strict=True)):
        assert ra.keys() == rb.keys(), i
        for label in ra:
            for layer, (x, y) in enumerate(zip(ra[label], rb[label], strict=True)):
                assert torch.equal(x, y), (i, label, layer)
    for i, (wa, wb) in enumerate(zip(a.windows, b.windows, strict=True)):
        assert wa.keys() == wb.keys(), i
        for key in wa:
            assert torch.equal(wa[key], wb[key]), (i, key)
    assert a.free == b.free
    assert a.released == b.released


def workload() -> list[Shape]:
    """Three requests: chunked prefill of both labels over many pages, then
    decode past several window releases; c joins late, one step keeps nothing."""
    shapes: list[Shape] = []
    for chunk in (7, 9, 6):  # a: chunked prefill, 22 tokens, 5 pages; releases at 9 on
        shapes.append(((("a", "w", chunk), ("a", "main", chunk)), True))
    shapes.append(((("a", "w", 3), ("b", "w", 13), ("b", "main", 5)), True))
    for i in range(26):
        segs: list[tuple[str, str, int]] = [("a", "w", 1), ("b", "w", 1), ("b", "main", 1)]
        if i % 3 == 0:
            segs.append(("a", "main", 2))
        if i == 8:
            segs.append(("c", "w", 11))  # c's prefill beside the decodes
        elif i > 8:
            segs.append(("c", "w", 1 if i % 4 else 5))
        shapes.append((tuple(segs), i != 12))  # step 12 keeps no tokens
    return shapes


@pytest.mark.parametrize("margin,sharing", [(0, True), (0, False), (3, True)])
def test_overlapped_windows_match_sequential(margin: int, sharing: bool) -> None:
    shapes = workload()
    seq = run_sequential(manager(margin, sharing), shapes, "abc")
    ovl = run_overlapped(manager(margin, sharing), shapes, "abc")
    assert_same(seq, ovl)
    # the workload did what it is for: several releases on every windowed stream
    last = seq.released[-1]
    assert all(last[(r, "w")] >= 3 * PS for r in "abc") and last[("a", "main")] == 0


def shapes_strategy() -> st.SearchStrategy[list[Shape]]:
    # windowed segments twice as often: releases need a stream past W
    seg = st.tuples(st.sampled_from("ab"), st.sampled_from(("w", "w", "main")),
                    st.sampled_from((0, 1, 1, 2, 3, 5, 8, 13)))

    def step(segs: list[tuple[str, str, int]], commit: bool) -> Shape:
        unique = {(r, lb): (r, lb, n) for r, lb, n in segs}
        return tuple(unique.values()), commit

    return st.lists(st.builds(step, st.lists(seg, min_size=1, max_size=4),
                              st.sampled_from((True, True, True, False))),
                    min_size=3, max_size=16)


def differential(shapes: list[Shape]) -> None:
    assert_same(run_sequential(manager(), shapes, "ab"), run_overlapped(manager(), shapes, "ab"))


@settings(max_examples=20, deadline=None, derandomize=True, database=None)
@given(shapes_strategy())
def test_random_step_shapes_overlapped_match_sequential(shapes: list[Shape]) -> None:
    differential(shapes)


# -- refusals, promotion ----------------------------------------------------


def test_preplans_with_windowed_forks_are_refused() -> None:
    # without sharing: with it, R57 refuses any preplan over a running fork
    mgr = make_manager(page_size=PS, pages=64, sharing=False,
                       retention={"w": RetentionPolicy(W), "w2": RetentionPolicy(W)})
    run_step(mgr, "a", "w", 9)
    ctx = StepContext(("a",))
    running = KVStep([Segment("a", "w", 1)], post_forks=[("w", "w2")])
    assert mgr.admit(running, ctx).ok
    pre = StepContext(("a",), is_preplan=True)
    free = mgr.num_free_pages
    # its own fork names a windowed label
    own = mgr.admit(KVStep([Segment("a", "w2", 1)], pre_forks=[("w", "w2")]), pre)
    # it names a windowed stream the running step's post-fork has still to write
    onto = mgr.admit(KVStep([Segment("a", "w2", 1)]), pre)
    for out in (own, onto):
        assert not out.ok and isinstance(out.reason, PreplanRefused)
        assert "fork" in out.reason.message and "windowed" in out.reason.message
    assert mgr.num_free_pages == free and mgr._preplan is None
    # the fork's source is another matter: the fork does not move it
    assert mgr.admit(KVStep([Segment("a", "w", 1)]), pre).ok
    mgr.plan(running, ctx)
    mgr.commit(running, ctx)
    mgr.clear_preplan()
    check_device_pages(mgr)


def test_preplan_reserves_slots_not_the_pages_the_commit_releases() -> None:
    """a.w at 17 tokens (slots 1-4 held), W = 10: the running step's +3 ends
    at 20 and releases slot 1; the preplan's +1 needs slot 5, one new page.
    The released page goes to the pool, not to the preplan, and the view
    starts at slot 2."""
    mgr, ctx, running = seventeen_then_running()
    s = mgr._streams["a"]["w"]
    assert s.released == 4 and len(s.page_indices) == 4
    first = s.page_indices[0]
    free = mgr.num_free_pages
    pre = StepContext(("a",), is_preplan=True)
    nxt = KVStep([Segment("a", "w", 1)])
    assert mgr.admit(nxt, pre).ok
    assert mgr.num_free_pages == free - 1 and len(s.page_indices) == 5
    (view,) = [v for o in mgr.plan(nxt, pre).values() for v in o.views]
    assert (view.offset, view.length) == (8, 13) and first not in view.page_idxs
    assert view.page_idxs == s.page_indices[1:5]
    mgr.commit(running, ctx)
    assert s.released == 8 and mgr.num_free_pages == free
    assert mgr.admit(nxt, ctx).ok
    mgr.plan(nxt, ctx)
    mgr.commit(nxt, ctx)
    check_device_pages(mgr)


# -- plants: each check above fails on its defect ---------------------------


def views_from_current_released(mp: pytest.MonkeyPatch) -> None:
    """(i) Preplanned views start at the stream's current ``released``, not
    the one the running commit leaves; the projection is still recorded, so
    promotion's staleness check passes and only the views are wrong."""
    orig = Stepping._sequence_views

    def bad(self: Stepping, segments: Sequence[Segment], fork_len: object,
            starts: object = None) -> object:
        return orig(self, segments, fork_len)  # type: ignore[arg-type]

    mp.setattr(Stepping, "_sequence_views", bad)


def no_projection(mp: pytest.MonkeyPatch) -> None:
    """(i') No projection at all: views and the recorded basis both from the
    current ``released``."""
    mp.setattr(stepping_mod, "projected_released", lambda table, basis: {
        k: table.streams[k[0]][k[1]].released for k in basis})


@pytest.mark.parametrize("plant", [views_from_current_released, no_projection])
@pytest.mark.parametrize("check", ["workload", "hypothesis"])
def test_plant_preplan_views_are_caught(plant: Callable[[pytest.MonkeyPatch], None],
                                       check: str) -> None:
    def run() -> None:
        if check == "workload":
            shapes = workload()
            assert_same(run_sequential(manager(), shapes, "abc"),
                        run_overlapped(manager(), shapes, "abc"))
        else:
            # the property above, without shrinking: the failure is enough
            settings(max_examples=20, deadline=None, derandomize=True, database=None,
                     phases=[Phase.generate])(given(shapes_strategy())(differential))()

    run()  # clean
    with pytest.MonkeyPatch.context() as mp:
        plant(mp)
        with pytest.raises(AssertionError, match="name pages"):
            run()


def test_plant_no_projection_is_refused_stale_at_promotion() -> None:
    """Planted (i'), an engine that does not look at the views still gets no
    wrong plan: the stream's released count is not the one the preplan was
    built from, so its promotion is refused as stale (R42)."""
    with pytest.MonkeyPatch.context() as mp:
        no_projection(mp)
        mgr, ctx, running = seventeen_then_running()
        nxt = KVStep([Segment("a", "w", 1)])
        assert mgr.admit(nxt, StepContext(("a",), is_preplan=True)).ok
        mgr.commit(running, ctx)
        out = mgr.admit(nxt, ctx)
        assert not out.ok and isinstance(out.reason, PreplanStale)
        assert "released" in out.reason.message and out.reason.label == "w"
        mgr.clear_preplan()
        check_device_pages(mgr)
