"""Forks: copy one stream of a request onto another, over pages admit reserved.

Pre-forks run at plan (or at a commit without a plan, R24), post-forks at
commit after the spans land. A copy that fails empties its target and the
other forks still run; the first failure is raised as `ForkCopyError` (R26).
Called under the stream table's lock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvref.cache import KVCache
from kvref.errors import ForkCopyError, KVRefError
from kvref.running_step import RunningStep
from kvref.step import KVStep
from kvref.stream_table import Key, StreamTable, pages_for


class ForkFailed(Exception):
    """One fork copy failed; `Forks.run` gathers them into a ForkCopyError."""


class Forks:
    """Fork copies over the stream table's pages in one KV cache."""

    def __init__(self, table: StreamTable, kv_cache: KVCache) -> None:
        self._table = table
        self._kv_cache = kv_cache

    def run_pre(self, running: RunningStep) -> None:
        if running.forked:
            return
        # done even if a copy fails: a retried plan, or the commit, must not
        # run a chain of forks twice over its own results
        running.forked = True
        self.run(running, running.step.pre_forks)

    def run(self, running: RunningStep, forks: Sequence[tuple[str, str]]) -> None:
        """Each fork for each padded request, in order; a failed copy empties its
        target and the rest still run, then the first failure is raised."""
        failed: list[tuple[Key, BaseException]] = []
        for from_label, to_label in forks:
            for rid in running.padded:
                try:
                    self.apply(rid, from_label, to_label, running.created)
                except ForkFailed as err:
                    failed.append(((rid, to_label), err.__cause__ or err))
        if failed:
            (rid, label), cause = failed[0]
            raise ForkCopyError(
                f"fork copy failed ({type(cause).__name__}: {cause}); the target was left "
                f"empty ({len(failed)} target(s) in this call)",
                request_id=rid, label=label,
            ) from cause

    def lengths_after_pre_forks(self, step: KVStep, padded: Sequence[str],
                                created: Sequence[Key], base: Mapping[Key, int] | None = None
                                ) -> dict[Key, int]:
        """Target lengths the pre-forks will give, without applying them (R11),
        over ``base`` (a preplan over the running step: what it leaves, R41)."""
        unfilled = set(created)
        lengths: dict[Key, int] = dict(base or {})
        for from_label, to_label in step.pre_forks:
            for rid in padded:
                src = self._table.streams[rid].get(from_label)
                if src is None:
                    continue
                n = lengths.get((rid, from_label), src.stored_len)
                if (rid, from_label) in unfilled and n == 0:
                    continue  # R20
                unfilled.discard((rid, to_label))
                lengths[(rid, to_label)] = n
        return lengths

    def apply(self, rid: str, from_label: str, to_label: str, created: set[Key]) -> None:
        """Copy a stream onto its fork target, over pages admit reserved."""
        streams = self._table.streams[rid]
        src = streams[from_label]  # admit made both ends (R16)
        dst = streams[to_label]
        if (rid, from_label) in created and src.stored_len == 0:
            # R20: this step's admit made the source only so a mark covers
            # it; a padded request without the label has nothing to give, and
            # copying the empty stream wiped the target's tokens
            return
        created.discard((rid, to_label))  # a fork wrote it: a source from here on
        # sized off the source's length, not either side's page count: both
        # may hold spare pages, and copying those made the copy lopsided
        n = pages_for(src.stored_len, self._table.page_size)
        if len(dst.page_indices) < n:
            raise KVRefError(
                f"fork target holds {len(dst.page_indices)} pages, source "
                f"{from_label!r} needs {n}: the step was not admitted with this fork",
                request_id=rid,
                label=to_label,
            )
        if n:
            try:
                self._kv_cache.copy_pages(src.page_indices[:n], dst.page_indices[:n])
            except Exception as err:
                # the target may hold part of the source: nothing of it is
                # trustworthy, so it is emptied rather than left torn (R26)
                dst.stored_len = 0
                dst.generation += 1
                raise ForkFailed() from err
        dst.stored_len = src.stored_len
        dst.generation += 1
