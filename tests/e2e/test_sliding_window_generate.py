"""End to end: a sliding-window Mistral generates through kvref's windowed label.

The oracle is transformers' greedy ``generate`` (eager attention, its
DynamicCache with sliding layers), one prompt at a time. The same weights
then generate through kvref, driven as in `test_llama_generate` (one packed,
ragged forward per step, attention by kvref's page table), but with the
label ``main`` windowed: ``RetentionPolicy(context_budget=SLIDING_WINDOW)``.

The semantics match exactly: transformers' ``sliding_window_overlay`` keeps
``kv_idx > q_idx - sliding_window``, i.e. a query sees itself and the
``sliding_window - 1`` tokens before it. That is ``context_budget = S`` and
``window_left = S - 1`` (`RetentionPolicy.window_left`). The windowed
stream releases the pages wholly before its window at each commit, so its
views start at ``offset`` released tokens: a token's position is
``view.offset + j``, and positions keep growing past several windows while
the stream holds at most ``ceil(W / ps) + 1`` pages.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from kvref.attention.paged import Backend, PagedAttention
from kvref.core.config import KVConfig, KVLayout, RetentionPolicy
from kvref.manager import KVManager
from kvref.stepping.step import KVStep, Segment, StepContext
from kvref.transfer.engine import TransferEngineInfo
from tests.e2e.test_llama_generate import (
    ATTN_NAME,
    TINY,
    Request,
    attn_implementation,
    eager_model,
    forward_logits,
    greedy_generate,
)

SLIDING_WINDOW = 16
NEW_TOKENS = 60
# two shorter than the window, one longer: the last one releases pages
# at its prefill's own commit
PROMPT_LENS = [10, 3, 23]
VOCAB = 128
LABEL = "main"


@dataclass
class WindowedRequest(Request):
    @property
    def done(self) -> bool:
        return len(self.out) == NEW_TOKENS


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matmuls gain nothing from intra-op threads, and on a loaded machine
    (the suite's other workers) their spinning costs this module ~30x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> MistralForCausalLM:
    return eager_model(MistralForCausalLM, MistralConfig(**TINY, sliding_window=SLIDING_WINDOW))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@contextmanager
def sliding_window(model: MistralForCausalLM, window: int | None) -> Iterator[None]:
    before = model.config.sliding_window
    model.config.sliding_window = window
    try:
        yield
    finally:
        model.config.sliding_window = before


@pytest.fixture(scope="module")
def oracle(model: MistralForCausalLM, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy generate with its sliding-window cache."""
    return greedy_generate(model, prompts, NEW_TOKENS)


def test_the_window_decides_the_tokens(
    model: MistralForCausalLM, prompts: list[list[int]], oracle: list[list[int]]
) -> None:
    """The same weights with full attention pick otherwise: the window is exercised.

    One teacher-forced forward per prompt: with the window it reproduces the
    oracle's greedy picks, without it (full causal attention) it does not.
    """
    full_differs = False
    with torch.no_grad():
        for p, out in zip(prompts, oracle, strict=True):
            ids = torch.tensor([p + out[:-1]])
            windowed = model(ids).logits[0, len(p) - 1 :].argmax(-1).tolist()
            assert windowed == out
            with sliding_window(model, None):
                full = model(ids).logits[0, len(p) - 1 :].argmax(-1).tolist()
            full_differs |= full != out
    assert full_differs


def make_manager(layout: KVLayout, page_size: int, model: MistralForCausalLM) -> KVManager:
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
        retention={LABEL: RetentionPolicy(context_budget=SLIDING_WINDOW)},
    )
    return KVManager(cfg, "kv", None, TransferEngineInfo(), torch.device("cpu"), torch.float32)


def held_pages(mgr: KVManager, rid: str) -> int:
    return len(mgr._streams[rid][LABEL].page_indices)


def generate_paged(
    model: MistralForCausalLM,
    prompts: list[list[int]],
    mgr: KVManager,
    chunk: int | None,
    backend: Backend,
) -> tuple[list[WindowedRequest], int, int]:
    """Greedy generation, one packed forward per step, on the windowed label.

    Returns the requests, the steps, and the most pages any stream held
    after a commit once its window had filled.
    """
    cfg = mgr.config
    policy = cfg.retention[LABEL]
    assert policy.window_left == SLIDING_WINDOW - 1
    attn = PagedAttention.from_config(
        cfg,
        backend=backend,
        sm_scale=model.model.layers[0].self_attn.scaling,
        window_left=policy.window_left,
    )
    bound = math.ceil(SLIDING_WINDOW / cfg.page_size) + 1
    reqs = [WindowedRequest(f"r{i}", p) for i, p in enumerate(prompts)]
    for r in reqs:
        mgr.ingest_request(r.rid)
    steps = 0
    most_held = 0
    with torch.no_grad(), attn_implementation(model, ATTN_NAME):
        while live := [r for r in reqs if not r.done]:
            spans = {r.rid: r.pending()[:chunk] for r in live}
            step = KVStep(segments=[Segment(r.rid, LABEL, span=len(spans[r.rid])) for r in live])
            ctx = StepContext(padded_request_ids=[r.rid for r in live])
            outcome = mgr.admit(step, ctx)
            assert outcome.ok, outcome
            plan = mgr.plan(step, ctx)[LABEL]
            ids: list[int] = []
            pos: list[int] = []
            for view, r in zip(plan.views, live, strict=True):
                assert view.request_id == r.rid and view.to_compute == len(spans[r.rid])
                # the view starts at the first retained page: whole pages released
                assert view.offset % cfg.page_size == 0
                assert view.offset == (max(0, r.fed - SLIDING_WINDOW) // cfg.page_size
                                       ) * cfg.page_size
                start = view.offset + view.length - view.to_compute
                assert start == r.fed == mgr.stored_len(r.rid, LABEL)
                ids += spans[r.rid]
                pos += range(start, view.offset + view.length)
            logits = forward_logits(model, mgr, attn, plan, ids, pos)
            mgr.commit(step, ctx)
            last_rows = plan.cpu_indptrs.qo_indptr[1:] - 1
            for r, row in zip(live, last_rows.tolist(), strict=True):
                r.fed += len(spans[r.rid])
                if r.fed >= len(r.prompt):  # the prompt is in: this row predicts a token
                    r.out.append(int(logits[row].argmax()))
                if r.fed >= SLIDING_WINDOW:
                    held = held_pages(mgr, r.rid)
                    assert held <= bound, f"{r.rid} at {r.fed} holds {held} > {bound} pages"
                    most_held = max(most_held, held)
            steps += 1
    return reqs, steps, most_held


def check_window_against_transformers(
    model: MistralForCausalLM, mgr: KVManager, reqs: list[WindowedRequest]
) -> None:
    """The retained window equals transformers' sliding cache for the same tokens.

    ``read_stream`` gives the last W tokens; transformers' sliding layer keeps
    the last ``W - 1`` (the next query adds itself).
    """
    with torch.no_grad():
        for r in reqs:
            fed = r.prompt + r.out[:-1]  # the last sampled token is never fed
            assert mgr.stored_len(r.rid, LABEL) == len(fed)
            cache = model(torch.tensor([fed]), use_cache=True).past_key_values
            ours = mgr.read_stream(r.rid, LABEL)  # [layers, len, 2, Hkv, D]
            assert ours.shape[1] == min(len(fed), SLIDING_WINDOW)
            for layer in range(model.config.num_hidden_layers):
                k_hf = cache.layers[layer].keys[0].transpose(0, 1)
                v_hf = cache.layers[layer].values[0].transpose(0, 1)
                assert k_hf.shape[0] == SLIDING_WINDOW - 1
                tail = ours[layer, -(SLIDING_WINDOW - 1) :]
                torch.testing.assert_close(tail[:, 0], k_hf, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(tail[:, 1], v_hf, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("layout", "page_size", "chunk", "backend"),
    [
        pytest.param(KVLayout.NHD, 4, None, "torch", id="NHD-ps4-prefill-torch"),
        pytest.param(KVLayout.NHD, 4, 3, "sdpa", id="NHD-ps4-chunked-sdpa"),
        pytest.param(KVLayout.HND, 8, 5, "torch", id="HND-ps8-chunked-torch"),
    ],
)
def test_windowed_generate_matches_transformers(
    model: MistralForCausalLM,
    prompts: list[list[int]],
    oracle: list[list[int]],
    layout: KVLayout,
    page_size: int,
    chunk: int | None,
    backend: Backend,
) -> None:
    mgr = make_manager(layout, page_size, model)
    free_before = mgr.num_free_pages
    reqs, steps, most_held = generate_paged(model, prompts, mgr, chunk, backend)
    for r, want in zip(reqs, oracle, strict=True):
        assert r.out == want, f"{r.rid} (prompt {len(r.prompt)}): {r.out} != {want}"
        # past several windows: positions far beyond what the stream holds
        assert len(r.prompt) + NEW_TOKENS > 3 * SLIDING_WINDOW
    # the bound is reached, not only respected
    assert most_held == math.ceil(SLIDING_WINDOW / page_size) + 1
    if chunk is not None:
        assert steps > NEW_TOKENS + 1
    check_window_against_transformers(model, mgr, reqs)
    for r in reqs:
        mgr.remove_request(r.rid)
    assert mgr.num_free_pages == free_before
