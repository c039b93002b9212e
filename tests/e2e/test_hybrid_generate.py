"""End to end: a hybrid Gemma 3 generates through kvref's attention groups.

The model is transformers' own Gemma 3 text model (random weights, a local
config) whose ``layer_types`` mix ``sliding_attention`` and
``full_attention``, as Gemma 3 (5:1) and gpt-oss (alternating) do. Its
sliding and full layers rotate with different RoPE bases, scale queries by
``query_pre_attn_scalar``, and norm q and k; transformers computes all of
that, and only the attention itself is replaced, as in `test_llama_generate`:
one packed, ragged forward per step whose attention reads kvref's page
tables.

kvref serves the model with ``KVConfig.groups`` (`groups_for` of the layer
types): label ``main`` is one stream per group, a sliding group's under
``RetentionPolicy(context_budget=S)`` (S transformers' ``sliding_window``;
``window_left = S - 1``, the semantics `test_sliding_window_generate`
states). ``plan`` gives one table per group, ``main`` for the full group and
``main@name`` for the others; ``write_kv`` and ``layer_view`` route each
layer to its group's stream and page slot, and each layer attends with its
group's table and window. A window group's views start past its released
pages (``offset``); the full group's at 0: both put a step's tokens at the
same positions.

The prefix cache is on (the default): every stream follows its ids
(`follow_tokens`), so each commit keys the pages it filled in every group,
and each request looks up its prompt (`match_prefix`) as it arrives. The
oracle is transformers' greedy ``generate`` (eager attention, its
DynamicCache with sliding layers), one prompt at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from transformers import AttentionInterface, Gemma3ForCausalLM, Gemma3TextConfig
from transformers.masking_utils import AttentionMaskInterface

from kvref.attention.paged import Backend, PagedAttention
from kvref.core.config import KVConfig, RetentionPolicy
from kvref.core.groups import GROUP_SEP, AttentionGroup, ChunkedAttention, groups_for
from kvref.manager import KVManager
from kvref.stepping.plan import KVPlanOutputs
from kvref.stepping.step import KVStep, Segment, StepContext
from kvref.transfer.engine import TransferEngineInfo
from tests.e2e.test_llama_generate import attn_implementation, eager_model, greedy_generate

ATTN_NAME = "kvref_hybrid"
VOCAB = 128
MAIN, SAMPLE = "main", "s1"
SLIDING, FULL = "sliding_attention", "full_attention"

# Gemma 3: five sliding layers to one full one, a window far shorter than
# the sequences (its W = 1024, scaled down)
GEMMA3_WINDOW = 8
GEMMA3_LAYERS = [SLIDING] * 5 + [FULL]
# gpt-oss: sliding and full alternating, W = 128 scaled down; two layers a
# group, so a page holds two layers and a layer's slot in it matters
GPT_OSS_WINDOW = 6
GPT_OSS_LAYERS = [SLIDING, FULL] * 2


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matmuls gain nothing from intra-op threads, and on a loaded
    machine their spinning costs this module many times over."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_model(layer_types: list[str], window: int) -> Gemma3ForCausalLM:
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=len(layer_types), layer_types=layer_types, sliding_window=window,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        # not head_dim: the scale is Gemma's own, and kvref must use it
        query_pre_attn_scalar=24, max_position_embeddings=256,
        # wider than the default 0.02, so greedy picks are decided by margins
        # far above float32 noise, not by near-ties
        initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=0,
        # tied, Gemma's embedding (scaled by sqrt(hidden)) dominates the random
        # logits and greedy repeats one token: untied, the tokens vary
        tie_word_embeddings=False,
    )
    model: Gemma3ForCausalLM = eager_model(Gemma3ForCausalLM, cfg)
    # what the harness relies on: per-type RoPE bases, and no logit softcap
    # inside attention (kvref's attention does not cap)
    rope: Any = cfg.rope_parameters
    assert rope[SLIDING]["rope_theta"] != rope[FULL]["rope_theta"]
    assert cfg.attn_logit_softcapping is None
    return model


def window_of(model: Gemma3ForCausalLM) -> int:
    """The sliding layers' window S."""
    window = model.config.sliding_window
    assert window is not None
    return int(window)


def layer_types_of(model: Gemma3ForCausalLM) -> list[str]:
    types = model.config.layer_types
    assert types is not None
    return list(types)


def hybrid_groups(model: Gemma3ForCausalLM) -> tuple[AttentionGroup, ...]:
    """kvref's groups for the model's layer types: a sliding layer keeps
    (and reads) the ``sliding_window`` tokens up to its query."""
    window = RetentionPolicy(context_budget=window_of(model))
    return groups_for([window if t == SLIDING else None for t in layer_types_of(model)])


def make_manager(model: Gemma3ForCausalLM, page_size: int, pages: int = 256,
                 host_pages: int = 0) -> KVManager:
    mc = model.config
    cfg = KVConfig(
        num_layers=mc.num_hidden_layers, num_kv_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim, max_seq_len=256, max_num_pages=pages, page_size=page_size,
        num_qo_heads=mc.num_attention_heads, groups=hybrid_groups(model),
        cpu_offload_pages=host_pages,
    )
    return KVManager(cfg, "kv", None, TransferEngineInfo(), torch.device("cpu"), torch.float32)


def group_label(label: str, groups: tuple[AttentionGroup, ...], g: int) -> str:
    return label if g == 0 else f"{label}{GROUP_SEP}{groups[g].name}"


# -- kvref's attention inside the model -------------------------------------------


@dataclass
class HybridForward:
    """What one forward's attention calls need; passed down as a model kwarg."""

    manager: KVManager
    # a layer's group's attention: its plan label's table, its window
    by_layer: dict[int, PagedAttention]


def hybrid_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query: [1, Hq, T, D]``, ``key/value: [1, Hkv, T, D]`` (normed and
    rotated with the layer type's RoPE). The mask is ignored: the layer's
    group's page table and window say who attends to what."""
    fwd: HybridForward = kwargs["kvref"]
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    attn = fwd.by_layer[layer]
    # the layer's window and scale are those its group attends with: a layer
    # routed to the other group's table would be caught here, not by chance
    sliding = kwargs.get("sliding_window")
    assert attn.window_left == (-1 if sliding is None else sliding - 1), (layer, sliding)
    assert scaling == attn.sm_scale and kwargs.get("softcap") is None
    # write_kv and layer_view find the layer's group stream and page slot
    fwd.manager.write_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), layer_idx=layer)
    out = attn.run(query[0].transpose(0, 1), fwd.manager.layer_view(layer))
    return out.unsqueeze(0), None  # [1, T, Hq, D], as eager returns it


AttentionInterface.register(ATTN_NAME, hybrid_attention)
AttentionMaskInterface.register(ATTN_NAME, lambda *args, **kwargs: None)


# -- an engine loop: arrivals, prefix hits, chunked prefill, a fork ------------------


@dataclass
class Request:
    rid: str
    prompt: list[int]
    new_tokens: int
    arrival: int = 0  # the step of its run it arrives at
    samples: int = 1  # 2: a second stream, forked from main once the prompt is in
    out: dict[str, list[int]] = field(default_factory=dict)  # label -> tokens
    # label -> the stream's ids (prompt, then kept tokens): what follow_tokens keys
    ids: dict[str, list[int]] = field(default_factory=dict)
    hit: int = 0  # prompt tokens match_prefix attached
    # label -> the logits row each of its tokens was picked from
    logits: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    fed: dict[str, int] = field(default_factory=dict)  # label -> tokens in the cache
    state: str = "new"  # new, running, done

    def pending(self, label: str, chunk: int | None) -> list[int]:
        fed = self.fed[label]
        if fed < len(self.prompt):
            return self.prompt[fed:][:chunk]
        return [self.out[label][-1]]  # decode: the last sampled token

    def finished(self) -> bool:
        return len(self.out) == self.samples and all(
            len(t) == self.new_tokens for t in self.out.values())


@dataclass
class Engine:
    model: Gemma3ForCausalLM
    kv: KVManager
    chunk: int | None = None
    backend: Backend = "torch"
    remove: bool = True  # remove a request once it finished (off: the test reads it first)
    steps: int = 0
    # the most pages a window group's stream held after a commit
    most_window_pages: int = 0
    # rid -> its streams (group label -> observed) right after its match_prefix
    arrived: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def groups(self) -> tuple[AttentionGroup, ...]:
        return tuple(self.kv.config.groups)

    def attention(self) -> dict[int, PagedAttention]:
        scaling = self.model.model.layers[0].self_attn.scaling
        by_layer: dict[int, PagedAttention] = {}
        for g in self.groups:
            # a window group masks its window, a chunked one (Llama 4) its chunk
            r = g.retention
            attn = PagedAttention.from_config(
                self.kv.config, backend=self.backend, sm_scale=scaling,
                window_left=r.window_left if isinstance(r, RetentionPolicy) else -1,
                chunk=r.size if isinstance(r, ChunkedAttention) else 0)
            by_layer.update(dict.fromkeys(g.layers, attn))
        return by_layer

    def run(self, reqs: list[Request]) -> None:
        by_layer = self.attention()
        start = self.steps
        with torch.no_grad(), attn_implementation(self.model, ATTN_NAME):
            while not all(r.state == "done" for r in reqs):
                assert self.steps < start + 1000, "no progress"
                for r in reqs:
                    if r.state == "new" and r.arrival <= self.steps - start:
                        self.arrive(r)
                live = [r for r in reqs if r.state == "running"]
                if live:
                    self.step(live, by_layer)
                self.steps += 1

    def arrive(self, r: Request) -> None:
        self.kv.ingest_request(r.rid)
        r.hit = self.kv.match_prefix(r.rid, MAIN, r.prompt)
        r.fed[MAIN] = r.hit
        self.arrived[r.rid] = self.streams(r.rid)
        # from here on every commit keys the pages it filled, in every group
        self.kv.follow_tokens(r.rid, r.ids.setdefault(MAIN, list(r.prompt)))
        r.state = "running"

    def step(self, live: list[Request], by_layer: dict[int, PagedAttention]) -> None:
        work = {(r.rid, lb): r.pending(lb, self.chunk) for r in live for lb in r.fed
                if len(r.out.get(lb, ())) < r.new_tokens}
        labels = sorted({lb for _, lb in work}, key=[MAIN, SAMPLE].index)
        # one forward for both samples: their tables planned as one batch
        step = KVStep(segments=[Segment(rid, lb, len(t)) for (rid, lb), t in work.items()],
                      combined_labels=[labels] if len(labels) > 1 else ())
        ctx = StepContext(padded_request_ids=[r.rid for r in live])
        outcome = self.kv.admit(step, ctx)
        assert outcome.ok, outcome
        plan = self.kv.plan(step, ctx)
        ids, pos, rows = self.batch(plan, work)
        for g, group in enumerate(self.groups):
            by_layer[group.layers[0]].plan(plan[group_label(MAIN, self.groups, g)])
        logits: torch.Tensor = self.model(
            input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]), use_cache=False,
            kvref=HybridForward(self.kv, by_layer)).logits[0]
        self.kv.commit(step, ctx)
        reqs = {r.rid: r for r in live}
        for (rid, lb), tokens in work.items():
            r = reqs[rid]
            r.fed[lb] += len(tokens)
            if r.fed[lb] >= len(r.prompt):  # the prompt is in: the last row predicts
                self.sample(r, lb, logits[rows[(rid, lb)] - 1])
        for r in live:
            self.most_window_pages = max(self.most_window_pages, self.window_pages(r.rid))
            if r.samples == 2 and r.out and SAMPLE not in r.fed:
                self.fork(r)
            if r.finished():
                if self.remove:
                    self.kv.remove_request(r.rid)
                r.state = "done"

    def batch(self, plan: KVPlanOutputs, work: dict[tuple[str, str], list[int]]
              ) -> tuple[list[int], list[int], dict[tuple[str, str], int]]:
        """The packed batch in the plan's row order, and where each
        segment's rows end. Every group's table orders the same segments the
        same way and puts each at the same positions."""
        ids: list[int] = []
        pos: list[int] = []
        rows: dict[tuple[str, str], int] = {}
        first = plan[MAIN]
        for view in first.views:
            key = (view.request_id, view.label)
            tokens = work[key]
            assert view.to_compute == len(tokens)
            start = view.offset + view.length - view.to_compute
            assert start == self.kv.stored_len(*key)
            ids += tokens
            pos += range(start, start + len(tokens))
            rows[key] = len(ids)
        for g, group in enumerate(self.groups[1:], 1):
            out = plan[group_label(MAIN, self.groups, g)]
            assert torch.equal(out.cpu_indptrs.qo_indptr, first.cpu_indptrs.qo_indptr)
            for view, want in zip(out.views, first.views, strict=True):
                assert view.request_id == want.request_id
                assert view.label == group_label(want.label, self.groups, g)
                # a window group's view starts past its released pages
                assert view.offset % self.kv.config.page_size == 0
                assert view.offset + view.length == want.length, (group.name, view, want)
        return ids, pos, rows

    def sample(self, r: Request, label: str, logits: torch.Tensor) -> None:
        if label == MAIN and not r.out:
            top = logits.topk(2).indices.tolist()
            r.out[MAIN] = [top[0]]
            r.ids[MAIN].append(top[0])
            r.logits[MAIN] = [logits]
            if r.samples == 2:
                r.out[SAMPLE] = [top[1]]  # the second sample starts from the runner-up
                r.logits[SAMPLE] = [logits]
            return
        r.logits[label].append(logits)
        tok = int(logits.argmax())
        r.out[label].append(tok)
        r.ids[label].append(tok)

    def fork(self, r: Request) -> None:
        """Fork main onto the second sample's stream in every group, copy on
        write. A fork applies to every padded request: this step pads only ``r``."""
        step = KVStep(segments=[], pre_forks=[(MAIN, SAMPLE)])
        ctx = StepContext(padded_request_ids=[r.rid])
        assert self.kv.admit(step, ctx).ok
        self.kv.plan(step, ctx)
        self.kv.commit(step, ctx)
        r.fed[SAMPLE] = self.kv.stored_len(r.rid, SAMPLE)
        assert r.fed[SAMPLE] == r.fed[MAIN]
        r.ids[SAMPLE] = list(r.prompt) + r.out[SAMPLE]
        self.kv.follow_tokens(r.rid, r.ids[SAMPLE], SAMPLE)

    def window_pages(self, rid: str) -> int:
        return max((len(s.pages) for s in self.kv.observe().streams()
                    if s.request_id == rid and GROUP_SEP in s.label), default=0)

    def streams(self, rid: str) -> dict[str, Any]:
        return {s.label: s for s in self.kv.observe().streams() if s.request_id == rid}


def prompts_of(lens: list[int], seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lens]


def check_cache_against_transformers(engine: Engine, r: Request) -> None:
    """Each group's stream holds transformers' own K/V for its layers: a full
    layer every token, a sliding layer (at least) the ``S - 1`` it keeps."""
    kv, model = engine.kv, engine.model
    fed = r.prompt + r.out[MAIN][:-1]  # the last sampled token is never fed
    with torch.no_grad():
        cache = model(torch.tensor([fed]), use_cache=True).past_key_values
    for g, group in enumerate(engine.groups):
        ours = kv.read_stream(r.rid, group_label(MAIN, engine.groups, g))
        for slot, layer in enumerate(group.layers):
            k_hf = cache.layers[layer].keys[0].transpose(0, 1)
            v_hf = cache.layers[layer].values[0].transpose(0, 1)
            n = k_hf.shape[0]
            assert n == (len(fed) if group.retention is None
                         else min(len(fed), window_of(model) - 1))
            torch.testing.assert_close(ours[slot, -n:, 0], k_hf, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ours[slot, -n:, 1], v_hf, atol=1e-5, rtol=1e-5)


MODELS = {
    "gemma3": (GEMMA3_LAYERS, GEMMA3_WINDOW),
    "gpt-oss": (GPT_OSS_LAYERS, GPT_OSS_WINDOW),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request: pytest.FixtureRequest) -> Gemma3ForCausalLM:
    layer_types, window = MODELS[request.param]
    return build_model(layer_types, window)


def assert_sample_greedy(model: Gemma3ForCausalLM, r: Request) -> None:
    """Main is greedy generate's; a second sample starts from the runner-up
    first token, then is greedy after it. Every logits row a token was
    picked from is transformers' own for the same tokens: a KV slightly
    wrong (a page short of a window, say) moves logits far more than the
    tolerance, though it need not flip a greedy pick."""
    assert r.out[MAIN] == greedy_generate(model, [r.prompt], r.new_tokens)[0], r.rid
    if r.samples == 2:
        with torch.no_grad():
            last = model(torch.tensor([r.prompt])).logits[0, -1]
        runner_up = int(last.topk(2).indices[1])
        assert r.out[SAMPLE][0] == runner_up, r.rid
        want = greedy_generate(model, [[*r.prompt, runner_up]], r.new_tokens - 1)[0]
        assert r.out[SAMPLE][1:] == want, r.rid
    for label, out in r.out.items():
        with torch.no_grad():
            dense = model(torch.tensor([r.prompt + out[:-1]])).logits[0, len(r.prompt) - 1:]
        got = torch.stack(r.logits[label])
        assert got.shape == dense.shape
        err = float((got - dense).abs().max())
        assert err <= 1e-4, (r.rid, label, err)


def test_the_window_decides_the_tokens(model: Gemma3ForCausalLM) -> None:
    """The same weights with the sliding layers reading every token pick
    otherwise: the window groups' windows are exercised, not idle."""
    differs = False
    with torch.no_grad():
        for p in prompts_of([5, 21, 13]):
            want = greedy_generate(model, [p], 16)[0]
            ids = torch.tensor([p + want[:-1]])
            assert model(ids).logits[0, len(p) - 1:].argmax(-1).tolist() == want
            window = window_of(model)
            model.config.sliding_window = 256  # past every sequence: full attention
            try:
                full = model(ids).logits[0, len(p) - 1:].argmax(-1).tolist()
            finally:
                model.config.sliding_window = window
            differs |= full != want
    assert differs


@pytest.mark.parametrize(("page_size", "chunk", "backend"),
                         [(4, None, "torch"), (2, 3, "sdpa")],
                         ids=["ps4-torch", "ps2-chunked-sdpa"])
def test_hybrid_generate_matches_transformers(
    model: Gemma3ForCausalLM, page_size: int, chunk: int | None, backend: Backend
) -> None:
    """(a) Prompts shorter and longer than the window, prefilled whole or in
    chunks beside other requests' decodes, generate what transformers does,
    far past the window; each group's stream holds transformers' K/V for
    its layers, and a window group's never more than ``ceil(S / ps) + 1``
    pages."""
    window = window_of(model)
    kv = make_manager(model, page_size)
    free = kv.num_free_pages
    engine = Engine(model, kv, chunk, backend, remove=False)
    reqs = [Request(f"r{i}", p, 16 + i)
            for i, p in enumerate(prompts_of([5, 2 * window + 3, 1, window + 1]))]
    engine.run(reqs)
    for r in reqs:
        assert len(r.prompt) + r.new_tokens > 2 * window
        assert r.hit == 0  # no two prompts share a page's worth of ids
        assert_sample_greedy(model, r)
        check_cache_against_transformers(engine, r)
        kv.remove_request(r.rid)
    if chunk is not None:
        assert engine.steps > 16 + 3 + 1  # the long prompts were split
    assert engine.most_window_pages == -(-window // page_size) + 1  # reached, not passed
    # the pool is whole again, the pages keyed as they filled kept cached
    assert kv.num_free_pages == free and kv.num_cached_pages > 0


def test_prefix_hit_served_by_every_group(model: Gemma3ForCausalLM) -> None:
    """(b) A second turn of a chat re-sends the first turn's prompt and
    answer: its prompt hits every group, the window groups attaching only
    the pages their window reads at the hit point, and it generates what
    transformers does. A prompt that parts from the first inside its
    window-passed head hits nothing: the window group's pages there went
    back blank (H3), so no group attaches (H2)."""
    window = window_of(model)
    ps = 2  # divides both windows: the hit point's window starts on a page
    kv = make_manager(model, ps)
    engine = Engine(model, kv)
    first = Request("turn1", prompts_of([11])[0], 12)
    engine.run([first])
    stored = len(first.prompt) + first.new_tokens - 1  # the last token is never fed
    assert stored > 2 * window

    suffix, other = prompts_of([5, 9], seed=3)
    second = Request("turn2", first.prompt + first.out[MAIN] + suffix, 10, arrival=1)
    parted = Request("parted", first.prompt[:5] + other, 10, arrival=1)
    busy = Request("busy", prompts_of([7], seed=4)[0], 12)  # decodes beside them
    engine.run([busy, second, parted])

    assert second.hit == stored // ps * ps > 0
    groups = engine.groups
    streams = engine.arrived["turn2"]
    assert len(streams) == len(groups)
    for g, group in enumerate(groups):
        s = streams[group_label(MAIN, groups, g)]
        assert s.stored_len == second.hit  # the same tokens in every group
        if group.retention is None:
            assert s.released == 0 and len(s.pages) == second.hit // ps
        else:
            # the window group's table starts at the first page its window
            # reads at the hit: the hit covered pages there, not only the full group
            assert s.released == (second.hit - window) // ps * ps > 0
            assert len(s.pages) == (second.hit - s.released) // ps > 0
    assert parted.hit == 0
    assert all(s.stored_len == 0 for s in engine.arrived["parted"].values())
    for r in (second, parted, busy):
        assert_sample_greedy(model, r)


def test_fork_samples_match_transformers(model: Gemma3ForCausalLM) -> None:
    """(c) Parallel sampling: once the prompt (longer than the window) is
    in, main forks onto a second sample in every group, copy on write, and
    both continue greedily, each from its own first token, beside another
    request. A forked sample keys its pages as its source does (in every
    group): a later turn that re-sends the second sample's text hits it,
    sharing the pages the finished (still held) request holds."""
    window = window_of(model)
    ps = 2
    kv = make_manager(model, ps)
    free = kv.num_free_pages
    engine = Engine(model, kv, chunk=6, remove=False)
    prompt = prompts_of([window + 9])[0]
    pair = Request("pair", prompt, 12, samples=2)
    solo = Request("solo", prompts_of([4], seed=5)[0], 14)
    engine.run([pair, solo])
    assert set(pair.out) == {MAIN, SAMPLE} and pair.out[MAIN] != pair.out[SAMPLE]
    for r in (pair, solo):
        assert_sample_greedy(model, r)

    again = Request("again", prompt + pair.out[SAMPLE] + prompts_of([3], seed=6)[0], 8)
    engine.run([again])
    assert again.hit == (len(prompt) + pair.new_tokens - 1) // ps * ps > window
    assert_sample_greedy(model, again)
    for r in (pair, solo, again):
        kv.remove_request(r.rid)
    assert kv.num_free_pages == free


def test_a_hit_request_offloads_and_reloads(model: Gemma3ForCausalLM) -> None:
    """A request whose window groups' tables start past released slots
    attached by a hit, preempted mid-decode (offload, every group) and
    reloaded, goes on generating what transformers does."""
    ps = 2
    kv = make_manager(model, ps, host_pages=128)
    engine = Engine(model, kv, chunk=5)
    first = Request("turn1", prompts_of([11])[0], 12)
    engine.run([first])
    late = Request("turn2", first.prompt + first.out[MAIN] + prompts_of([6], seed=7)[0], 10)
    by_layer = engine.attention()
    with torch.no_grad(), attn_implementation(model, ATTN_NAME):
        engine.arrive(late)
        assert late.hit > window_of(model)
        for _ in range(3):  # the prompt's rest, then a decode
            engine.step([late], by_layer)
        assert late.out and kv.offload(late.rid) > 0
        assert kv.reload(late.rid)
        while late.state != "done":
            engine.step([late], by_layer)
    assert_sample_greedy(model, late)
    assert kv.num_free_pages == kv.config.max_num_pages - 1
