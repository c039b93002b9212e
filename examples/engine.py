"""A small continuous-batching engine on kvref's public API.

A random-weight Llama (built from a local ``LlamaConfig``: nothing is
downloaded) generates greedily for a handful of requests that arrive over
time. Every step is one packed forward over every scheduled request, with
kvref's page table keeping them apart. What it shows, each counted in
`Stats` and printed at the end:

- chunked prefill mixed with decode: a long prompt goes in ``chunk`` tokens a
  step, in the same forward as other requests' decode tokens;
- preemption: the device pool is small; when ``admit`` refuses with
  ``AllocationFailed``, the youngest scheduled request is offloaded to host
  memory (``offload``), and reloaded (``reload``) once pages are free;
- prefix caching: several requests open with the same system prompt. A
  request's prompt ids go to ``match_prefix`` when it arrives, which attaches
  the cached pages holding its head to its empty stream; only the rest of the
  prompt is computed, at positions from the hit on, attending to the cached
  KV. Each stream's list of ids (the prompt, then the tokens kept) is
  handed over once (``follow_tokens``), and every commit keys the pages
  it filled, so they become findable for the requests after it;
- parallel sampling: a request asks for two samples; once its prompt is in,
  a fork step forks its ``main`` stream onto ``s1`` (forks apply to every
  request in ``padded_request_ids``, so that step pads only this request).
  The fork is copy-on-write: ``s1`` shares the prompt's full pages and
  copies only the partly filled last one. ``s1`` continues from the
  runner-up first token;
- a speculative verify step: a draft model (the target with perturbed
  weights) proposes tokens; one step computes them all, commits them, and
  ``truncate`` cuts the stream back to the accepted prefix;
- disaggregated prefill: a second manager (the prefill worker) computes a
  prompt, ``publish`` leases its pages, the decode manager copies them with
  ``admit_retrieve`` and, once the copy landed, the lease is released with
  ``release_published``.

A windowed model (``--sliding-window W``, ``Engine(..., sliding_window=W)``):
a Mistral-architecture model whose attention has ``sliding_window = W`` (a
query sees itself and the ``W - 1`` tokens before it). Both labels are
windowed, ``KVConfig.retention = {label: RetentionPolicy(context_budget=W,
rollback_margin=draft_len)}``, and attention masks with ``window_left = W -
1``. A windowed stream releases, at every commit, the pages wholly before
its window less the margin: its plan views start at ``view.offset``
released tokens, so a token's position is ``offset + j``, and it holds at
most ``ceil((W + draft_len) / page_size) + 1`` pages however long it runs
(the summary prints the most any stream held). Chunked prefill, decode,
preemption (offload/reload), the fork (both labels have the same window) and
speculative verify steps work on windowed labels, and so does the
disaggregated prefill: its prompt is longer than the window, so the prefill
manager publishes only the retained pages with ``released`` set, and the
decode manager's retrieve copies only those (W16, W17 of specs/retention.md).
kvref refuses prefix sharing: ``match_prefix`` answers 0 and
``follow_tokens`` follows nothing (W9/W10), so the windowed demo has no
prefix hits. ``truncate`` refuses (``ReleasedPrefixError``) a length
whose window would reach into released tokens; the margin keeps
``draft_len`` tokens past the window, so a verify step that rejects every
draft can always roll back (W15).

A hybrid model (``--hybrid W``, ``Engine(..., sliding_window=W,
hybrid=True)``): a Gemma 3 (the same shapes, RoPE bases per layer type,
Gemma's query scale) whose layers alternate sliding-window attention (W)
and full attention, as Gemma 2 and gpt-oss do (Gemma 3 runs 5:1). kvref
serves it with attention groups, ``KVConfig.groups = groups_for(...)``: one
group per attention type, a page holds one group's layers, and every group
draws from the one pool. A label is one stream per group (``main`` for the
full group, ``main@<group>`` for the window's), so ``plan`` returns a table
per group; each layer attends with its group's table and window, and
``write_kv``/``layer_view`` find its group and its slot in the group's pages
by themselves. Every call on a label moves all its groups together: an admit
reserves in both or neither, a fork, a truncate, an offload and a publish
act on both. Prefix caching works here: a window group keys its pages as
they fill, and a hit attaches what every group serves, the window group
only the pages its window reads at the hit point. The pages a window
passes go back blank, not cached (H1-H5 of specs/retention.md).

The summary reports the prefix cache's hit rate (prompt tokens attached from
the cache over all prompt tokens) and the pages saved: at the step where
sharing saves most, the pages the step's page tables name, summed per stream
(what they would hold without sharing), minus the pages the manager holds
(``max_num_pages - 1 - num_free_pages``).

Run it: ``python examples/engine.py``, ``python examples/engine.py
--sliding-window 16`` for the windowed model, or ``python examples/engine.py
--hybrid 16`` for the hybrid one. ``tests/e2e/test_example_engine.py``
checks every sample's tokens against transformers' ``generate``, in every mode.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    AttentionInterface,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)
from transformers.masking_utils import AttentionMaskInterface

from kvref import (
    AllocationFailed,
    KVConfig,
    KVManager,
    KVPlanOutput,
    KVStep,
    RetentionPolicy,
    Segment,
    StepContext,
    TransferEngineInfo,
)
from kvref.attention.paged import PagedAttention
from kvref.core.groups import GROUP_SEP, ChunkedAttention, groups_for
from kvref.transfer.published import PublishRefused

ATTN_NAME = "kvref_example_engine"
VOCAB = 128
MAIN, SAMPLE = "main", "s1"
SYSTEM_LEN = 12  # the demo's shared system prompt, in tokens

Model = LlamaForCausalLM | MistralForCausalLM | Gemma3ForCausalLM
# the hybrid model's layers: sliding and full attention, alternating
HYBRID_LAYERS = ["sliding_attention", "full_attention"]


# -- the model and kvref's attention inside it ------------------------------------


@dataclass
class Forward:
    """What one forward's attention layers need (passed down as a model kwarg)."""

    manager: KVManager
    # each layer's attention: its group's page table and window (one for all
    # layers without groups)
    attention: dict[int, PagedAttention]


def kvref_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None,
                    scaling: float | None = None, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Write this layer's new K/V into the step's slots, attend over the pages.

    ``query: [1, Hq, T, D]``, ``key/value: [1, Hkv, T, D]``, RoPE applied. The
    mask is ignored: the page table says who attends to what.
    """
    fwd: Forward = kwargs["kvref"]
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    fwd.manager.write_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), layer_idx=layer)
    out = fwd.attention[layer].run(query[0].transpose(0, 1), fwd.manager.layer_view(layer))
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_NAME, kvref_attention)
AttentionMaskInterface.register(ATTN_NAME, lambda *args, **kwargs: None)


def build_model(seed: int = 0, sliding_window: int | None = None,
                hybrid: bool = False) -> Model:
    """A random-weight Llama, or with ``sliding_window`` a Mistral (the same
    shapes) whose every attention layer sees only that many tokens, or with
    ``hybrid`` too a Gemma 3 whose layers alternate a window of that many
    tokens and full attention (`HYBRID_LAYERS`)."""
    torch.manual_seed(seed)
    shape: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        # wider than the default: greedy picks then win by margins far above
        # float32 noise, so a paged forward and a dense one pick the same
        initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    model: Model
    if hybrid:
        if sliding_window is None:
            raise ValueError("a hybrid model needs its sliding_window")
        gemma = Gemma3TextConfig(**{**shape, "num_hidden_layers": len(HYBRID_LAYERS)},
                                 head_dim=16, layer_types=HYBRID_LAYERS,
                                 sliding_window=sliding_window,
                                 # tied, Gemma's scaled embedding dominates random
                                 # logits: greedy would repeat one token
                                 tie_word_embeddings=False)
        gemma._attn_implementation = "eager"
        model = Gemma3ForCausalLM(gemma)
    elif sliding_window is None:
        llama = LlamaConfig(**shape)
        llama._attn_implementation = "eager"
        model = LlamaForCausalLM(llama)
    else:
        mistral = MistralConfig(**shape, sliding_window=sliding_window)
        mistral._attn_implementation = "eager"
        model = MistralForCausalLM(mistral)
    model.train(False)  # inference: no dropout
    model.generation_config.eos_token_id = None
    return model


def build_draft(model: Model, noise: float = 0.02, seed: int = 1) -> Model:
    """A stand-in for a small draft model: the target, weights perturbed, so it
    agrees with the target often but not always."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen))
    return draft


@contextmanager
def attn_implementation(model: Model, name: str) -> Iterator[None]:
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


# -- requests and what the engine did ----------------------------------------------


@dataclass
class Request:
    rid: str
    prompt: list[int]
    max_new: int
    arrival: int  # the engine step it arrives at
    samples: int = 1  # 2: parallel sampling, a second stream forked from main
    speculative: bool = False
    disaggregated: bool = False  # prefilled on the prefill worker's manager
    out: dict[str, list[int]] = field(default_factory=dict)  # label -> tokens
    # label -> the stream's ids: the prompt, then the tokens kept, as the
    # manager reads them when a commit fills a page (`follow_tokens`)
    ids: dict[str, list[int]] = field(default_factory=dict)
    state: str = "new"  # new, transferring, running, swapped, done
    published: Any = None  # the prefill worker's publication, until it landed
    runner_up: int = -1  # the second-best first token: the second sample's start
    hit: int = 0  # prompt tokens attached from the prefix cache

    def labels(self) -> list[str]:
        return list(self.out) or [MAIN]

    def keep(self, label: str, tokens: list[int]) -> None:
        """Tokens the stream keeps: its output, and its list of ids (a
        verify step's drafts join only once accepted)."""
        self.out.setdefault(label, []).extend(tokens)
        self.ids.setdefault(label, list(self.prompt)).extend(tokens)

    def prefilled(self, kv: KVManager) -> bool:
        return kv.stored_len(self.rid) >= len(self.prompt)

    def finished(self) -> bool:
        return bool(self.out) and all(len(t) >= self.max_new for t in self.out.values()) and (
            len(self.out) == self.samples)


@dataclass
class Stats:
    steps: int = 0
    mixed_steps: int = 0  # a prefill chunk and a decode in one forward
    preemptions: int = 0
    pages_offloaded: int = 0
    reloads: int = 0
    forks: int = 0
    fork_pages: int = 0  # device pages the fork took: its partial last page at most
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    pages_truncated: int = 0
    transfers: int = 0
    leases_released: int = 0
    prompt_tokens: int = 0  # every request's prompt
    hit_tokens: int = 0  # of them, attached from the prefix cache
    pages_cached: int = 0  # pages the prefix caches name at the end: keyed as they filled
    pages_saved: int = 0  # at most, in one step: page tables summed minus pages held
    window_pages: int = 0  # the most pages a windowed stream held entering a step
    window_bound: int = 0  # ceil(W / page_size) + 1: what it may hold (0: no window)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class Work:
    """One (request, label) segment of a step: the tokens it feeds."""

    req: Request
    label: str
    tokens: list[int]
    draft: list[int] = field(default_factory=list)  # speculative tokens among them


class Engine:
    """Continuous batching over a decode manager, plus a prefill worker's manager."""

    def __init__(self, model: Model, draft: Model | None = None, *,
                 page_size: int = 4, device_pages: int = 16, chunk: int = 4,
                 draft_len: int = 3, prefix_caching: bool = True,
                 sliding_window: int | None = None, hybrid: bool = False) -> None:
        # the model's window must be the one kvref retains and masks with
        if sliding_window != getattr(model.config, "sliding_window", None):
            raise ValueError(f"sliding_window={sliding_window}, but the model's is "
                             f"{getattr(model.config, 'sliding_window', None)}")
        if hybrid != isinstance(model, Gemma3ForCausalLM):
            raise ValueError(f"hybrid={hybrid} for a {type(model).__name__}")
        self.hybrid = hybrid
        self.model = model
        self.window = sliding_window
        self.prefix_caching = prefix_caching  # off: no hits, and forks copy every page
        self.draft = draft
        self.chunk = chunk
        self.draft_len = draft_len
        self.kv = self._manager("decode", page_size, device_pages)
        self.prefill_kv = self._manager("prefill", page_size, 64)
        self.stats = Stats()
        if sliding_window is not None:
            # W15: the rollback margin holds draft_len tokens past the window
            self.stats.window_bound = math.ceil((sliding_window + draft_len) / page_size) + 1
        self.requests: list[Request] = []

    def _manager(self, name: str, page_size: int, pages: int) -> KVManager:
        mc = self.model.config
        # W15: the rollback margin keeps a verify step's rollback legal
        window = None if self.window is None else RetentionPolicy(
            context_budget=self.window, rollback_margin=self.draft_len)
        cfg = KVConfig(
            num_layers=mc.num_hidden_layers,
            num_kv_heads=mc.num_key_value_heads or mc.num_attention_heads,
            head_dim=mc.hidden_size // mc.num_attention_heads, max_seq_len=256,
            max_num_pages=pages + 1,  # + the sink page
            page_size=page_size, num_qo_heads=mc.num_attention_heads, cpu_offload_pages=64,
            enable_prefix_caching=self.prefix_caching,
            # both labels: the fork's source and target must share a window (W5)
            retention={} if window is None or self.hybrid else {
                lb: window for lb in (MAIN, SAMPLE)},
            # hybrid: a group per attention type, the window on the sliding
            # layers' group; every label has both
            groups=groups_for([window if t == "sliding_attention" else None
                               for t in mc.layer_types or ()]) if self.hybrid else (),
        )
        return KVManager(cfg, name, None, TransferEngineInfo(), torch.device("cpu"),
                         torch.float32)

    # -- the loop ---------------------------------------------------------------

    def run(self, requests: list[Request], max_steps: int = 500) -> Stats:
        self.requests = requests
        with torch.no_grad(), attn_implementation(self.model, ATTN_NAME):
            while not all(r.state == "done" for r in requests):
                if self.stats.steps >= max_steps:
                    raise RuntimeError(f"no progress after {max_steps} steps")
                self.arrive()
                self.land_transfers()
                self.reload_swapped()
                work = self.schedule()
                if work:
                    self.step(work)
                    self.finish()
                elif any(r.state == "transferring" for r in requests):
                    time.sleep(0.001)  # only copies in flight: wait for them
                self.stats.steps += 1
        # what the prefix caches name now, held or free: every page keyed as
        # it filled and not evicted since
        self.stats.pages_cached = sum(p.key is not None for kv in (self.kv, self.prefill_kv)
                                      for p in kv.observe().pages)
        return self.stats

    def arrive(self) -> None:
        for r in self.requests:
            if r.state == "new" and r.arrival <= self.stats.steps:
                self.stats.prompt_tokens += len(r.prompt)
                if r.disaggregated:
                    self.prefill_remotely(r)
                else:
                    self.kv.ingest_request(r.rid)
                    r.hit = self.kv.match_prefix(r.rid, MAIN, r.prompt)
                    self.stats.hit_tokens += r.hit
                    # from here on every commit keys the pages it filled
                    self.kv.follow_tokens(r.rid, r.ids.setdefault(MAIN, list(r.prompt)))
                    r.state = "running"

    def schedule(self) -> list[Work]:
        """Every running request, oldest first: a prefill chunk, a decode token
        per sample, or a verify step of drafted tokens."""
        work: list[Work] = []
        for r in self.running():
            if not r.prefilled(self.kv):
                done = self.kv.stored_len(r.rid)
                work.append(Work(r, MAIN, r.prompt[done:done + self.chunk]))
                continue
            for label, toks in r.out.items():
                if len(toks) >= r.max_new:
                    continue
                draft = self.propose(r, label)
                work.append(Work(r, label, [toks[-1], *draft], draft))
        return work

    def running(self) -> list[Request]:
        return sorted((r for r in self.requests if r.state == "running"),
                      key=lambda r: r.arrival)

    def step(self, work: list[Work]) -> None:
        work, step, ctx = self.admit(work)
        plans = self.kv.plan(step, ctx)
        self.count_shared(plans)
        logits, rows = self.forward(self.kv, plans, {(w.req.rid, w.label): w for w in work})
        self.kv.commit(step, ctx)
        self.stats.mixed_steps += any(not w.req.out for w in work) and any(w.req.out for w in work)
        for w in work:
            self.sample(w, logits[rows[(w.req.rid, w.label)]])
        # after every sample: a fork may preempt a request sampled in this step
        for r in {w.req.rid: w.req for w in work}.values():
            if r.samples == 2 and r.out and SAMPLE not in r.out:
                self.fork(r)
                r.keep(SAMPLE, [r.runner_up])
                # the sample's own list: the prompt, then its tokens
                self.kv.follow_tokens(r.rid, r.ids[SAMPLE], SAMPLE)

    def count_shared(self, plans: dict[str, KVPlanOutput]) -> None:
        """Pages saved now: the step's page tables summed (each stream's pages
        as if it held them alone, in every group) minus the pages the manager
        holds."""
        tables = sum(len(v.page_idxs) for plan in plans.values() for v in plan.views)
        held = self.kv.config.max_num_pages - 1 - self.kv.num_free_pages
        self.stats.pages_saved = max(self.stats.pages_saved, tables - held)

    def admit(self, work: list[Work]) -> tuple[list[Work], KVStep, StepContext]:
        """Admit the step, preempting the youngest scheduled request while the
        device is short of pages; returns the work that was admitted, as a step."""
        while True:
            step, ctx = self._step_of(work)
            outcome = self.kv.admit(step, ctx)
            if outcome.ok:
                return work, step, ctx
            if not isinstance(outcome.reason, AllocationFailed):
                raise RuntimeError(f"admit refused: {outcome.reason}")
            victims = sorted({w.req.rid: w.req for w in work}.values(), key=lambda r: r.arrival)
            if len(victims) < 2:
                raise RuntimeError(f"{victims[0].rid} alone does not fit: {outcome.reason}")
            if self.kv.reclaimable(victims[-1].rid):
                self.preempt(victims[-1])
            # else it holds nothing yet: it simply waits for a later step
            work = [w for w in work if w.req is not victims[-1]]

    @staticmethod
    def _step_of(work: list[Work]) -> tuple[KVStep, StepContext]:
        # one forward for every label: plan them as one batch under "main"
        labels = sorted({w.label for w in work}, key=[MAIN, SAMPLE].index)
        step = KVStep(segments=[Segment(w.req.rid, w.label, len(w.tokens)) for w in work],
                      combined_labels=[labels] if len(labels) > 1 else ())
        return step, StepContext(padded_request_ids=sorted({w.req.rid for w in work}))

    def forward(self, kv: KVManager, plans: dict[str, KVPlanOutput],
                work: dict[tuple[str, str], Work],
                ) -> tuple[torch.Tensor, dict[tuple[str, str], slice]]:
        """One packed forward in the plan's row order (label-major, as planned).

        ``plans``: every plan label's table, one per group of ``main`` with
        groups. Each layer attends over its group's table with its window."""
        attention, windowed = self.attention(kv, plans)
        plan = plans[MAIN]  # the first group's: its rows are every group's
        ids: list[int] = []
        pos: list[int] = []
        rows: dict[tuple[str, str], slice] = {}
        for view in plan.views:
            w = work[(view.request_id, view.label)]
            assert view.to_compute == len(w.tokens)
            # a windowed view starts at its first retained page, ``offset``
            # released tokens in (0 without a window): positions are absolute
            start = view.offset + view.length - view.to_compute  # the length before
            rows[(view.request_id, view.label)] = slice(len(ids), len(ids) + len(w.tokens))
            ids += w.tokens
            pos += range(start, view.offset + view.length)
        if kv is self.kv:
            for view in (v for p in windowed for v in p.views):
                # what the stream held entering the step: the retained pages
                held = -(-(view.length - view.to_compute) // kv.config.page_size)
                self.stats.window_pages = max(self.stats.window_pages, held)
        logits = self.model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]),
                            use_cache=False, kvref=Forward(kv, attention)).logits[0]
        return logits, rows

    def attention(self, kv: KVManager, plans: dict[str, KVPlanOutput],
                  ) -> tuple[dict[int, PagedAttention], list[KVPlanOutput]]:
        """Each layer's attention, planned on its group's table, and the
        windowed tables among them."""
        cfg = kv.config
        scale = self.model.model.layers[0].self_attn.scaling
        # (plan label, window, layers): a group's plan label is main's stream in it
        tables = ([(MAIN if g == 0 else MAIN + GROUP_SEP + group.name, group.retention,
                    group.layers) for g, group in enumerate(cfg.groups)]
                  or [(MAIN, cfg.retention.get(MAIN), tuple(range(cfg.num_layers)))])
        attention: dict[int, PagedAttention] = {}
        windowed: list[KVPlanOutput] = []
        for label, policy, layers in tables:
            # a window masks W - 1 tokens back, a chunk (Llama 4) to its start
            attn = PagedAttention.from_config(
                cfg, backend="torch", sm_scale=scale,
                window_left=policy.window_left if isinstance(policy, RetentionPolicy) else -1,
                chunk=policy.size if isinstance(policy, ChunkedAttention) else 0)
            attn.plan(plans[label])
            attention.update(dict.fromkeys(layers, attn))
            if policy is not None:
                windowed.append(plans[label])
        return attention, windowed

    def sample(self, w: Work, logits: torch.Tensor) -> None:
        r = w.req
        if not r.out:
            if r.prefilled(self.kv):
                self.first_tokens(r, logits[-1])
            return
        if not w.draft:
            r.keep(w.label, [int(logits[-1].argmax())])
            return
        # verify: row i predicts the token after tokens[i]; keep the drafted
        # tokens the target agrees with, then the target's own next token
        target = logits.argmax(-1).tolist()
        accepted = 0
        while accepted < len(w.draft) and w.draft[accepted] == target[accepted]:
            accepted += 1
        r.keep(w.label, target[:accepted + 1])
        keep = self.kv.stored_len(r.rid, w.label) - (len(w.draft) - accepted)
        self.stats.pages_truncated += self.kv.truncate(r.rid, w.label, keep)
        self.stats.verify_steps += 1
        self.stats.drafted += len(w.draft)
        self.stats.accepted += accepted

    def first_tokens(self, r: Request, last: torch.Tensor) -> None:
        top = last.topk(2).indices.tolist()
        r.keep(MAIN, [top[0]])
        r.runner_up = top[1]  # where a second sample starts

    def fork(self, r: Request) -> None:
        """Fork main onto the second sample's stream, copy-on-write: the two
        share the full pages. A fork applies to every padded request, so this
        step pads only ``r``."""
        step = KVStep(segments=[], pre_forks=[(MAIN, SAMPLE)])
        ctx = StepContext(padded_request_ids=[r.rid])
        free = self.kv.num_free_pages
        outcome = self.kv.admit(step, ctx)
        while not outcome.ok:
            # a request whose pages are all shared would free nothing
            others = [o for o in self.running() if o is not r and self.kv.reclaimable(o.rid)]
            if not others or not isinstance(outcome.reason, AllocationFailed):
                raise RuntimeError(f"fork of {r.rid} refused: {outcome.reason}")
            self.preempt(others[-1])
            free = self.kv.num_free_pages
            outcome = self.kv.admit(step, ctx)
        self.kv.plan(step, ctx)
        self.kv.commit(step, ctx)
        self.stats.forks += 1
        self.stats.fork_pages += free - self.kv.num_free_pages

    def propose(self, r: Request, label: str) -> list[int]:
        """Drafted tokens for ``r``'s next verify step; none for a plain decode."""
        remaining = r.max_new - len(r.out[label])
        k = min(self.draft_len, remaining - 1)
        if not r.speculative or self.draft is None or k <= 0:
            return []
        context = r.prompt + r.out[label]
        drafted: list[int] = []
        for _ in range(k):
            logits = self.draft(torch.tensor([context + drafted]), use_cache=False).logits
            drafted.append(int(logits[0, -1].argmax()))
        return drafted

    # -- preemption -------------------------------------------------------------

    def preempt(self, r: Request) -> None:
        freed = self.kv.offload(r.rid)
        if freed == 0:
            raise RuntimeError(f"offload of {r.rid} freed nothing")
        r.state = "swapped"
        self.stats.preemptions += 1
        self.stats.pages_offloaded += freed

    def reload_swapped(self) -> None:
        """Bring preempted requests back, oldest first, while the device has
        room for them and a step's growth of everything running."""
        for r in sorted((r for r in self.requests if r.state == "swapped"),
                        key=lambda r: r.arrival):
            need = sum(self.resident_pages(r.rid, lb) + 1 for lb in r.labels())
            headroom = sum(len(o.labels()) for o in self.running())
            if self.kv.num_free_pages < need + headroom or not self.kv.reload(r.rid):
                return
            r.state = "running"
            self.stats.reloads += 1

    def resident_pages(self, rid: str, label: str) -> int:
        """The pages the label holds on the device when resident: all its
        pages, or for a windowed one those from its window's first page on;
        hybrid, summed over its groups."""
        cfg = self.kv.config
        ps, n = cfg.page_size, self.kv.stored_len(rid, label)
        windows = [g.retention for g in cfg.groups] or [cfg.retention.get(label)]
        return sum(-(-n // ps) - (0 if w is None else n // w.size * w.size // ps
                                  if isinstance(w, ChunkedAttention)
                                  else max(0, n - w.context_budget) // ps)
                   for w in windows)

    # -- disaggregated prefill --------------------------------------------------

    def prefill_remotely(self, r: Request) -> None:
        """The prefill worker computes the prompt and publishes it; the decode
        manager starts copying it (ready once it landed)."""
        pkv = self.prefill_kv
        pkv.ingest_request(r.rid)
        hit = r.hit = pkv.match_prefix(r.rid, MAIN, r.prompt)  # the worker caches too
        self.stats.hit_tokens += hit
        pkv.follow_tokens(r.rid, r.ids.setdefault(MAIN, list(r.prompt)))
        step = KVStep(segments=[Segment(r.rid, MAIN, len(r.prompt) - hit)])
        ctx = StepContext(padded_request_ids=[r.rid])
        outcome = pkv.admit(step, ctx)
        if not outcome.ok:
            raise RuntimeError(f"prefill worker refused {r.rid}: {outcome.reason}")
        plans = pkv.plan(step, ctx)
        logits, _ = self.forward(pkv, plans, {(r.rid, MAIN): Work(r, MAIN, r.prompt[hit:])})
        pkv.commit(step, ctx)  # keys the prompt's full pages
        r.keep(MAIN, [int(logits[-1].argmax())])
        published = pkv.publish(r.rid)  # leased: the worker keeps these pages until released
        if isinstance(published, PublishRefused):
            raise RuntimeError(f"publish of {r.rid} refused: {published.reason}")
        r.published = published
        self.kv.ingest_request(r.rid)
        r.state = "transferring"
        self.start_transfer(r)

    def start_transfer(self, r: Request) -> None:
        outcome = self.kv.admit_retrieve(r.rid, published=r.published)
        if not outcome.ok and not isinstance(outcome.reason, AllocationFailed):
            raise RuntimeError(f"retrieve of {r.rid} refused: {outcome.reason}")
        if outcome.ok:
            r.published = None  # started: later calls only check readiness

    def land_transfers(self) -> None:
        for r in self.requests:
            if r.state != "transferring":
                continue
            if r.published is not None:  # the decode side had no room yet
                self.start_transfer(r)
                continue
            outcome = self.kv.admit_retrieve(r.rid)  # a readiness check
            if not outcome.ok:
                raise RuntimeError(f"retrieve of {r.rid} failed: {outcome.reason}")
            if outcome.ready:
                # the copy landed: end the lease, then the worker may drop it
                self.prefill_kv.release_published(r.rid)
                self.prefill_kv.remove_request(r.rid)
                r.state = "running"
                self.stats.transfers += 1
                self.stats.leases_released += 1

    def finish(self) -> None:
        for r in self.requests:
            if r.state == "running" and r.finished():
                self.kv.remove_request(r.rid)
                r.state = "done"


def demo_requests(max_new: int = 10, seed: int = 1, windowed: bool = False) -> list[Request]:
    """The demo's requests. ``windowed``: for a windowed model, whose
    disaggregated prompt outruns the window."""
    gen = torch.Generator().manual_seed(seed)

    def prompt(n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=gen).tolist()

    # a system prompt of three pages (page size 4) that three requests open with
    system = prompt(SYSTEM_LEN)
    return [
        # prefilled in chunks; its system prompt is cached once it is in (step 2)
        Request("long", system + prompt(5), max_new, arrival=0),
        Request("spec", prompt(11), max_new, arrival=1, speculative=True),
        # windowed: longer than the window, so the publication has released pages
        Request("remote", prompt(27 if windowed else 8), max_new, arrival=2,
                disaggregated=True),
        # both hit the system prompt, and compute only what follows it
        Request("pair", system + prompt(3), max_new, arrival=3, samples=2),
        Request("late", system + prompt(4), max_new, arrival=4),
    ]


# a hybrid page holds one group's layer, half the bytes of the demo's pages:
# 40 are 20 of those, as tight (it preempts) and with room for two groups
HYBRID_ENGINE: dict[str, Any] = {"device_pages": 40}
WINDOWED_MAX_NEW = 40  # far past a window of 16: positions outgrow what a stream holds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--sliding-window", type=int, default=None, metavar="W",
                      help="a Mistral whose attention sees W tokens, on windowed labels")
    mode.add_argument("--hybrid", type=int, default=None, metavar="W",
                      help="a Gemma 3 whose layers alternate a window of W tokens and full "
                           "attention, on attention groups")
    args = parser.parse_args(argv)
    hybrid = args.hybrid is not None
    window = args.hybrid if hybrid else args.sliding_window
    model = build_model(sliding_window=window, hybrid=hybrid)
    engine = Engine(model, build_draft(model), sliding_window=window, hybrid=hybrid,
                    **HYBRID_ENGINE if hybrid else {})
    reqs = (demo_requests() if window is None
            else demo_requests(WINDOWED_MAX_NEW, windowed=True))
    stats = engine.run(reqs)
    for r in reqs:
        for label, toks in r.out.items():
            print(f"{r.rid:>6} {label:<4} prompt {len(r.prompt):>2} -> {toks}")
    s = stats
    print(f"{s.steps} steps, {s.mixed_steps} of them a prefill chunk beside decodes; "
          f"{s.preemptions} preemptions ({s.pages_offloaded} pages offloaded), "
          f"{s.reloads} reloads; {s.forks} fork (copy-on-write: {s.fork_pages} page copied)")
    print(f"prefix cache: {s.hit_tokens} of {s.prompt_tokens} prompt tokens hit "
          f"(hit rate {s.hit_rate:.0%}), {s.pages_cached} pages cached; "
          f"sharing saved up to {s.pages_saved} device pages in one step")
    print(f"{s.verify_steps} speculative verify steps: {s.accepted} of {s.drafted} drafted "
          f"tokens accepted, truncate freed {s.pages_truncated} pages")
    print(f"{s.transfers} disaggregated prefill, {s.leases_released} lease released; "
          f"device pages free at the end: {engine.kv.num_free_pages} of "
          f"{engine.kv.config.max_num_pages - 1} ({engine.kv.num_cached_pages} of them cached)")
    if window is not None:
        longest = max(len(r.prompt) + r.max_new for r in reqs)
        what = "a window group's" if hybrid else "a windowed"
        print(f"sliding window {window} (page size {engine.kv.config.page_size}): {what} "
              f"stream held at most {s.window_pages} device pages, bound ceil((W+k)/ps)+1 = "
              f"{s.window_bound}, for sequences of up to {longest} tokens")

if __name__ == "__main__":
    main()
