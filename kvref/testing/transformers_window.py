"""transformers' sliding-window allocator against kvref's window bound (W3 of
specs/retention.md), under the same steps (issue 43, item 5).

transformers keeps a request of a sliding-window group in a ring of
ceil(min(n, W) / page) blocks: token t lives in slot t % W, so it never
releases a block, it overwrites.  kvref releases the pages wholly before the
window at each commit: after a commit to n tokens its stream holds
ceil(n / ps) - floor(max(0, n - W) / ps) pages (the model's `need` less its
`retired_slots`), at most ceil(W / ps) + 1; inside a step of q tokens it holds
the step's new pages too, taken before the commit's release.

`compare(W, ps, steps)` runs both: transformers' `SlidingAttentionCacheAllocator`
in a real `PagedAttentionCache` (one sliding layer) through
`can_store_request_tokens` step by step, and kvref's model through its own
page arithmetic for the same window, page size and step sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvref.testing.transformers_pool import Tf
from kvref_model.core import Model, Scope

SLIDING = "sliding_attention"


@dataclass(frozen=True)
class Row:
    tokens: int  # after the step
    transformers: int  # blocks its table holds after the step
    kvref_settled: int  # pages after the commit's release
    kvref_peak: int  # pages inside the step (new ones taken before the release)
    bound: int  # W3: ceil(W / ps) + 1


def _cache(tf: Tf, window: int, ps: int) -> Any:
    import torch
    from transformers import LlamaConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cfg = LlamaConfig(hidden_size=16, num_attention_heads=1, num_key_value_heads=1,
                      head_dim=16, num_hidden_layers=1, intermediate_size=16, vocab_size=16)
    cfg.sliding_window = window  # no layer_types: every layer slides (one group)
    cb = ContinuousBatchingConfig(page_size=ps, num_blocks=-(-window // ps) + 2,
                                  max_batch_tokens=16, max_memory_percent=0.5)
    return tf.cache.PagedAttentionCache(cfg, cb, "cpu",
                                        tf.distributed.DistributedHelper(None, None),
                                        dtype=torch.float32)


def compare(tf: Tf, window: int, ps: int, steps: list[int]) -> list[Row]:
    cache = _cache(tf, window, ps)
    alloc = cache.cache_allocators[SLIDING]
    model = Model(Scope(page_size=ps, windows=(window,)))
    rows, n = [], 0
    for q in steps:
        state = tf.requests.RequestState(request_id="r", initial_tokens=[],
                                         position_offset=n)
        if not cache.can_store_request_tokens(state, q):
            raise RuntimeError(f"transformers refused a step of {q} at {n} tokens")
        n += q
        settled = model.need(n) - model.retired_slots(0, n)
        peak = model.need(n) - model.retired_slots(0, n - q)
        rows.append(Row(n, len(alloc.block_table["r"]), settled, peak,
                        model.need(window) + 1))
    return rows
