"""admit, plan, commit in order: each call out of order, against a staged
preplan or over a stale one is refused by name (R11, R40-R43), and commit's
last defence drops a span onto a stream offloaded mid-step loudly.
"""

from __future__ import annotations

import logging

import pytest
from _manager_fixtures import (
    Driver,
    failing_page_copy,
    fill,
    make_manager,
    three_tokens,
)

from kvref.core.errors import (
    ForkCopyError,
    InvalidStepError,
    PreplanPendingError,
    StepInFlightError,
    StepNotAdmittedError,
    StepOrderError,
    UnknownRequestError,
)
from kvref.core.streams import OffloadState
from kvref.stepping.step import (
    AdmitOutcome,
    KVStep,
    PreplanStale,
    Segment,
    StepContext,
)


def test_commit_of_a_step_not_admitted_names_why() -> None:
    d = three_tokens()
    step = KVStep([Segment("a", "cfg", 1)])
    pre = StepContext(("a",), is_preplan=True)
    with pytest.raises(StepNotAdmittedError) as info:
        d.mgr.commit(step, StepContext(("a",)))
    assert str(info.value) == ("request 'a' label 'cfg': commit of a step that was not "
                               "admitted (or was changed in place since)")
    assert d.mgr.admit(step, pre).ok
    with pytest.raises(StepNotAdmittedError) as info:
        d.mgr.commit(step, StepContext(("a",)))
    assert str(info.value) == "request 'a' label 'cfg': commit of a step that is only preplanned"
    assert (info.value.request_id, info.value.label) == ("a", "cfg")


def test_plan_out_of_order_names_why() -> None:
    d = three_tokens()
    mgr = d.mgr
    step = KVStep([Segment("a", "cfg", 1)])
    pre = StepContext(("a",), is_preplan=True)
    with pytest.raises(StepNotAdmittedError) as info:
        mgr.plan(step, pre)
    assert str(info.value) == ("request 'a' label 'cfg': preplan of a step that was not "
                               "preplan-admitted")
    assert (info.value.request_id, info.value.label) == ("a", "cfg")
    with pytest.raises(StepNotAdmittedError) as info:
        mgr.plan(step, StepContext(("a",)))
    assert str(info.value) == ("request 'a' label 'cfg': plan of a step that was not "
                               "admitted (or was changed in place since)")
    assert mgr.admit(step, pre).ok
    mgr.plan(step, pre)
    with pytest.raises(PreplanPendingError) as pending:
        mgr.plan(step, pre)
    assert str(pending.value) == "the staged preplan was already planned"


def test_plan_of_another_or_an_already_planned_step_names_why() -> None:
    d = three_tokens()
    mgr = d.mgr
    step = KVStep([Segment("a", "main", 1)])
    ctx = StepContext(("a",))
    assert mgr.admit(step, ctx).ok
    other = KVStep([Segment("a", "main", 1), Segment("a", "cfg", 1)])
    with pytest.raises(StepNotAdmittedError) as info:
        mgr.plan(other, ctx)
    assert str(info.value) == ("request 'a' label 'cfg': plan of a step other than the "
                               "admitted one (or the admitted step changed in place since "
                               "its admit)")
    assert (info.value.request_id, info.value.label) == ("a", "cfg")
    mgr.plan(step, ctx)
    with pytest.raises(StepOrderError) as order:
        mgr.plan(step, ctx)
    assert str(order.value) == ("request 'a' label 'main': the admitted step was already "
                                "planned; commit it")
    mgr.commit(step, ctx)


def test_admit_against_a_staged_preplan_names_why() -> None:
    d = Driver(make_manager(pages=32, page_size=4, max_seq_len=16))
    d.ingest("a")
    fill(d, "a", 3)
    mgr = d.mgr
    staged = KVStep([Segment("a", "main", 1)])
    pre = StepContext(("a",), is_preplan=True)
    assert mgr.admit(staged, pre).ok
    with pytest.raises(PreplanPendingError) as pending:
        mgr.admit(staged, pre)
    assert str(pending.value) == ("a preplan is already staged; clear_preplan before "
                                  "preplanning again")
    other = KVStep([Segment("a", "main", 2)])
    with pytest.raises(PreplanPendingError) as pending:
        mgr.admit(other, StepContext(("a",)))
    assert str(pending.value) == ("admit of a different step than the staged preplan; "
                                  "clear_preplan first")
    # malformed input first, whatever the lifecycle state
    too_long = KVStep([Segment("a", "main", 14)])
    with pytest.raises(InvalidStepError) as info:
        mgr.admit(too_long, StepContext(("a",)))
    assert str(info.value) == ("request 'a' label 'main': stream would reach 17 tokens "
                               "(3 stored + span 14), past KVConfig.max_seq_len 16")


def test_a_second_step_or_an_unknown_padded_request_is_misuse() -> None:
    d = three_tokens()
    mgr = d.mgr
    # R40: a plain step's padded ids must be known too
    with pytest.raises(UnknownRequestError) as unknown:
        mgr.admit(KVStep([Segment("a", "main", 1)]), StepContext(("a", "ghost")))
    assert unknown.value.request_id == "ghost"
    step = KVStep([Segment("a", "main", 1)])
    ctx = StepContext(("a",))
    assert mgr.admit(step, ctx).ok
    with pytest.raises(StepInFlightError) as info:
        mgr.admit(KVStep([Segment("a", "cfg", 1)]), ctx)
    assert str(info.value) == "a step is already admitted; commit it before admitting another"


def test_a_promoted_preplan_cannot_be_planned_again() -> None:
    d = three_tokens()
    mgr = d.mgr
    step = KVStep([Segment("a", "main", 1)])
    assert mgr.admit(step, StepContext(("a",), is_preplan=True)).ok
    mgr.plan(step, StepContext(("a",), is_preplan=True))
    ctx = StepContext(("a",))
    assert mgr.admit(step, ctx).ok
    mgr.plan(step, ctx)  # promotion
    with pytest.raises(StepOrderError):
        mgr.plan(step, ctx)
    mgr.commit(step, ctx)
    assert mgr.stored_len("a") == 4


def test_clear_preplan_over_a_running_step_with_forks_keeps_the_running_marks() -> None:
    # R43: the running step's marks (over its forks' streams too) stay
    d = three_tokens(sharing=False)
    mgr = d.mgr
    step = KVStep([Segment("a", "main", 1)], post_forks=[("main", "cfg")])
    ctx = StepContext(("a",))
    assert mgr.admit(step, ctx).ok
    nxt = KVStep([Segment("a", "cfg", 1)], post_forks=[("cfg", "draft")])
    assert mgr.admit(nxt, StepContext(("a",), is_preplan=True)).ok
    mgr.clear_preplan()
    marks = {label: s.step_in_flight for label, s in mgr._streams["a"].items()}
    assert marks == {"main": True, "cfg": True}
    mgr.plan(step, ctx)
    mgr.commit(step, ctx)
    assert mgr.stored_len("a", "cfg") == 4


def test_a_stale_preplan_names_both_lengths_and_the_remedy() -> None:
    # step N post-forks main onto cfg; N+1 is preplanned over cfg at 4 tokens;
    # N's fork copy fails and leaves cfg empty (R42)
    d = three_tokens(sharing=False)
    mgr = d.mgr
    ctx = StepContext(("a",))
    step = KVStep([Segment("a", "main", 1)], post_forks=[("main", "cfg")])
    assert mgr.admit(step, ctx).ok
    nxt = KVStep([Segment("a", "main", 1), Segment("a", "cfg", 1)])
    assert mgr.admit(nxt, StepContext(("a",), is_preplan=True)).ok
    mgr.plan(step, ctx)

    with failing_page_copy(mgr), pytest.raises(ForkCopyError):
        mgr.commit(step, ctx)
    assert mgr.admit(nxt, ctx) == AdmitOutcome(ok=False, reason=PreplanStale(
        message="the staged preplan was planned over length 4, but the stream holds 0: "
                "the step running under it committed otherwise; clear_preplan and admit "
                "afresh", request_id="a", label="cfg"))


def test_a_span_committed_onto_a_stream_offloaded_mid_step_is_dropped_loudly(
        caplog: pytest.LogCaptureFixture) -> None:
    # the last defence behind R2-R5 (unreachable through the API): driven by
    # marking the stream offloaded by hand between plan and commit
    d = Driver(make_manager(sharing=False, pages=32, page_size=4))
    d.ingest("a", "b")
    fill(d, "a", 3)
    fill(d, "b", 3)
    mgr = d.mgr
    step = KVStep([Segment("a", "main", 2), Segment("b", "main", 1)])
    ctx = StepContext(("a", "b"))
    assert mgr.admit(step, ctx).ok
    mgr.plan(step, ctx)
    stream = mgr._streams["a"]["main"]
    stream.offload, stream.offloaded = OffloadState.CLAIMED, True  # by hand: past R2-R5
    gen = mgr._streams["b"]["main"].generation
    with caplog.at_level(logging.ERROR, logger="kvref.stepping.admit_plan_commit"):
        mgr.commit(step, ctx)
    logged = [r.getMessage() for r in caplog.records
              if r.name == "kvref.stepping.admit_plan_commit"]
    assert logged == [
        "KV kv: dropping 2 committed tokens for request 'a' label 'main'; the stream "
        "was offloaded mid-step"]
    assert mgr.stored_len("a") == 3
    assert mgr.stored_len("b") == 4  # the rest of the commit still lands
    assert mgr._streams["b"]["main"].generation > gen
