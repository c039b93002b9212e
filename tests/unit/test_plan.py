"""Plan: FlashInfer CSR page tables, sliced views, combined labels, write addressing."""

from __future__ import annotations

import pytest
import torch
from _manager_fixtures import Driver, fill, make_manager
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.stepping.plan import (
    SINK_PAGE,
    KVPlanOutputs,
    KVPlanState,
    SequenceView,
    build_paged_indptrs,
    decode_plan_state,
    decode_tables,
    group_by_plan_label,
    packed_plan_state,
)
from kvref.stepping.step import KVStep, Segment, StepContext

CPU = torch.device("cpu")
# ``meta`` is the one non-CPU device every build has: it checks where the
# write slots are placed (the host-to-device branch) without a GPU.
META = torch.device("meta")


def test_build_paged_indptrs_csr() -> None:
    ps = 4
    views = [
        SequenceView("a", "main", [3, 7], 8, 8, 0),   # full last page
        SequenceView("b", "main", [5], 1, 1, 0),      # one token
        SequenceView("c", "main", [1, 2, 9], 9, 3, 0),
    ]
    ind = build_paged_indptrs(views, ps)
    for t in (ind.qo_indptr, ind.paged_kv_indptr, ind.paged_kv_indices, ind.paged_kv_last_page_len):
        assert t.dtype == torch.int32
    assert ind.qo_indptr.tolist() == [0, 8, 9, 12]
    assert ind.paged_kv_indptr.tolist() == [0, 2, 3, 6]
    assert ind.paged_kv_indices.tolist() == [3, 7, 5, 1, 2, 9]
    assert ind.paged_kv_last_page_len.tolist() == [4, 1, 1]
    assert ind.batch_size == 3


def test_manager_plan_tables_in_range() -> None:
    mgr = make_manager(pages=32, page_size=4)
    drv = Driver(mgr)
    drv.ingest("a", "b", "c")
    fill(drv, "a", 5)
    fill(drv, "b", 8)
    step = KVStep([Segment("a", "main", 3), Segment("b", "main", 1), Segment("c", "main", 4)])
    ctx = StepContext(("a", "b", "c"))
    assert mgr.admit(step, ctx).ok
    out = mgr.plan(step, ctx)["main"]
    ind = out.cpu_indptrs
    assert ind.paged_kv_last_page_len.dtype == torch.int32
    last = ind.paged_kv_last_page_len.tolist()
    assert last == [4, 1, 4]  # lengths 8, 9, 4
    assert all(1 <= x <= 4 for x in last)
    assert ind.qo_indptr.tolist() == [0, 3, 4, 8]
    assert [v.length for v in out.views] == [8, 9, 4]
    # not a decode step: the packed path also ships the table to the device
    assert out.cuda_indptrs is not None
    mgr.commit(step, ctx)


def test_views_sliced_after_reset_keeping_pages() -> None:
    mgr = make_manager(pages=16, page_size=4)
    drv = Driver(mgr)
    drv.ingest("a")
    fill(drv, "a", 11)  # 3 pages
    held = list(mgr._streams["a"]["main"].page_indices)
    assert len(held) == 3
    mgr.reset_request("a")  # keep pages: high-water
    drv.model[("a", "main")] = []
    assert mgr._streams["a"]["main"].page_indices == held
    free = mgr.num_free_pages
    out = drv.step([("a", "main", 2)])["main"]
    assert mgr.num_free_pages == free  # reused, nothing new taken
    assert out.views[0].page_idxs == held[:1]
    assert out.cpu_indptrs.paged_kv_indices.tolist() == held[:1]
    assert out.cpu_indptrs.paged_kv_last_page_len.tolist() == [2]
    drv.check("a")


def test_views_sliced_after_uncommitted_step() -> None:
    mgr = make_manager(pages=16, page_size=4)
    drv = Driver(mgr)
    drv.ingest("a")
    fill(drv, "a", 3)
    drv.step([("a", "main", 9)], commit=False)  # grows to 3 pages, keeps 3 tokens
    assert len(mgr._streams["a"]["main"].page_indices) == 3
    assert mgr.stored_len("a") == 3
    out = drv.step([("a", "main", 1)])["main"]
    assert len(out.views[0].page_idxs) == 1
    assert out.cpu_indptrs.paged_kv_indptr.tolist() == [0, 1]
    assert out.cpu_indptrs.paged_kv_last_page_len.tolist() == [4]
    drv.check("a")


def test_group_by_plan_label_label_major() -> None:
    segs = [Segment("r1", "main", 1), Segment("r1", "cfg", 1), Segment("r2", "main", 1),
            Segment("r2", "cfg", 1), Segment("r1", "draft", 2)]
    grouped = group_by_plan_label(segs, [("main", "cfg")])
    assert list(grouped) == ["main", "draft"]
    assert [(s.request_id, s.label) for s in grouped["main"]] == [
        ("r1", "main"), ("r2", "main"), ("r1", "cfg"), ("r2", "cfg")]
    # a group keyed by its first label even when only the second appears
    assert list(group_by_plan_label([Segment("r", "cfg", 1)], [("main", "cfg")])) == ["main"]
    with pytest.raises(ValueError):
        group_by_plan_label(segs, [("main", "cfg"), ("cfg", "draft")])


def test_combined_labels_write_under_first_label() -> None:
    mgr = make_manager(pages=32, page_size=4)
    drv = Driver(mgr)
    drv.ingest("r1", "r2")
    fill(drv, "r1", 5)
    fill(drv, "r2", 2)
    drv.step([("r1", "cfg", 3), ("r2", "cfg", 1)])
    outs = drv.step([("r1", "main", 1), ("r1", "cfg", 1), ("r2", "main", 1), ("r2", "cfg", 1)],
                    combined=[("main", "cfg")])
    assert list(outs) == ["main"]
    views = outs["main"].views
    assert [(v.request_id, v.label) for v in views] == [
        ("r1", "main"), ("r2", "main"), ("r1", "cfg"), ("r2", "cfg")]
    assert outs["main"].is_decode
    for rid in ("r1", "r2"):
        for label in ("main", "cfg"):
            drv.check(rid, label)


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.integers(1, 8),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    spare=st.lists(st.integers(0, 3), min_size=8, max_size=8),
    data=st.data(),
)
def test_decode_and_packed_addressing_agree(
    page_size: int, lengths: list[int], spare: list[int], data: st.DataObject
) -> None:
    views = []
    next_page = 1
    for i, n in enumerate(lengths):
        held = -(-n // page_size) + spare[i]
        pages = data.draw(st.permutations(range(next_page, next_page + held)))
        next_page += held
        # as the manager builds them: sliced to the length
        views.append(SequenceView(f"r{i}", "main", list(pages)[: -(-n // page_size)], n, 1, 0))
    ind = build_paged_indptrs(views, page_size)
    dec = decode_plan_state(views, page_size, CPU)
    packed = packed_plan_state(ind, page_size, len(views), CPU)
    assert dec.total_tokens == packed.total_tokens == len(views)
    assert torch.equal(dec.token_to_page, packed.token_to_page)
    assert torch.equal(dec.token_to_cache, packed.token_to_cache)
    for i, v in enumerate(views):
        assert int(dec.token_to_page[i]) == v.page_idxs[(v.length - 1) // page_size]
        assert int(dec.token_to_cache[i]) == (v.length - 1) % page_size


@settings(max_examples=40, deadline=None)
@given(page_size=st.integers(1, 6),
       shapes=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)), min_size=1, max_size=5))
def test_packed_addressing_positions(page_size: int, shapes: list[tuple[int, int]]) -> None:
    views, nxt = [], 1
    for i, (stored, span) in enumerate(shapes):
        n = stored + span
        k = -(-n // page_size)
        views.append(SequenceView(f"r{i}", "main", list(range(nxt + k - 1, nxt - 1, -1)),
                                  n, span, 0))
        nxt += k
    total = sum(s for _, s in shapes)
    st_ = packed_plan_state(build_paged_indptrs(views, page_size), page_size, total, CPU)
    row = 0
    for v in views:
        for pos in range(v.length - v.to_compute, v.length):
            assert int(st_.token_to_page[row]) == v.page_idxs[pos // page_size]
            assert int(st_.token_to_cache[row]) == pos % page_size
            row += 1


@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    page_size=st.sampled_from([1, 2, 4, 16]),
)
def test_decode_tables_equal_the_separate_builders(lengths: list[int], page_size: int) -> None:
    """The fused decode path builds exactly the page table and slots of the two
    general builders (and so of the packed path, compared above)."""
    from kvref.stepping.plan import (
        SequenceView,
        build_paged_indptrs,
        decode_plan_state,
        decode_tables,
    )

    views, next_page = [], 1
    for i, n in enumerate(lengths):
        pages = list(range(next_page, next_page + -(-n // page_size)))
        next_page += len(pages) + 1  # a gap: pages are not contiguous across views
        views.append(SequenceView(f"r{i}", "main", pages, n, 1, 0))
    indptrs, state = decode_tables(views, page_size, torch.device("cpu"))
    want = build_paged_indptrs(views, page_size)
    for name in ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"):
        got, exp = getattr(indptrs, name), getattr(want, name)
        assert got.dtype == torch.int32 and torch.equal(got, exp), name
    slots = decode_plan_state(views, page_size, torch.device("cpu"))
    assert torch.equal(state.token_to_page, slots.token_to_page)
    assert torch.equal(state.token_to_cache, slots.token_to_cache)
    assert state.token_to_page.dtype == torch.long


@settings(max_examples=80, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 3, 4, 16]),
    # (stored, span): decode rows (span 1), prefill chunks, and span 0 (reads only)
    shapes=st.lists(
        st.tuples(st.integers(0, 60), st.sampled_from([0, 1, 1, 1, 5, 17, 64, 130])),
        min_size=1, max_size=10,
    ),
    data=st.data(),
)
def test_mixed_tables_equal_the_oracle_builders(
    page_size: int, shapes: list[tuple[int, int]], data: st.DataObject
) -> None:
    """The fused path of any step (a decode batch plus chunks) builds exactly
    the page table of `build_paged_indptrs` and the slots of `packed_plan_state`."""
    from kvref.stepping.plan import mixed_tables, plan_tables

    views, next_page = [], 1
    for i, (stored, span) in enumerate(shapes):
        n = stored + span
        if n == 0:
            continue  # the manager makes no view of an empty stream
        need = -(-n // page_size)
        pages = data.draw(st.permutations(range(next_page, next_page + need)))
        next_page += need + 1  # a gap: pages are not contiguous across views
        views.append(SequenceView(f"r{i}", "main", list(pages), n, span, 0))
    total = sum(v.to_compute for v in views)
    indptrs, state, dev = mixed_tables(views, page_size, CPU)
    want = build_paged_indptrs(views, page_size)
    want_state = packed_plan_state(want, page_size, total, CPU)
    for name in ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"):
        for table in (indptrs, dev):
            got, exp = getattr(table, name), getattr(want, name)
            assert got.dtype == torch.int32 and torch.equal(got, exp), name
    assert state.total_tokens == total and state.write_len == total
    assert state.token_to_page.dtype == state.token_to_cache.dtype == torch.long
    assert torch.equal(state.token_to_page, want_state.token_to_page)
    assert torch.equal(state.token_to_cache, want_state.token_to_cache)
    # the dispatch: decode keeps its own path (no device table), the rest is fused
    _, _, dispatched = plan_tables(views, page_size, CPU)
    assert (dispatched is None) == bool(views and all(v.to_compute == 1 for v in views))


def test_stream_page_array_follows_its_list() -> None:
    """`CacheStream.pages_array` (the plan's kept copy of a stream's table)
    equals the list after appends in place, growth past its buffer, a
    list replaced by a shorter or a longer one, and a window's release
    (which starts the kept buffer further on) with appends not yet copied."""
    from kvref.core.streams import CacheStream

    s = CacheStream()
    assert s.pages_array().tolist() == []
    steps: list[list[int]] = []
    s.append_pages([3, 4])  # in place
    steps.append(s.pages_array().tolist())
    s.append_pages(list(range(5, 60)))  # past the first buffer
    steps.append(s.pages_array().tolist())
    steps.append(s.pages_array().tolist())  # unchanged: the kept array
    s.release_window_to(7, 1)  # a window's release: a new, shorter list
    steps.append(s.pages_array().tolist())
    s.adopt_fork_pages([*s.page_indices, 99, 100])  # a new, longer list
    steps.append(s.pages_array().tolist())
    s.append_pages([61, 62])  # in place, not yet copied when the release shifts the buffer
    s.release_window_to(9, 1)
    steps.append(s.pages_array().tolist())
    s.append_pages(list(range(200, 300)))  # past the shifted buffer
    steps.append(s.pages_array().tolist())
    assert steps == [[3, 4], [3, 4, *range(5, 60)], [3, 4, *range(5, 60)],
                     list(range(10, 60)), [*range(10, 60), 99, 100],
                     [*range(12, 60), 99, 100, 61, 62],
                     [*range(12, 60), 99, 100, 61, 62, *range(200, 300)]]
    view = SequenceView.of_stream("r", "main", s.page_indices, s.pages_array(), 2, 5,
                                  40, 1, 0, offset=32)
    assert view.page_idxs == s.page_indices[2:5] and view.num_pages == 3
    assert view.page_at(1) == s.page_indices[3]


def test_stream_page_array_after_an_empty_list_is_read() -> None:
    """A reset that frees a stream's pages gives it a new, empty list; a step
    that reads it empty (a zero-span segment) and then an admit that appends
    to that list in place must see the new pages from the first. The kept
    count stayed at the old list's, so the first new page was never copied:
    the plan named the page the stream had before its reset (found by the
    seam lockstep, seed 0; `test_a_zero_span_read_after_a_freeing_reset`)."""
    from kvref.core.streams import CacheStream

    s = CacheStream()
    s.append_pages([2])
    assert s.pages_array().tolist() == [2]
    s.reset(freed=True)
    assert s.pages_array().tolist() == []
    s.append_pages([6, 2])  # in place, into the list read empty
    assert s.pages_array().tolist() == [6, 2]


# -- plan states, where tables are placed, forks and combined groups in the plan


def _static_state(capacity: int) -> KVPlanState:
    """A graph-captured state: buffers of ``capacity`` slots, filled with junk."""
    return KVPlanState(
        token_to_page=torch.full((capacity,), 99, dtype=torch.int64),
        token_to_cache=torch.full((capacity,), 99, dtype=torch.int64),
        total_tokens=0,
    )


def _live_state(pages: list[int], offsets: list[int]) -> KVPlanState:
    return KVPlanState(
        token_to_page=torch.tensor(pages, dtype=torch.int64),
        token_to_cache=torch.tensor(offsets, dtype=torch.int64),
        total_tokens=len(pages),
    )


def test_static_state_accepts_a_bucket_as_large_as_its_buffers() -> None:
    # the largest bucket a buffer was built for must fit it exactly
    static = _static_state(4)
    static.copy_(_live_state([5, 6, 7], [1, 2, 3]), capture_len=4)
    assert static.token_to_page.tolist() == [5, 6, 7, SINK_PAGE]
    assert static.token_to_cache.tolist() == [1, 2, 3, 0]
    assert static.total_tokens == 3


def test_static_state_refuses_a_bucket_past_its_buffers_naming_the_remedy() -> None:
    static = _static_state(4)
    with pytest.raises(ValueError, match="build_cuda_graph_buffers with a larger max_seq_len"):
        static.copy_(_live_state([5], [1]), capture_len=5)
    assert static.token_to_page.tolist() == [99] * 4  # nothing staged


def test_static_state_refuses_more_tokens_than_the_bucket() -> None:
    static = _static_state(8)
    with pytest.raises(ValueError, match="do not fit a bucket of 2"):
        static.copy_(_live_state([5, 6, 7], [1, 2, 3]), capture_len=2)


def _decode_views() -> list[SequenceView]:
    return [SequenceView("a", "main", [3, 7], 6, 1, 0), SequenceView("b", "main", [5], 1, 1, 0)]


def test_decode_slots_are_placed_on_the_requested_device() -> None:
    state = decode_plan_state(_decode_views(), 4, META)
    for t in (state.token_to_page, state.token_to_cache):
        assert t.device == META
        assert tuple(t.shape) == (2,)
    assert state.total_tokens == 2


def test_fused_decode_tables_place_slots_on_the_requested_device() -> None:
    indptrs, state = decode_tables(_decode_views(), 4, META)
    for t in (state.token_to_page, state.token_to_cache):
        assert t.device == META
        assert tuple(t.shape) == (2,)
    # the page table stays on the host: plan copies it once, with the rest
    assert indptrs.paged_kv_indices.device.type == "cpu"
    assert indptrs.paged_kv_indices.tolist() == [3, 7, 5]


def test_packed_slots_are_placed_on_the_requested_device() -> None:
    views = [SequenceView("a", "main", [3, 7], 6, 3, 0)]
    state = packed_plan_state(build_paged_indptrs(views, 4), 4, 3, META)
    for t in (state.token_to_page, state.token_to_cache):
        assert t.device == META
        assert tuple(t.shape) == (3,)


def test_page_table_moves_whole_to_the_requested_device() -> None:
    host = build_paged_indptrs(_decode_views(), 4)
    moved = host.to_device(META)
    for name in ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"):
        t = getattr(moved, name)
        assert t.device == META, name
        assert t.shape == getattr(host, name).shape, name


def test_plan_outputs_carry_the_steps_forks_as_tuples() -> None:
    outs = KVPlanOutputs({}, pre_forks=[("main", "cfg")], post_forks=[("cfg", "aux")])
    assert outs.pre_forks == (("main", "cfg"),)
    assert outs.post_forks == (("cfg", "aux"),)
    assert KVPlanOutputs({}).pre_forks == () == KVPlanOutputs({}).post_forks


def test_a_combined_pair_is_planned_label_major() -> None:
    # exactly two segments, given cfg first: the group still plans main first
    grouped = group_by_plan_label(
        [Segment("a", "cfg", 1), Segment("a", "main", 1)], [("main", "cfg")])
    assert list(grouped) == ["main"]
    assert [s.label for s in grouped["main"]] == ["main", "cfg"]


def test_a_label_in_two_combined_groups_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="label 'cfg' is in two combined groups"):
        group_by_plan_label([Segment("a", "main", 1)], [("main", "cfg"), ("aux", "cfg")])
