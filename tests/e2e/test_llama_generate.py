"""End to end: a real Llama generates through kvref's paged KV, token for token.

The oracle is transformers' own greedy ``generate`` (eager attention, its
DynamicCache), one prompt at a time. The same weights then generate through
kvref: a custom function registered in transformers' ``AttentionInterface``
writes each layer's new K/V with ``KVManager.write_kv`` and attends with
kvref's torch reference over the manager's page table and ``layer_view``.

How the model is driven: every step is ONE forward of a packed, ragged batch
(``input_ids`` of shape ``[1, total_tokens]``, no padding), request-major in
the order of the step's segments, with ``position_ids`` giving each token its
own position in its own request. Everything but attention (embeddings, norms,
MLP, the LM head) is per token, so packing changes nothing there; RoPE is
applied by the model from ``position_ids`` before our function sees q/k.
Only attention mixes tokens, and it is exactly kvref's page table that keeps
the requests apart and causal. That makes the step look like an inference
engine's (prefill chunks and decode tokens of different requests in one
batch) and tests the ragged page table, not only a batch of one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface

from kvref.attention.paged import PagedAttention
from kvref.core.config import KVConfig, KVLayout
from kvref.manager import KVManager
from kvref.stepping.step import KVStep, Segment, StepContext
from kvref.transfer.engine import TransferEngineInfo

ATTN_NAME = "kvref_paged"
NEW_TOKENS = 10
PROMPT_LENS = [5, 11, 1, 17, 8]
VOCAB = 128


@dataclass
class KVRefForward:
    """What one forward's attention calls need; passed down as a model kwarg."""

    manager: KVManager
    attention: PagedAttention


def kvref_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query: [1, Hq, T, D]``, ``key/value: [1, Hkv, T, D]`` (already rotated).

    The mask is ignored: the page table says who attends to what.
    """
    fwd: KVRefForward = kwargs["kvref"]
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    q = query[0].transpose(0, 1)  # -> [T, Hq, D]
    fwd.manager.write_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), layer_idx=layer)
    out = fwd.attention.run(q, fwd.manager.layer_view(layer))
    return out.unsqueeze(0), None  # [1, T, Hq, D], as eager returns it


AttentionInterface.register(ATTN_NAME, kvref_attention)
# transformers builds a mask per implementation name; ours needs none, and an
# unregistered name would fail the lookup
AttentionMaskInterface.register(ATTN_NAME, lambda *args, **kwargs: None)


# a tiny random-weight decoder; the sliding-window test builds Mistral from it
TINY: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    # wider than the default 0.02, so greedy picks are decided by margins
    # far above float32 noise, not by near-ties
    "initializer_range": 0.1,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": 0,
}


def eager_model(model_cls: Any, cfg: Any) -> Any:
    """``model_cls(cfg)`` seeded, in eval mode, with eager attention and no
    end-of-sequence token (every generate runs its full length)."""
    torch.manual_seed(0)
    cfg._attn_implementation = "eager"
    m = model_cls(cfg).eval()
    m.generation_config.eos_token_id = None
    return m


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return eager_model(LlamaForCausalLM, LlamaConfig(**TINY))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def forward_logits(model: Any, mgr: KVManager, attn: PagedAttention, plan: Any,
                   ids: list[int], pos: list[int]) -> torch.Tensor:
    """One forward pass of the batch's tokens through kvref's attention, as
    planned: a row of logits per token."""
    attn.plan(plan)
    logits: torch.Tensor = model(
        input_ids=torch.tensor([ids]),
        position_ids=torch.tensor([pos]),
        use_cache=False,
        kvref=KVRefForward(mgr, attn),
    ).logits[0]
    return logits


def greedy_generate(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy generate with its own KV cache, one prompt at a
    time: the ``new_tokens`` that follow each."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                use_cache=True,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


@pytest.fixture(scope="module")
def oracle(model: LlamaForCausalLM, prompts: list[list[int]]) -> list[list[int]]:
    return greedy_generate(model, prompts, NEW_TOKENS)


@contextmanager
def attn_implementation(model: LlamaForCausalLM, name: str) -> Iterator[None]:
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


@dataclass
class Request:
    rid: str
    prompt: list[int]
    out: list[int] = field(default_factory=list)
    fed: int = 0  # tokens whose K/V are in the cache

    def pending(self) -> list[int]:
        if self.fed < len(self.prompt):
            return self.prompt[self.fed :]
        return [self.out[-1]]  # decode: the last sampled token

    @property
    def done(self) -> bool:
        return len(self.out) == NEW_TOKENS


def make_manager(layout: KVLayout, page_size: int, model: LlamaForCausalLM) -> KVManager:
    mc = model.config
    cfg = KVConfig(
        num_layers=mc.num_hidden_layers,
        num_kv_heads=int(mc.num_key_value_heads),
        head_dim=mc.hidden_size // mc.num_attention_heads,
        max_seq_len=256,
        max_num_pages=256,
        page_size=page_size,
        num_qo_heads=mc.num_attention_heads,
        layout=layout,
    )
    return KVManager(cfg, "kv", None, TransferEngineInfo(), torch.device("cpu"), torch.float32)


def generate_paged(
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    mgr: KVManager,
    chunk: int | None,
) -> tuple[list[Request], int]:
    """Greedy generation, every step one packed forward over all live requests.

    ``chunk`` caps a request's tokens per step (chunked prefill): a long
    prompt then shares steps with other requests' decode tokens.
    """
    attn = PagedAttention.from_config(
        mgr.config, backend="torch", sm_scale=model.model.layers[0].self_attn.scaling
    )
    reqs = [Request(f"r{i}", p) for i, p in enumerate(prompts)]
    for r in reqs:
        mgr.ingest_request(r.rid)
    steps = 0
    with torch.no_grad(), attn_implementation(model, ATTN_NAME):
        while live := [r for r in reqs if not r.done]:
            spans = {r.rid: r.pending()[:chunk] for r in live}
            step = KVStep(segments=[Segment(r.rid, "main", span=len(spans[r.rid])) for r in live])
            ctx = StepContext(padded_request_ids=[r.rid for r in live])
            outcome = mgr.admit(step, ctx)
            assert outcome.ok, outcome
            plan = mgr.plan(step, ctx)["main"]
            ids: list[int] = []
            pos: list[int] = []
            for view, r in zip(plan.views, live, strict=True):
                assert view.request_id == r.rid and view.to_compute == len(spans[r.rid])
                # the positions come from kvref's view; they must be what was fed so far
                start = view.length - view.to_compute
                assert start == r.fed == mgr.stored_len(r.rid)
                ids += spans[r.rid]
                pos += range(start, view.length)
            logits = forward_logits(model, mgr, attn, plan, ids, pos)
            mgr.commit(step, ctx)
            last_rows = plan.cpu_indptrs.qo_indptr[1:] - 1
            for r, row in zip(live, last_rows.tolist(), strict=True):
                r.fed += len(spans[r.rid])
                if r.fed >= len(r.prompt):  # the prompt is in: this row predicts a token
                    r.out.append(int(logits[row].argmax()))
            steps += 1
    return reqs, steps


def check_cache_against_transformers(
    model: LlamaForCausalLM, mgr: KVManager, reqs: list[Request]
) -> None:
    """Each stream's K/V equal transformers' own cache for the same tokens (I7, end to end)."""
    with torch.no_grad():
        for r in reqs:
            fed = r.prompt + r.out[:-1]  # the last sampled token is never fed
            assert mgr.stored_len(r.rid) == len(fed)
            cache = model(torch.tensor([fed]), use_cache=True).past_key_values
            ours = mgr.read_stream(r.rid)  # [layers, len, 2, Hkv, D]
            for layer in range(model.config.num_hidden_layers):
                k_hf = cache.layers[layer].keys[0].transpose(0, 1)
                v_hf = cache.layers[layer].values[0].transpose(0, 1)
                torch.testing.assert_close(ours[layer, :, 0], k_hf, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(ours[layer, :, 1], v_hf, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("layout", "page_size", "chunk"),
    [
        pytest.param(KVLayout.NHD, 4, None, id="NHD-ps4-prefill"),
        pytest.param(KVLayout.NHD, 4, 3, id="NHD-ps4-chunked"),
        pytest.param(KVLayout.HND, 8, None, id="HND-ps8-prefill"),
        pytest.param(KVLayout.HND, 1, 4, id="HND-ps1-chunked"),
    ],
)
def test_generate_matches_transformers(
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    oracle: list[list[int]],
    layout: KVLayout,
    page_size: int,
    chunk: int | None,
) -> None:
    mgr = make_manager(layout, page_size, model)
    free_before = mgr.num_free_pages
    reqs, steps = generate_paged(model, prompts, mgr, chunk)
    for r, want in zip(reqs, oracle, strict=True):
        assert r.out == want, f"{r.rid} (prompt {len(r.prompt)}): {r.out} != {want}"
    if chunk is not None:
        # the 17-token prompt really was split, and shared steps with decodes
        assert steps > NEW_TOKENS + 1
    check_cache_against_transformers(model, mgr, reqs)
    for r in reqs:
        mgr.remove_request(r.rid)
    assert mgr.num_free_pages == free_before
