"""Sliding-window retention defects, planted in kvref's manager, each found
by the retention lockstep (tests/conformance/test_retention_lockstep.py)
within the budget the clean manager passes (its BUDGET).

The four of specs/retention.md (issue 19's anchors, adapted to kvref):
(a) vLLM 42948, freed window pages cached; (b) SGLang PR 27586, a stale
window after a truncate or a fork; (c) vLLM 42571, a release list naming
the pages the window retired; (d) an off-by-one at the window's first page.
And the rollback margin's two (W15), found by the lockstep whose labels
keep one (its MARGIN scope): (e) a commit that releases from n - W, the
margin ignored; (f) a truncate checked against W + k, the margin counted
as window. And KV transfer's two (W16, W17): (g) a retrieve that keeps its
own released count, not the peer's; (h) a publish that names the retained
pages but not what was released.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from kvref.core.stream_table import Key, StreamTable
from kvref.core.streams import CacheStream
from kvref.manager import KVManager
from kvref.prefix import cache as prefix_cache
from kvref.stepping import truncation
from kvref.stepping.forks import Forks
from kvref.transfer.published import KVSequenceInfo, PublishedKVInfo
from kvref.transfer.retrieval import Retrieval
from tests.conformance.test_retention_lockstep import BUDGET, RetentionLockstep, with_margin

Plant = Callable[[pytest.MonkeyPatch], None]


def window_pages_cached(mp: pytest.MonkeyPatch) -> None:
    """(a) vLLM 42948: cache_prefix registers a windowed label's pages (W9
    off), so the window's release leaves them on the LRU as cached."""
    orig = prefix_cache.cache_prefix

    def bad(table: StreamTable, rid: str, label: str, tokens: object, start: int = 0) -> int:
        windows, table.windows = table.windows, {}
        try:
            return orig(table, rid, label, tokens, start)  # type: ignore[arg-type]
        finally:
            table.windows = windows

    mp.setattr(prefix_cache, "cache_prefix", bad)


def stale_window(mp: pytest.MonkeyPatch) -> None:
    """(b) SGLang PR 27586: the release works the window out from `position`,
    which a truncate and a fork leave stale (W4 off): the next commit frees
    a page of the window."""
    orig_truncate, orig_apply = truncation.truncate, Forks.apply

    def truncate(table: StreamTable, rid: str, label: str, new_len: int) -> int:
        stream = table.stream(rid, label)
        position = stream.position
        try:
            return orig_truncate(table, rid, label, new_len)
        finally:
            stream.position = position

    def apply(self: Forks, rid: str, from_label: str, to_label: str,
              created: set[Key], span: int = 0, copy: bool = False) -> None:
        dst = self._table.streams[rid][to_label]
        position = dst.position
        orig_apply(self, rid, from_label, to_label, created, span, copy)
        dst.position = position

    def retire(self: StreamTable, key: Key, stream: CacheStream) -> int:
        w = self.windows.get(key[1])
        if w is None:
            return 0
        ps = self.page_size
        # the commit's span moved position on from the stale value
        upto = min(max(0, stream.position - w) // ps, -(-stream.stored_len // ps))
        off = stream.released // ps
        if upto <= off:
            return 0
        go = stream.page_indices[:upto - off]
        stream.page_indices = stream.page_indices[upto - off:]
        stream.released = upto * ps
        return self.give_back(key, go)

    def add_position(self: object, step: object) -> None:
        # position moves by the span, not to the length
        for seg in step.segments:  # type: ignore[attr-defined]
            if seg.span:
                s = self._table.streams[seg.request_id][seg.label]  # type: ignore[attr-defined]
                if not s.offloaded:
                    s.stored_len += seg.span
                    s.position += seg.span
                    s.generation += 1
                    self._table.retire((seg.request_id, seg.label), s)  # type: ignore[attr-defined]

    from kvref.stepping.admit_plan_commit import Stepping
    mp.setattr(truncation, "truncate", truncate)
    mp.setattr(Forks, "apply", apply)
    mp.setattr(StreamTable, "retire", retire)
    mp.setattr(Stepping, "_add_spans", add_position)


RETIRED: dict[Key, list[int]] = {}


def release_lists_name_retired_pages(mp: pytest.MonkeyPatch) -> None:
    """(c) vLLM 42571: the eager-store list keeps the ids of the pages the
    window retired, and a remove's or an offload's release list names them
    again (W7 off)."""
    orig_retire = StreamTable.retire
    RETIRED.clear()

    def retire(self: StreamTable, key: Key, stream: CacheStream) -> int:
        before = list(stream.page_indices)
        freed = orig_retire(self, key, stream)
        gone = before[:len(before) - len(stream.page_indices)]
        RETIRED.setdefault(key, []).extend(gone)
        return freed

    orig_remove = KVManager.remove_request

    def remove(self: KVManager, rid: str) -> None:
        for label, s in self._streams.get(rid, {}).items():
            s.page_indices = s.page_indices + RETIRED.pop((rid, label), [])
        orig_remove(self, rid)

    mp.setattr(StreamTable, "retire", retire)
    mp.setattr(KVManager, "remove_request", remove)


def off_by_one_at_the_window(mp: pytest.MonkeyPatch) -> None:
    """(d) the release drops a page that *starts* before the window's first
    token f (ceil(f / ps) slots, not f // ps): token f is gone (W2 off)."""

    def retire(self: StreamTable, key: Key, stream: CacheStream) -> int:
        w = self.windows.get(key[1])
        if w is None:
            return 0
        ps = self.page_size
        upto = min(-(-max(0, stream.stored_len - w) // ps), -(-stream.stored_len // ps))
        off = stream.released // ps
        if upto <= off:
            return 0
        go = stream.page_indices[:upto - off]
        stream.page_indices = stream.page_indices[upto - off:]
        stream.released = upto * ps
        return self.give_back(key, go)

    mp.setattr(StreamTable, "retire", retire)


def margin_ignored(mp: pytest.MonkeyPatch) -> None:
    """(e) the commit releases from n - W (W15 off): a rollback of the
    margin's tokens is then refused, and the stream holds fewer pages."""
    orig = StreamTable.retire

    def retire(self: StreamTable, key: Key, stream: CacheStream) -> int:
        margins, self.margins = self.margins, {}
        try:
            return orig(self, key, stream)
        finally:
            self.margins = margins

    mp.setattr(StreamTable, "retire", retire)


def margin_counted_as_window(mp: pytest.MonkeyPatch) -> None:
    """(f) the truncate's check uses W + k, as configuring a larger window
    would (the example engine's finding): a rollback within the margin is
    refused with ReleasedPrefixError."""
    orig = truncation.truncate

    def truncate(table: StreamTable, rid: str, label: str, new_len: int) -> int:
        windows = table.windows
        table.windows = {lb: w + table.margins.get(lb, 0) for lb, w in windows.items()}
        try:
            return orig(table, rid, label, new_len)
        finally:
            table.windows = windows

    mp.setattr(truncation, "truncate", truncate)


MARGIN_PLANTS: dict[str, Plant] = {
    "(e) the rollback margin ignored at release": margin_ignored,
    "(f) the rollback margin counted as window by truncate": margin_counted_as_window,
}

def retrieve_ignores_released(mp: pytest.MonkeyPatch) -> None:
    """(g) the consumer keeps its own `released`, not the peer's (W16 off): it
    gives the slots the peer released pages, holding more than the window."""

    def own(self: Retrieval, label: str, stream: CacheStream | None,
            info: KVSequenceInfo) -> int:
        return stream.released if stream is not None else 0

    mp.setattr(Retrieval, "_released_after", own)


def publish_forgets_released(mp: pytest.MonkeyPatch) -> None:
    """(h) publish names the retained pages but says nothing was released
    (W17 off): read by position, each page would be taken for an earlier slot;
    the consumer must refuse it."""
    orig = Retrieval.publish

    def publish(self: Retrieval, rid: str) -> object:
        pub = orig(self, rid)
        if isinstance(pub, PublishedKVInfo):
            for info in pub.get(0).values():
                info.released = 0
        return pub

    mp.setattr(Retrieval, "publish", publish)


PLANTS: dict[str, Plant] = {
    "(a) window pages cached (vLLM 42948)": window_pages_cached,
    "(b) a stale window after truncate or fork (SGLang PR 27586)": stale_window,
    "(c) a release list naming retired pages (vLLM 42571)": release_lists_name_retired_pages,
    "(d) an off-by-one at the window's first page": off_by_one_at_the_window,
    "(g) a retrieve that ignores the peer's released prefix": retrieve_ignores_released,
    "(h) a publish that forgets its released prefix": publish_forgets_released,
}


# each plant against the machine whose scope shows it: the margin's plants
# need a margin to break, the others the plain windows
MACHINES: dict[str, Callable[[], RetentionLockstep]] = {
    "plain": RetentionLockstep, "margin": with_margin}
CASES = [("plain", name) for name in PLANTS] + [("margin", name) for name in MARGIN_PLANTS]


@pytest.mark.parametrize("machine", list(MACHINES))
def test_the_clean_manager_passes(machine: str) -> None:
    run_state_machine_as_test(MACHINES[machine], settings=BUDGET)


@pytest.mark.parametrize(("machine", "name"), CASES)
def test_plant_is_found(machine: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    {**PLANTS, **MARGIN_PLANTS}[name](monkeypatch)
    with pytest.raises((AssertionError, Flaky)):
        run_state_machine_as_test(MACHINES[machine], settings=BUDGET)
