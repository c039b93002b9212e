"""`KVManager.follow_tokens`: pages keyed as they fill, by the commits, from
the engine's own list of ids (issue 28 part 2, specs/shared-pages.md S33).
The lockstep runs it against the model (`FollowTokens`, `Commit`); these
pin its contract at the manager."""

from __future__ import annotations

import logging
import struct
from typing import Any

import pytest

from kvref import KVManager
from kvref.core.errors import (
    InvalidArgumentError,
    StreamUnavailableError,
    UnknownRequestError,
)
from kvref.prefix import follow
from kvref.testing.page_checks import check_device_pages
from tests.unit._manager_fixtures import Driver, make_manager
from tests.unit.test_cache_prefixes import IDS, PS, _decode, _mgr, _state


def _followed(mgr: KVManager, rid: str, label: str = "main") -> bool:
    return mgr.observe().requests[rid][label].followed


def test_commits_key_what_a_cache_prefix_after_each_commit_keys() -> None:
    """Decode one token a step, then a chunk of several pages: the followed
    manager ends every commit where a careful engine's `cache_prefix` of the
    committed ids leaves the other (the same keys, ids, pages and pool)."""
    rids = ["a", "b", "c"]
    (called, d1), (followed, d2) = _mgr(), _mgr()
    for drv in (d1, d2):
        drv.ingest(*rids)
    lists = {r: IDS[r][:0] for r in rids}
    for r in rids:
        assert followed.follow_tokens(r, lists[r]) == 0
        assert _followed(followed, r)
    for n in range(1, 15):
        for r in rids:
            lists[r].append(IDS[r][n - 1])  # the engine appends the step's input id
        _decode(d1, rids, 1)
        _decode(d2, rids, 1)
        for r in rids:
            called.cache_prefix(r, "main", IDS[r][:n])
        assert _state(followed) == _state(called), n
    # a chunk of 9 tokens fills two pages past the chain at once (the general path)
    for r in rids:
        lists[r].extend(IDS[r][14:23])
    d1.step([(r, "main", 9) for r in rids])
    d2.step([(r, "main", 9) for r in rids])
    for r in rids:
        called.cache_prefix(r, "main", IDS[r][:23])
    assert _state(followed) == _state(called)
    assert followed.cached_tokens("a") == 20
    check_device_pages(followed)
    followed.ingest_request("z")
    assert followed.match_prefix("z", "main", [*IDS["b"][:20], 0]) == 20


def test_a_step_that_fills_no_page_looks_at_no_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit asks the keying only of the streams whose length reached
    the end of the page after their chain: none on a step filling no page."""
    mgr, drv = _mgr()
    drv.ingest("a", "b")
    drv.step([("a", "main", 5), ("b", "main", 6)])
    mgr.follow_tokens("a", IDS["a"])
    mgr.follow_tokens("b", IDS["b"])
    seen: list[list[str]] = []
    real = follow.key_followed

    def spy(table: Any, due: list[Any], unkeyable: Any) -> None:
        seen.append(sorted(s.follow.request_id for s in due))
        real(table, due, unkeyable)

    monkeypatch.setattr(follow, "key_followed", spy)
    for _ in range(4):
        drv.step([("a", "main", 1), ("b", "main", 1)])
    # a reaches 8 on the third step, b on the second; nothing else is looked at
    assert seen == [["b"], ["a"]]
    assert (mgr.cached_tokens("a"), mgr.cached_tokens("b")) == (8, 8)


def test_ids_past_the_committed_tokens_are_never_read() -> None:
    """The engine's list may run ahead (the next input, a draft before its
    verify): only committed pages are keyed, and a rejected draft truncated
    from the stream and the list alike leaves no key over it (R56)."""
    mgr, drv = _mgr()
    drv.ingest("a")
    ids = list(IDS["a"][:6])
    drv.step([("a", "main", 6)])
    assert mgr.follow_tokens("a", ids) == 1
    ids += [7, 7, 7]  # drafts, not committed
    assert mgr.cached_tokens("a") == 4
    drv.step([("a", "main", 3)])  # the drafts' KV written: 9 tokens, page 2 full
    assert mgr.cached_tokens("a") == 8
    mgr.truncate("a", "main", 6)  # the verify rejected them
    del ids[6:]
    del drv.model[("a", "main")][6:]
    assert mgr.cached_tokens("a") == 4
    ids += IDS["a"][6:9]
    drv.step([("a", "main", 3)])
    assert mgr.cached_tokens("a") == 8
    mgr.ingest_request("z")
    # the page is keyed under the accepted ids, not the drafts
    assert mgr.match_prefix("z", "main", [*IDS["a"][:8], 0]) == 8


@pytest.mark.parametrize("ids, err, match", [
    ("abcd", InvalidArgumentError, "sequence"),
    (None, InvalidArgumentError, "sequence"),
    (7, InvalidArgumentError, "sequence"),
    ([9] * 12, InvalidArgumentError, "otherwise"),
    ([True, *IDS["b"][1:12]], InvalidArgumentError, "bool"),
    ([*IDS["b"][:8], 1.5, 0, 0, 0], InvalidArgumentError, "64-bit"),
])
def test_a_misuse_changes_nothing_and_follows_nothing(ids: Any, err: type[Exception],
                                                     match: str) -> None:
    """`follow_tokens` refuses as `cache_prefix` of the committed ids does
    (ids that disagree with the keyed pages, ids that are not 64-bit ints),
    and refuses what is not a sequence, changing nothing: the stream stays
    unfollowed."""
    mgr, drv = _mgr()
    drv.ingest("b")
    drv.step([("b", "main", 12)])
    assert mgr.cache_prefix("b", "main", IDS["b"][:8]) == 2
    before = _state(mgr)
    with pytest.raises(err, match=match):
        mgr.follow_tokens("b", ids)
    assert _state(mgr) == before
    assert not _followed(mgr, "b")


def test_unknown_and_offloaded_streams_are_refused() -> None:
    mgr = make_manager(page_size=PS, pages=64, cpu_pages=8)
    drv = Driver(mgr)
    drv.ingest("a")
    drv.step([("a", "main", 8)])
    with pytest.raises(UnknownRequestError):
        mgr.follow_tokens("nobody", [])
    with pytest.raises(UnknownRequestError):
        mgr.follow_tokens("a", [], "nope")
    with pytest.raises(InvalidArgumentError):
        mgr.follow_tokens(3, [])  # type: ignore[arg-type]
    assert mgr.offload("a") == 2
    with pytest.raises(StreamUnavailableError):
        mgr.follow_tokens("a", IDS["a"])
    assert not _followed(mgr, "a")


def test_drafts_wait_for_their_verify(caplog: pytest.LogCaptureFixture) -> None:
    """A verify step commits the drafts' KV before the engine knows which it
    keeps; its list holds only the kept tokens, so their pages wait, quietly,
    and the first commit after the engine appended the kept ones keys them."""
    mgr, drv = _mgr()
    drv.ingest("a")
    ids = list(IDS["a"][:3])
    drv.step([("a", "main", 3)])
    mgr.follow_tokens("a", ids)
    with caplog.at_level(logging.WARNING, logger="kvref.prefix.follow"):
        drv.step([("a", "main", 4)])  # the last input and three drafts
    assert (mgr.stored_len("a"), mgr.cached_tokens("a"), caplog.text) == (7, 0, "")
    mgr.truncate("a", "main", 5)  # the first draft kept, the other two not
    del drv.model[("a", "main")][5:]
    ids += IDS["a"][3:6]  # the kept ones and the target's own next token
    drv.step([("a", "main", 1)])
    assert mgr.cached_tokens("a") == 4
    check_device_pages(mgr)


@pytest.mark.parametrize("bad", [True, 2.5, 1 << 64, "x"])
def test_ids_a_commit_cannot_key_are_logged_and_left(
        bad: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The step is committed whatever its ids: a page whose ids are not
    64-bit ints is left unkeyed, with a warning naming the stream, and the
    other streams of the step are keyed as ever."""
    mgr, drv = _mgr()
    drv.ingest("a", "b")
    a_ids, b_ids = list(IDS["a"][:3]), list(IDS["b"][:3])
    drv.step([("a", "main", 3), ("b", "main", 3)])
    mgr.follow_tokens("a", a_ids)
    mgr.follow_tokens("b", b_ids)
    a_ids.append(bad)
    b_ids.append(IDS["b"][3])
    with caplog.at_level(logging.WARNING, logger="kvref.prefix.follow"):
        drv.step([("a", "main", 1), ("b", "main", 1)])
    assert (mgr.stored_len("a"), mgr.cached_tokens("a"), mgr.cached_tokens("b")) == (4, 0, 4)
    assert "request 'a'" in caplog.text
    check_device_pages(mgr)


def test_following_lasts_through_a_reset_and_an_offload() -> None:
    """A reset request recomputes from its list, and a reloaded one goes on
    keying from where its chain was cut (S29, S33)."""
    mgr = make_manager(page_size=PS, pages=64, cpu_pages=8)
    drv = Driver(mgr)
    drv.ingest("a")
    ids = list(IDS["a"][:6])
    drv.step([("a", "main", 6)])
    mgr.follow_tokens("a", ids)
    mgr.reset_request("a", free=True)
    drv.model[("a", "main")] = []
    assert _followed(mgr, "a") and mgr.cached_tokens("a") == 0
    drv.step([("a", "main", 6)])
    assert mgr.cached_tokens("a") == 4
    assert mgr.offload("a") > 0
    assert _followed(mgr, "a") and mgr.cached_tokens("a") == 0
    assert mgr.reload("a")
    ids += IDS["a"][6:8]
    drv.step([("a", "main", 2)])
    assert mgr.cached_tokens("a") == 8
    check_device_pages(mgr)


def test_with_the_cache_off_or_a_windowed_label_nothing_is_followed() -> None:
    mgr = make_manager(page_size=PS, pages=64, sharing=False)
    drv = Driver(mgr)
    drv.ingest("a")
    drv.step([("a", "main", 8)])
    assert mgr.follow_tokens("a", IDS["a"]) == 0
    assert not _followed(mgr, "a")
    drv.step([("a", "main", 4)])
    assert mgr.cached_tokens("a") == 0


def test_the_handed_over_partial_page_is_not_packed_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The committed ids past the chain at hand-over were checked and packed
    then: the page they begin is keyed from those bytes and only the ids
    appended since are packed (issue 42). A truncate into that page drops
    them: the engine decides those tokens again, and the page is keyed from
    its new ids, as a `cache_prefix` of them keys it."""
    (mgr, drv), (ref, rdrv) = _mgr(), _mgr()
    for d in (drv, rdrv):
        d.ingest("a", "b")
        d.step([("a", "main", 6), ("b", "main", 6)])
    a_ids, b_ids = list(IDS["a"][:6]), list(IDS["b"][:6])
    mgr.follow_tokens("a", a_ids)
    mgr.follow_tokens("b", b_ids)
    heads = {r: mgr._streams[r]["main"].follow for r in ("a", "b")}
    assert [(f.head, f.head_at) for f in heads.values() if f is not None] == [
        (struct.pack("<2q", *IDS[r][4:6]), 4) for r in ("a", "b")]
    packed: list[int] = []
    real = follow.prefix_hash.page_packer

    def counting(n: int) -> Any:
        if n < PS:  # a part of a page (a whole page's packer is built once, kept)
            packed.append(n)
        return real(n)

    monkeypatch.setattr(follow.prefix_hash, "page_packer", counting)
    # b: truncated into its partial page, then decided otherwise
    mgr.truncate("b", "main", 5)
    ref.truncate("b", "main", 5)
    del drv.model[("b", "main")][5:], rdrv.model[("b", "main")][5:]
    del b_ids[5:]
    assert mgr._streams["b"]["main"].follow.head == b""  # type: ignore[union-attr]
    b_ids.append(7)
    for d in (drv, rdrv):
        d.step([("b", "main", 1)])
    a_ids += IDS["a"][6:8]
    b_ids += [8, 9]
    for d in (drv, rdrv):
        d.step([("a", "main", 2), ("b", "main", 2)])
    # a: only the two ids appended since; b's head went with the truncate,
    # so its page was packed whole (by the page's own packer, not counted)
    assert packed == [2]
    ref.cache_prefix("a", "main", a_ids)
    ref.cache_prefix("b", "main", b_ids)
    assert _state(mgr) == _state(ref)
    # a decode step of one token filling a handed-over page
    c_ids = list(IDS["c"][:7])
    for d in (drv, rdrv):
        d.ingest("c")
        d.step([("c", "main", 7)])
    mgr.follow_tokens("c", c_ids)
    c_ids.append(IDS["c"][7])
    for d in (drv, rdrv):
        d.step([("c", "main", 1)])
    # c: its three committed ids past the chain packed once, at hand-over;
    # then the one id appended, not the page's four
    assert packed == [2, 3, 1]
    ref.cache_prefix("c", "main", c_ids)
    assert _state(mgr) == _state(ref) and mgr.cached_tokens("c") == 8


def test_ids_past_the_committed_tokens_at_hand_over_are_read_at_their_commit() -> None:
    """An engine may hand over a buffer it fills in place (placeholders past
    the committed tokens, as vLLM's input batch keeps its token ids): those
    ids were never checked nor packed at hand-over (R56), so each commit
    keys the ids the list holds then, not what it held at hand-over (S33),
    in one-token decode steps (the one-pass path) and in a chunk (the
    general path)."""
    (mgr, drv), (ref, rdrv) = _mgr(), _mgr()
    for d in (drv, rdrv):
        d.ingest("a")
        d.step([("a", "main", 6)])
    real = IDS["a"]
    buf = [*real[:6], *[0] * 18]  # 6 committed ids, then placeholders
    assert mgr.follow_tokens("a", buf) == 1
    for n in range(6, 13):  # the engine writes each step's input before it
        buf[n] = real[n]
        for d in (drv, rdrv):
            d.step([("a", "main", 1)])
        ref.cache_prefix("a", "main", real[:n + 1])
        assert _state(mgr) == _state(ref), n
    assert mgr.cached_tokens("a") == 12
    buf[13:21] = real[13:21]
    for d in (drv, rdrv):
        d.step([("a", "main", 8)])  # 21 tokens: two more pages at once
    ref.cache_prefix("a", "main", real[:21])
    assert _state(mgr) == _state(ref) and mgr.cached_tokens("a") == 20
    mgr.ingest_request("z")
    assert mgr.match_prefix("z", "main", [*real[:20], 0]) == 20
    check_device_pages(mgr)
