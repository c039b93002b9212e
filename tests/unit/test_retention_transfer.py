"""publish and retrieve over windowed labels (W16, W17 of specs/retention.md;
R69): two managers of one process, the local transfer engine. The lockstep
against the one model is tests/conformance/test_feature_plants.py; these tests
find the kvref plants (g) and (h), which its harness cannot drive."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvref import RetentionPolicy
from kvref.core.errors import PublishedInfoError
from kvref.manager import KVManager
from kvref.stepping.step import AdmitOutcome, AllocationFailed
from kvref.transfer.published import PublishedKVInfo
from tests.unit._manager_fixtures import assert_same, check_conservation, snapshot
from tests.unit.test_retention import PS, W, step, stream, window_reads_right, windowed


def landed(dst: KVManager, rid: str, pub: PublishedKVInfo) -> AdmitOutcome:
    """admit_retrieve, wait for the copies, and the readiness check after."""
    dst.ingest_request(rid)
    out = dst.admit_retrieve(rid, None, None, pub)
    if not out.ok:
        return out
    for s in dst._streams[rid].values():
        if s.read_future is not None:
            s.read_future.result(timeout=10)
    return dst.admit_retrieve(rid, None, None, pub)


def published(src: KVManager, rid: str, label: str = "w") -> PublishedKVInfo:
    pub = src.publish(rid)
    assert isinstance(pub, PublishedKVInfo), pub
    return pub


def test_publish_names_only_the_retained_pages() -> None:
    src = windowed()
    step(src, "r", "w", 22)  # W = 8, ps 4: 12 released, slots 3..5 retained
    step(src, "r", "main", 5)
    s = stream(src, "r", "w")
    info = published(src, "r").get(0)
    assert info["w"].released == 12 == s.released  # W17
    assert info["w"].page_indices == s.page_indices and len(s.page_indices) == 3
    assert info["main"].released == 0 and len(info["main"].page_indices) == 2


@pytest.mark.parametrize("held", [0, 3, 9, 13])
def test_retrieve_copies_only_the_window_and_takes_released(held: int) -> None:
    src, dst = windowed(), windowed()
    step(src, "r", "w", 22)
    if held:
        step(dst, "r", "w", held)  # its own tokens are the same positions' K/V
    dst.ingest_request("r")
    free = dst.num_free_pages
    own = stream(dst, "r", "w") if held else None
    before = list(own.page_indices) if own is not None else []
    off = own.released // PS if own is not None else 0
    out = landed(dst, "r", published(src, "r"))
    assert out.ok and out.ready, out
    s = stream(dst, "r", "w")
    # W16: the peer's released prefix, a page per retained slot only
    assert (s.stored_len, s.position, s.released) == (22, 22, 12)
    assert len(s.page_indices) == 3 and s.received
    # its pages of slots now released went back; those of retained slots stay
    # (13 held: slots 1 and 2 go, slot 3 stays)
    assert s.page_indices[:len(before[12 // PS - off:])] == before[12 // PS - off:]
    assert dst.num_free_pages == free + len(before) - 3
    window_reads_right(dst, "r", "w")
    check_conservation(dst)
    # a commit after it releases from the retrieved counters (W2)
    step(dst, "r", "w", 3)
    assert stream(dst, "r", "w").released == 16
    window_reads_right(dst, "r", "w")
    src.cleanup()
    dst.cleanup()


def test_a_full_attention_peer_into_a_windowed_label() -> None:
    src = windowed(retention={})  # "w" is full attention there
    dst = windowed()
    step(src, "r", "w", 22)
    out = landed(dst, "r", published(src, "r"))
    assert out.ok and out.ready
    s = stream(dst, "r", "w")
    # the consumer releases by its own window, as a commit to 22 would
    assert s.released == (22 - W) // PS * PS and len(s.page_indices) == 3
    window_reads_right(dst, "r", "w")
    check_conservation(dst)


def test_a_windowed_peer_into_a_full_attention_label_is_refused() -> None:
    src = windowed()
    dst = windowed(retention={})
    step(src, "r", "w", 22)
    dst.ingest_request("r")
    before = snapshot(dst)
    with pytest.raises(PublishedInfoError, match="window starts at 0"):
        dst.admit_retrieve("r", None, None, published(src, "r"))
    assert_same(before, snapshot(dst))


def test_a_smaller_window_at_the_peer_is_refused() -> None:
    src = windowed(retention={"w": RetentionPolicy(4)})  # released 16 of 22
    dst = windowed()  # W = 8: its window starts at 14
    step(src, "r", "w", 22)
    dst.ingest_request("r")
    before = snapshot(dst)
    with pytest.raises(PublishedInfoError, match="window starts at 14"):
        dst.admit_retrieve("r", None, None, published(src, "r"))
    assert_same(before, snapshot(dst))


@pytest.mark.parametrize("released", [-4, 3, 24, True])
def test_a_malformed_released_is_refused(released: int) -> None:
    src, dst = windowed(), windowed()
    step(src, "r", "w", 22)
    pub = published(src, "r")
    pub.info[0]["w"] = dataclasses.replace(pub.info[0]["w"], released=released)
    dst.ingest_request("r")
    before = snapshot(dst)
    with pytest.raises(PublishedInfoError):
        dst.admit_retrieve("r", None, None, pub)
    assert_same(before, snapshot(dst))


def test_a_publication_short_of_retained_pages_is_refused() -> None:
    src, dst = windowed(), windowed()
    step(src, "r", "w", 22)
    pub = published(src, "r")
    info = pub.info[0]["w"]
    pub.info[0]["w"] = dataclasses.replace(info, page_indices=info.page_indices[:-1])
    dst.ingest_request("r")
    before = snapshot(dst)
    with pytest.raises(PublishedInfoError, match="over only 2 pages"):
        dst.admit_retrieve("r", None, None, pub)
    assert_same(before, snapshot(dst))


def test_a_retrieve_short_of_pages_takes_nothing() -> None:
    src = windowed()
    dst = windowed(pages=3)  # 2 usable pages; the window needs 3
    step(src, "r", "w", 22)
    dst.ingest_request("r")
    before = snapshot(dst)
    out = dst.admit_retrieve("r", None, None, published(src, "r"))
    assert not out.ok and isinstance(out.reason, AllocationFailed)
    assert out.reason.pages_short == 1
    assert_same(before, snapshot(dst))


def test_a_retrieved_window_is_never_cached_and_bytes_stay() -> None:
    src, dst = windowed(), windowed()
    step(src, "r", "main", 9)
    step(src, "r", "w", 9)
    assert landed(dst, "r", published(src, "r")).ready
    assert dst.cache_prefix("r", "main", list(range(9))) == 0  # R55
    assert dst.cache_prefix("r", "w", list(range(9))) == 0
    assert torch.equal(dst.read_stream("r", "main"), src.read_stream("r", "main"))
    assert torch.equal(dst.read_stream("r", "w"), src.read_stream("r", "w"))
