"""Each label's attention type answers the per-label decisions (issue 29).

`kvref.core.labels` is the one home of what differs between full attention
and a sliding window with a rollback margin; the table and the prefix cache
ask it. These pin each behaviour's answers against the rules it states.
"""

from __future__ import annotations

import pytest

from kvref.core.config import RetentionPolicy
from kvref.core.labels import (
    FULL_ATTENTION,
    FullAttention,
    SlidingWindow,
    behaviour_of,
    behaviours_of,
)


def test_a_label_without_retention_is_full_attention() -> None:
    assert behaviour_of({}, "main") is FULL_ATTENTION
    assert behaviour_of({"draft": RetentionPolicy(4)}, "main") is FULL_ATTENTION
    assert behaviours_of({}) == {}


def test_a_windowed_label_carries_its_window_and_margin() -> None:
    chosen = behaviour_of({"main": RetentionPolicy(6, rollback_margin=2)}, "main")
    assert chosen == SlidingWindow(6, 2)
    assert (chosen.releases, chosen.cacheable) == (True, False)
    assert behaviours_of({"main": RetentionPolicy(6, rollback_margin=2)}) == {"main": chosen}


def test_full_attention_keeps_everything_and_is_cached() -> None:
    full = FullAttention()
    assert (full.releases, full.cacheable) == (False, True)
    assert full.released_after(0, 1000, 4) == 0
    assert full.first_read(1000) == 0


@pytest.mark.parametrize(("length", "expected"), [(0, 0), (5, 0), (6, 0), (7, 1), (20, 14)])
def test_a_window_reads_its_last_w_tokens_whatever_its_margin(
        length: int, expected: int) -> None:
    # W1: the margin is kept (W15), not read
    assert SlidingWindow(6, 2).first_read(length) == expected
    assert SlidingWindow(6, 0).first_read(length) == expected


@pytest.mark.parametrize(("released", "length", "expected"), [
    (0, 5, 0),     # shorter than W + k: nothing goes
    (0, 12, 4),    # first token kept is 12 - 8 = 4: slot 0 goes, slot 1 holds it
    (0, 15, 4),    # 7 is kept: its page (4..7) stays
    (8, 12, 8),    # a truncate left more released: never less (W2)
])
def test_a_window_releases_whole_pages_before_its_kept_tokens(
        released: int, length: int, expected: int) -> None:
    assert SlidingWindow(6, 2).released_after(released, length, 4) == expected


def test_forks_compare_behaviours_window_and_margin() -> None:
    # W5: a fork joins labels of the same retention only
    assert SlidingWindow(6, 2) != SlidingWindow(6, 0)
    assert SlidingWindow(6, 0) != FULL_ATTENTION
    assert SlidingWindow(6, 2) == SlidingWindow(6, 2)
