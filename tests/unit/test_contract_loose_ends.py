"""The contract's loose ends of issue 29, each as the spec now settles it:
the offload priority of a request that holds only shared pages (R45), the
stream `match_prefix` leaves (R58), what `cache_prefix` returns (S23), W3's
bound beside spare pages, bool token ids refused, and tagged extra keys per
request (`KVReqConfig.extra_keys`). The model's side is
tests/model/test_contract_model.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvref import (
    KVReqConfig,
    KVStep,
    PublishLeasedError,
    RetentionPolicy,
    Segment,
    StepContext,
)
from kvref.core.errors import InvalidArgumentError, InvalidConfigError
from kvref.manager import KVManager
from tests.unit._manager_fixtures import make_manager

PS = 4


def compute(kv: KVManager, rid: str, n: int, label: str = "main", commit: bool = True) -> None:
    """One step of ``n`` tokens (bytes are not what these tests read)."""
    if not kv.has_request(rid):
        kv.ingest_request(rid)
    step, ctx = KVStep([Segment(rid, label, n)], commit=commit), StepContext((rid,))
    assert kv.admit(step, ctx).ok
    kv.plan(step, ctx)
    kv.commit(step, ctx)


def pages_of(kv: KVManager, rid: str, label: str = "main") -> tuple[int, ...]:
    return kv.observe().stream(rid, label).pages


# -- R45: priority 0 also when an accepted claim would free nothing -----------------


def test_priority_counts_what_a_claim_frees_and_zero_when_it_frees_nothing() -> None:
    kv = make_manager(cpu_pages=8)
    prompt = list(range(8))
    compute(kv, "a", 8)
    assert kv.cache_prefix("a", "main", prompt) == 2
    kv.ingest_request("b")
    assert kv.match_prefix("b", "main", [*prompt, 99]) == 8  # both of a's pages
    # every page of each is held by the other: a claim of either frees nothing
    assert kv.get_offload_priority("a") == 0.0
    assert kv.get_offload_priority("b") == 0.0
    out = kv.offload_outcome("b")  # accepted all the same (a preemption)
    assert out.reason is None and out.moved == ("main",) and out.pages_freed == 0
    # now a is the last holder: its priority is what its offload frees
    assert kv.get_offload_priority("a") == 2.0
    assert kv.offload_outcome("a").pages_freed == 2


# -- R58: match_prefix leaves the stream there, hit or not ---------------------------


@pytest.mark.parametrize("sharing", [True, False])
def test_match_prefix_creates_a_missing_stream_with_or_without_a_hit(sharing: bool) -> None:
    kv = make_manager(sharing=sharing, retention={"w": RetentionPolicy(8)})
    kv.ingest_request("r")
    assert kv.match_prefix("r", "main", list(range(9))) == 0  # nothing cached
    assert kv.match_prefix("r", "w", list(range(9))) == 0  # W10: a windowed label
    assert set(kv.labels("r")) >= {"main", "w"}
    assert kv.stored_len("r", "main") == kv.stored_len("r", "w") == 0


# -- S23: cache_prefix returns the pages it made findable ----------------------------


def test_cache_prefix_counts_only_pages_newly_keyed() -> None:
    kv = make_manager()
    prompt = list(range(15))  # three full pages and a partial one
    compute(kv, "a", 15)
    compute(kv, "b", 15)  # b computed the same prompt itself
    assert kv.cache_prefix("a", "main", prompt) == 3
    free = kv.num_cached_pages
    # b's pages go on under a's keys: none of them becomes findable
    assert kv.cache_prefix("b", "main", prompt) == 0
    assert kv.cached_tokens("b") == 12  # its chain goes on all the same (S11)
    assert kv.num_cached_pages == free
    compute(kv, "b", 1)  # the 16th token fills b's fourth page: that one is new
    assert kv.cache_prefix("b", "main", [12, 13, 14, 15], start=12) == 1


# -- W3: the bound counts the pages of the tokens; spare pages are on top -------------


def test_a_windowed_stream_holds_spare_pages_past_w3s_bound_after_an_uncommitted_step(
) -> None:
    w = 6
    kv = make_manager(pages=32, retention={"w": RetentionPolicy(w)})
    for n in (4, 4, 4, 1):
        compute(kv, "r", n, "w")
    seen = kv.observe().stream("r", "w")
    bound = -(-w // PS) + 1  # 3
    # docs/concepts/streams.md's example: 13 tokens on 3 pages, the bound
    assert seen.stored_len == 13 and len(seen.pages) == bound
    compute(kv, "r", 8, "w", commit=False)  # a step that keeps nothing
    seen = kv.observe().stream("r", "w")
    assert seen.stored_len == 13
    # slots released // ps .. ceil(n / ps) - 1 hold its tokens: within W3's bound
    assert -(-13 // PS) - seen.released // PS == bound
    # and the pages the step took stay as spare ones, reused first: 5 pages
    assert len(seen.pages) == 5


# -- bool ids: refused, naming the argument, nothing changed -------------------------


MASK = torch.tensor([1, 0, 1, 1, 0], dtype=torch.bool)


@pytest.mark.parametrize("ids", [
    [0, 1, True, 3, 4], [0, 1, 2, 3, np.bool_(False)], MASK, np.array([True] * 5),
    list(MASK), [0, 1, 2, 3, torch.tensor(False)],
], ids=["bool", "numpy-bool", "torch-bool", "numpy-bool-array", "torch-bool-scalars",
        "a-torch-bool-scalar"])
def test_bool_token_ids_are_refused_and_change_nothing(ids: object) -> None:
    kv = make_manager()
    compute(kv, "a", 5)
    kv.ingest_request("b")
    before = kv.observe()
    with pytest.raises(InvalidArgumentError, match="token_ids"):
        kv.cache_prefix("a", "main", ids)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="token_ids"):
        kv.cache_prefixes([("a", "main", ids, 0)])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match="token_ids"):
        kv.match_prefix("b", "main", ids)  # type: ignore[arg-type]
    assert kv.observe() == before
    # the same ids as integers are taken
    assert kv.cache_prefix("a", "main", [int(x) for x in ids]) == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("bad", [True, np.bool_(True), torch.tensor(True)],
                         ids=["bool", "numpy-bool", "torch-bool-scalar"])
def test_a_bool_in_a_long_prompt_is_refused(bad: object) -> None:
    """A prompt of 64 ids or more is checked after packing, by the ids that
    packed as 0 or 1: a bool there is found too."""
    n = 72
    kv = make_manager(pages=64)
    compute(kv, "a", n)
    kv.ingest_request("b")
    ids: list[object] = list(range(n))
    ids[1] = bad
    before = kv.observe()
    with pytest.raises(InvalidArgumentError, match="token_ids"):
        kv.cache_prefix("a", "main", ids)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="token_ids"):
        kv.match_prefix("b", "main", ids)  # type: ignore[arg-type]
    assert kv.observe() == before
    assert kv.cache_prefix("a", "main", list(range(n))) == n // PS


# -- extra keys: tagged, per request ------------------------------------------------


def hit_between(kv: KVManager, a: KVReqConfig, b: KVReqConfig) -> int:
    prompt = list(range(8))
    kv.ingest_request("a", a)
    compute(kv, "a", 8)
    kv.cache_prefix("a", "main", prompt)
    kv.ingest_request("b", b)
    return kv.match_prefix("b", "main", [*prompt, 0])


def test_same_extra_keys_share_pages() -> None:
    cfg = KVReqConfig(extra_keys=(("lora", "adapter-7"), ("mm", b"\x01\x02"), ("mm_offset", 3)))
    same = KVReqConfig(extra_keys=(("lora", "adapter-7"), ("mm", b"\x01\x02"), ("mm_offset", 3)))
    assert hit_between(make_manager(), cfg, same) == 8


@pytest.mark.parametrize(("a", "b"), [
    ((("lora", "x"),), (("mm", "x"),)),  # one value under two tags (vLLM 44701)
    ((("lora", "x"),), ()),
    ((("lora", "ab"), ("mm", "c")), (("lora", "a"), ("mm", "bc"))),  # same joined string
    ((("mm_offset", 1),), (("mm_offset", "1"),)),  # an int is not its decimal str
    ((("lora", "x"), ("mm", "y")), (("mm", "y"), ("lora", "x"))),  # order is part of it
], ids=["tags", "missing", "split", "types", "order"])
def test_different_extra_keys_never_share_pages(a: tuple[tuple[str, object], ...],
                                                b: tuple[tuple[str, object], ...]) -> None:
    got = hit_between(make_manager(), KVReqConfig(extra_keys=a),  # type: ignore[arg-type]
                      KVReqConfig(extra_keys=b))  # type: ignore[arg-type]
    assert got == 0


def test_extra_keys_are_kept_apart_from_the_salt() -> None:
    salted = KVReqConfig(cache_salt="t")
    assert hit_between(make_manager(), salted, KVReqConfig(extra_keys=(("tenant", "t"),))) == 0
    assert hit_between(make_manager(), salted, KVReqConfig(cache_salt="t")) == 8


@pytest.mark.parametrize("bad", [
    "lora", (("salt", "x"),), (("label", "main"),), (("", "x"),), (("lora", True),),
    (("lora", 1.5),), (("lora",),), ((3, "x"),),
])
def test_bad_extra_keys_are_refused_at_construction(bad: object) -> None:
    with pytest.raises(InvalidConfigError, match="extra_keys"):
        KVReqConfig(extra_keys=bad)  # type: ignore[arg-type]


def test_match_prefix_while_leased_raises_and_makes_no_stream() -> None:
    kv = make_manager()
    compute(kv, "r", 4)
    assert kv.publish("r")
    with pytest.raises(PublishLeasedError):
        kv.match_prefix("r", "other", list(range(5)))
    assert "other" not in kv.labels("r")
