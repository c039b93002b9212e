"""The free queues' order after a remove of streams that share a page (issue 41).

A fork shares a windowed stream's pages with another label of the same
request; the target's window then lets go of its head, so one stream holds
a private page below a page both hold. A remove lets each stream go tail
first (S6, S22), but the shared page becomes free only when its second
holder lets go, and which of the request's streams goes first is left
open: kvref goes in the order the streams were made, the model by label.
The lockstep's free-order check once read that interleaving as one
stream's pages freed head first.
"""

from __future__ import annotations

import pytest

from kvref.testing.driver import DriverConfig
from kvref.testing.exhaustive import Mismatch, run_trace
from kvref_model import core as m

SCOPE = m.Scope(requests=3, labels=3, device_pages=8, host_pages=4, page_size=2, max_span=3,
                depth=6, sharing=True, windows=(None, 2, 2), margins=(0, 1, 1),
                salts=("a", "a", "lora=b"))


def step(*segs: tuple[int, int], forks: tuple[tuple[int, int], ...] = ()) -> list[m.Action]:
    """One admitted, planned, written and committed step of request 1."""
    s = m.Step(tuple(m.Seg(1, label, span) for label, span in segs), forks, (), (1,), True)
    return [m.Admit(s), m.Plan(), m.Write(), m.Commit()]


# label 2 grows to 4 tokens (two full pages, its window keeps both); the
# fork 2 -> 1 shares them, label 1's next token moves its window past
# slot 0, so label 2 holds slot 0 alone and slot 1 with label 1
# (label 0's three tokens, two pages it holds alone, keep the check's reach)
CALLS: list[m.Action] = [m.Ingest(1), *step((2, 1)), *step((2, 2)), *step((2, 1)),
                         *step((2, 0), (1, 1), (0, 3), forks=((2, 1),)), m.Remove(1)]


def test_the_calls_reach_a_private_page_below_a_shared_one() -> None:
    model = m.Model(SCOPE)
    s = model.init()
    for a in CALLS[:-1]:
        _, s = model.step(s, a)
    t = s.stream_map()
    one, two, zero = t[(1, 1)].table, t[(1, 2)].table, t[(1, 0)].table
    assert one[0] == 0 and one[1] == two[1] != 0 and two[0] not in (0, *one)
    assert len([p for p in zero if p]) == 2


def test_remove_of_streams_sharing_a_page_past_a_window_head() -> None:
    run_trace(m.Model(SCOPE), CALLS, DriverConfig())


def test_the_check_still_sees_a_stream_freed_head_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages a stream held alone still come back in its own order: a model
    whose full-attention label lets go head first (it lets go only at the
    remove, with two other streams) disagrees with kvref there."""
    real = m.Model._release

    def head_first(self: m.Model, pool: object, k: m.Key, table: tuple[int, ...],
                   blank: bool = False) -> object:
        return real(self, pool, k, table[::-1] if k[1] == 0 else table,  # type: ignore[arg-type]
                    blank)

    monkeypatch.setattr(m.Model, "_release", head_first)
    with pytest.raises(Mismatch, match=r"step 17 Remove.*\(1, 0\)'s pages .*tail first"):
        run_trace(m.Model(SCOPE), CALLS, DriverConfig())
