"""`validate.StepValidator`: a step is walked once per object, and again once changed.

admit, plan and commit each check their step; the manager walks a step
object once and passes the same unchanged objects at once. A step (or its
context) changed in place between admit and commit must still be caught,
and leave the manager as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvref import validate
from kvref.core.errors import InvalidStepError, StepInFlightError, StepNotAdmittedError
from kvref.stepping.step import KVStep, Segment, StepContext
from tests.unit._manager_fixtures import assert_same, make_manager, snapshot


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    walks = [0]
    walk = validate.step

    def counted(step: object, ctx: object) -> None:
        walks[0] += 1
        walk(step, ctx)

    monkeypatch.setattr(validate, "step", counted)
    return walks


def test_one_walk_per_step_object(monkeypatch: pytest.MonkeyPatch) -> None:
    walks = _counting(monkeypatch)
    kv = make_manager()
    kv.ingest_request("a")
    step, ctx = KVStep([Segment("a", "main", 3)]), StepContext(["a"])
    kv.admit(step, ctx)
    kv.plan(step, ctx)
    kv.commit(step, ctx)
    assert walks[0] == 1
    # an equal step in new objects is walked again (identity, not equality, is remembered)
    again = KVStep([Segment("a", "main", 1)])
    kv.admit(again, StepContext(["a"]))
    assert walks[0] == 2


def test_steps_that_could_change_unseen_are_walked_every_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    walks = _counting(monkeypatch)
    kv = make_manager()
    kv.ingest_request("a")
    kv.ingest_request("b")
    # forks as a list of lists: a pair could change in place without a trace
    step = KVStep([Segment("a", "main", 2)], post_forks=[["main", "cfg"]])  # type: ignore[list-item]
    ctx = StepContext(["a"])
    kv.admit(step, ctx)
    kv.plan(step, ctx)
    kv.commit(step, ctx)
    assert walks[0] == 3


def _swap_field(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)  # a frozen dataclass's field, swapped


MUTATIONS: dict[str, Callable[[KVStep, StepContext], None]] = {
    "segment-replaced-negative": lambda s, c: s.segments.__setitem__(  # type: ignore[attr-defined]
        0, Segment("a", "main", -1)),
    "segment-replaced-bool-span": lambda s, c: s.segments.__setitem__(  # type: ignore[attr-defined]
        0, Segment("a", "main", True)),
    "segment-appended-not-a-segment": lambda s, c: s.segments.append(  # type: ignore[attr-defined]
        ("b", "main", 1)),
    "segments-swapped": lambda s, c: _swap_field(s, "segments", "ab"),
    "commit-swapped": lambda s, c: _swap_field(s, "commit", 1),
    "forks-swapped": lambda s, c: _swap_field(s, "post_forks", (("main", "main"),)),
    "padded-appended-int": lambda s, c: c.padded_request_ids.append(7),  # type: ignore[attr-defined]
    "preplan-swapped": lambda s, c: _swap_field(c, "is_preplan", "no"),
}


@pytest.mark.parametrize("when", ["plan", "commit"])
@pytest.mark.parametrize("mutate", list(MUTATIONS), ids=list(MUTATIONS))
def test_a_step_changed_after_admit_is_caught(mutate: str, when: str) -> None:
    kv = make_manager()
    kv.ingest_request("a")
    kv.ingest_request("b")
    step, ctx = KVStep([Segment("a", "main", 3)]), StepContext(["a"])
    kv.admit(step, ctx)
    if when == "commit":
        kv.plan(step, ctx)
    before = snapshot(kv)
    MUTATIONS[mutate](step, ctx)
    call: Any = kv.plan if when == "plan" else kv.commit
    with pytest.raises(InvalidStepError):
        call(step, ctx)
    assert_same(before, snapshot(kv))


@pytest.mark.parametrize("when", ["after admit", "after plan"])
@pytest.mark.parametrize("change", ["append a segment", "grow a span", "drop the commit"])
def test_a_well_formed_change_in_place_is_not_the_admitted_step(when: str, change: str) -> None:
    """Validation passes a well-formed step; stepping must still see that it
    is not what was admitted. Before, a segment appended after plan was
    committed onto stream ``b`` with a length and no pages for it."""
    kv = make_manager()
    kv.ingest_request("a")
    kv.ingest_request("b")
    segments = [Segment("a", "main", 2)]
    step, ctx = KVStep(segments), StepContext(["a", "b"])
    assert kv.admit(step, ctx).ok
    if when == "after plan":
        kv.plan(step, ctx)
    if change == "append a segment":
        segments.append(Segment("b", "main", 20))
    elif change == "grow a span":
        segments[0] = Segment("a", "main", 9)
    else:
        object.__setattr__(step, "commit", False)
    before = snapshot(kv)
    calls: list[Callable[[], Any]] = [lambda: kv.commit(step, ctx), lambda: kv.admit(step, ctx)]
    if when == "after admit":
        calls.append(lambda: kv.plan(step, ctx))
    for call in calls:
        with pytest.raises((StepNotAdmittedError, StepInFlightError)):
            call()
        assert_same(before, snapshot(kv))
    assert kv.stored_len("b") == 0


def _run(kv: Any, step: KVStep, ctx: StepContext) -> None:
    for call in (kv.admit, kv.plan, kv.commit):
        call(step, ctx)


def _decoded_batch() -> tuple[Any, list[Segment], StepContext]:
    """Requests a, b and c, and one decode step of a and b run over a
    context naming all three: the step the next one follows."""
    kv = make_manager()
    for rid in "abc":
        kv.ingest_request(rid)
    batch = [Segment("a", "main", 1), Segment("b", "main", 1)]
    ctx = StepContext(["a", "b", "c"])
    _run(kv, KVStep(batch), ctx)
    return kv, batch, ctx


def test_a_step_beginning_with_the_last_ones_segments_walks_only_the_rest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode batch with a prefill chunk beside it (issue 42) reuses the
    batch's segment objects: only the segments after them are walked, and a
    bad one there is still refused."""
    firsts: list[int] = []
    walk = validate.segments

    def counted(segs: object, first: int = 0) -> None:
        firsts.append(first)
        walk(segs, first)

    monkeypatch.setattr(validate, "segments", counted)
    kv, batch, ctx = _decoded_batch()
    _run(kv, KVStep([*batch, Segment("c", "main", 4)]), ctx)
    assert firsts == [0, 2]
    before = snapshot(kv)
    with pytest.raises(InvalidStepError):
        kv.admit(KVStep([*batch, Segment("c", "main", -1)]), ctx)
    with pytest.raises(InvalidStepError):
        kv.admit(KVStep([batch[0], Segment("b", "main", True)]), ctx)  # type: ignore[arg-type]
    assert firsts[2:] == [2, 1]
    assert_same(before, snapshot(kv))


def _after(change: Callable[[StepContext], None]) -> Callable[[list[Segment], StepContext],
                                                               KVStep]:
    """A new step of the same fields, over the context changed by ``change``."""
    def make(batch: list[Segment], ctx: StepContext) -> KVStep:
        change(ctx)
        return KVStep(batch)
    return make


NEXT_STEP_CHANGES: dict[str, Callable[[list[Segment], StepContext], KVStep]] = {
    "commit-not-a-bool": lambda b, c: KVStep(b, commit=1),  # type: ignore[arg-type]
    "forks-onto-itself": lambda b, c: KVStep(b, post_forks=(("main", "main"),)),
    "combined-not-str": lambda b, c: KVStep(b, combined_labels=((1,),)),  # type: ignore[arg-type]
    "padded-appended-int": _after(
        lambda c: c.padded_request_ids.append(7)),  # type: ignore[attr-defined]
    "preplan-swapped": _after(lambda c: _swap_field(c, "is_preplan", "no")),
    "lease-swapped": _after(lambda c: _swap_field(c, "slot_lease", "slot")),
}


def test_a_new_step_of_the_same_fields_walks_only_its_segments(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each engine step is a new `KVStep` over the same context (issue 42):
    where every field but the segments is the last step's object, only the
    new segments are walked (no `_step_from`), and the memo moves on."""
    walks: list[int] = []
    walk = validate._step_from

    def counted(step: object, ctx: object, first: int) -> None:
        walks.append(first)
        walk(step, ctx, first)

    monkeypatch.setattr(validate, "_step_from", counted)
    kv, batch, ctx = _decoded_batch()
    assert walks == [0]
    for step in (KVStep([*batch, Segment("c", "main", 4)]), KVStep(batch)):
        _run(kv, step, ctx)
    assert walks == [0]  # neither new step walked its fields again
    before = snapshot(kv)
    with pytest.raises(InvalidStepError):
        kv.admit(KVStep([*batch, Segment("c", "main", -1)]), ctx)
    assert walks == [0]
    assert_same(before, snapshot(kv))


@pytest.mark.parametrize("change", list(NEXT_STEP_CHANGES), ids=list(NEXT_STEP_CHANGES))
def test_a_new_step_with_a_bad_field_is_refused(change: str) -> None:
    """The memo moves on only for the very objects it checked: a new step
    whose other fields are bad, or whose context changed since, is walked
    whole and refused, the manager unchanged."""
    kv, batch, ctx = _decoded_batch()
    before = snapshot(kv)
    with pytest.raises(InvalidStepError):
        kv.admit(NEXT_STEP_CHANGES[change](batch, ctx), ctx)
    assert_same(before, snapshot(kv))
