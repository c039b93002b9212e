"""examples/engine.py generates, token for token, what transformers' greedy
``generate`` does: every request, both samples of the forked one, through
chunked prefill, preemption, a fork, speculative verify steps and a
disaggregated prefill. Each of those must have happened (the run's `Stats`),
so a change to the example that stopped exercising one fails here too."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "engine.py"


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


def test_example_engine_matches_generate() -> None:
    ex = load_example()
    model = ex.build_model()
    engine = ex.Engine(model, ex.build_draft(model))
    reqs = ex.demo_requests()
    stats = engine.run(reqs)

    with torch.no_grad():
        for r in reqs:
            assert r.state == "done", r.rid
            assert r.out[ex.MAIN] == greedy(model, r.prompt, r.max_new), r.rid
            if r.samples == 2:
                # the second sample starts from the runner-up first token, then is greedy
                runner_up = int(model(torch.tensor([r.prompt])).logits[0, -1].topk(2).indices[1])
                want = [runner_up, *greedy(model, [*r.prompt, runner_up], r.max_new - 1)]
                assert r.out[ex.SAMPLE] == want, r.rid

    # each part of the engine contract ran, not only the happy path
    assert stats.mixed_steps > 0, stats
    assert stats.preemptions > 0 and stats.reloads == stats.preemptions, stats
    assert stats.forks == 1, stats
    assert stats.verify_steps > 0 and 0 < stats.accepted < stats.drafted, stats
    assert stats.pages_truncated > 0, stats
    assert stats.transfers == 1 and stats.leases_released == 1, stats
    # nothing leaked on either manager
    for kv in (engine.kv, engine.prefill_kv):
        assert kv.num_free_pages == kv.config.max_num_pages - 1
