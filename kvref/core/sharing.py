"""Shared pages, or none: one object per manager, chosen once from the config.

With `KVConfig.enable_prefix_caching` a page may have several holders (a
fork's full pages, a prefix hit) and may carry a prefix-cache key; without
it every page has one holder and no key. The mechanisms that differ between
the two ask the manager's `PageSharing` instead of testing the flag:
admission (a copy-on-write, a fork target's private pages), forks (share or
copy), the prefix cache (is a label's page keyed or hit), offload (the keys
a host copy remembers, which a reload attaches again) and reset (which
pages a stream emptied may keep). `page_sharing` is the one place that reads
the flag. Commit-time keying of filled pages (the engine's ids carried by
the step) asks `caches` the same way `cache_prefix` does.

Whether a page still holds anything on release (kept findable in the
pool's LRU of free cached pages, or plain free) follows from its key, so
the page pool needs no switch: without sharing no page is ever keyed.

Core: imports nothing above `kvref.core`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from kvref.core.config import KVConfig
from kvref.core.labels import LabelBehaviour
from kvref.core.page_keys import PageKey
from kvref.core.page_pool import PagePool
from kvref.core.streams import CacheStream

Key = tuple[str, str]  # (request id, label)
Forks = Iterable[tuple[str, str]]  # (from label, to label)


class PageSharing(Protocol):
    """What the mechanisms ask of shared pages."""

    @property
    def shares(self) -> bool:
        """Whether pages may be shared and keyed (what `observe` reports)."""
        ...

    def caches(self, behaviour: LabelBehaviour) -> bool:
        """Whether a label's full pages are keyed and found by the prefix
        cache (W9, W10: never a window's)."""
        ...

    def unkeyable(self, fork_targets: Callable[[], frozenset[Key]]) -> frozenset[Key]:
        """The streams whose pages may not be keyed now: those an admitted fork
        will still write into (R57, S32), found by ``fork_targets`` only
        where keying happens at all."""
        ...

    def cow_needed(self, key: Key, stream: CacheStream) -> bool:
        """Whether the stream's next write lands in a page it may not write:
        its partial last page, shared or registered after a truncate into it."""
        ...

    def private_count(self, key: Key, stream: CacheStream) -> int:
        """Pages of the stream only it holds, unkeyed: what a fork onto it
        can keep writing into (R51)."""
        ...

    def fork_targets(self, forks: Forks, padded: Iterable[str]
                     ) -> tuple[set[Key], set[Key]]:
        """The fork targets that share their source's full pages, and those of
        them whose private pages may be fewer when their fork runs than now
        (a fork from it runs first, a cycle; a target twice): admission
        counts the first from their private pages, the second whole."""
        ...

    def forks_move_pages(self, forks: tuple[tuple[str, str], ...]) -> bool:
        """Whether running these forks gives their targets other pages than
        they hold now (a share swaps them): a preplan's views, built before,
        would then address pages gone (R57)."""
        ...

    def fork(self, share: Callable[[], None], copy: Callable[[], None]) -> None:
        """Run a fork the step did not ask to copy: share its source's full
        pages (R51), or copy them."""
        ...

    def release_shared(self, key: Key, stream: CacheStream,
                       private: list[bool] | None = None, head_first: bool = False) -> None:
        """Keep only the pages private to the stream, in order: what a stream
        emptied but keeping its pages (a reset, a failed fork) may hold as
        spare without a later write landing in a page someone else reads.
        ``private``: the pages' privacy as it was before a call that empties
        several streams at once (a reset: each stream keeps what was its own
        when the call was made, whichever of them lets go first, R62)."""
        ...

    def remembered_keys(self, stream: CacheStream) -> tuple[PageKey | None, ...]:
        """The keys of the stream's full pages, one per page (None where one
        is not keyed), for its host copy to remember so a reload attaches
        the cached pages again (S29); () where none is keyed."""
        ...


class PrefixSharing:
    """Forks share full pages copy on write, and the prefix cache keys them."""

    def __init__(self, pages: PagePool, page_size: int) -> None:
        self._pages = pages
        self._page_size = page_size

    @property
    def shares(self) -> bool:
        return True

    def caches(self, behaviour: LabelBehaviour) -> bool:
        return behaviour.cacheable

    def unkeyable(self, fork_targets: Callable[[], frozenset[Key]]) -> frozenset[Key]:
        return fork_targets()

    def cow_needed(self, key: Key, stream: CacheStream) -> bool:
        if not stream.tail_maybe_shared:
            return False
        ps = self._page_size
        n = stream.stored_len
        i = n // ps - stream.released // ps
        return (n % ps != 0 and i < len(stream.page_indices)
                and not self._pages.writable(key, stream.page_indices[i]))

    def private_count(self, key: Key, stream: CacheStream) -> int:
        return sum(self._pages.private_pages(key, stream.page_indices))

    def fork_targets(self, forks: Forks, padded: Iterable[str]
                     ) -> tuple[set[Key], set[Key]]:
        targets: set[Key] = set()
        unsure: set[Key] = set()
        sources: set[Key] = set()
        padded = tuple(padded)
        for from_label, to_label in forks:
            for rid in padded:
                target = (rid, to_label)
                if target in targets or target in sources:
                    unsure.add(target)
                targets.add(target)
                sources.add((rid, from_label))
        return targets, unsure

    def forks_move_pages(self, forks: tuple[tuple[str, str], ...]) -> bool:
        return bool(forks)

    def fork(self, share: Callable[[], None], copy: Callable[[], None]) -> None:
        share()

    def release_shared(self, key: Key, stream: CacheStream,
                       private: list[bool] | None = None, head_first: bool = False) -> None:
        pages = stream.page_indices
        if not pages:
            return
        if private is None:
            private = self._pages.private_pages(key, pages)
        if all(private):
            return
        kept: list[int] = []
        shared: list[int] = []
        for p, mine in zip(pages, private, strict=True):
            (kept if mine else shared).append(p)
        # tail first, as `StreamTable.give_back` (S6); a cached window head
        # first, so its tail is evicted last (H4)
        self._pages.release_table(key, shared if head_first else shared[::-1])
        stream.keep_spare(kept)

    def remembered_keys(self, stream: CacheStream) -> tuple[PageKey | None, ...]:
        # a window's stream remembers none (H6; its caller asks only of a
        # full-attention stream's): only a stream with no slot released has any
        if stream.released:
            return ()
        full = stream.page_indices[:stream.stored_len // self._page_size]
        keys = tuple(self._pages.key_of(p) for p in full)
        return keys if any(k is not None for k in keys) else ()


class NoSharing:
    """Every page has one holder and no key: forks copy, nothing is cached."""

    @property
    def shares(self) -> bool:
        return False

    def caches(self, behaviour: LabelBehaviour) -> bool:
        return False

    def unkeyable(self, fork_targets: Callable[[], frozenset[Key]]) -> frozenset[Key]:
        return frozenset()  # nothing is keyed, so nothing is refused for it

    def cow_needed(self, key: Key, stream: CacheStream) -> bool:
        return False

    def private_count(self, key: Key, stream: CacheStream) -> int:
        return len(stream.page_indices)

    def fork_targets(self, forks: Forks, padded: Iterable[str]
                     ) -> tuple[set[Key], set[Key]]:
        return set(), set()  # every fork copies into pages its target holds

    def forks_move_pages(self, forks: tuple[tuple[str, str], ...]) -> bool:
        return False  # a copy writes into the pages its target holds

    def fork(self, share: Callable[[], None], copy: Callable[[], None]) -> None:
        copy()

    def release_shared(self, key: Key, stream: CacheStream,
                       private: list[bool] | None = None, head_first: bool = False) -> None:
        return None  # every page it holds is its own

    def remembered_keys(self, stream: CacheStream) -> tuple[PageKey | None, ...]:
        return ()


NO_SHARING = NoSharing()


def page_sharing(cfg: KVConfig, pages: PagePool) -> PageSharing:
    """The manager's sharing, chosen once: `KVConfig.enable_prefix_caching`."""
    return PrefixSharing(pages, cfg.page_size) if cfg.enable_prefix_caching else NO_SHARING
