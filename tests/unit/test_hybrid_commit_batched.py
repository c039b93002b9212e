"""A hybrid decode step's commit in batches (issue 40, item 6): the pages
each window passes given back blank in one pool call
(`PagePool.release_blank_each`, `StreamTable.retire_each`), and a page the
groups of a request fill together packed once for their keys. Each is held
to what the one-by-one path leaves: the same pool, streams and keys."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvref import KVConfig, KVManager, KVStep, Segment, StepContext, TransferEngineInfo
from kvref.core.config import RetentionPolicy
from kvref.core.errors import InvalidArgumentError
from kvref.core.groups import groups_for
from kvref.core.page_keys import page_keys
from kvref.core.page_pool import PagePool, PageRefError
from kvref.core.stream_table import Key, StreamTable
from kvref.core.streams import CacheStream
from kvref.prefix.cache import extras_for
from tests.unit._manager_fixtures import assert_same, snapshot

PS = 2


def _pool() -> tuple[PagePool, list[int]]:
    """Owners a, b, c hold pages 1..6, two each, keyed; a and b share page 7;
    page 8 free-cached."""
    pool = PagePool(10, PS)
    got = pool.allocate_each(["a", "b", "c", "x"], [2, 2, 2, 2])
    assert isinstance(got, list)
    parent = None
    for i, p in enumerate(q for pages in got for q in pages):
        parent = pool.register(p, parent, [i, i]).key
    pool.release("x", got[3][1:])
    pool.share("b", [got[3][0]])
    pool.share("a", [got[3][0]])
    pool.release("x", got[3][:1])
    return pool, [p for pages in got for p in pages]


def test_each_is_release_blank_in_turn() -> None:
    each, pages = _pool()
    one_by_one, _ = _pool()
    owners = ["a", "b", "c"]
    # a's first page, b's both and the page a and b share, none of c's
    lists = [[pages[0], pages[6]], [pages[3], pages[2], pages[6]], []]
    freed = each.release_blank_each(owners, lists)
    assert freed == sum(one_by_one.release_blank(o, ps) for o, ps in zip(owners, lists,
                                                                         strict=True))
    assert freed == 4  # page 7 went only when its second holder let go
    assert each.snapshot() == one_by_one.snapshot()  # holders, keys, LRU, blank alike
    each.sanity_check()


@pytest.mark.parametrize("owners, lists, err", [
    (["a", "b"], [[1]], InvalidArgumentError),  # lengths disagree
    (["a", "a"], [[1], [2]], PageRefError),  # an owner twice
    (["a", "b"], [[1], [1]], PageRefError),  # b does not hold page 1
    (["a", "b"], [[1, 1], [3]], PageRefError),  # a page twice in a list
    (["a", "b"], [[1], [99]], PageRefError),  # past the pool
    (["a", "b"], [[1], [True]], PageRefError),  # not a page
    (["a", "b"], [[1], [9]], PageRefError),  # free
])
def test_misuse_raises_and_releases_nothing(owners: list[str], lists: list[list[int]],
                                            err: type[Exception]) -> None:
    pool, _ = _pool()
    before = pool.snapshot()
    with pytest.raises(err):
        pool.release_blank_each(owners, lists)
    assert pool.snapshot() == before


def _mgr() -> KVManager:
    sw = RetentionPolicy(6)
    cfg = KVConfig(num_layers=4, num_kv_heads=1, head_dim=4, max_seq_len=256,
                   max_num_pages=200, page_size=PS, num_qo_heads=1,
                   enable_prefix_caching=True, groups=groups_for([sw, sw, sw, None]))
    return KVManager(cfg, "kv", None, TransferEngineInfo(), torch.device("cpu"),
                     dtype=torch.float32)


def _decode(one_by_one: bool, mp: pytest.MonkeyPatch) -> tuple[KVManager, dict[Key, list]]:
    """Three requests of two lengths decode past the window, every group
    keyed as it fills; ``one_by_one``: each window retired by `retire` and
    each group following its own copy of the ids (nothing packed is shared)."""
    if one_by_one:
        def retire_each(self: StreamTable, keys: list[Key], streams: list[CacheStream]) -> None:
            for key, stream in zip(keys, streams, strict=True):
                self.retire(key, stream)

        mp.setattr(StreamTable, "retire_each", retire_each)
    m = _mgr()
    rids = ["r0", "r1", "r2"]
    ids = [list(range(100 * i, 100 * i + 40)) for i in range(3)]
    ctx = StepContext(tuple(rids))
    for i, rid in enumerate(rids):
        m.ingest_request(rid)
        m.follow_tokens(rid, ids[i])
        if one_by_one:
            for s in m._streams[rid].values():
                assert s.follow is not None
                s.follow = dataclasses.replace(s.follow, ids=list(s.follow.ids))
    # r0 and r2 fill their pages in the same commits, at the same places
    first = KVStep([Segment(r, "main", n) for r, n in zip(rids, [3, 4, 3], strict=True)])
    assert m.admit(first, ctx).ok
    m.plan(first, ctx)
    m.commit(first, ctx)
    step = KVStep([Segment(r, "main", 1) for r in rids])
    for _ in range(20):
        assert m.admit(step, ctx).ok
        m.plan(step, ctx)
        m.commit(step, ctx)
    keys = {(rid, lb): list(s.keys) for rid in rids for lb, s in m._streams[rid].items()}
    return m, keys


def test_a_decode_commit_leaves_what_one_by_one_does(monkeypatch: pytest.MonkeyPatch) -> None:
    batched, keys = _decode(False, monkeypatch)
    with monkeypatch.context() as mp:
        plain, plain_keys = _decode(True, mp)
    assert_same(snapshot(batched), snapshot(plain))
    assert keys == plain_keys
    # every full page keyed, in every group, as its own label's chain of
    # the request's ids (a group keyed from another's bytes would differ)
    table = batched._table
    want = {}
    for (rid, lb), stream in ((k, table.streams[k[0]][k[1]]) for k in keys):
        assert stream.follow is not None
        ids = list(stream.follow.ids)[:stream.stored_len]
        want[(rid, lb)] = page_keys(ids, PS, extras_for(table, rid, stream.space or lb),
                                    key_hash=table.pages.key_hash)
    assert keys == want
    # the groups key the same tokens under their own labels: no two keys alike
    flat = [k for ks in keys.values() for k in ks]
    assert len(set(flat)) == len(flat)
    assert batched.observe().pages == plain.observe().pages
