"""`CacheStream`'s transitions: the model's states, each move from the state
it is written for, a typed refusal from any other (leaving the stream as it
was), and the generation bumped by each one that changes pages or length."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import pytest

from kvref.core.streams import CacheStream, OffloadState, RetrieveState, StreamStateError

PS = 4


def _filled(tokens: int = 6) -> CacheStream:
    s = CacheStream()
    s.append_pages([1, 2])
    s.append_tokens(tokens)
    return s


def _state(s: CacheStream) -> tuple[object, ...]:
    return (list(s.page_indices), s.stored_len, s.position, s.released, s.generation,
            list(s.keys), bytes(s.key_tokens), s.offload, s.retrieve, s.step_in_flight,
            s.tail_maybe_shared, s.received, s.space)


def test_offload_states_follow_the_model() -> None:
    s = _filled()
    assert s.offload is OffloadState.RESIDENT and not s.offloaded
    claim = s.claim_offload("main")
    assert s.offload is OffloadState.CLAIMED and s.offloaded
    assert (claim.pages, claim.stored_len, claim.generation) == ([1, 2], 6, s.generation)
    s.abandon_offload()
    assert s.offload is OffloadState.RESIDENT and s.page_indices == [1, 2]
    s.claim_offload("main")
    gen = s.generation
    s.commit_offload()
    assert s.offload is OffloadState.OFFLOADED and s.page_indices == [] and s.stored_len == 6
    assert s.generation == gen + 1
    s.reload([7, 8], 6, 6, 0)
    assert s.offload is OffloadState.RESIDENT and s.page_indices == [7, 8]
    assert s.generation == gen + 2
    s.claim_offload("main")
    s.commit_offload()
    s.forget_offload()
    assert s.offload is OffloadState.RESIDENT


def _claimed() -> CacheStream:
    s = _filled()
    s.claim_offload("main")
    return s


def _offloaded() -> CacheStream:
    s = _claimed()
    s.commit_offload()
    return s


def _pending() -> CacheStream:
    s = CacheStream()
    s.start_retrieve([3], 0, Future(), 2)
    return s


def _in_flight() -> CacheStream:
    s = _filled()
    s.mark_in_flight()
    return s


# (the stream, the transition asked of it): each from a state it does not leave
REFUSED: list[tuple[str, Callable[[], CacheStream], Callable[[CacheStream], object]]] = [
    ("claim a claimed stream", _claimed, lambda s: s.claim_offload("main")),
    ("claim an offloaded stream", _offloaded, lambda s: s.claim_offload("main")),
    ("claim a stream in flight (R4)", _in_flight, lambda s: s.claim_offload("main")),
    ("commit a resident stream", _filled, lambda s: s.commit_offload()),
    ("commit an offloaded stream", _offloaded, lambda s: s.commit_offload()),
    ("abandon a resident stream", _filled, lambda s: s.abandon_offload()),
    ("abandon an offloaded stream", _offloaded, lambda s: s.abandon_offload()),
    ("forget a claimed stream", _claimed, lambda s: s.forget_offload()),
    ("reload a resident stream", _filled, lambda s: s.reload([5], 2, 2, 0)),
    ("reload a claimed stream", _claimed, lambda s: s.reload([5], 2, 2, 0)),
    ("append tokens to a claimed stream", _claimed, lambda s: s.append_tokens(1)),
    ("append pages to an offloaded stream", _offloaded, lambda s: s.append_pages([9])),
    ("mark an offloaded stream in flight", _offloaded, lambda s: s.mark_in_flight()),
    ("truncate past the length", _filled, lambda s: s.truncate_to(7, 2, PS)),
    ("release no further", _filled, lambda s: s.release_window_to(0, PS)),
    ("release part of a page", _filled, lambda s: s.release_window_to(3, PS)),
    ("rehome onto fewer slots", _filled, lambda s: s.rehome_pages([5])),
    ("keep spare pages of a stream with tokens", _filled, lambda s: s.keep_spare([1])),
    ("attach a hit to a stream with tokens", _filled,
     lambda s: s.attach_prefix([5], PS, [b"k"], bytes(8 * PS))),
    ("start a retrieve over a pending one", _pending,
     lambda s: s.start_retrieve([4], 0, None, 2)),
    ("start a retrieve into an offloaded stream", _offloaded,
     lambda s: s.start_retrieve([4], 0, None, 2)),
    ("latch a failure over a running copy", _pending,
     lambda s: s.fail_retrieve(RuntimeError("stale"))),
]


@pytest.mark.parametrize(("what", "make", "move"), REFUSED, ids=[r[0] for r in REFUSED])
def test_a_transition_refuses_a_wrong_source_state(
        what: str, make: Callable[[], CacheStream],
        move: Callable[[CacheStream], object]) -> None:
    s = make()
    before = _state(s)
    with pytest.raises(StreamStateError):
        move(s)
    assert _state(s) == before, what


def test_retrieve_states_follow_the_model() -> None:
    fut: Future[None] = Future()
    s = CacheStream()
    gen = s.generation
    s.start_retrieve([3, 4], 0, fut, 6)
    assert s.retrieve is RetrieveState.PENDING and s.read_pending and s.received
    assert (s.stored_len, s.page_indices, s.generation) == (6, [3, 4], gen + 1)
    assert s.settle_retrieve() is RetrieveState.PENDING
    fut.set_exception(RuntimeError("copy failed"))
    assert s.settle_retrieve() is RetrieveState.FAILED  # latched (I11)
    assert s.read_future is None and s.retrieve is RetrieveState.FAILED
    s.reset()
    assert s.retrieve is RetrieveState.IDLE and not s.read_pending
    ok: Future[None] = Future()
    s.start_retrieve([3, 4], 0, ok, 6)
    ok.set_result(None)
    assert s.settle_retrieve() is RetrieveState.IDLE and not s.read_pending


def test_each_change_of_pages_or_length_bumps_the_generation() -> None:
    """I14, from the transitions themselves (the lockstep checks it end to end)."""
    s = CacheStream()
    moves: list[tuple[str, Callable[[], object]]] = [
        ("append_pages", lambda: s.append_pages([1, 2, 3])),
        ("append_tokens", lambda: s.append_tokens(10)),
        ("rehome_pages", lambda: s.rehome_pages([4, 5, 6])),
        ("release_window_to", lambda: s.release_window_to(PS, PS)),
        ("truncate_to", lambda: s.truncate_to(6, 1, PS)),
        ("adopt_fork_pages", lambda: s.adopt_fork_pages([5, 7])),
        ("fork_from", lambda: s.fork_from(_filled(), "main", PS)),
        ("empty_torn", lambda: s.empty_torn()),
        ("keep_spare", lambda: s.keep_spare([5])),
        ("reset", lambda: s.reset()),
        ("attach_prefix", lambda: s.attach_prefix([8], PS, [b"k"], bytes(8 * PS))),
        ("drop_pages", lambda: s.drop_pages()),
    ]
    for name, move in moves:
        gen = s.generation
        move()
        assert s.generation == gen + 1, name



def test_marking_a_step_refuses_before_marking_any() -> None:
    """`mark_step` over a step's streams: one offloaded among them refuses,
    and none of them is marked (all are checked before any write)."""
    streams = [_filled(), _filled(), _offloaded(), _filled()]
    before = [_state(s) for s in streams]
    with pytest.raises(StreamStateError):
        CacheStream.mark_step(streams)
    assert [_state(s) for s in streams] == before
    ok = streams[:2] + streams[3:]
    CacheStream.mark_step(ok)
    assert all(s.step_in_flight for s in ok)


def test_ending_a_step_is_the_single_transitions_over_each_stream() -> None:
    """`end_step` does per stream what `clear_in_flight` and `append_tokens`
    do (span 0 appends nothing and bumps nothing), passes over an offloaded
    stream's span and names it, and without spans (a step that keeps no
    tokens) only clears the marks."""
    spans = [1, 0, 3, 2]

    def batch() -> list[CacheStream]:
        out = [_filled(), _filled(5), _filled(7), _claimed()]
        CacheStream.mark_step(out[:3])
        return out

    ended, one_by_one = batch(), batch()
    due: list[CacheStream] = []
    assert CacheStream.end_step(ended, spans, due) == [ended[3]]
    assert due == []  # none is followed (S33): no commit keys them
    for s, span in zip(one_by_one, spans, strict=True):
        s.clear_in_flight()
        if span and not s.offloaded:
            s.append_tokens(span)
    assert [_state(s) for s in ended] == [_state(s) for s in one_by_one]
    assert ended[0].stored_len == 7 and ended[1].stored_len == 5
    kept = batch()
    before = [s.generation for s in kept]
    assert CacheStream.end_step(kept, None, due) == []
    assert [s.generation for s in kept] == before
    assert not any(s.step_in_flight for s in kept)
