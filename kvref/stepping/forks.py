"""Forks: copy one stream of a request onto another, over pages admit reserved.

Pre-forks run at plan (or at a commit without a plan, R24), post-forks at
commit after the spans land. A copy that fails empties its target and the
other forks still run; the first failure is raised as `ForkCopyError` (R26).
Called under the stream table's lock.

With shared pages (`kvref.core.sharing.PrefixSharing`) a fork is copy on
write (R51): the target takes a reference on each of the source's full
pages and copies only the partly filled last one, so a fork of a 2,048
token stream at page size 16 copies one page, not 128. A write never lands
in a page with another holder or a prefix-cache key: the one page a write
could find so (a partial last page, after a truncate into a shared one) is
copied first by `copy_on_write`, at the admit that reserved its page (R52).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvref.core.cache import KVCache
from kvref.core.errors import ForkCopyError, KVRefError
from kvref.core.groups import GROUP_SEP
from kvref.core.stream_table import Key, StreamTable, pages_for
from kvref.core.streams import CacheStream
from kvref.stepping.running_step import RunningStep
from kvref.stepping.step import KVStep


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
        if not forks:
            return  # a step with no fork (every decode step) does no fork work
        failed: list[tuple[Key, BaseException]] = []
        pre = forks is running.step.pre_forks
        # a segment on a pre-fork target grows it from the forked length (R9)
        spans = {(g.request_id, g.label): g.span for g in running.step.segments} if pre else {}
        # a hybrid label's fork is one per group (H1): once a copy of it
        # fails, its target in every later group is emptied, not forked, so
        # the label's groups stay alike (each group's fork follows group 0's)
        torn: set[tuple[str, str, str]] = set()
        for from_label, to_label in forks:
            for rid in running.padded:
                pair = (rid, from_label.split(GROUP_SEP, 1)[0], to_label.split(GROUP_SEP, 1)[0])
                if GROUP_SEP in to_label and pair in torn and self.tear(
                        rid, from_label, to_label, running.created):
                    continue
                try:
                    self.apply(rid, from_label, to_label, running.created,
                               spans.get((rid, to_label), 0), copy=running.copy_forks)
                except ForkFailed as err:
                    failed.append(((rid, to_label), err.__cause__ or err))
                    if GROUP_SEP not in to_label:
                        torn.add(pair)
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
                    continue  # a source this admit created, still empty, copies nothing (R20)
                unfilled.discard((rid, to_label))
                lengths[(rid, to_label)] = n
        return lengths

    def tear(self, rid: str, from_label: str, to_label: str, created: set[Key]) -> bool:
        """A group's fork whose label's copy failed in an earlier group: its
        target emptied as the failed copy left that group's. False where
        the fork moves nothing (R20), as the failed one would not have."""
        streams = self._table.streams[rid]
        if (rid, from_label) in created and streams[from_label].stored_len == 0:
            return False
        created.discard((rid, to_label))
        self._emptied(rid, to_label, streams[to_label])
        return True

    def apply(self, rid: str, from_label: str, to_label: str, created: set[Key],
              span: int = 0, copy: bool = False) -> None:
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
        # retained slots only: the source's released ones hold no page
        n = pages_for(src.stored_len, self._table.page_size) - (
            src.released // self._table.page_size)
        if copy:  # a preplan's fork: its views name the target's own pages (R57)
            self._copy(rid, from_label, to_label, n)
        else:
            self._table.sharing.fork(lambda: self._share(rid, from_label, to_label, span),
                                     lambda: self._copy(rid, from_label, to_label, n))
        # W5: the target inherits the retention state (its released prefix and
        # the position the next commit's release is worked out from)
        dst.fork_from(src, src.space or from_label, self._table.page_size)

    def _copy(self, rid: str, from_label: str, to_label: str, n: int) -> None:
        """The copying fork: the source's first ``n`` retained pages into the
        target's own, which admit reserved."""
        streams = self._table.streams[rid]
        src, dst = streams[from_label], streams[to_label]
        if len(dst.page_indices) < n:
            raise KVRefError(
                f"fork target holds {len(dst.page_indices)} pages, source "
                f"{from_label!r} needs {n}: the step was not admitted with this fork",
                request_id=rid,
                label=to_label,
            )
        if not n:
            return
        try:
            self._kv_cache.copy_pages(src.page_indices[:n], dst.page_indices[:n])
        except Exception as err:
            # the target may hold part of the source: nothing of it is
            # trustworthy, so it is emptied rather than left torn (R26)
            self._emptied(rid, to_label, dst)
            raise ForkFailed() from err

    def _share(self, rid: str, from_label: str, to_label: str, span: int = 0) -> None:
        """The copy-on-write fork (R51): the target takes references on the
        source's full pages, keeps the pages private to it after them (admit
        reserved what its length past the full pages needs, ``span`` tokens of
        a segment after a pre-fork included), copies the source's partial page
        into the first of them, and lets go of its surplus beyond its old
        high-water mark."""
        table = self._table
        src = table.streams[rid][from_label]
        dst = table.streams[rid][to_label]
        dkey = (rid, to_label)
        full, partial = divmod(src.stored_len, table.page_size)
        off = src.released // table.page_size  # the source's released slots
        private = table.pages.private_pages(dkey, dst.page_indices)
        keep = [p for p, mine in zip(dst.page_indices, private, strict=True) if mine]
        drop = [p for p, mine in zip(dst.page_indices, private, strict=True) if not mine]
        need = pages_for(src.stored_len + span, table.page_size) - full
        if len(keep) < need:
            raise KVRefError(
                f"fork target holds {len(keep)} private pages, needs {need} past the "
                f"{full} it shares from {from_label!r}: the step was not admitted with "
                "this fork", request_id=rid, label=to_label)
        if partial:
            try:
                self._kv_cache.copy_pages([src.page_indices[full - off]], [keep[0]])
            except Exception as err:
                self._emptied(rid, to_label, dst)
                raise ForkFailed() from err
        table.give_back(dkey, drop)
        shared = src.page_indices[:full - off]
        table.pages.share(dkey, shared)
        # the table keeps its length where it can: spare pages stay spare
        tail = max(need, len(keep) - full)
        table.give_back(dkey, keep[tail:])
        dst.adopt_fork_pages(shared + keep[:tail])

    def _emptied(self, rid: str, label: str, dst: CacheStream) -> None:
        """A target a failed copy left torn: empty, holding only private pages."""
        dst.empty_torn()
        self._table.sharing.release_shared((rid, label), dst,
                                           head_first=self._table.head_first(label))

    def privatise(self, rid: str, label: str) -> None:
        """Copy every page of the stream that another holds or the cache names
        into a fresh one of its own (admit reserved them), in place in its
        table: a preplanned fork will copy into these pages (R57). A copy that
        raises gives back what this call took and changes nothing."""
        table = self._table
        key = (rid, label)
        stream = table.streams[rid][label]
        pages = list(stream.page_indices)
        private = table.pages.private_pages(key, pages)
        shared = [i for i, mine in enumerate(private) if not mine]
        if not shared:
            return
        fresh = table.take(key, len(shared))
        try:
            self._kv_cache.copy_pages([pages[i] for i in shared], fresh)
        except Exception as err:
            table.give_back(key, fresh)
            raise KVRefError(f"copying shared pages into private ones failed "
                             f"({type(err).__name__}: {err}); nothing changed",
                             request_id=rid, label=label) from err
        old = [pages[i] for i in shared]
        for i, p in zip(shared, fresh, strict=True):
            pages[i] = p
        table.give_back(key, old)
        stream.rehome_pages(pages)

    def copy_page_head(self, src: int, dst: int, slots: int) -> None:
        """`KVCache.copy_page_head`: a retrieve's copy-on-write (R52), whose
        page the copy names before it starts and takes once it started."""
        self._kv_cache.copy_page_head(src, dst, slots)

    def copy_on_write(self, rid: str, label: str) -> None:
        """Give the stream a private copy of its partial last page, which it
        shares or which is registered, before a write lands in it (R52).
        Admit reserved the page. A copy that raises changes nothing."""
        table = self._table
        key = (rid, label)
        stream = table.streams[rid][label]
        i = (stream.stored_len - stream.released) // table.page_size
        old = stream.page_indices[i]
        (new,) = table.take(key, 1)
        try:
            self._kv_cache.copy_pages([old], [new])
        except Exception as err:
            table.give_back(key, [new])
            raise KVRefError(f"copy-on-write of page {old} failed ({type(err).__name__}: "
                             f"{err}); nothing changed", request_id=rid, label=label) from err
        pages = list(stream.page_indices)
        pages[i] = new
        table.give_back(key, [old])
        stream.rehome_pages(pages)
