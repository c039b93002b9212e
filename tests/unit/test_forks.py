"""Forks: the copy, its failure and its generation, the pages admit reserves
for a fork target, and the lengths a preplan predicts for forks not yet
copied (R9, R11, R16, R20, R24, R26, I14).
"""

from __future__ import annotations

import pytest
from _manager_fixtures import (
    Driver,
    assert_same,
    check_conservation,
    failing_page_copy,
    fill,
    make_manager,
    snapshot,
)

from kvref.core.errors import (
    ForkCopyError,
    KVRefError,
)
from kvref.manager import KVManager
from kvref.stepping.forks import Forks
from kvref.stepping.step import (
    KVStep,
    Segment,
    StepContext,
)


def _forked_request() -> Driver:
    """Request ``a``: ``main`` 6 tokens (2 pages), ``cfg`` 3 tokens over three
    steps; forks copy (the copying fork's defences are what these kill)."""
    d = Driver(make_manager(sharing=False, pages=32, page_size=4))
    d.ingest("a")
    fill(d, "a", 6)
    fill(d, "a", 3, "cfg", chunk=1)
    return d


def test_a_failed_fork_copy_names_its_cause_and_chains_it() -> None:
    d = _forked_request()
    mgr = d.mgr
    step = KVStep([Segment("a", "main", 1)], post_forks=[("main", "cfg")])
    ctx = StepContext(("a",))
    assert mgr.admit(step, ctx).ok
    mgr.plan(step, ctx)
    fault = RuntimeError("injected copy fault")
    with failing_page_copy(mgr, fault), pytest.raises(ForkCopyError) as info:
        mgr.commit(step, ctx)
    assert str(info.value) == (
        "request 'a' label 'cfg': fork copy failed (RuntimeError: injected copy fault); "
        "the target was left empty (1 target(s) in this call)")
    assert info.value.__cause__ is fault


def test_a_fork_moves_its_targets_generation_forward() -> None:
    # I14: a change of length or pages bumps the generation; it never goes back
    d = _forked_request()
    mgr = d.mgr
    gen = mgr._streams["a"]["cfg"].generation
    assert gen >= 2  # three commits: a reset to 1 would be a step back
    d.step([("a", "main", 1)], post_forks=[("main", "cfg")])
    assert mgr.stored_len("a", "cfg") == 7
    assert mgr._streams["a"]["cfg"].generation > gen


def test_a_fork_onto_a_target_without_its_pages_is_refused_by_name() -> None:
    # the defence behind admit (which reserves every fork target's pages):
    # driven directly, a target short of pages is refused, and nothing is copied
    d = _forked_request()
    mgr = d.mgr
    forks = Forks(mgr._table, mgr.kv_cache)
    before = snapshot(mgr)
    assert len(mgr._streams["a"]["cfg"].page_indices) == 1
    with pytest.raises(KVRefError) as info:
        forks.apply("a", "main", "cfg", set())
    assert str(info.value) == (
        "request 'a' label 'cfg': fork target holds 1 pages, source 'main' needs 2: "
        "the step was not admitted with this fork")
    assert (info.value.request_id, info.value.label) == ("a", "cfg")
    assert_same(before, snapshot(mgr))


def test_a_pre_fork_that_fails_at_a_commit_without_a_plan_is_raised() -> None:
    # R24: a commit without a plan runs the pre-forks; a failed copy is raised
    # (R26) after the rest of the commit, and empties its target
    d = Driver(make_manager(pages=32, page_size=4))
    d.ingest("a")
    fill(d, "a", 3)
    fill(d, "a", 6, "cfg")
    mgr = d.mgr
    step = KVStep([Segment("a", "main", 1)], pre_forks=[("main", "cfg")], commit=False)
    ctx = StepContext(("a",))
    assert mgr.admit(step, ctx).ok
    fault = OSError("page copy failed (injected)")
    with failing_page_copy(mgr, fault), pytest.raises(ForkCopyError) as info:
        mgr.commit(step, ctx)
    assert info.value.__cause__ is fault
    assert mgr.stored_len("a", "cfg") == 0
    assert not any(s.step_in_flight for s in mgr._streams["a"].values())


def test_a_plan_reports_the_steps_forks() -> None:
    d = Driver(make_manager(pages=32, page_size=4))
    d.ingest("a")
    fill(d, "a", 3)
    step = KVStep([Segment("a", "main", 1)], pre_forks=[("main", "cfg")],
                  post_forks=[("main", "draft")])
    ctx = StepContext(("a",))
    assert d.mgr.admit(step, ctx).ok
    out = d.mgr.plan(step, ctx)
    assert out.pre_forks == (("main", "cfg"),)
    assert out.post_forks == (("main", "draft"),)


def test_a_fork_target_reserves_the_most_it_reaches_in_the_step() -> None:
    # cfg: 10 tokens from the pre-fork, +2 from its segment (3 pages), then a
    # post-fork from a 1-token draft: its reservation must stay 3 pages
    d = Driver(make_manager(pages=32, page_size=4))
    d.ingest("r")
    fill(d, "r", 10)
    fill(d, "r", 1, "draft")
    d.step([("r", "cfg", 2)], pre_forks=[("main", "cfg")], post_forks=[("draft", "cfg")])
    d.model[("r", "cfg")] = list(d.model[("r", "draft")])
    assert d.mgr.stored_len("r", "cfg") == 1
    d.check("r", "cfg")
    check_conservation(d.mgr)


def test_an_absent_fork_source_reserves_exactly_what_the_step_needs() -> None:
    # R20: q lacks the source, so its target keeps its 8 tokens (2 pages) and
    # its segment needs one more page; r's fork copies 4 tokens (1 page)
    d = Driver(make_manager(sharing=False, pages=32, page_size=4))
    d.ingest("q", "r")
    fill(d, "q", 8, "cfg")
    fill(d, "r", 4, "src")
    free = d.mgr.num_free_pages
    step = KVStep([Segment("q", "cfg", 4)], pre_forks=[("src", "cfg")])
    ctx = StepContext(("q", "r"))
    assert d.mgr.admit(step, ctx).ok
    assert d.mgr.num_free_pages == free - 2  # q/cfg: 1, r/cfg: 1, q/src (made empty): 0
    d.mgr.clear_preplan()


def test_a_fork_chain_through_an_empty_stream_reserves_no_spare_page() -> None:
    # r/a exists but is empty: a->b empties b, b->c empties c, and c's segment
    # then needs 1 page, which c already holds: no new page
    d = Driver(make_manager(pages=32, page_size=4))
    d.ingest("r")
    fill(d, "r", 8, "c")
    d.mgr.admit(KVStep([Segment("r", "a", 0)]), StepContext(("r",)))
    d.mgr.plan(KVStep([Segment("r", "a", 0)]), StepContext(("r",)))
    d.mgr.commit(KVStep([Segment("r", "a", 0)]), StepContext(("r",)))
    assert d.mgr.stored_len("r", "a") == 0
    free = d.mgr.num_free_pages
    step = KVStep([Segment("r", "c", 4)], pre_forks=[("a", "b"), ("b", "c")])
    assert d.mgr.admit(step, StepContext(("r",))).ok
    assert d.mgr.num_free_pages == free


# -- preplanned forks predict what the copies leave (R11, R16, R20, R26) ---------


def test_a_preplanned_chain_of_forks_predicts_the_chained_length() -> None:
    # main -> b, then b -> c: c ends with main's length, known before any copy
    mgr = make_manager(sharing=False, pages=32, page_size=4)
    mgr.ingest_request("a")
    fill_step = KVStep([Segment("a", "main", 5)])
    ctx = StepContext(("a",))
    assert mgr.admit(fill_step, ctx).ok
    mgr.plan(fill_step, ctx)
    mgr.commit(fill_step, ctx)
    step = KVStep([Segment("a", "c", 1)], pre_forks=[("main", "b"), ("b", "c")])
    pre = StepContext(("a",), is_preplan=True)
    assert mgr.admit(step, pre).ok
    staged = mgr.plan(step, pre)
    assert [v.length for v in staged["c"].views] == [6]
    assert mgr.stored_len("a", "c") == 0  # predicted, not copied (R11)
    real = StepContext(("a",))
    assert mgr.admit(step, real).ok
    outs = mgr.plan(step, real)
    assert [v.length for v in outs["c"].views] == [6]
    mgr.commit(step, real)
    assert mgr.stored_len("a", "c") == 6


def _commit_span(mgr: KVManager, rid: str, label: str, span: int) -> None:
    step = KVStep([Segment(rid, label, span)])
    ctx = StepContext((rid,))
    assert mgr.admit(step, ctx).ok
    mgr.plan(step, ctx)
    mgr.commit(step, ctx)


def _preplan_then_run(mgr: KVManager, step: KVStep, padded: tuple[str, ...],
                      label: str) -> tuple[list[int], list[int]]:
    """View lengths of ``label`` as preplanned, then as really planned; commits."""
    pre = StepContext(padded, is_preplan=True)
    assert mgr.admit(step, pre).ok
    staged = [v.length for v in mgr.plan(step, pre)[label].views]
    real = StepContext(padded)
    assert mgr.admit(step, real).ok
    planned = [v.length for v in mgr.plan(step, real)[label].views]
    mgr.commit(step, real)
    return staged, planned


def test_a_padded_request_without_the_fork_source_keeps_its_target() -> None:
    # "b" (first in the batch) lacks src but holds keep; "a" holds src only
    mgr = make_manager(sharing=False, pages=32, page_size=4)
    mgr.ingest_request("a")
    mgr.ingest_request("b")
    _commit_span(mgr, "a", "src", 3)
    _commit_span(mgr, "b", "keep", 5)
    step = KVStep([Segment("b", "keep", 1), Segment("a", "keep", 1)],
                  pre_forks=[("src", "keep")])
    staged, planned = _preplan_then_run(mgr, step, ("b", "a"), "keep")
    assert staged == planned == [6, 4]
    assert mgr.stored_len("b", "keep") == 6  # nothing copied over it (R20)
    assert mgr.stored_len("a", "keep") == 4  # src's 3, then the step's 1


def test_a_chain_through_an_empty_source_empties_its_end() -> None:
    # main exists and is empty: main -> b -> c copies that emptiness onto c
    mgr = make_manager(sharing=False, pages=32, page_size=4)
    mgr.ingest_request("a")
    _commit_span(mgr, "a", "c", 5)
    step = KVStep([Segment("a", "c", 1)], pre_forks=[("main", "b"), ("b", "c")])
    staged, planned = _preplan_then_run(mgr, step, ("a",), "c")
    assert staged == planned == [1]
    assert mgr.stored_len("a", "c") == 1
    assert mgr.stored_len("a", "b") == 0


def test_a_failed_fork_copy_empties_its_target_and_moves_its_generation() -> None:
    mgr = make_manager(sharing=False, pages=32, page_size=4)
    mgr.ingest_request("a")
    _commit_span(mgr, "a", "main", 3)
    _commit_span(mgr, "a", "cfg", 6)
    step = KVStep([Segment("a", "main", 1)], post_forks=[("main", "cfg")])
    ctx = StepContext(("a",))
    assert mgr.admit(step, ctx).ok
    mgr.plan(step, ctx)
    gen_before = mgr._streams["a"]["cfg"].generation

    fault = RuntimeError("injected copy fault")
    with failing_page_copy(mgr, fault), pytest.raises(ForkCopyError) as err:
        mgr.commit(step, ctx)
    assert err.value.request_id == "a" and err.value.label == "cfg"
    assert mgr.stored_len("a", "cfg") == 0  # never half old, half new (R26)
    assert mgr.stored_len("a", "main") == 4  # the rest of the commit was done
    assert mgr._streams["a"]["cfg"].generation > gen_before
