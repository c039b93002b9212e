"""The decode batch (`StreamBatch`, issue 42) against the row-by-row path.

Two managers take the same calls: one makes a batch of the same streams
decoded twice in a row (from two rows here, 32 in production), the other
never does (every step row by row, the path the lockstep holds to the
model). After every call their answers (outcome, refusal, error type and
message) and their whole state (`KVManager.observe`: lengths, positions,
page tables, generations, in-flight marks, offloads, keys, pages, the
staged preplan) must be equal, and each decode step's plan the same tables. Between the batch's
decode steps every call that changes a row otherwise runs: an offload and
reload, a truncate, a reset, a remove and re-ingest, a mixed step, a
step of a subset or in another order, a step that keeps nothing, followed
tokens keyed as pages fill, a registration, a pool run dry, and misuse in
flight (a second admit, a remove, an offload, an unknown padded id), and a
preplan of the next step over the batch's.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch

from kvref.core.config import RetentionPolicy
from kvref.core.groups import AttentionGroup, ChunkedAttention
from kvref.core.labels import FULL_ATTENTION, NEVER, ChunkedLocal, SlidingWindow
from kvref.core.streams import CacheStream, StreamBatch
from kvref.stepping.step import KVStep, Segment, StepContext
from tests.unit._manager_fixtures import make_manager

PS = 4
ROWS = ["a", "b", "c", "d", "e"]
LIMIT = 64  # max_seq_len: the "long" call takes a row to it


def _answer(call: Callable[[], Any]) -> Any:
    try:
        got = call()
    except Exception as err:  # both managers must raise alike
        return ("raised", type(err).__name__, str(err))
    if isinstance(got, torch.Tensor):
        return ("tensor", got.tolist())
    return ("ok", got)


def _tables(outputs: Any) -> Any:
    return {label: (tuple(t.tolist() for t in (out.cpu_indptrs.qo_indptr,
                                                out.cpu_indptrs.paged_kv_indptr,
                                                out.cpu_indptrs.paged_kv_indices,
                                                out.cpu_indptrs.paged_kv_last_page_len)),
                    [(v.request_id, v.label, list(v.page_idxs), v.length, v.to_compute,
                      v.generation, v.offset)
                     for v in out.views])
            for label, out in outputs.items()}


class Pair:
    """The same calls on a batching manager and a row-by-row one."""

    def __init__(self, **cfg: Any) -> None:
        self.fast = make_manager(**cfg)
        self.slow = make_manager(**cfg)
        self.fast._stepping.batch_rows = 2
        self.slow._stepping.batch_rows = 1 << 30
        self.calls = 0

    def both(self, name: str, *args: Any, **kw: Any) -> Any:
        self.calls += 1
        answers = [_answer(partial(getattr(m, name), *args, **kw))
                   for m in (self.fast, self.slow)]
        if name == "plan" and answers[0][0] == "ok":
            answers = [(a[0], _tables(a[1])) for a in answers]
        elif name == "admit" and answers[0][0] == "ok":
            answers = [(a[0], a[1].ok, type(a[1].reason).__name__, getattr(
                a[1].reason, "message", None)) for a in answers]
        assert answers[0] == answers[1], (name, args, answers)
        assert self.fast.observe() == self.slow.observe(), (name, args)
        return answers[0]

    def step(self, segments: list[Segment], commit: bool = True,
             padded: tuple[str, ...] = (), misuse: str | None = None) -> None:
        step = KVStep(segments, commit=commit)
        ctx = StepContext(padded_request_ids=padded)
        admitted = self.both("admit", step, ctx)
        if admitted[0] != "ok" or not admitted[1]:
            return
        if misuse == "again":
            self.both("admit", step, ctx)  # the same step: admitted already
            self.both("admit", KVStep(segments[:1]), ctx)  # another: refused
        elif misuse == "remove":
            self.both("remove_request", segments[0].request_id)
        elif misuse == "offload":
            self.both("offload", segments[0].request_id)
        elif misuse == "commit-first":
            self.both("commit", step, ctx)  # not planned: allowed, ends the step
            return
        elif misuse == "preplan":
            # the next step admitted and planned over this one (R41), then
            # this one committed and the next promoted
            nxt = KVStep(list(segments))
            pre = StepContext(padded_request_ids=padded, is_preplan=True)
            self.both("plan", step, ctx)
            if self.both("admit", nxt, pre)[1]:
                self.both("plan", nxt, pre)
            self.both("commit", step, ctx)
            self.both("admit", nxt, ctx)
            self.both("plan", nxt, ctx)
            self.both("commit", nxt, ctx)
            return
        self.both("plan", step, ctx)
        self.both("commit", step, ctx)


# the rows the last `run`'s batch released pages of at its own commits
RELEASED = [0]


def run(seed: int, pages: int = 80, aux: bool = False, **cfg: Any) -> tuple[int, int]:
    """Returns the batch's admits and the rows its transitions ever detached.
    ``aux``: the batch also decodes a second label of the first two rows."""
    rng = random.Random(seed)
    cfg.setdefault("layers", 1)
    pair = Pair(pages=pages, page_size=PS, cpu_pages=40, heads=1, head_dim=2,
                max_seq_len=LIMIT, **cfg)
    admits = detached = 0
    admit, detach, release = StreamBatch.short, StreamBatch.detach, StreamBatch.released

    def counting_short(self: StreamBatch, ps: int) -> tuple[Any, Any]:
        nonlocal admits
        if self is pair.fast._stepping._decode_batch:
            admits += 1
        return admit(self, ps)

    def counting_detach(self: StreamBatch, s: Any) -> None:
        nonlocal detached
        detached += 1
        detach(self, s)

    def counting_release(self: StreamBatch, s: Any) -> None:
        RELEASED[0] += 1
        release(self, s)

    RELEASED[0] = 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StreamBatch, "short", counting_short)
        mp.setattr(StreamBatch, "detach", counting_detach)
        mp.setattr(StreamBatch, "released", counting_release)
        for rid in ROWS:
            pair.both("ingest_request", rid)
            pair.step([Segment(rid, "main", rng.randint(1, 9))])
        batch = [Segment(r, "main", 1) for r in ROWS]
        if aux:
            for rid in ROWS[:2]:
                pair.step([Segment(rid, "aux", rng.randint(1, 9))])
            batch += [Segment(r, "aux", 1) for r in ROWS[:2]]
        for _ in range(150):
            for g in batch:
                # the rows' lengths bounded, so the pool holds them all
                if pair.fast.stored_len(g.request_id, g.label) > LIMIT - 10:
                    # to a page's end: a row cut inside a page may share
                    # its tail, and joins a batch only from a page's end
                    cut = pair.both("truncate", g.request_id, g.label,
                                    rng.randint(1, 5) * PS)
                    if cut[0] == "raised":
                        # a window's released prefix: refused alike (W6);
                        # the request starts over instead
                        pair.both("reset_request", g.request_id, free=True)
                        pair.step([Segment(g.request_id, "main", rng.randint(1, 9))])
            rid = rng.choice(ROWS)
            op = rng.choice(["decode"] * 8 + [
                "copies", "subset", "order", "no-commit", "truncate", "reset", "remove",
                "offload", "mixed", "follow", "register", "again", "remove-in-flight",
                "offload-in-flight", "padded", "commit-first", "dry", "long", "preplan"])
            if op == "copies":
                # equal segments, other objects: an engine that builds its step afresh
                pair.step([Segment(g.request_id, g.label, g.span) for g in batch])
            elif op == "subset":
                pair.step(batch[1:])
            elif op == "order":
                pair.step(batch[::-1])
            elif op == "no-commit":
                pair.step(batch, commit=False)
            elif op == "truncate":
                n = pair.fast.stored_len(rid)
                if n > 1:
                    pair.both("truncate", rid, "main", rng.randrange(1, n))
            elif op == "reset":
                pair.both("reset_request", rid, free=rng.random() < 0.5)
                pair.step([Segment(rid, "main", rng.randint(1, 6))])
            elif op == "remove":
                pair.both("remove_request", rid)
                pair.both("ingest_request", rid)
                pair.step([Segment(rid, "main", rng.randint(1, 6))])
            elif op == "offload":
                if pair.both("offload", rid)[1]:
                    pair.both("reload", rid)
            elif op == "mixed":
                pair.step([Segment(g.request_id, g.label, rng.choice([2, 5]))
                           if g.request_id == rid else g for g in batch])
            elif op == "follow" and cfg.get("sharing", True):
                n = pair.fast.stored_len(rid)
                pair.both("follow_tokens", rid, list(range(100, 100 + n + 60)))
            elif op == "register" and cfg.get("sharing", True):
                n = pair.fast.stored_len(rid)
                pair.both("cache_prefix", rid, "main", list(range(100, 100 + n)))
            elif op in ("again", "commit-first", "preplan"):
                pair.step(batch, misuse=op)
            elif op == "remove-in-flight":
                pair.step(batch, misuse="remove")
            elif op == "offload-in-flight":
                pair.step(batch, misuse="offload")
            elif op == "padded":
                pair.step(batch, padded=("nobody",))
            elif op == "dry":
                # a long prefill of the pool's free pages: the batch's next
                # decode steps may find too few and are refused alike
                free = pair.fast.num_free_pages
                pair.both("ingest_request", "z")
                pair.step([Segment("z", "main", max(1, free * PS - rng.randint(0, PS)))])
                for _ in range(rng.randint(1, 3)):
                    pair.step(batch)
                pair.both("remove_request", "z")
            elif op == "long":
                # a row at max_seq_len: the decode steps below are misuse
                pair.step([Segment(rid, "main", LIMIT - 2 - pair.fast.stored_len(rid))])
            for _ in range(4):
                pair.step(batch)
    return admits, detached


@pytest.mark.parametrize("seed", range(3))
def test_a_batch_answers_as_row_by_row(seed: int) -> None:
    admits, detached = run(seed)
    # the batch ran most decode steps, and was broken up by the other calls
    assert admits > 100 and detached > 20, (admits, detached)


def test_a_batch_answers_as_row_by_row_without_sharing() -> None:
    admits, detached = run(7, sharing=False)
    assert admits > 100 and detached > 20, (admits, detached)


@pytest.mark.parametrize("margin", [0, 3])
def test_a_batch_of_windows_answers_as_row_by_row(margin: int) -> None:
    """W2 at a batch's commit: a row whose window passes a page releases it
    there, and stays a row (`StreamBatch.passing`, `BatchedStream.release_window_to`)."""
    admits, detached = run(11 + margin, retention={"main": RetentionPolicy(6, margin)})
    assert admits > 100 and detached > 20 and RELEASED[0] > 50, (admits, detached, RELEASED)


def test_a_batch_of_a_hybrid_models_groups_answers_as_row_by_row() -> None:
    """A hybrid step's group streams as one batch: the full group's rows
    never release, each window group's and chunked group's release as
    their windows and chunks pass pages (cached: given back blank, H3)."""
    groups = (AttentionGroup("full", (0,)), AttentionGroup("w", (1,), RetentionPolicy(6, 1)),
              AttentionGroup("c", (2,), ChunkedAttention(8)))
    admits, detached = run(5, pages=160, layers=3, groups=groups)
    assert admits > 100 and detached > 20 and RELEASED[0] > 50, (admits, detached, RELEASED)


def test_a_batch_releasing_a_page_late_is_found() -> None:
    """Planted: a window's next release one token late (`next_release`): the
    batch's commit keeps a page its window passed, which the row-by-row
    commit gives back."""

    def late(self: SlidingWindow, released: int, page_size: int) -> int:
        return released + page_size + self.window_tokens + self.margin + 1

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SlidingWindow, "next_release", late)
        with pytest.raises(AssertionError):
            run(11, retention={"main": RetentionPolicy(6)})


def test_next_release_is_the_first_length_that_releases() -> None:
    """`next_release` against `released_after` by brute force: the batch
    asks for a row's release only from that length on."""
    ps = 4
    for behaviour in (SlidingWindow(6), SlidingWindow(6, 3), SlidingWindow(1),
                      SlidingWindow(9, 2, cached=True), ChunkedLocal(8), ChunkedLocal(4),
                      ChunkedLocal(12), ChunkedLocal(2), FULL_ATTENTION):
        for released in range(0, 40, ps):
            # at every length, not only those past ``released``: exact
            first = next((n for n in range(300)
                          if behaviour.released_after(released, n, ps) != released), NEVER)
            assert behaviour.next_release(released, ps) == first, (behaviour, released)


def test_a_batch_short_of_the_page_its_next_token_starts_is_found() -> None:
    """Planted: the batch counts the pages its rows' current tokens need, not
    the next one's, so a row at a page's end is given no page."""

    def one_behind(self: StreamBatch, page_size: int) -> tuple[Any, Any]:
        short = (self.lens + (self.ticks + page_size - 1)) // page_size - self.npages
        rows = (short > 0).nonzero()[0]
        return rows, short[rows]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StreamBatch, "short", one_behind)
        with pytest.raises(AssertionError):
            run(0)


def test_a_batch_of_two_labels_answers_as_row_by_row() -> None:
    admits, detached = run(3, pages=100, aux=True)
    assert admits > 100 and detached > 20, (admits, detached)


def _batch_of(lens: list[int]) -> StreamBatch:
    streams = []
    for n in lens:
        s = CacheStream()
        s.stored_len = s.position = n
        streams.append(s)
    segments = tuple(Segment(f"r{i}", "main", 1) for i in range(len(lens)))
    return StreamBatch(streams, segments, [(g.request_id, g.label) for g in segments], PS)


def test_look_all_over_a_batchs_rows_is_look_at_of_each() -> None:
    """A commit looks at the rows of a decode batch again by one store into
    its array (`CacheStream.look_all`): each row's ``key_at``, the batch's
    array, and the rows each later commit finds due are what `look_at` of
    each row would leave; `CacheStream.lengths` reads each row's length as
    its property does, and a plain stream's from its slot."""
    lens = [5, 9, 14, 3, 21]
    one, each = _batch_of(lens), _batch_of(lens)
    rows = [0, 2, 4]
    ats = [8, 16, 24]
    for b in (one, each):
        b.end(True, True)  # a commit: ticks 1
    CacheStream.look_all([one.streams[i] for i in rows], ats)
    for i, at in zip(rows, ats, strict=True):
        each.streams[i].look_at(at)
    assert [s.key_at for s in one.streams] == [s.key_at for s in each.streams]
    assert one.key_at.tolist() == each.key_at.tolist()
    assert one.next_due <= each.next_due  # a lower bound: never a row missed
    for _ in range(12):
        assert one.end(True, True) == each.end(True, True)
    assert CacheStream.lengths(one.streams) == [s.stored_len for s in one.streams] == [
        n + 13 for n in lens]
    one.dissolve()
    mixed = [one.streams[0], each.streams[1]]  # a plain stream beside a row
    assert CacheStream.lengths(mixed) == [s.stored_len for s in mixed] == [18, 22]
