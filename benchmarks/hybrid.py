"""kvref's attention groups beside vLLM's hybrid coordinator, in one run (issue 40, item 6).

    python -m benchmarks.hybrid [--vllm PATH] [--quick] [--tiny] [--json PATH]

The config is Gemma-3-like: one full-attention group and five sliding-window
groups of equal layer count (W = 1024, pages of 16 tokens), as vLLM splits
Gemma 3's 1:5 (`kvref.core.groups.groups_for`). vLLM's side is its unmodified
``KVCacheManager`` (so its ``HybridKVCacheCoordinator``) over one group spec
per group, Gemma 3 12B's shapes (48 layers, 8 per group; 8 KV heads of 256,
bf16), nothing allocated. kvref's cache is scaled down to one layer per group
(the 1:5 structure kept) and one head of 8 halves, since it allocates its
pages on the CPU; page counts do not depend on a page's bytes, and bytes are
reported as pages times Gemma 3 12B's page (`PAGE_BYTES`). ``--vllm``: a copy
of vLLM's KV-manager files, as for `benchmarks.vs_vllm` (which this module
imports and times with); without one it skips, saying how to get one.

Three comparisons, each kvref against vLLM measured in this run:

1. Memory held at 32k-token contexts: N requests prefill a 32k-token prompt in
   chunks and decode to 32,768 tokens; the pages each pool has handed out
   while a step runs (after kvref's admit and plan, after vLLM's
   ``allocate_slots``: what the step's forward pass holds), at the last step
   and the peak over the run. vLLM's window manager replaces passed blocks by
   its null block (freed, still cached); kvref's window releases them at the
   commit (W2) and hands them back blank (H3). Pages cached but held by no
   request count on neither side.
2. Multi-turn chat hit rate (vLLM 48435's shape): sessions take turns, each
   re-sending its history grown by a user message, its prompt computed in
   chunks, a reply decoded, the request finished; the pool sized so the
   sessions' histories fill 25, 50 or 75 % of its capacity in tokens as vLLM
   logs it (``GPU KV cache size``: group-aware, a 64k-token request's full
   pages plus each window's), the occupancy 48435 reports. Tokens hit /
   tokens prompted per side; kvref keys pages as they fill (`follow_tokens`,
   as an engine does), vLLM as its requests append tokens. Sessions' ids are
   distinct, so a hit is only a session's own history.
3. A hybrid decode step of B requests past the window, caching on: kvref
   admit + plan + commit (the commit keys each page that fills, from the
   list handed to `follow_tokens`, in every group, and releases what each
   window passes; the plan builds every group's FlashInfer tables and write
   slots) against vLLM's per-request ``allocate_slots(req, 1)`` (which frees
   the blocks each window skipped and caches full blocks in every group),
   ``num_computed_tokens += 1`` and ``append_output_token_ids`` (which hashes
   a block as it fills). Ratio vLLM / kvref per pair, above 1: kvref faster.
   Below the table, the median share of kvref's step spent in `plan`.

Nothing here asserts a figure; `tests/test_benchmarks_hybrid_smoke.py` checks
that a tiny run's results are well formed.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from benchmarks import machine, md_table, write_json
from benchmarks.vs_vllm import HOW_TO_GET, PAGE, VLLM, VOCAB, Row, find_copy, paired, table
from kvref import KVConfig, KVManager, KVStep, RetentionPolicy, Segment, StepContext
from kvref.core.groups import groups_for

WINDOWS = 5  # window groups per full group: Gemma 3's 5:1
# Gemma 3 12B: 48 layers, 8 per group; a page holds K and V of a group's
# layers for PAGE tokens, 8 KV heads of 256 in bf16
GEMMA_LAYERS_PER_GROUP, GEMMA_KV_HEADS, GEMMA_HEAD = 8, 8, 256
PAGE_BYTES = 2 * GEMMA_LAYERS_PER_GROUP * PAGE * GEMMA_KV_HEADS * GEMMA_HEAD * 2
MAX_MODEL_LEN = 1 << 16


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Sizes:
    """One run's sizes; `TINY` is the smoke test's."""

    window: int = 1024
    requests: int = 4  # memory: requests of `context` tokens
    context: int = 32768
    chunk: int = 2048  # prefill chunk (the scheduler's token budget per request)
    tail: int = 16  # memory: decode steps that end the run at `context` tokens
    sessions: int = 8
    turns: int = 6
    first: int = 2048  # chat: the first turn's prompt
    grow: int = 512  # a user message
    reply: int = 64  # tokens decoded per turn
    occupancy: tuple[float, ...] = (0.25, 0.5, 0.75)
    batches: tuple[int, ...] = (16, 256)
    decode_prompt: int = 1088  # past the window: every group in its steady state
    decode_steps: int = 64
    warmup: int = 16


FULL = Sizes(requests=8, turns=8, decode_steps=160)
QUICK = Sizes()
TINY = Sizes(window=32, requests=2, context=256, chunk=64, tail=16, sessions=3, turns=3,
             first=64, grow=32, reply=4, batches=(2, 4), decode_prompt=48, decode_steps=4,
             warmup=1)


@dataclass
class Memory:
    requests: int
    context: int
    kvref_pages: float  # handed out, mean over the last page's positions (the tail)
    vllm_pages: float
    kvref_last: int  # at the last step (the 32,768th token)
    vllm_last: int
    kvref_peak: int  # the most over the run
    vllm_peak: int
    kvref_per_request: list[int]  # one request's pages per group, full first
    vllm_per_request: list[int]
    page_bytes: int = PAGE_BYTES


@dataclass
class Chat:
    occupancy: float
    pool: int  # pages
    needed: int  # pages every session's last hit reads: its full pages and each window's
    prompted: int  # tokens, both sides the same
    kvref_hit: int
    vllm_hit: int
    possible: int  # what a cache that kept everything would hit


@dataclass
class Decode:
    row: Row
    plan_share: float  # median share of kvref's timed step in `plan`


@dataclass
class Results:
    sizes: Sizes
    memory: Memory | None = None
    chat: list[Chat] = field(default_factory=list)
    decode: list[Decode] = field(default_factory=list)


# ------------------------------------------------------------------ the two sides


def kv_manager(pages: int, window: int) -> KVManager:
    sw = RetentionPolicy(window)  # sliding_window W: kvref's context budget W
    cfg = KVConfig(num_layers=1 + WINDOWS, num_kv_heads=1, head_dim=8, max_seq_len=MAX_MODEL_LEN,
                   max_num_pages=pages + 1, page_size=PAGE, num_qo_heads=1,
                   enable_prefix_caching=True,
                   groups=groups_for([*[sw] * WINDOWS, None]))
    return KVManager(cfg, "kv", None, None, "cpu", dtype=torch.float16)


def kv_held(kv: KVManager) -> int:
    """Pages the pool has handed out (the sink not counted)."""
    return kv.config.max_num_pages - 1 - kv.num_free_pages


def vllm_manager(vl: VLLM, blocks: int, window: int) -> Any:
    _, mgr, full, cfg, group, sliding, _, _ = vl._m
    kw: dict[str, Any] = dict(block_size=PAGE, num_kv_heads=GEMMA_KV_HEADS,
                              head_size=GEMMA_HEAD, dtype=torch.bfloat16)
    # Gemma 3's layer i is full attention when (i + 1) % 6 == 0; each type's
    # layers in order, cut into groups of 8 (vLLM's equal-size grouping)
    n = GEMMA_LAYERS_PER_GROUP * (1 + WINDOWS)
    full_layers = [i for i in range(n) if (i + 1) % 6 == 0]
    win_layers = [i for i in range(n) if (i + 1) % 6]

    def names(layers: list[int]) -> list[str]:
        return [f"model.layers.{i}.self_attn.attn" for i in layers]

    per = GEMMA_LAYERS_PER_GROUP
    groups = [group(names(full_layers), full(**kw))] + [
        group(names(win_layers[j * per:(j + 1) * per]), sliding(**kw, sliding_window=window))
        for j in range(WINDOWS)]
    # + 1: vLLM's block 0 is its null block, as kvref's page 0 is its sink
    config = cfg(num_blocks=blocks + 1, kv_cache_tensors=[], kv_cache_groups=groups)
    return mgr(kv_cache_config=config, max_model_len=MAX_MODEL_LEN, scheduler_block_size=PAGE,
               hash_block_size=PAGE, enable_caching=True)


def vllm_held(vm: Any) -> int:
    pool = vm.block_pool
    return int(pool.num_gpu_blocks) - 1 - int(pool.get_num_free_blocks())


def kv_step(kv: KVManager, step: KVStep, ctx: StepContext,
            during: Callable[[], None] | None = None) -> None:
    if not kv.admit(step, ctx).ok:
        raise RuntimeError("kvref refused a step the benchmark sized to fit")
    kv.plan(step, ctx)
    if during is not None:
        during()
    kv.commit(step, ctx)


def vllm_alloc(vm: Any, req: Any, n: int, hit: int = 0, blocks: Any = None) -> None:
    if vm.allocate_slots(req, n, hit, blocks) is None:
        raise RuntimeError("vLLM's pool is exhausted where the benchmark sized it to fit")


# ------------------------------------------------------------------ 1. memory


def memory(vl: VLLM, s: Sizes, rng: random.Random) -> Memory:
    n, prompt = s.requests, s.context - s.tail
    per_request = cdiv(s.context, PAGE) + WINDOWS * (cdiv(s.window + s.chunk, PAGE) + 2)
    pages = n * per_request + 64
    kv, vm = kv_manager(pages, s.window), vllm_manager(vl, pages, s.window)
    ids = [[rng.randrange(VOCAB) for _ in range(s.context + 1)] for _ in range(n)]
    rids = [f"m{i}" for i in range(n)]
    ctx = StepContext(tuple(rids))
    for i, rid in enumerate(rids):
        kv.ingest_request(rid)
        kv.match_prefix(rid, "main", ids[i][:prompt])
        kv.follow_tokens(rid, ids[i])  # ids past the committed are never read
    reqs = [vl.request(ids[i][:prompt]) for i in range(n)]
    kv_seen: list[int] = []
    vl_seen: list[int] = []
    done = 0
    spans = [min(s.chunk, prompt - p) for p in range(0, prompt, s.chunk)] + [1] * s.tail
    for k, span in enumerate(spans):
        kv_step(kv, KVStep([Segment(r, "main", span) for r in rids]), ctx,
                during=lambda: kv_seen.append(kv_held(kv)))
        for r in reqs:
            if k == 0:
                blocks, hit, _ = vm.get_computed_blocks(r)
                assert hit == 0
                vllm_alloc(vm, r, span, hit, blocks)
            else:
                vllm_alloc(vm, r, span)
        vl_seen.append(vllm_held(vm))
        done += span
        for r in reqs:
            r.num_computed_tokens = done
            if done >= prompt:  # the prompt computed: a token sampled per step
                r.status = vl._m[-1].RUNNING
                r.append_output_token_ids(ids[0][done])
    assert kv.stored_len(rids[0]) == reqs[0].num_computed_tokens == s.context
    obs = kv.observe()
    kv_groups = [len(obs.stream(rids[0], lb).pages) for lb in
                 ["main", *(f"main@{g.name}" for g in kv.config.groups[1:])]]
    vl_groups = [sum(not b.is_null for b in blocks)
                 for blocks in vm.coordinator.get_blocks(reqs[0].request_id)]
    tail = len(spans) - s.tail
    return Memory(n, s.context, sum(kv_seen[tail:]) / s.tail, sum(vl_seen[tail:]) / s.tail,
                  kv_seen[-1], vl_seen[-1], max(kv_seen), max(vl_seen), kv_groups, vl_groups)


# ------------------------------------------------------------------ 2. chat hit rate


def chat(vl: VLLM, s: Sizes, occupancy: float, seed: int) -> Chat:
    rng = random.Random(seed)
    last = s.first + (s.turns - 1) * (s.reply + s.grow) + s.reply  # a session's history
    # occupancy as vLLM 48435 reads it: the sessions' tokens over the pool's
    # capacity in tokens as vLLM logs it (group-aware: a MAX_MODEL_LEN-token
    # request takes its full pages and each window's)
    per_request = cdiv(MAX_MODEL_LEN, PAGE) + WINDOWS * (cdiv(s.window, PAGE) + 1)
    pages = int(s.sessions * last * per_request / MAX_MODEL_LEN / occupancy)
    # never below what one request's chunk takes (binds only at tiny sizes)
    pages = max(pages, cdiv(last, PAGE) + WINDOWS * (cdiv(s.window + s.chunk, PAGE) + 2))
    needed = s.sessions * (cdiv(last, PAGE) + WINDOWS * (cdiv(s.window, PAGE) + 1))
    kv, vm = kv_manager(pages, s.window), vllm_manager(vl, pages, s.window)
    history: list[list[int]] = [[] for _ in range(s.sessions)]
    prompted = kv_hit = vl_hit = possible = 0

    def toks(k: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(k)]

    for t in range(s.turns):
        for sess in range(s.sessions):
            prompt = history[sess] + toks(s.first if t == 0 else s.grow)
            reply = toks(s.reply)
            prompted += len(prompt)
            if t:  # the last turn's computed tokens, whole pages, at most all but one
                possible += min((len(history[sess]) - 1) // PAGE * PAGE, len(prompt) - 1)
            kv_hit += kv_turn(kv, f"s{sess}.{t}", prompt, reply, s.chunk)
            vl_hit += vllm_turn(vl, vm, prompt, reply, s.chunk)
            history[sess] = prompt + reply
    return Chat(occupancy, pages, needed, prompted, kv_hit, vl_hit, possible)


def kv_turn(kv: KVManager, rid: str, prompt: list[int], reply: list[int], chunk: int) -> int:
    """One chat request as an engine runs it on kvref: its hit, the rest of
    the prompt in chunks, then the reply decoded, and the request removed."""
    kv.ingest_request(rid)
    hit = kv.match_prefix(rid, "main", prompt)
    ids = list(prompt)  # the engine's list of the request's ids, appended as it samples
    kv.follow_tokens(rid, ids)
    ctx = StepContext((rid,))
    pos = hit
    while pos < len(prompt):
        span = min(chunk, len(prompt) - pos)
        kv_step(kv, KVStep([Segment(rid, "main", span)]), ctx)
        pos += span
    for k, tok in enumerate(reply):
        ids.append(tok)
        if k < len(reply) - 1:  # the last sampled token is never computed
            kv_step(kv, KVStep([Segment(rid, "main", 1)]), ctx)
    kv.remove_request(rid)
    return hit


def vllm_turn(vl: VLLM, vm: Any, prompt: list[int], reply: list[int], chunk: int) -> int:
    """The same request as vLLM's scheduler runs it."""
    req = vl.request(prompt)
    blocks, hit, _ = vm.get_computed_blocks(req)
    pos = hit
    first = True
    while pos < len(prompt):
        span = min(chunk, len(prompt) - pos)
        if first:
            vllm_alloc(vm, req, span, hit, blocks)
            req.num_computed_tokens = hit
            first = False
        else:
            vllm_alloc(vm, req, span)
        pos += span
        req.num_computed_tokens = pos
    req.status = vl._m[-1].RUNNING
    for k, tok in enumerate(reply):
        req.append_output_token_ids(tok)
        if k < len(reply) - 1:
            vllm_alloc(vm, req, 1)
            req.num_computed_tokens += 1
    vm.free(req)
    return int(hit)


# ------------------------------------------------------------------ 3. decode step


def decode(vl: VLLM, s: Sizes, batch: int, rng: random.Random) -> Decode:
    total = s.warmup + s.decode_steps
    # staggered lengths: page fills (and window releases) spread over the steps
    lengths = [s.decode_prompt + i % PAGE for i in range(batch)]
    ids = [[rng.randrange(VOCAB) for _ in range(n + total + 1)] for n in lengths]
    per = cdiv(s.decode_prompt + PAGE + total, PAGE)
    pages = batch * (1 + WINDOWS) * per + PAGE
    kv, vm = kv_manager(pages, s.window), vllm_manager(vl, pages, s.window)
    rids = [f"d{i}" for i in range(batch)]
    for i, rid in enumerate(rids):
        kv.ingest_request(rid)
        kv.match_prefix(rid, "main", ids[i][:lengths[i]])
    ctx = StepContext(tuple(rids))
    kv_step(kv, KVStep([Segment(r, "main", n) for r, n in zip(rids, lengths, strict=True)]),
            ctx)
    for i, rid in enumerate(rids):
        kv.follow_tokens(rid, ids[i])  # the whole list: ids past the committed are never read
    reqs = [vl.request(ids[i][:lengths[i]]) for i in range(batch)]
    for r in reqs:
        vl.admit(vm, r)
        vl.running(r, rng)
    step = KVStep([Segment(r, "main", 1) for r in rids])
    k_vl = [0]

    plan_ns: list[float] = []  # of each kvref step, the plan: what vLLM's manager never builds

    def kv_go() -> float:
        t0 = time.perf_counter_ns()
        if not kv.admit(step, ctx).ok:
            raise RuntimeError("kvref refused a step the benchmark sized to fit")
        t1 = time.perf_counter_ns()
        kv.plan(step, ctx)
        t2 = time.perf_counter_ns()
        kv.commit(step, ctx)
        t = time.perf_counter_ns()
        plan_ns.append((t2 - t1) / (t - t0))
        return t - t0

    def vl_go() -> float:
        tok = ids[0][lengths[0] + k_vl[0]]
        k_vl[0] += 1
        t0 = time.perf_counter_ns()
        for r in reqs:
            if vm.allocate_slots(r, 1) is None:
                raise RuntimeError("vLLM's pool is exhausted")
            r.num_computed_tokens += 1
            r.append_output_token_ids(tok)
        return time.perf_counter_ns() - t0

    got = paired(kv_go, vl_go, s.decode_steps, s.warmup, per=batch)
    assert kv.stored_len(rids[0]) == reqs[0].num_computed_tokens
    for rid in rids:  # keyed as they filled, in every group
        assert kv.cached_tokens(rid) == kv.stored_len(rid) // PAGE * PAGE
    return Decode(Row(f"hybrid decode B={batch}, {s.decode_prompt}-token prompts, 1 full + "
                      f"{WINDOWS} window groups (W={s.window})", "µs/req/step", *got),
                  statistics.median(plan_ns[s.warmup:]))


# ------------------------------------------------------------------ run, report


def run(vl: VLLM, sizes: Sizes, seed: int = 0) -> Results:
    rng = random.Random(seed)
    out = Results(sizes, memory=memory(vl, sizes, rng))
    out.chat = [chat(vl, sizes, occ, seed + k) for k, occ in enumerate(sizes.occupancy)]
    out.decode = [decode(vl, sizes, b, rng) for b in sizes.batches]
    return out


def tables(r: Results) -> str:
    s, m = r.sizes, r.memory
    out = []
    if m is not None:
        gib = m.page_bytes / 2**30
        out += [f"Memory held: {m.requests} requests at {m.context:,} tokens (pages the pool "
                f"has handed out while a step runs; GiB at Gemma 3 12B's "
                f"{m.page_bytes / 2**20:.0f} MiB page)", "",
                md_table(["", "kvref", "vLLM", "kvref / vLLM"], [
                    [f"pages, mean over the last {r.sizes.tail} decode steps",
                     f"{m.kvref_pages:.1f}", f"{m.vllm_pages:.1f}",
                     f"{m.kvref_pages / m.vllm_pages:.4f}"],
                    ["GiB, the same", f"{m.kvref_pages * gib:.2f}",
                     f"{m.vllm_pages * gib:.2f}", f"{m.kvref_pages / m.vllm_pages:.4f}"],
                    [f"pages at the last step (token {m.context:,})", m.kvref_last,
                     m.vllm_last, f"{m.kvref_last / m.vllm_last:.4f}"],
                    ["peak pages over the run (a prefill chunk)", m.kvref_peak, m.vllm_peak,
                     f"{m.kvref_peak / m.vllm_peak:.4f}"],
                    ["one request's pages per group after the run (full, windows)",
                     " ".join(map(str, m.kvref_per_request)),
                     " ".join(map(str, m.vllm_per_request)), ""]]), ""]
    if r.chat:
        out += [f"Multi-turn chat: {s.sessions} sessions round robin, {s.turns} turns, first "
                f"prompt {s.first:,}, +{s.grow} user and {s.reply} reply tokens a turn, "
                f"prefill chunks of {s.chunk:,}", "",
                md_table(["pool occupancy", "pool pages", "pages every hit reads / pool",
                          "tokens prompted", "kvref hit rate", "vLLM hit rate", "kvref / vLLM",
                          "all history cached"],
                         [[f"{c.occupancy:.0%}", c.pool, f"{c.needed / c.pool:.2f}", c.prompted,
                           f"{c.kvref_hit / c.prompted:.3f}", f"{c.vllm_hit / c.prompted:.3f}",
                           f"{c.kvref_hit / c.vllm_hit:.2f}" if c.vllm_hit else "inf"
                           if c.kvref_hit else "-", f"{c.possible / c.prompted:.3f}"]
                          for c in r.chat]), ""]
    if r.decode:
        out += ["Hybrid decode step (ratio vLLM / kvref, median [p10, p90] of per-pair "
                "ratios; above 1: kvref faster)", "", table([d.row for d in r.decode]), "",
                "Of kvref's step, the plan (every group's FlashInfer tables and write slots, "
                "which vLLM's manager does not build): " + ", ".join(
                    f"B={b} {d.plan_share:.0%}" for b, d in zip(s.batches, r.decode,
                                                                strict=True)), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.hybrid",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", help="a vllm_kv copy (default: $KVREF_VLLM_KV, then "
                                   "../shared/anchors/vllm_kv)")
    ap.add_argument("--quick", action="store_true", help="fewer sessions and steps")
    ap.add_argument("--tiny", action="store_true", help="the smoke test's sizes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="also write the results here")
    args = ap.parse_args(argv)
    copy = find_copy(args.vllm)
    if copy is None or not copy.is_dir():
        print(f"hybrid vs vLLM: skipped, {HOW_TO_GET}")
        return 0
    torch.set_num_threads(1)  # a shared box: two threads stall on each other
    vl = VLLM(copy)
    sizes = TINY if args.tiny else QUICK if args.quick else FULL
    load_start, t0 = os.getloadavg()[0], time.perf_counter()
    results = run(vl, sizes, args.seed)
    seconds, load_end = time.perf_counter() - t0, os.getloadavg()[0]
    print(f"### {heading(vl.version, sizes)}\n")
    print(tables(results))
    print(f"{seconds:.0f} s; load average {load_start:.1f} before, {load_end:.1f} after "
          f"({os.cpu_count()} CPUs)")
    if args.json:
        write_json(args.json, {
            "benchmark": "hybrid", "quick": args.quick, "tiny": args.tiny, "vllm": vl.version,
            "machine": machine(), "cpus": os.cpu_count(), "load_start": load_start,
            "load_end": load_end, "seconds": seconds, "results": results})
    return 0


def heading(version: str, s: Sizes) -> str:
    return (f"kvref groups vs vLLM {version} hybrid coordinator (one process, CPU; 1 full + "
            f"{WINDOWS} sliding-window groups, W={s.window}, page {PAGE}, prefix caching on)")


if __name__ == "__main__":
    sys.exit(main())
