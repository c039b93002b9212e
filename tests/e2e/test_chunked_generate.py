"""End to end: a Llama-4-style model generates through kvref's chunked groups.

transformers' own Llama 4 text model (random weights, a local config):
three chunked local attention layers to one full (NoPE) layer, chunks of
`CHUNK` tokens (Llama 4's 8192, scaled down), a mixture of experts on
every other layer. kvref serves it with ``KVConfig.groups`` from
`groups_for` of its ``layer_types``, a chunked layer's group under
`ChunkedAttention(CHUNK)` (H7 of specs/retention.md), through the engine
loop of `test_hybrid_generate` (packed ragged steps, prefill chunks beside
decodes, the prefix cache on): each layer reads its group's table, a
chunked one with ``PagedAttention(chunk=CHUNK)``. The oracle is
transformers' greedy ``generate`` with its own cache and chunked masks.
Attention temperature tuning (which reads the absolute position from
``cache_position``, not from ``position_ids``) is off: the packed batch
has no single cache position.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Llama4ForCausalLM, Llama4TextConfig

from kvref.core.config import KVConfig
from kvref.core.groups import ChunkedAttention, groups_for
from kvref.manager import KVManager
from kvref.transfer.engine import TransferEngineInfo
from tests.e2e.test_hybrid_generate import (
    MAIN,
    VOCAB,
    Engine,
    Request,
    assert_sample_greedy,
    group_label,
    one_thread,  # noqa: F401  (its autouse fixture: one intra-op thread here too)
    prompts_of,
)
from tests.e2e.test_llama_generate import eager_model

CHUNK = 8
CHUNKED = "chunked_attention"


@pytest.fixture(scope="module")
def model() -> Llama4ForCausalLM:
    cfg = Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2,
        attention_chunk_size=CHUNK, attn_temperature_tuning=False,
        max_position_embeddings=256, initializer_range=0.1, bos_token_id=None,
        eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    m: Llama4ForCausalLM = eager_model(Llama4ForCausalLM, cfg)
    assert list(m.config.layer_types) == [CHUNKED] * 3 + ["full_attention"]
    return m


def make_manager(model: Llama4ForCausalLM, page_size: int) -> KVManager:
    mc = model.config
    chunk = ChunkedAttention(CHUNK)
    cfg = KVConfig(
        num_layers=mc.num_hidden_layers, num_kv_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim, max_seq_len=256, max_num_pages=256, page_size=page_size,
        num_qo_heads=mc.num_attention_heads,
        groups=groups_for([chunk if t == CHUNKED else None for t in mc.layer_types]))
    return KVManager(cfg, "kv", None, TransferEngineInfo(), torch.device("cpu"), torch.float32)


def test_the_chunk_decides_the_tokens(model: Llama4ForCausalLM) -> None:
    """With chunks past every sequence the same weights pick otherwise: the
    oracle's chunked layers are chunked, and so must kvref's be."""
    differs = False
    with torch.no_grad():
        for p in prompts_of([5, 21, 13]):
            ids = torch.tensor([p + [1] * 12])
            want = model(ids).logits[0].argmax(-1).tolist()
            model.config.attention_chunk_size = 256
            try:
                full = model(ids).logits[0].argmax(-1).tolist()
            finally:
                model.config.attention_chunk_size = CHUNK
            differs |= full != want
    assert differs


@pytest.mark.parametrize(("page_size", "chunk", "backend"),
                         [(4, None, "torch"), (2, 3, "sdpa")],
                         ids=["ps4-torch", "ps2-chunked-sdpa"])
def test_llama4_generate_matches_transformers(model: Llama4ForCausalLM, page_size: int,
                                              chunk: int | None, backend: str) -> None:
    """Prompts shorter and longer than a chunk, prefilled whole or in pieces
    that cross chunk boundaries beside other requests' decodes, generate
    what transformers does; a chunked group's stream never holds more than
    its chunk's pages after a commit."""
    kv = make_manager(model, page_size)
    free = kv.num_free_pages
    engine = Engine(model, kv, chunk, backend)  # type: ignore[arg-type]
    reqs = [Request(f"r{i}", p, 14 + i)
            for i, p in enumerate(prompts_of([5, 2 * CHUNK + 3, 1, CHUNK + 1]))]
    engine.run(reqs)
    for r in reqs:
        assert len(r.prompt) + r.new_tokens > 2 * CHUNK
        assert_sample_greedy(model, r)  # type: ignore[arg-type]
    assert engine.most_window_pages == CHUNK // page_size  # reached, not passed
    assert kv.num_free_pages == free


def test_a_prefix_hit_reads_its_chunk(model: Llama4ForCausalLM) -> None:
    """A second turn re-sends the first's prompt and answer: it hits every
    group, each chunked group attaching only the pages of the hit point's
    chunk, and generates what transformers does."""
    ps = 2
    kv = make_manager(model, ps)
    engine = Engine(model, kv)  # type: ignore[arg-type]
    first = Request("turn1", prompts_of([11])[0], 12)
    engine.run([first])
    stored = len(first.prompt) + first.new_tokens - 1
    second = Request("turn2", first.prompt + first.out[MAIN] + prompts_of([5], seed=3)[0], 10)
    engine.run([second])
    assert second.hit == stored // ps * ps > CHUNK
    groups = engine.groups
    for g, group in enumerate(groups):
        s = engine.arrived["turn2"][group_label(MAIN, groups, g)]
        assert s.stored_len == second.hit
        start = 0 if group.retention is None else second.hit // CHUNK * CHUNK
        assert s.released == start and len(s.pages) == (second.hit - start) // ps
    assert_sample_greedy(model, second)  # type: ignore[arg-type]
