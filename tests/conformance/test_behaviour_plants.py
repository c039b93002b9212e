"""Defects planted inside `SlidingWindow`'s hooks (kvref.core.labels, issue 29)
are found by the one-model layers, as the retired retention plants are.

The window's arithmetic lives in the behaviour's hooks only, so a defect
there reaches every mechanism that asks them. Each plant here breaks one
hook; a named trace of the one model (`tests/conformance/test_feature_plants.py`'s
window cases), replayed on kvref with every result, state, page map and
byte compared, fails with it in. The clean tree replays the same traces
there. The composed lockstep (SHIPPED_SCOPE) and the exhaustive replay of a
windowed scope find these too; that is measured by hand, not in CI (each
takes minutes).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvref.core.labels import SlidingWindow
from tests.conformance.test_feature_plants import CASES, replay

Plant = Callable[[pytest.MonkeyPatch], None]


def release_rounds_up(mp: pytest.MonkeyPatch) -> None:
    """`released_after` lets go of the page holding the first kept token
    (ceil, not floor: W2 off by one)."""

    def released_after(self: SlidingWindow, released: int, length: int, page_size: int) -> int:
        first_kept = max(0, length - self.window_tokens - self.margin)
        return max(released, -(-first_kept // page_size) * page_size)

    mp.setattr(SlidingWindow, "released_after", released_after)


def release_drops_the_margin(mp: pytest.MonkeyPatch) -> None:
    """`released_after` keeps W tokens, not W + k (W15 off)."""

    def released_after(self: SlidingWindow, released: int, length: int, page_size: int) -> int:
        return max(released, max(0, length - self.window_tokens) // page_size * page_size)

    mp.setattr(SlidingWindow, "released_after", released_after)


def first_read_counts_the_margin(mp: pytest.MonkeyPatch) -> None:
    """`first_read` starts W + k back: a truncate within the margin is refused
    and `read_stream` answers tokens the window does not read (W1, W6)."""

    def first_read(self: SlidingWindow, length: int) -> int:
        return max(0, length - self.window_tokens - self.margin)

    mp.setattr(SlidingWindow, "first_read", first_read)


def window_never_releases(mp: pytest.MonkeyPatch) -> None:
    """`releases` says False: every commit skips the release (W2 off)."""
    mp.setattr(SlidingWindow, "releases", property(lambda self: False))


# plant -> the feature-plant trace that finds it
PLANTS: dict[str, tuple[Plant, str]] = {
    "release rounds up": (release_rounds_up, "(d) an off-by-one at the window's first page"),
    "release drops the margin": (release_drops_the_margin,
                                 "(e) the rollback margin ignored at release"),
    "first_read counts the margin": (first_read_counts_the_margin,
                                     "(f) the rollback margin counted as window by truncate"),
    "a window never releases": (window_never_releases,
                                "(c) a release list naming retired pages (vLLM 42571)"),
}


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_the_clean_manager_replays_the_trace(name: str) -> None:
    case = CASES[PLANTS[name][1]]
    replay(case.scope, case.trace)


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_a_plant_in_a_window_hook_is_found(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    plant, trace = PLANTS[name]
    case = CASES[trace]
    plant(monkeypatch)
    # a result or state the model disagrees with (Mismatch), or a page or
    # byte check of the driver (the AssertionError it subclasses)
    with pytest.raises(AssertionError):
        replay(case.scope, case.trace)
