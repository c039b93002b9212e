"""examples/engine.py generates, token for token, what transformers' greedy
``generate`` does: every request, both samples of the forked one, through
chunked prefill, prefix-cache hits (a prompt whose system prompt was served
from another request's pages), preemption, a copy-on-write fork, speculative
verify steps and a disaggregated prefill. Each of those must have happened
(the run's `Stats`), so a change to the example that stopped exercising one
fails here too. The prefix cache's hit rate and the pages sharing saved are
printed (``pytest -s``) and asserted."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "engine.py"


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matmuls gain nothing from intra-op threads, and on a loaded machine
    their spinning costs these runs ~15x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvref_example_engine", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, use_cache=True)
    return list(out[0, len(prompt):].tolist())


# Random weights make near-ties: at one step of one request the two best
# logits were 3.6e-7 apart, and generate's cached decode and the engine's
# packed forward sum in different orders, so they picked different tokens.
# A gap this small is float noise; a wrong KV moves logits by far more.
TIE = 1e-4


def assert_greedy(model: Any, prompt: list[int], out: list[int], rid: str) -> None:
    """``out`` is what greedy ``generate`` gives after ``prompt``; where the
    two part, only at a float tie: then every token of ``out`` must be a
    greedy pick, within `TIE`, of the model run over its own prefix."""
    want = greedy(model, prompt, len(out))
    if out == want:
        return
    first = next(i for i, (a, b) in enumerate(zip(out, want, strict=True)) if a != b)
    # one forward over the engine's tokens: row i scores token i
    logits = model(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:]
    best = logits.max(dim=-1).values
    gaps = best - logits.gather(1, torch.tensor(out)[:, None])[:, 0]
    at_split = float(best[first] - logits[first, want[first]])
    assert at_split <= TIE, (rid, first, out[first], want[first], at_split)
    assert float(gaps.max()) <= TIE, (rid, int(gaps.argmax()), float(gaps.max()))


def test_example_engine_matches_generate() -> None:
    ex = load_example()
    model = ex.build_model()
    engine = ex.Engine(model, ex.build_draft(model))
    reqs = ex.demo_requests()
    stats = engine.run(reqs)

    with torch.no_grad():
        for r in reqs:
            assert r.state == "done", r.rid
            assert_greedy(model, r.prompt, r.out[ex.MAIN], r.rid)
            if r.samples == 2:
                # the second sample starts from the runner-up first token, then is greedy
                runner_up = int(model(torch.tensor([r.prompt])).logits[0, -1].topk(2).indices[1])
                assert r.out[ex.SAMPLE][0] == runner_up, r.rid
                assert_greedy(model, [*r.prompt, runner_up], r.out[ex.SAMPLE][1:], r.rid)

    # shared pages: the requests that open with the system prompt and arrive
    # once it is cached compute only what follows it
    sharing = [r for r in reqs if r.prompt[:ex.SYSTEM_LEN] == reqs[0].prompt[:ex.SYSTEM_LEN]]
    assert len(sharing) >= 3 and 2 * engine.kv.config.page_size < ex.SYSTEM_LEN
    assert [r.hit for r in sharing] == [0] + [ex.SYSTEM_LEN] * (len(sharing) - 1)
    assert stats.hit_tokens == sum(r.hit for r in reqs)
    assert stats.prompt_tokens == sum(len(r.prompt) for r in reqs)
    print(f"\nprefix cache hit rate {stats.hit_rate:.1%} ({stats.hit_tokens} of "
          f"{stats.prompt_tokens} prompt tokens); pages saved {stats.pages_saved}")
    assert stats.hit_rate > 0 and stats.pages_cached > 0, stats
    assert stats.pages_saved > 0, stats
    # the fork shared the prompt's full pages and copied only its partial last one
    pair = next(r for r in reqs if r.samples == 2)
    assert len(pair.prompt) // engine.kv.config.page_size >= 3
    assert stats.fork_pages == (1 if len(pair.prompt) % engine.kv.config.page_size else 0)

    # each part of the engine contract ran, not only the happy path
    assert stats.mixed_steps > 0, stats
    assert stats.preemptions > 0 and stats.reloads == stats.preemptions, stats
    assert stats.forks == 1, stats
    assert stats.verify_steps > 0 and 0 < stats.accepted < stats.drafted, stats
    assert stats.pages_truncated > 0, stats
    assert stats.transfers == 1 and stats.leases_released == 1, stats
    # the same run without sharing: the same tokens, no hits, nothing saved,
    # and the fork copies the whole prompt
    plain = ex.Engine(model, ex.build_draft(model), prefix_caching=False)
    plain_reqs = ex.demo_requests()
    plain_stats = plain.run(plain_reqs)
    assert [r.out for r in plain_reqs] == [r.out for r in reqs]
    assert plain_stats.hit_tokens == plain_stats.pages_cached == plain_stats.pages_saved == 0
    assert plain_stats.fork_pages == -(-len(pair.prompt) // engine.kv.config.page_size)

    # nothing leaked on either manager: every page is free, cached or blank,
    # and with nothing held the cache can be reset to all blank
    for kv in (engine.kv, engine.prefill_kv):
        assert kv.num_free_pages == kv.config.max_num_pages - 1
        cached = kv.num_cached_pages
        assert kv.reset_prefix_cache() == cached
        assert kv.num_cached_pages == 0 and kv.num_free_pages == kv.config.max_num_pages - 1


def test_example_engine_windowed_matches_generate() -> None:
    """The windowed option: a Mistral with ``sliding_window = 16`` on windowed
    labels generates what ``generate`` (its sliding-window cache) does, for
    every request and both samples, through chunked prefill, preemption, the
    fork, speculative verify steps and a disaggregated prefill whose prompt
    outruns the window, far past several windows; no stream ever holds more
    than ``ceil((W + k) / ps) + 1`` pages (k the rollback margin, W15), and
    one reaches that."""
    window = 16
    ex = load_example()
    model = ex.build_model(sliding_window=window)
    engine = ex.Engine(model, ex.build_draft(model), sliding_window=window)
    reqs = ex.demo_requests(ex.WINDOWED_MAX_NEW, windowed=True)
    # the disaggregated prompt outruns the window: its publication releases
    assert any(r.disaggregated and len(r.prompt) > window for r in reqs)
    stats = engine.run(reqs)

    with torch.no_grad():
        for r in reqs:
            assert r.state == "done", r.rid
            # past several windows: positions far beyond what a stream holds
            assert len(r.prompt) + r.max_new > 3 * window, r.rid
            assert_greedy(model, r.prompt, r.out[ex.MAIN], r.rid)
            if r.samples == 2:
                runner_up = int(model(torch.tensor([r.prompt])).logits[0, -1].topk(2).indices[1])
                assert r.out[ex.SAMPLE][0] == runner_up, r.rid
                assert_greedy(model, [*r.prompt, runner_up], r.out[ex.SAMPLE][1:], r.rid)
        # the window decides the tokens: the same weights with full attention differ
        model.config.sliding_window = None
        try:
            full = [greedy(model, r.prompt, r.max_new) for r in reqs]
        finally:
            model.config.sliding_window = window
        assert any(f != r.out[ex.MAIN] for f, r in zip(full, reqs, strict=True))

    ps = engine.kv.config.page_size
    print(f"\nwindow {window}, page size {ps}: at most {stats.window_pages} pages held, "
          f"bound {stats.window_bound}")
    # W15: the rollback margin (the engine's draft_len) counts with the window
    assert stats.window_bound == -(-(window + engine.draft_len) // ps) + 1
    assert stats.window_pages == stats.window_bound  # respected, and reached
    # kvref refuses prefix hits on windowed labels: nothing hit, nothing cached
    assert stats.hit_tokens == stats.pages_cached == 0, stats
    # publish and retrieve over the window (W16, W17), the lease given back
    assert stats.transfers == stats.leases_released == 1, stats
    assert stats.mixed_steps > 0, stats
    assert stats.preemptions > 0 and stats.reloads == stats.preemptions, stats
    assert stats.forks == 1, stats
    # speculative rollbacks within the window: truncate freed pages, never refused
    assert stats.verify_steps > 0 and 0 < stats.accepted < stats.drafted, stats
    assert stats.pages_truncated > 0, stats
    for kv in (engine.kv, engine.prefill_kv):
        assert kv.num_free_pages == kv.config.max_num_pages - 1


def test_example_engine_hybrid_matches_generate() -> None:
    """The hybrid option: a Gemma 3 whose layers alternate a window of 16 and
    full attention, on attention groups (a stream per group, a table per
    group), generates what ``generate`` does for every request and both
    samples, through chunked prefill, prefix hits served by both groups,
    preemption, the fork (copy on write in each group), speculative verify
    steps and a disaggregated prefill; a window group's stream never holds
    more than ``ceil((W + k) / ps) + 1`` pages, and one reaches that."""
    window = 16
    ex = load_example()
    model = ex.build_model(sliding_window=window, hybrid=True)
    engine = ex.Engine(model, ex.build_draft(model), sliding_window=window, hybrid=True,
                       **ex.HYBRID_ENGINE)
    reqs = ex.demo_requests(ex.WINDOWED_MAX_NEW, windowed=True)
    stats = engine.run(reqs)
    groups = engine.kv.config.groups
    assert [g.retention is None for g in groups] == [True, False]

    with torch.no_grad():
        for r in reqs:
            assert r.state == "done", r.rid
            assert len(r.prompt) + r.max_new > 3 * window, r.rid
            assert_greedy(model, r.prompt, r.out[ex.MAIN], r.rid)
            if r.samples == 2:
                runner_up = int(model(torch.tensor([r.prompt])).logits[0, -1].topk(2).indices[1])
                assert r.out[ex.SAMPLE][0] == runner_up, r.rid
                assert_greedy(model, [*r.prompt, runner_up], r.out[ex.SAMPLE][1:], r.rid)
        # the window decides the tokens: with every layer reading all, they differ
        model.config.sliding_window = 256
        try:
            full = [greedy(model, r.prompt, r.max_new) for r in reqs]
        finally:
            model.config.sliding_window = window
        assert any(f != r.out[ex.MAIN] for f, r in zip(full, reqs, strict=True))

    # the system prompt's pages hit in both groups: the later requests that
    # open with it compute only what follows it
    sharing = [r for r in reqs if r.prompt[:ex.SYSTEM_LEN] == reqs[0].prompt[:ex.SYSTEM_LEN]]
    assert [r.hit for r in sharing] == [0] + [ex.SYSTEM_LEN] * (len(sharing) - 1)
    assert stats.pages_cached > 0 and stats.pages_saved > 0, stats
    ps = engine.kv.config.page_size
    print(f"\nhybrid, window {window}, page size {ps}: hit rate {stats.hit_rate:.1%}, "
          f"at most {stats.window_pages} window pages held, bound {stats.window_bound}")
    assert stats.window_bound == -(-(window + engine.draft_len) // ps) + 1
    assert stats.window_pages == stats.window_bound
    # copy on write in each group: the prompt's partial last page, once per group
    pair = next(r for r in reqs if r.samples == 2)
    assert len(pair.prompt) % ps and stats.fork_pages == len(groups), stats
    assert stats.mixed_steps > 0, stats
    assert stats.preemptions > 0 and stats.reloads == stats.preemptions, stats
    assert stats.forks == 1, stats
    assert stats.verify_steps > 0 and 0 < stats.accepted < stats.drafted, stats
    assert stats.pages_truncated > 0, stats
    assert stats.transfers == stats.leases_released == 1, stats
    for kv in (engine.kv, engine.prefill_kv):
        assert kv.num_free_pages == kv.config.max_num_pages - 1
