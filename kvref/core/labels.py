"""What a label's attention type decides: one object per label.

Each label of a `KVConfig` is full attention, or a sliding window with a
rollback margin (`KVConfig.retention`, specs/retention.md). Everything that
differs between the two is asked of the label's `LabelBehaviour`, chosen
once from the config by `behaviour_of`: which tokens attention still reads
at a length (W1), what a commit releases (W2, W15), whether the label ever
releases (so a fork moves a released prefix when it runs, R67, and a
publish waits on a commit, R70), and whether its pages are cached (W9,
W10). The mechanisms (admission, plan, commit, forks, offload, retrieve)
work on a stream's ``released`` prefix and never ask which type a label
is, so a new attention type is one new class here. The idea follows vLLM
v1's per-attention-type KV managers (FullAttentionManager,
SlidingWindowManager); the rules are kvref's own.

Core: imports nothing above `kvref.core`.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvref.core.config import RetentionPolicy
from kvref.core.groups import GROUP_SEP, AttentionGroup, ChunkedAttention

# no length: what `next_release` answers for a label that never releases
NEVER = sys.maxsize


class LabelBehaviour(Protocol):
    """The per-label decisions mechanisms ask of a label's attention type.

    Compared with ``==``: a fork joins two labels only where their
    behaviours are equal (W5), so an implementation is a value (a frozen
    dataclass)."""

    @property
    def releases(self) -> bool:
        """Whether a commit may ever release pages (``released_after`` may
        grow). A label that does has a released prefix a fork moves only
        when it runs (R67), and a commit a publish waits on (R70); a cache
        whose labels never release skips those questions altogether."""
        ...

    @property
    def cacheable(self) -> bool:
        """Whether the label's pages may be registered in, and hit from, the
        prefix cache (W9, W10: a window's released prefix cannot be hit)."""
        ...

    def first_read(self, length: int) -> int:
        """The first token attention reads for the next token of a stream
        ``length`` long (W1): the front of what a read, a truncate (W6) or
        a received publication (W16) must still hold."""
        ...

    def released_after(self, released: int, length: int, page_size: int) -> int:
        """The released token count, whole pages from the front, once a
        commit leaves the stream ``length`` long (W2): never less than
        ``released`` (a truncate keeps it)."""
        ...

    def next_release(self, released: int, page_size: int) -> int:
        """The least length at which ``released_after(released, length)``
        passes ``released`` (``released`` whole pages), `NEVER` where no
        length does: a decode batch asks each row's once per release, not
        ``released_after`` at every commit (`kvref.core.streams.StreamBatch`)."""
        ...


@dataclass(frozen=True)
class FullAttention:
    """Every token stays resident until the request goes."""

    @property
    def releases(self) -> bool:
        return False

    @property
    def cacheable(self) -> bool:
        return True

    def first_read(self, length: int) -> int:
        return 0

    def __str__(self) -> str:
        return "full attention"

    def released_after(self, released: int, length: int, page_size: int) -> int:
        return released

    def next_release(self, released: int, page_size: int) -> int:
        return NEVER


class _ReleasesPages:
    """What a window and a chunk share: a commit lets go of pages, and the
    pages stay cached only where the behaviour says (``cached``)."""

    cached: bool

    @property
    def releases(self) -> bool:
        return True

    @property
    def cacheable(self) -> bool:
        return self.cached


@dataclass(frozen=True)
class SlidingWindow(_ReleasesPages):
    """The last ``window_tokens`` tokens are read; a commit keeps ``margin``
    more so a speculative step's rejected drafts may be truncated (W15)."""

    window_tokens: int
    margin: int = 0
    # a hybrid model's window group keys its pages and hits (H2-H4 of
    # specs/retention.md); a label's window (KVConfig.retention) does not (W9, W10)
    cached: bool = False

    def first_read(self, length: int) -> int:
        return max(0, length - self.window_tokens)

    def __str__(self) -> str:
        return f"W = {self.window_tokens}" + (f", k = {self.margin}" if self.margin else "")

    def released_after(self, released: int, length: int, page_size: int) -> int:
        # every page wholly before the first kept token max(0, n - W - k)
        # goes (W2, W15); the page holding that token stays
        first_kept = max(0, length - self.window_tokens - self.margin)
        return max(released, first_kept // page_size * page_size)

    def next_release(self, released: int, page_size: int) -> int:
        # the page after ``released`` goes once the first kept token is past it
        return released + page_size + self.window_tokens + self.margin


@dataclass(frozen=True)
class ChunkedLocal(_ReleasesPages):
    """Chunked local attention (H7): the next token of a stream ``n`` long
    reads from its chunk's start ``n // chunk * chunk``; a commit lets go of
    every page wholly before it, so the pages go at each chunk boundary. A
    hybrid model's chunked group keys its pages and hits, as a window group
    does (H2-H4): a hit at h needs only the pages of h's chunk."""

    chunk: int
    cached: bool = True

    def first_read(self, length: int) -> int:
        return length // self.chunk * self.chunk

    def __str__(self) -> str:
        return f"chunks of C = {self.chunk}"

    def released_after(self, released: int, length: int, page_size: int) -> int:
        return max(released, self.first_read(length) // page_size * page_size)

    def next_release(self, released: int, page_size: int) -> int:
        # the first chunk boundary at or past the end of the page after ``released``
        return -(-(released + page_size) // self.chunk) * self.chunk


FULL_ATTENTION = FullAttention()


def behaviour_of(retention: Mapping[str, RetentionPolicy], label: str) -> LabelBehaviour:
    """The label's behaviour under ``KVConfig.retention``: absent is full attention."""
    policy = retention.get(label)
    if policy is None:
        return FULL_ATTENTION
    return SlidingWindow(policy.context_budget, policy.rollback_margin)


def behaviours_of(retention: Mapping[str, RetentionPolicy],
                  groups: Sequence[AttentionGroup] = ()) -> dict[str, LabelBehaviour]:
    """Every label ``KVConfig.retention`` names, with its behaviour; a label
    absent from the result is full attention (`StreamTable.behaviour`).
    With attention groups, every label's behaviour is its group's."""
    if groups:
        return GroupBehaviours(groups)
    return {label: behaviour_of(retention, label) for label in retention}


class GroupBehaviours(dict[str, LabelBehaviour]):
    """A hybrid model's behaviours: a group label ``L@name`` has group
    ``name``'s, a bare label the first group's (`kvref.core.groups`). Held
    by group name; `get` resolves any label, and the values are every
    group's, which is what `StreamTable.releasing` asks of them."""

    def __init__(self, groups: Sequence[AttentionGroup]) -> None:
        # groups of one type share one behaviour object: a commit over a
        # hybrid step compares them per row, and identity answers at once
        one: dict[LabelBehaviour, LabelBehaviour] = {}
        super().__init__({g.name: one.setdefault(b, b)
                          for g in groups for b in (_group_behaviour(g),)})
        self._first = self[groups[0].name]
        # label -> its behaviour, resolved once: every step asks per stream
        self._resolved: dict[str, LabelBehaviour] = {}

    def get(self, label: str, default: object = None) -> LabelBehaviour:
        got = self._resolved.get(label)
        if got is None:
            _, sep, name = label.rpartition(GROUP_SEP)
            got = dict.get(self, name, self._first) if sep else self._first
            if len(self._resolved) > 4096:
                self._resolved.clear()  # bounded: labels are few, but come from engines
            self._resolved[label] = got
        return got


def _group_behaviour(g: AttentionGroup) -> LabelBehaviour:
    r = g.retention
    if r is None:
        return FULL_ATTENTION
    if isinstance(r, ChunkedAttention):
        return ChunkedLocal(r.size)
    return SlidingWindow(r.context_budget, r.rollback_margin, cached=True)
