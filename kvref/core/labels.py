"""What a label's attention type decides: one object per label.

Each label of a `KVConfig` is full attention, or a sliding window with a
rollback margin (`KVConfig.retention`, specs/retention.md). The decisions that
differ between the two (what a commit keeps and releases, whether a fork may
join two labels, whether the label's pages are cached or hit) are asked of
the label's `LabelBehaviour`, chosen once from the config by `behaviour_of`,
instead of branching on "is there a window" at each call. A new attention
type is one new class here. The idea follows vLLM v1's per-attention-type
KV managers (FullAttentionManager, SlidingWindowManager); the rules are
kvref's own (W2, W5, W9, W10, W15).

Core: imports nothing above `kvref.core`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from kvref.core.config import RetentionPolicy


class LabelBehaviour(Protocol):
    """The per-label decisions mechanisms ask of a label's attention type."""

    @property
    def window(self) -> int | None:
        """The retention window W in tokens, or None (every token is kept)."""
        ...

    @property
    def kept(self) -> int | None:
        """Tokens a commit keeps, W plus the rollback margin (W15), or None."""
        ...

    @property
    def cacheable(self) -> bool:
        """Whether the label's pages may be registered in, and hit from, the
        prefix cache (W9, W10: a window's released prefix cannot be hit)."""
        ...

    def released_after(self, released: int, length: int, page_size: int) -> int:
        """The released token count once a commit leaves the stream ``length``
        long (W2): never less than ``released`` (a truncate keeps it)."""
        ...


@dataclass(frozen=True)
class FullAttention:
    """Every token stays resident until the request goes."""

    @property
    def window(self) -> int | None:
        return None

    @property
    def kept(self) -> int | None:
        return None

    @property
    def cacheable(self) -> bool:
        return True

    def released_after(self, released: int, length: int, page_size: int) -> int:
        return released


@dataclass(frozen=True)
class SlidingWindow:
    """The last ``window`` tokens stay, ``margin`` more so a speculative
    step's rejected drafts may be truncated (W15)."""

    window_tokens: int
    margin: int = 0

    @property
    def window(self) -> int | None:
        return self.window_tokens

    @property
    def kept(self) -> int | None:
        return self.window_tokens + self.margin

    @property
    def cacheable(self) -> bool:
        return False

    def released_after(self, released: int, length: int, page_size: int) -> int:
        return window_released_after(released, length, self.window_tokens + self.margin,
                                     page_size)


def window_released_after(released: int, length: int, keep: int, page_size: int) -> int:
    """A windowed stream's released count once a commit leaves it ``length``
    long, keeping ``keep`` tokens (W plus its rollback margin): every page
    wholly before ``max(0, length - keep)`` (W2, W15), and never less than
    ``released`` (a truncate keeps it). The one statement of the rule."""
    return max(released, max(0, length - keep) // page_size * page_size)


FULL_ATTENTION = FullAttention()


def behaviour_of(retention: Mapping[str, RetentionPolicy], label: str) -> LabelBehaviour:
    """The label's behaviour under ``KVConfig.retention``: absent is full attention."""
    policy = retention.get(label)
    if policy is None:
        return FULL_ATTENTION
    return SlidingWindow(policy.context_budget, policy.rollback_margin)


def behaviour_from(windows: Mapping[str, int], margins: Mapping[str, int],
                   label: str) -> LabelBehaviour:
    """The same choice from the table's label -> W and label -> k maps."""
    w = windows.get(label)
    if w is None:
        return FULL_ATTENTION
    return SlidingWindow(w, margins.get(label, 0))
