"""A fork of a windowed stream reserves only the pages its target must hold:
the source's retained slots (issue 27, defects 1 and 2). Found first by
the retention lockstep without sharing (since retired, issue 27);
these are the issue's reproductions, kept as regression tests.

Before the fix `reserve` counted a fork target's own released slots as
pages it held and its source's released slots as pages it needed: a fork
of a W=7 stream at 400 tokens reserved 101 pages, and a post-fork onto a
target that had released more than its source held reserved none, so the
commit raised after the source's span had landed.
"""

from __future__ import annotations

import pytest
import torch

from kvref import KVStep, RetentionPolicy, Segment, StepContext
from kvref.manager import KVManager
from tests.unit._manager_fixtures import check_conservation, make_manager
from tests.unit.test_retention import kv_of, step, stream

PS, W = 4, 7
LAYERS = 2


def manager(pages: int, sharing: bool) -> KVManager:
    # the configuration: ps=4, two labels of one window
    return make_manager(page_size=PS, heads=2, head_dim=4, layers=LAYERS, pages=pages,
                        max_seq_len=512, sharing=sharing,
                        retention={"w": RetentionPolicy(W), "w2": RetentionPolicy(W)})


def retained(n: int) -> int:
    """Pages a stream of n tokens holds once its commit released (W2)."""
    return -(-n // PS) - max(0, n - W) // PS


def reads_its_window(kv: KVManager, rid: str, label: str) -> None:
    n = kv.stored_len(rid, label)
    got = kv.read_stream(rid, label)
    first = max(0, n - W)  # W1: the window, K and V of its own positions
    assert got.shape[1] == n - first
    for layer in range(LAYERS):
        assert got[layer, :, 0, 0, 0].tolist() == [kv_of(p, layer) for p in range(first, n)]


@pytest.mark.parametrize("sharing", [False, True])
def test_a_fork_of_a_long_windowed_stream_needs_only_its_retained_pages(sharing: bool) -> None:
    """Defect 1: 50 steps of 8 on ("a", "w"), then a pre-fork onto "w2" with a
    segment of 1 on the target. It needs the pages of 401 tokens past the
    source's 392 released ones, 3 (slots 98..100); it counted 101."""
    kv = manager(pages=31, sharing=sharing)
    for _ in range(50):
        step(kv, "a", "w", 8)
    src = stream(kv, "a", "w")
    assert (kv.stored_len("a", "w"), src.released, len(src.page_indices)) == (400, 392, 2)
    fork = KVStep([Segment("a", "w2", 1)], pre_forks=[("w", "w2")])
    # with sharing too: the step writes the target, so it reserves as a
    # copying fork would, and gives back what the share makes spare
    assert kv.pages_needed(fork, StepContext(("a",))) == 3
    # on the 31-page pool it was refused with pages_short=73
    free = kv.num_free_pages
    step(kv, "a", "w2", 1, pre_forks=(("w", "w2"),))
    target = stream(kv, "a", "w2")
    assert (kv.stored_len("a", "w2"), target.released) == (401, 392)
    assert len(target.page_indices) == retained(401) == 3  # W3: no spare pages
    # with sharing it shares the source's two full pages and keeps one
    assert free - kv.num_free_pages == (3 if not sharing else 1)
    reads_its_window(kv, "a", "w2")
    reads_its_window(kv, "a", "w")
    check_conservation(kv)


@pytest.mark.parametrize("sharing", [False, True])
def test_a_plain_fork_of_a_windowed_stream_reserves_its_retained_slots(sharing: bool) -> None:
    kv = manager(pages=31, sharing=sharing)
    for _ in range(50):
        step(kv, "a", "w", 8)
    fork = KVStep([Segment("a", "w", 0)], pre_forks=[("w", "w2")])
    # without sharing it copies both retained pages (it counted 100); with,
    # both are full and shared, and nothing is copied
    assert kv.pages_needed(fork, StepContext(("a",))) == (2 if not sharing else 0)


def test_a_post_fork_onto_a_target_that_released_more_than_the_source_holds() -> None:
    """Defect 2 (sharing off): "w2" at 40 tokens holds 2 pages and released
    8; "w" at 10 holds 3. The post-fork must reserve the target's third page
    at admit; it reserved none, and the commit raised a plain KVRefError
    after "w"'s span committed, the target keeping its old tokens."""
    kv = manager(pages=31, sharing=False)
    step(kv, "a", "w2", 40)
    step(kv, "a", "w", 9)
    assert (len(stream(kv, "a", "w2").page_indices), stream(kv, "a", "w2").released) == (2, 32)
    post = KVStep([Segment("a", "w", 1)], post_forks=[("w", "w2")])
    ctx = StepContext(("a",))
    assert kv.pages_needed(post, ctx) == 1  # the target's third page, none for "w"
    free = kv.num_free_pages
    out = kv.admit(post, ctx)
    assert out.ok, out.reason
    assert free - kv.num_free_pages == 1  # reserved at admit, not found short at commit
    kv.plan(post, ctx)
    for layer in range(LAYERS):
        k = torch.full((1, 2, 4), kv_of(9, layer))
        kv.write_kv(k, k.clone(), layer_idx=layer, label="w")
    kv.commit(post, ctx)
    target = stream(kv, "a", "w2")
    assert (kv.stored_len("a", "w2"), target.released, target.position) == (10, 0, 10)
    assert len(target.page_indices) == retained(10) == 3
    reads_its_window(kv, "a", "w2")
    check_conservation(kv)


def test_a_post_fork_short_of_pages_is_refused_before_anything_commits() -> None:
    """The same step on a pool one page short: refused at admit with the page
    it lacks, changing nothing, instead of failing after the span."""
    kv = manager(pages=8, sharing=False)
    for _ in range(5):  # 40 tokens in steps the 7-page pool admits
        step(kv, "a", "w2", 8)
    step(kv, "a", "w", 9)
    hog = kv.num_free_pages
    if hog:
        step(kv, "b", "full", hog * PS)  # the full label keeps every page it takes
    assert kv.num_free_pages == 0
    before = (kv.stored_len("a", "w"), kv.stored_len("a", "w2"),
              list(stream(kv, "a", "w2").page_indices))
    post = KVStep([Segment("a", "w", 1)], post_forks=[("w", "w2")])
    out = kv.admit(post, StepContext(("a",)))
    assert not out.ok and out.reason.pages_short == 1, out.reason
    assert (kv.stored_len("a", "w"), kv.stored_len("a", "w2"),
            list(stream(kv, "a", "w2").page_indices)) == before
    check_conservation(kv)
