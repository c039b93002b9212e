"""`KVManager.cache_prefixes`: the pages of many streams keyed as they fill,
in one call per step (issue 28 part 2, specs/shared-pages.md S31)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref import KVManager
from kvref.core.errors import (
    InvalidArgumentError,
    KVRefError,
    StepInFlightError,
    UnknownRequestError,
)
from kvref.testing.page_checks import check_device_pages
from tests.unit._manager_fixtures import Driver, make_manager

PS = 4
IDS = {rid: list(range(base, base + 40)) for rid, base in (("a", 100), ("b", 500), ("c", 900))}


def _mgr() -> tuple[KVManager, Driver]:
    mgr = make_manager(page_size=PS, pages=64)
    return mgr, Driver(mgr)


def _state(mgr: KVManager) -> tuple[Any, ...]:
    streams = tuple((rid, label, tuple(s.keys), bytes(s.key_tokens))
                    for rid, by in sorted(mgr._streams.items()) for label, s in sorted(by.items()))
    return streams, mgr.num_free_pages, mgr.num_cached_pages, mgr._table.pages.snapshot()


def _two_written_b_keyed() -> KVManager:
    """Requests a and b with 12 tokens written each, b's first 8 keyed: the
    state the refusal tests start from."""
    mgr, drv = _mgr()
    for r in ("a", "b"):
        drv.ingest(r)
    drv.step([("a", "main", 12), ("b", "main", 12)])
    assert mgr.cache_prefix("b", "main", IDS["b"][:8]) == 2
    return mgr


def _decode(drv: Driver, rids: list[str], n: int) -> None:
    for _ in range(n):
        drv.step([(r, "main", 1) for r in rids])


def test_keys_what_one_cache_prefix_per_stream_keys() -> None:
    """Page by page as decode fills them, the batch leaves every stream and
    the pool as a `cache_prefix` per stream would (the same keys, the same
    counts), and the keyed pages are found by a later prompt."""
    rids = ["a", "b", "c"]
    (one, d1), (many, d2) = _mgr(), _mgr()
    for drv in (d1, d2):
        for r in rids:
            drv.ingest(r)
    for n in range(1, 21):
        _decode(d1, rids, 1)
        _decode(d2, rids, 1)
        if n % PS:
            continue
        # the engine names the page that filled, from where the keyed pages end
        calls = [(r, "main", IDS[r][n - PS:n], one.cached_tokens(r)) for r in rids]
        got = [one.cache_prefix(r, lb, ids, start=st) for r, lb, ids, st in calls]
        assert many.cache_prefixes(calls) == got == [1, 1, 1]
        assert _state(many) == _state(one)
    check_device_pages(many)
    many.ingest_request("z")
    assert many.match_prefix("z", "main", [*IDS["b"][:20], 0]) == 20
    # longer runs, and a call that keys nothing, go through the general path
    assert many.cache_prefixes([("a", "main", IDS["a"][:20], 0), ("c", "main", [], 20)]) \
        == [0, 0]


def test_a_run_of_pages_and_an_empty_batch() -> None:
    mgr, drv = _mgr()
    drv.ingest("a")
    drv.step([("a", "main", 13)])
    assert mgr.cache_prefixes([]) == []
    assert mgr.cache_prefixes([("a", "main", IDS["a"][:13], 0)]) == [3]
    assert mgr.cached_tokens("a") == 12


@pytest.mark.parametrize("bad, err, match", [
    ("not a list", InvalidArgumentError, "sequence"),
    ([("a", "main", [1, 2, 3, 4])], InvalidArgumentError, "entry 1"),
    ([["b", "main", [1], 0]], InvalidArgumentError, "entry 1"),
    ([(7, "main", [], 0)], InvalidArgumentError, "request id"),
    ([("b", 3, [], 0)], InvalidArgumentError, "label"),
    ([("b", "main", IDS["b"][8:12], 8), ("b", "main", IDS["b"][8:12], 8)],
     InvalidArgumentError, "previous entry"),
    ([("b", "main", IDS["b"][8:16], 8)], InvalidArgumentError, "committed 12"),
    ([("b", "main", IDS["b"][:4], 2)], InvalidArgumentError, "whole number of pages"),
    ([("b", "main", IDS["b"][:4], True)], InvalidArgumentError, "whole number of pages"),
    ([("b", "main", IDS["b"][12:12], 12)], InvalidArgumentError, "cached pages end at 8"),
    ([("b", "main", [7] * 12, 0)], InvalidArgumentError, "otherwise"),
    ([("b", "main", ["x"] * 4, 8)], InvalidArgumentError, "64-bit"),
    ([("zz", "main", [], 0)], UnknownRequestError, "unknown request"),
    ([("b", "nope", [], 0)], UnknownRequestError, "no such label"),
])
def test_a_misuse_in_any_entry_changes_nothing(bad: Any, err: type[Exception],
                                                match: str) -> None:
    """Every entry is checked before any page is keyed: a misuse in the
    second entry leaves the first's pages unkeyed too."""
    mgr = _two_written_b_keyed()
    before = _state(mgr)
    good = ("a", "main", IDS["a"][:12], 0)
    calls = bad if isinstance(bad, str) else [good, *bad]
    with pytest.raises(err, match=match):
        mgr.cache_prefixes(calls)
    assert _state(mgr) == before
    check_device_pages(mgr)


@pytest.mark.parametrize("bad, match", [
    ([("b", "main", IDS["b"][8:12], 8), ("b", "main", IDS["b"][8:12], 8)], "previous entry"),
    ([("b", "main", [True, *IDS["b"][9:12]], 8)], "bool"),
    ([("b", "main", [*IDS["b"][8:11], 1 << 64], 8)], "64-bit"),
    ([("b", "main", [*IDS["b"][8:11], 2.0], 8)], "64-bit"),
])
def test_a_misuse_among_single_pages_changes_nothing(bad: Any, match: str) -> None:
    """A batch of one filled page per stream (the one-pass path) refuses as
    the general path does, a stream named twice and ids that are not plain
    64-bit ints included, changing nothing."""
    mgr = _two_written_b_keyed()
    before = _state(mgr)
    with pytest.raises(InvalidArgumentError, match=match):
        mgr.cache_prefixes([("a", "main", IDS["a"][:4], 0), *bad])
    assert _state(mgr) == before
    # the same batch, right, keys both pages
    assert mgr.cache_prefixes([("a", "main", IDS["a"][:4], 0),
                               ("b", "main", IDS["b"][8:12], 8)]) == [1, 1]


@pytest.mark.parametrize("page, match", [
    ([*IDS["b"][8:11], True], "bool"),
    ([np.bool_(False), *IDS["b"][9:12]], "bool"),
    ([*IDS["b"][8:11], torch.tensor(True)], "bool"),
    ([*IDS["b"][8:11], 1 << 64], "64-bit"),
    ([*IDS["b"][8:11], 2.0], "64-bit"),
    (IDS["b"][9:13], "committed"),  # start 12: ids past the 12 committed
])
def test_one_page_cache_prefix_refuses_as_the_general_path(page: list[Any], match: str) -> None:
    """`cache_prefix` of the one page after the chain takes the one-pass path;
    a page it must refuse (a bool of any kind, an id that is not a 64-bit
    int, ids past the committed tokens) raises there as through the general
    path, changing nothing; the right page keys one."""
    mgr = _two_written_b_keyed()
    before = _state(mgr)
    with pytest.raises(InvalidArgumentError, match=match):
        mgr.cache_prefix("b", "main", page, start=8 if page[0] != IDS["b"][9] else 12)
    assert _state(mgr) == before
    assert mgr.cache_prefix("b", "main", IDS["b"][8:12], start=8) == 1
    assert mgr.cached_tokens("b") == 12
    check_device_pages(mgr)


def test_a_stream_a_preplanned_fork_copies_into_is_refused() -> None:
    """R57, as `cache_prefix`: nothing keys a page a staged fork will copy into."""
    from kvref import KVStep, Segment, StepContext
    mgr, drv = _mgr()
    drv.ingest("a")
    drv.step([("a", "main", 8)])
    mgr.admit(KVStep([Segment("a", "main", 1)]), StepContext(("a",)))
    pre = KVStep([Segment("a", "main", 1)], post_forks=[("main", "s1")])
    assert mgr.admit(pre, StepContext(("a",), is_preplan=True)).ok
    with pytest.raises(StepInFlightError, match="R57"):
        mgr.cache_prefixes([("a", "main", IDS["a"][:8], 0), ("a", "s1", [], 0)])
    assert mgr.cached_tokens("a") == 0


@pytest.mark.parametrize("same_ids", [True, False])
def test_two_streams_naming_one_shared_page_as_one_call_per_stream(same_ids: bool) -> None:
    """A fork's streams share their first full page: a batch naming it for
    both does what a `cache_prefix` per stream does, the same ids keying it
    once, other ids refused after the first kept its key (S23's register)."""
    states = []
    for batched in (False, True):
        mgr, drv = _mgr()
        drv.ingest("a")
        drv.step([("a", "main", 6)], post_forks=[("main", "s1")])
        s1_ids = IDS["a"][:4] if same_ids else [7] * 4
        calls = [("a", "main", IDS["a"][:4], 0), ("a", "s1", s1_ids, 0)]
        try:
            got: Any = (mgr.cache_prefixes(calls) if batched
                        else [mgr.cache_prefix(r, lb, ids, start=st) for r, lb, ids, st in calls])
        except KVRefError as err:  # the same refusal either way
            got = (type(err).__name__, str(err))
        states.append((got, _state(mgr)))
    assert states[0] == states[1]
    if same_ids:
        # S23 counts the pages the call made findable: the second stream's
        # page was keyed by the first call already
        assert states[0][0] == [1, 0]
    else:
        assert states[0][0][0] == "PageRegisterError", states[0][0]


_VARIANTS = ("page", "page", "page", "start past", "bool", "float", "past 64 bits",
             "no label", "other ids", "two pages", "from 0", "unknown", "last a bool",
             "numpy bool", "torch bool", "numpy ints", "ids 0 and 1")


def _entry(mgr: KVManager, rid: str, variant: str) -> tuple[Any, ...]:
    """One entry of a batch: the page after the stream's chain, or that page
    with one defect (or a legal entry the one-pass path leaves alone)."""
    c = mgr.cached_tokens(rid)
    ids = IDS[rid][c:c + PS]
    if variant == "start past":
        return (rid, "main", ids, c + PS)
    if variant == "bool":
        return (rid, "main", [True, *ids[1:]], c)
    if variant == "last a bool":
        return (rid, "main", [*ids[:-1], False], c)
    if variant == "numpy bool":
        return (rid, "main", [*ids[:-1], np.True_], c)
    if variant == "torch bool":
        return (rid, "main", [*ids[:-1], torch.tensor(False)], c)
    if variant == "numpy ints":  # ints all the same: keyed as the plain ones
        return (rid, "main", [np.int64(t) for t in ids], c)
    if variant == "ids 0 and 1":  # plain ints a bool packs like
        return (rid, "main", [*ids[:-2], 0, 1], c)
    if variant == "float":
        return (rid, "main", [*ids[:-1], 2.0], c)
    if variant == "past 64 bits":
        return (rid, "main", [*ids[:-1], 1 << 64], c)
    if variant == "no label":
        return (rid, "nope", ids, c)
    if variant == "other ids" and c:
        return (rid, "main", [7] * PS, c - PS)
    if variant == "two pages":
        return (rid, "main", IDS[rid][c:c + 2 * PS], c)
    if variant == "from 0":
        return (rid, "main", IDS[rid][:c + PS], 0)
    if variant == "unknown":
        return ("zz", "main", ids, c)
    return (rid, "main", ids, c)


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_the_one_pass_path_answers_as_the_general_path(data: st.DataObject) -> None:
    """Differential: a batch as a list (the one-pass path, where it applies)
    and the same batch as a tuple (always the general path, entry by entry)
    leave two managers that took the same steps with the same answer or the
    same refusal, and in the same state. Batches are mostly one page per
    stream, at or past its commit, some entries with a defect the one-pass
    path must hand over: a start off the chain, a bool (a Python, numpy or
    torch one, first or last), a float, an id past 64 bits, an unknown label
    or request, ids unlike a keyed page's, a run of two pages, a stream named
    twice; and ids it may key as the general path does (numpy ints, plain
    ids 0 and 1, which pack as bools do)."""
    (fast, d1), (slow, d2) = _mgr(), _mgr()
    rids = ["a", "b", "c"]
    for drv in (d1, d2):
        drv.ingest(*rids)

    def outcome(mgr: KVManager, batch: Any) -> tuple[Any, ...]:
        before = _state(mgr)
        try:
            return ("counts", mgr.cache_prefixes(batch))
        except KVRefError as err:
            assert _state(mgr) == before, "a refused batch changed the manager"
            return (type(err).__name__, str(err))

    for _ in range(data.draw(st.integers(1, 6), label="rounds")):
        segs = [(r, "main", n) for r in rids
                if (n := data.draw(st.integers(0, 5), label=f"tokens of {r}"))]
        if segs:
            d1.step(segs)
            d2.step(segs)
        named = data.draw(st.lists(st.sampled_from(rids), max_size=4), label="streams")
        calls = [_entry(fast, r, data.draw(st.sampled_from(_VARIANTS), label="entry"))
                 for r in named]
        got = outcome(fast, list(calls))
        assert got == outcome(slow, tuple(calls)), calls
        assert _state(fast) == _state(slow)
    check_device_pages(fast)
