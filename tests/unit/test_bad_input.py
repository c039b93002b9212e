"""The bad-input probe: every public call handed malformed input.

Each case asserts the exact error class, that the message names the bad
value (and the request and label where there is one), and that nothing
changed: streams (labels, lengths, pages, generations, in-flight marks),
free pages, the layer cursor and every byte of the cache. The fixture admits
a step on ``b`` first; after the misuse that step must still plan, write and
commit as if nothing had happened.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from _manager_fixtures import Driver, assert_same, fill, make_cfg, make_manager, snapshot

from kvref.core.config import KVConfig, KVLayout, KVReqConfig
from kvref.core.errors import (
    InvalidArgumentError,
    InvalidConfigError,
    InvalidStepError,
    KVDeviceError,
    KVRefError,
    KVShapeError,
    PublishedInfoError,
)
from kvref.manager import KVManager
from kvref.stepping.step import KVStep, Segment, StepContext
from kvref.transfer.engine import TransferEngineInfo
from kvref.transfer.published import PublishedKVInfo

MAX_SEQ_LEN = 32
LAYERS = 2


@dataclass
class World:
    mgr: KVManager
    pub: PublishedKVInfo
    step: KVStep
    ctx: StepContext
    planned: bool = False

    def plan(self) -> None:
        self.mgr.plan(self.step, self.ctx)
        self.planned = True

    def kv(self, n: int = 1, **kw: Any) -> torch.Tensor:
        cfg = self.mgr.config
        return torch.ones(n, cfg.num_kv_heads, cfg.head_dim, **kw)


@pytest.fixture
def world() -> Iterator[World]:
    mgr = make_manager(pages=16, page_size=4, layers=LAYERS, cpu_pages=8,
                       max_seq_len=MAX_SEQ_LEN)
    drv = Driver(mgr)
    drv.ingest("a", "b")
    fill(drv, "a", 5)
    fill(drv, "b", 2)
    other = make_manager(pages=16, page_size=4, layers=LAYERS)
    od = Driver(other)
    od.ingest("a")
    fill(od, "a", 7)
    pub = other.publish("a")
    assert pub is not None
    # the step in flight that every misuse must leave alone
    step = KVStep([Segment("b", "main", 1)])
    ctx = StepContext(("b",))
    assert mgr.admit(step, ctx).ok
    yield World(mgr, pub, step, ctx)
    other.cleanup()
    mgr.cleanup()


def _seg(rid: Any, label: Any, span: Any) -> Segment:
    return Segment(rid, label, span)


def _step(*segs: Segment, **kw: Any) -> KVStep:
    return KVStep(list(segs), **kw)


def _ctx(*rids: Any) -> StepContext:
    return StepContext(rids)


FORK = {"pre_forks": [("main", "cfg")]}

Call = Callable[[World], Any]
# (id, needs a planned step, call, exact error class, strings the message must hold)
CASES: list[tuple[str, bool, Call, type[KVRefError], tuple[str, ...]]] = [
    # -- request ids and labels that are not str --------------------------------
    ("segment-rid-int", False,
     lambda w: w.mgr.admit(_step(_seg(7, "main", 1)), _ctx("a")), InvalidStepError, ("7",)),
    ("segment-label-int", False,
     lambda w: w.mgr.admit(_step(_seg("a", 3, 1)), _ctx("a")), InvalidStepError, ("'a'", "3")),
    ("segment-label-none-plan", False,
     lambda w: w.mgr.plan(_step(_seg("b", None, 1)), w.ctx), InvalidStepError, ("'b'", "None")),
    ("padded-rid-int", False,
     lambda w: w.mgr.admit(_step(_seg("a", "main", 1), **FORK), _ctx("a", 5)),
     InvalidStepError, ("5",)),
    ("ingest-int", False, lambda w: w.mgr.ingest_request(5), InvalidArgumentError, ("5",)),
    ("ingest-list", False, lambda w: w.mgr.ingest_request(["x"]), InvalidArgumentError,
     ("['x']",)),
    ("ingest-overrides-str", False, lambda w: w.mgr.ingest_request("c", "main"),  # type: ignore[arg-type]
     InvalidArgumentError, ("'c'", "str")),
    ("reset-int", False, lambda w: w.mgr.reset_request(5), InvalidArgumentError, ("5",)),
    ("reset-bytes", False, lambda w: w.mgr.reset_request(b"a"), InvalidArgumentError,
     ("b'a'",)),
    ("remove-int", False, lambda w: w.mgr.remove_request(5), InvalidArgumentError, ("5",)),
    ("remove-tuple", False, lambda w: w.mgr.remove_request(("a",)), InvalidArgumentError,
     ("('a',)",)),
    ("stored-len-rid-int", False, lambda w: w.mgr.stored_len(5), InvalidArgumentError, ("5",)),
    ("stored-len-label-int", False, lambda w: w.mgr.stored_len("a", 0), InvalidArgumentError,
     ("'a'", "0")),
    ("labels-int", False, lambda w: w.mgr.labels(5), InvalidArgumentError, ("5",)),
    ("cached-tokens-rid-int", False, lambda w: w.mgr.cached_tokens(5), InvalidArgumentError,
     ("cached_tokens", "5")),
    ("cached-tokens-label-int", False, lambda w: w.mgr.cached_tokens("a", 0),
     InvalidArgumentError, ("'a'", "0")),
    ("reclaimable-rid-int", False, lambda w: w.mgr.reclaimable(5), InvalidArgumentError,
     ("reclaimable", "5")),
    ("read-stream-rid-int", False, lambda w: w.mgr.read_stream(5), InvalidArgumentError,
     ("read_stream", "5")),
    ("read-stream-label-none", False, lambda w: w.mgr.read_stream("a", None),
     InvalidArgumentError, ("'a'", "None")),
    ("default-label-int", False, lambda w: w.mgr.set_default_label(3), InvalidArgumentError,
     ("set_default_label", "3")),
    ("default-layer-str", False, lambda w: w.mgr.set_default_layer_idx("0"),
     InvalidArgumentError, ("layer_idx", "'0'")),
    ("default-layer-bool", False, lambda w: w.mgr.set_default_layer_idx(True),
     InvalidArgumentError, ("layer_idx", "True")),
    ("retrieve-rid-int", False, lambda w: w.mgr.admit_retrieve(5, "n", "w", w.pub),
     InvalidArgumentError, ("5",)),
    ("retrieve-node-int", False, lambda w: w.mgr.admit_retrieve("a", 5, "w", w.pub),
     InvalidArgumentError, ("'a'", "5")),
    ("retrieve-walk-none", False, lambda w: w.mgr.admit_retrieve("a", "n", None, w.pub),
     InvalidArgumentError, ("'a'", "None")),
    ("retrieve-published-dict", False,
     lambda w: w.mgr.admit_retrieve("a", "n", "w", {0: w.pub.get(0)}),
     PublishedInfoError, ("'a'", "dict")),
    ("publish-int", False, lambda w: w.mgr.publish(5), InvalidArgumentError, ("5",)),
    ("offload-int", False, lambda w: w.mgr.offload(5), InvalidArgumentError, ("5",)),
    ("begin-offload-int", False, lambda w: w.mgr.begin_offload(5), InvalidArgumentError,
     ("5",)),
    ("reload-int", False, lambda w: w.mgr.reload(5), InvalidArgumentError, ("5",)),
    # -- spans --------------------------------------------------------------------
    ("span-float-admit", False, lambda w: w.mgr.admit(_step(_seg("a", "main", 1.5)), _ctx("a")),
     InvalidStepError, ("'a'", "'main'", "1.5")),
    ("span-str-admit", False, lambda w: w.mgr.admit(_step(_seg("a", "main", "2")), _ctx("a")),
     InvalidStepError, ("'a'", "'main'", "'2'")),
    ("span-bool-admit", False, lambda w: w.mgr.admit(_step(_seg("a", "main", True)), _ctx("a")),
     InvalidStepError, ("'a'", "'main'", "True")),
    ("span-negative-admit", False,
     lambda w: w.mgr.admit(_step(_seg("a", "main", -1)), _ctx("a")),
     InvalidStepError, ("'a'", "'main'", "-1")),
    ("span-negative-plan", False, lambda w: w.mgr.plan(_step(_seg("b", "main", -1)), w.ctx),
     InvalidStepError, ("'b'", "'main'", "-1")),
    ("span-negative-commit", False, lambda w: w.mgr.commit(_step(_seg("b", "main", -1)), w.ctx),
     InvalidStepError, ("'b'", "'main'", "-1")),
    ("span-float-plan", False, lambda w: w.mgr.plan(_step(_seg("b", "main", 1.0)), w.ctx),
     InvalidStepError, ("'b'", "'main'", "1.0")),
    ("span-float-commit", False, lambda w: w.mgr.commit(_step(_seg("b", "main", 1.0)), w.ctx),
     InvalidStepError, ("'b'", "'main'", "1.0")),
    # -- segments -----------------------------------------------------------------
    ("segments-none-admit", False, lambda w: w.mgr.admit(KVStep(None), _ctx()),  # type: ignore[arg-type]
     InvalidStepError, ("NoneType",)),
    ("segments-none-plan", False, lambda w: w.mgr.plan(KVStep(None), w.ctx),  # type: ignore[arg-type]
     InvalidStepError, ("NoneType",)),
    ("segments-none-commit", False, lambda w: w.mgr.commit(KVStep(None), w.ctx),  # type: ignore[arg-type]
     InvalidStepError, ("NoneType",)),
    ("segments-tuples", False, lambda w: w.mgr.admit(KVStep([("a", "main", 1)]), _ctx("a")),  # type: ignore[list-item]
     InvalidStepError, ("tuple",)),
    ("segments-bare-segment", False,
     lambda w: w.mgr.admit(KVStep(Segment("a", "main", 1)), _ctx("a")),  # type: ignore[arg-type]
     InvalidStepError, ("Segment",)),
    ("step-not-kvstep", False, lambda w: w.mgr.admit([Segment("a", "main", 1)], _ctx("a")),  # type: ignore[arg-type]
     InvalidStepError, ("list",)),
    # -- padded ids and combined labels given as a bare str ------------------------
    ("padded-bare-str", False,
     lambda w: w.mgr.admit(_step(_seg("a", "main", 1), **FORK), StepContext("a")),
     InvalidStepError, ("'a'",)),
    ("combined-bare-str", False,
     lambda w: w.mgr.admit(_step(_seg("a", "main", 1), combined_labels="main"), _ctx("a")),
     InvalidStepError, ("'main'",)),
    ("combined-of-bare-str", False,
     lambda w: w.mgr.admit(_step(_seg("a", "main", 1), combined_labels=["main", "cfg"]),
                           _ctx("a")),
     InvalidStepError, ("'main'", "'cfg'")),
    ("combined-label-int", False,
     lambda w: w.mgr.admit(_step(_seg("a", "main", 1), combined_labels=[("main", 2)]),
                           _ctx("a")),
     InvalidStepError, ("('main', 2)",)),
    ("combined-none-plan", False,
     lambda w: w.mgr.plan(KVStep(w.step.segments, combined_labels=None), w.ctx),  # type: ignore[arg-type]
     InvalidStepError, ("None",)),
    ("fork-not-pair", False,
     lambda w: w.mgr.admit(_step(_seg("a", "main", 1), pre_forks=["main"]), _ctx("a")),
     InvalidStepError, ("'main'",)),
    # -- layer indices --------------------------------------------------------------
    ("write-layer-neg", True, lambda w: w.mgr.write_kv(w.kv(), w.kv(), layer_idx=-1),
     InvalidArgumentError, ("-1",)),
    ("write-layer-past", True, lambda w: w.mgr.write_kv(w.kv(), w.kv(), layer_idx=LAYERS),
     InvalidArgumentError, (str(LAYERS),)),
    ("write-layer-float", True, lambda w: w.mgr.write_kv(w.kv(), w.kv(), layer_idx=0.0),
     InvalidArgumentError, ("0.0",)),
    ("write-layer-bool", True, lambda w: w.mgr.write_kv(w.kv(), w.kv(), layer_idx=True),
     InvalidArgumentError, ("True",)),
    ("read-layer-neg", True, lambda w: w.mgr.read_kv(layer_idx=-1), InvalidArgumentError,
     ("-1",)),
    ("read-layer-past", True, lambda w: w.mgr.read_kv(layer_idx=LAYERS), InvalidArgumentError,
     (str(LAYERS),)),
    ("read-layer-str", True, lambda w: w.mgr.read_kv(layer_idx="0"), InvalidArgumentError,
     ("'0'",)),
    ("view-layer-neg", False, lambda w: w.mgr.layer_view(-1), InvalidArgumentError, ("-1",)),
    ("view-layer-past", False, lambda w: w.mgr.layer_view(LAYERS), InvalidArgumentError,
     (str(LAYERS),)),
    ("view-layer-float", False, lambda w: w.mgr.layer_view(1.0), InvalidArgumentError,
     ("1.0",)),
    ("set-layer-neg", False, lambda w: w.mgr.set_layer_idx(-1), InvalidArgumentError, ("-1",)),
    ("set-layer-past", False, lambda w: w.mgr.set_layer_idx(LAYERS), InvalidArgumentError,
     (str(LAYERS),)),
    ("set-layer-str", False, lambda w: w.mgr.set_layer_idx("1"), InvalidArgumentError,
     ("'1'",)),
    ("write-label-int", True, lambda w: w.mgr.write_kv(w.kv(), w.kv(), label=0),
     InvalidArgumentError, ("0",)),
    ("read-label-int", True, lambda w: w.mgr.read_kv(plan_label=0), InvalidArgumentError,
     ("0",)),
    # -- max_seq_len at admit -----------------------------------------------------------
    ("max-seq-len", False,
     lambda w: w.mgr.admit(_step(_seg("a", "main", MAX_SEQ_LEN - 5 + 1)), _ctx("a")),
     InvalidStepError, ("'a'", "'main'", str(MAX_SEQ_LEN))),
    ("max-seq-len-new-label", False,
     lambda w: w.mgr.admit(_step(_seg("a", "draft", MAX_SEQ_LEN + 1)), _ctx("a")),
     InvalidStepError, ("'a'", "'draft'", str(MAX_SEQ_LEN))),
    ("max-seq-len-pre-fork-target", False,
     lambda w: w.mgr.admit(_step(_seg("a", "cfg", MAX_SEQ_LEN - 5 + 1), **FORK), _ctx("a")),
     InvalidStepError, ("'a'", "'cfg'", str(MAX_SEQ_LEN))),
    # -- K/V handed to write_kv -----------------------------------------------------------
    ("write-k-meta", True,
     lambda w: w.mgr.write_kv(w.kv(device="meta"), w.kv(), layer_idx=0),
     KVDeviceError, ("'main'", "meta")),
    ("write-v-meta", True,
     lambda w: w.mgr.write_kv(w.kv(), w.kv(device="meta"), layer_idx=0),
     KVDeviceError, ("'main'", "meta")),
    ("write-k-not-tensor", True,
     lambda w: w.mgr.write_kv(w.kv().tolist(), w.kv(), layer_idx=0),
     KVShapeError, ("'main'", "list")),
    ("write-v-float64", True,
     lambda w: w.mgr.write_kv(w.kv(), w.kv(dtype=torch.float64), layer_idx=0),
     KVShapeError, ("'main'", "float64")),
    ("write-k-heads", True,
     lambda w: w.mgr.write_kv(torch.ones(1, 3, 4), w.kv(), layer_idx=0),
     KVShapeError, ("'main'", "(1, 3, 4)")),
]


def _state(mgr: KVManager) -> tuple[Any, ...]:
    return (snapshot(mgr), mgr.kv_cache.tensor.clone(), mgr._default_layer_idx,
            mgr._default_label, sorted(mgr._current_plan_states),
            {rid: mgr.labels(rid) for rid in sorted(mgr._streams)})


def _assert_state(before: tuple[Any, ...], after: tuple[Any, ...]) -> None:
    assert_same(before[0], after[0])
    assert torch.equal(before[1], after[1]), "cache bytes changed"
    assert before[2:] == after[2:]


@pytest.mark.parametrize(("planned", "call", "exc", "names"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(world: World, planned: bool, call: Call, exc: type[KVRefError],
                   names: tuple[str, ...]) -> None:
    mgr = world.mgr
    if planned:
        world.plan()
    before = _state(mgr)
    with pytest.raises(KVRefError) as info:
        call(world)
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    for name in names:
        assert name in str(info.value), (name, str(info.value))
    _assert_state(before, _state(mgr))
    # the step admitted before the misuse still runs to the end
    if not world.planned:
        world.plan()
    kv = world.kv()
    for layer in range(LAYERS):
        mgr.write_kv(kv, kv, layer_idx=layer)
    mgr.commit(world.step, world.ctx)
    assert mgr.stored_len("b") == 3 and mgr.stored_len("a") == 5
    assert not any(s.step_in_flight for streams in mgr._streams.values()
                   for s in streams.values())


@pytest.mark.parametrize("label", ["main", "cfg"])
def test_max_seq_len_boundary_is_admitted(world: World, label: str) -> None:
    """Exactly max_seq_len fits: the check refuses past it, not at it (``cfg`` is
    a pre-fork target, which starts the step at main's 5 tokens)."""
    world.mgr.commit(world.step, world.ctx)  # one step runs at a time (R23)
    step = _step(_seg("a", label, MAX_SEQ_LEN - 5), **(FORK if label == "cfg" else {}))
    assert world.mgr.admit(step, _ctx("a")).ok
    world.mgr.plan(step, _ctx("a"))
    world.mgr.commit(step, _ctx("a"))
    assert world.mgr.stored_len("a", label) == MAX_SEQ_LEN


# -- the config ---------------------------------------------------------------------------


def _cfg(**kw: Any) -> KVConfig:
    base: dict[str, Any] = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4,
                            "max_seq_len": 64, "max_num_pages": 8, "page_size": 4,
                            "num_qo_heads": 2}
    base.update(kw)
    return KVConfig(**base)


def test_layout_by_name_converts_to_the_enum() -> None:
    cfg = _cfg(layout="HND")
    assert cfg.layout is KVLayout.HND
    mgr = KVManager(_cfg(layout="NHD"), "kv", None, TransferEngineInfo(), "cpu",
                    dtype=torch.float32)
    assert mgr.config.layout is KVLayout.NHD
    drv = Driver(mgr)
    drv.ingest("a")
    fill(drv, "a", 5)
    drv.check("a")
    assert mgr.publish("a") is not None  # transfer.py reads layout.value
    mgr.cleanup()


@pytest.mark.parametrize(("field", "value"), [
    ("page_size", 2.5), ("page_size", 0), ("page_size", -4), ("page_size", True),
    ("num_kv_heads", "2"), ("num_qo_heads", None), ("num_layers", 0), ("head_dim", 4.0),
    ("max_seq_len", 0), ("max_seq_len", "64"), ("max_num_pages", 1), ("max_num_pages", 8.0),
    ("cpu_offload_pages", -1), ("cpu_offload_pages", 0.5), ("layout", "XYZ"),
    ("layout", 3), ("num_qo_heads", 3),
])
def test_bad_config_fails_at_construction(field: str, value: Any) -> None:
    with pytest.raises(InvalidConfigError) as info:
        _cfg(**{field: value})
    assert f"{field}" in str(info.value) or field == "num_qo_heads"
    assert repr(value) in str(info.value) or str(value) in str(info.value)


@pytest.mark.parametrize("labels", ["main", ["main", 3], None])
def test_bad_req_config_fails_at_construction(labels: Any) -> None:
    with pytest.raises(InvalidConfigError, match="default_labels"):
        KVReqConfig(default_labels=labels)
    with pytest.raises(InvalidConfigError):
        KVReqConfig(labels={("n", "w"): labels})


def test_config_mutated_after_build_does_not_reach_the_manager() -> None:
    cfg = make_cfg(pages=16, page_size=4)
    mgr = KVManager(cfg, "kv", None, TransferEngineInfo(), "cpu", dtype=torch.float32)
    cfg.page_size = 7
    cfg.num_kv_heads = 5
    cfg.max_seq_len = 1
    assert mgr.config is not cfg and mgr.config.page_size == 4
    drv = Driver(mgr)
    drv.ingest("a")
    fill(drv, "a", 6)
    fill(drv, "a", 1)
    drv.check("a")
    assert mgr.stored_len("a") == 7
    mgr.cleanup()


def test_config_made_invalid_before_build_is_refused() -> None:
    cfg = make_cfg()
    cfg.page_size = 2.5  # type: ignore[assignment]
    with pytest.raises(InvalidConfigError, match="page_size"):
        KVManager(cfg, "kv", None, TransferEngineInfo(), "cpu", dtype=torch.float32)


# -- token ids that are not a sequence of ids (issue 44) ----------------------------------


def _ids_gen() -> Iterator[int]:
    yield from range(8)


# (id, ids, what the message must name besides "token_ids")
BAD_IDS: list[tuple[str, Callable[[], object], str]] = [
    ("none", lambda: None, "None"),
    ("generator", _ids_gen, "generator"),
    ("iterator", lambda: iter(range(8)), "iterator"),
    ("int", lambda: 7, "int"),
    ("str", lambda: "01234567", "str"),
    ("bytes", lambda: bytes(range(8)), "bytes"),
    ("set", lambda: set(range(8)), "set"),
    ("dict", lambda: dict.fromkeys(range(8)), "dict"),
    # follow_tokens takes no tensor at all (it reads the engine's growing list)
    ("tensor-0d", lambda: torch.tensor(3), "tensor"),
    ("tensor-2d", lambda: torch.arange(8).reshape(2, 4), "tensor"),
]

# every public call that takes token ids; "a" holds 8 committed tokens (two
# pages, one keyed), "b" is empty, and ids are always the third argument
IDS_CALLS: list[tuple[str, Callable[[KVManager, object], Any]]] = [
    ("match_prefix", lambda m, ids: m.match_prefix("b", "main", ids)),  # type: ignore[arg-type]
    ("match_prefix-new-label", lambda m, ids: m.match_prefix("b", "new", ids)),  # type: ignore[arg-type]
    ("cache_prefix", lambda m, ids: m.cache_prefix("a", "main", ids)),  # type: ignore[arg-type]
    ("cache_prefix-start", lambda m, ids: m.cache_prefix("a", "main", ids, 4)),  # type: ignore[arg-type]
    ("cache_prefixes", lambda m, ids: m.cache_prefixes([("a", "main", ids, 0)])),  # type: ignore[list-item]
    ("cache_prefixes-second", lambda m, ids: m.cache_prefixes(
        [("b", "main", [], 0), ("a", "main", ids, 4)])),  # type: ignore[list-item]
    ("follow_tokens", lambda m, ids: m.follow_tokens("a", ids)),  # type: ignore[arg-type]
]


@pytest.fixture
def keyed() -> Iterator[KVManager]:
    mgr = make_manager(pages=16, page_size=4)
    drv = Driver(mgr)
    drv.ingest("a", "b")
    fill(drv, "a", 8)
    assert mgr.cache_prefix("a", "main", list(range(4))) == 1
    yield mgr
    mgr.cleanup()


@pytest.mark.parametrize(("make_ids", "names"), [b[1:] for b in BAD_IDS],
                         ids=[b[0] for b in BAD_IDS])
@pytest.mark.parametrize("call", [c[1] for c in IDS_CALLS], ids=[c[0] for c in IDS_CALLS])
def test_ids_that_are_not_ids_are_typed_and_change_nothing(
        keyed: KVManager, call: Callable[[KVManager, object], Any],
        make_ids: Callable[[], object], names: str) -> None:
    """None, an iterator, an int, a str: `InvalidArgumentError` naming
    ``token_ids`` and what was given, the request and the label, never a bare
    `TypeError` from ``len``; the observation before and after is one."""
    before = keyed.observe()
    with pytest.raises(KVRefError) as info:
        call(keyed, make_ids())
    assert type(info.value) is InvalidArgumentError, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert "token_ids" in message and names.lower() in message.lower(), message
    assert info.value.request_id in ("a", "b") and info.value.label is not None, message
    assert keyed.observe() == before
    # and the manager goes on: the same call with a list of ids is taken
    call(keyed, list(range(8)) if "follow" in message else list(range(4)))


@pytest.mark.parametrize(("make_ids", "names"), [b[1:] for b in BAD_IDS],
                         ids=[b[0] for b in BAD_IDS])
def test_the_building_blocks_refuse_them_too(make_ids: Callable[[], object],
                                             names: str) -> None:
    """The keys and the page pool an engine may use alone check ids as the
    manager's calls do."""
    from kvref.core.page_pool import PagePool
    from kvref.prefix import keys

    pool = PagePool(8, 4, reserved=1)
    page = pool.allocate("o", 1)[0]
    calls: list[Callable[[object], object]] = [
        keys.token_bytes, lambda t: keys.page_key(None, t), lambda t: keys.page_keys(t, 4),
        lambda t: list(keys.iter_page_keys(t, 4)), pool.lookup, lambda t: pool.match("x", t),
        lambda t: pool.register(page, None, t),
    ]
    for call in calls:
        with pytest.raises(InvalidArgumentError, match="token_ids") as info:
            call(make_ids())  # type: ignore[arg-type]
        assert names.lower() in str(info.value).lower()
    assert pool.num_free == 6 and not pool.lookup(list(range(8))).pages
