"""A decode batch's window releases (`StreamBatch.retire`) checked by the
one model, call by call.

The lockstep's decode steps run label 0, which is full attention in the
shipped scope, and the hybrid scope's six pages run out before a window
group passes a page while its rows are a batch: no budget of either
reaches a release at a batch's commit. These traces do, on purpose: two
requests decode step after step under a window with a margin, under a
hybrid model's window group and under a chunked group, the batch made from
the second step in a row (in production from 32 rows and the third step),
replayed on the model and kvref together with every check after every
call (`kvref.testing.exhaustive.run_trace`: results, states, page holders
and keys, the free queues' order, bytes). tests/unit/test_stream_batch.py
holds the batch to stepping row by row; this holds both to the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvref.core.labels import SlidingWindow
from kvref.core.streams import StreamBatch
from kvref.stepping import admit_plan_commit, decode_table
from kvref_model import core as m
from tests.support.plant_layers import traces
from tests.support.seam_traces import run


def decode(steps: int, label: int = 0) -> list[m.Action]:
    """``steps`` decode steps of one token, both requests, as an engine repeats them."""
    step = m.Step((m.Seg(0, label, 1), m.Seg(1, label, 1)), padded=(0, 1))
    return [a for _ in range(steps) for a in (m.Admit(step), m.Plan(), m.Write(), m.Commit())]


def prefilled(spans: tuple[int, int], label: int = 0) -> list[m.Action]:
    return [m.Ingest(0), m.Ingest(1), *run(0, label, spans[0]), *run(1, label, spans[1])]


# a windowed label (W = 2, margin 1), no cache: each request passes a page
# every other step, from its fifth token on
WINDOW = m.Scope(requests=2, labels=1, device_pages=8, host_pages=1, page_size=2,
                 max_span=3, windows=(2,), margins=(1,))
# a hybrid model, one full and one cached window group (W = 2, margin 1)
HYBRID = m.Scope(requests=2, labels=1, device_pages=14, host_pages=1, page_size=2,
                 max_span=3, sharing=True, groups=(None, 2), margins=(0, 1),
                 window_cache=True)
# a hybrid model with a chunked group (C = 4): its pages go at each chunk start
CHUNKED = m.Scope(requests=2, labels=1, device_pages=14, host_pages=1, page_size=2,
                  max_span=3, sharing=True, groups=(None, 4), chunked=(1,),
                  window_cache=True)

TRACES: dict[str, tuple[m.Scope, list[m.Action]]] = {
    "a batch under a window": (WINDOW, [*prefilled((3, 2)), *decode(8)]),
    # keyed as it fills: the batch's commit keys and releases in one
    "a hybrid batch": (HYBRID, [*prefilled((3, 2)), m.CachePrefix(0, 0), *decode(6)]),
    "a chunked hybrid batch": (CHUNKED, [*prefilled((3, 1)), *decode(10)]),
}


@pytest.fixture(autouse=True)
def batched(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """A batch from the second decode step in a row, its rows released at
    its own commits counted."""
    monkeypatch.setattr(decode_table, "SMALL_BATCH", 1)
    monkeypatch.setattr(admit_plan_commit, "BATCH_ROWS", 1)
    monkeypatch.setattr(admit_plan_commit, "_BATCH_AFTER", 1)
    released = [0]
    retire = StreamBatch.retire

    def counted(self: StreamBatch, rows: list[int], release: Any) -> None:
        released[0] += len(rows)
        retire(self, rows, release)

    monkeypatch.setattr(StreamBatch, "retire", counted)
    yield released


@pytest.mark.parametrize("name", sorted(TRACES))
def test_a_batch_releases_as_the_model(name: str, batched: list[int]) -> None:
    scope, actions = TRACES[name]
    found = traces(None, scope, [actions])
    assert found.at is None, found.message
    assert batched[0] >= 4, f"{name}: {batched[0]} rows released at a batch's commit"


def test_a_release_one_token_late_is_found(batched: list[int]) -> None:
    """Planted: the window's next release asked one token late, so the
    batch's commit keeps a page its window passed (W2 off at a batch)."""

    def late(self: SlidingWindow, released: int, page_size: int) -> int:
        return released + page_size + self.window_tokens + self.margin + 1

    scope, actions = TRACES["a batch under a window"]
    found = traces(lambda mp: mp.setattr(SlidingWindow, "next_release", late), scope, [actions])
    assert found.at is not None, "the late release survived the trace"
