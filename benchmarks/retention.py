"""Sliding-window retention (issue 19, "Measured"):
``python -m benchmarks.retention [--quick] [--json PATH]``

Nothing here asserts a time; the timed figure is a ratio against a baseline
measured in the same run. CPU, one torch thread, the cyclic GC held off.

- **Pages held**: one request, a 32-token prompt, then 4,096 tokens decoded one
  a step (admit + plan + commit of a 1-token segment) on a stream of label
  ``"swa"``, on a manager with ``retention={"swa": RetentionPolicy(256)}``
  (page size 16) and on one without ``retention``, the same calls. Device
  pages held (the pool's, one request: its own) at every 512 generated tokens:
  flat at ``ceil(W / ps) + 1`` = 17 once the window has filled with
  retention, ``ceil(n / ps)`` without (checked exactly by
  tests/test_benchmarks_retention_smoke.py). Both runs are the same in
  ``--quick``.
- **Decode step**: B = 16 requests holding 100–500 tokens (as
  `benchmarks.control_plane`), each decoding one token a step: admit + plan,
  a ``write_kv`` of the 16 planned rows per layer (2 layers, 1 kv head,
  head_dim 8, float32), commit. With retention (W = 256: the pages that fall
  out of a window are released at the commit) against without, interleaved
  per step, alternating which goes first; ratio = median of per-step ratios.
  4,096 steps a round, 3 rounds on fresh managers, each 1,024-step span
  reported on its own: without retention the requests grow, and so does the
  plan's page table (``plan.decode_tables`` lists every page a request
  holds); with retention it stays at the window's pages. ``--quick``: one
  round of 256 steps.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks import Spread, machine, md_table, no_gc, run_cli, spread
from benchmarks import control_plane as cp
from kvref import KVConfig, KVManager, KVStep, RetentionPolicy, Segment, StepContext

LABEL = "swa"
WINDOW = 256
PAGE_SIZE = 16
PROMPT = 32  # the short prompt before decoding
GENERATED = 4096
EVERY = 512  # a checkpoint every so many generated tokens
BATCH = 16
LAYERS, KV_HEADS, HEAD_DIM = 2, 1, 8


def pages_for(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE)


# the most pages a windowed stream holds once its window has filled: the
# window's ceil(W / ps) pages, plus one when its first token is not a page's first
BOUND = pages_for(WINDOW) + 1


def manager(retention: bool, pages: int) -> KVManager:
    """A small CPU float32 manager of ``pages`` usable pages (+ the sink), with
    label ``"swa"`` windowed to ``WINDOW`` tokens or not."""
    cfg = KVConfig(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                   max_seq_len=1 << 20, max_num_pages=pages + 1, page_size=PAGE_SIZE,
                   num_qo_heads=KV_HEADS,
                   retention={LABEL: RetentionPolicy(context_budget=WINDOW)} if retention
                   else {})
    return KVManager(cfg, "kv", None, None, "cpu", dtype=torch.float32)


def held(mgr: KVManager) -> int:
    """Device pages the pool has given out (the sink aside)."""
    return mgr.config.max_num_pages - 1 - mgr.num_free_pages


def step_of(rids: list[str], span: int = 1) -> KVStep:
    return KVStep([Segment(rid, LABEL, span) for rid in rids])


# -- pages held -----------------------------------------------------------------------


@dataclass(frozen=True)
class Checkpoint:
    generated: int  # tokens decoded after the prompt
    stored: int  # the stream's length: prompt + generated
    retained: int  # device pages held, retention on
    full: int  # device pages held, no retention


@dataclass(frozen=True)
class Growth:
    window: int
    page_size: int
    prompt: int
    generated: int
    bound: int  # ceil(W / ps) + 1
    checkpoints: list[Checkpoint]
    max_retained_after_fill: int  # the most held with retention once stored >= W
    min_retained_after_fill: int
    full_linear: bool  # without retention: ceil(stored / ps) held after every step


def bench_growth(generated: int = GENERATED, every: int = EVERY) -> Growth:
    total = PROMPT + generated
    mgrs = {on: manager(on, pages_for(total) + 1) for on in (True, False)}
    ctx = StepContext(("r",))
    for mgr in mgrs.values():
        mgr.ingest_request("r")
        cp.decode_step(mgr, step_of(["r"], PROMPT), ctx)
    decode = step_of(["r"])
    points = [Checkpoint(0, PROMPT, held(mgrs[True]), held(mgrs[False]))]
    after_fill: list[int] = []
    linear = held(mgrs[False]) == pages_for(PROMPT)
    for g in range(1, generated + 1):
        for mgr in mgrs.values():
            cp.decode_step(mgr, decode, ctx)
        stored = PROMPT + g
        on, off = held(mgrs[True]), held(mgrs[False])
        if stored >= WINDOW:
            after_fill.append(on)
        linear = linear and off == pages_for(stored)
        if g % every == 0 or g == generated:
            points.append(Checkpoint(g, stored, on, off))
    for mgr in mgrs.values():
        assert mgr.stored_len("r", LABEL) == total
    return Growth(WINDOW, PAGE_SIZE, PROMPT, generated, BOUND, points, max(after_fill),
                  min(after_fill), linear)


# -- decode step -------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    first: int  # steps [first, last) of each round, warmup excluded
    last: int
    stored_min: int  # the requests' lengths over these steps (tokens decoded included)
    stored_max: int
    retained_us: Spread  # µs per step, retention on
    full_us: Spread  # the same step, no retention
    ratio: Spread  # retained / full, per step


@dataclass(frozen=True)
class DecodeRow:
    batch: int
    steps: int  # timed steps a round
    rounds: int  # fresh managers each round; a phase pools its steps over them
    layers: int
    phases: list[Phase]
    held_retained: int  # device pages held after the last step (the last round)
    held_full: int


def _decode_round(batch: int, steps: int, warmup: int, seed: int
                  ) -> tuple[list[int], list[list[float]], tuple[int, int]]:
    rng = random.Random(seed)
    lengths = {f"r{i}": rng.randint(cp.MIN_LEN, cp.MAX_LEN) for i in range(batch)}
    total = steps + warmup
    pages = sum(pages_for(n + total) for n in lengths.values()) + 1
    mgrs = [manager(True, pages), manager(False, pages)]
    ctx = StepContext()
    for mgr in mgrs:
        for rid in lengths:
            mgr.ingest_request(rid)
        cp.decode_step(mgr, KVStep([Segment(rid, LABEL, n) for rid, n in lengths.items()]),
                       ctx)
    step = step_of(list(lengths))
    k = torch.randn(batch, KV_HEADS, HEAD_DIM)
    v = torch.randn(batch, KV_HEADS, HEAD_DIM)

    def decoder(mgr: KVManager) -> Any:
        def go() -> None:
            outcome = mgr.admit(step, ctx)
            if not outcome.ok:
                raise RuntimeError(f"decode refused: {outcome.reason}")
            mgr.plan(step, ctx)
            for layer in range(LAYERS):
                mgr.write_kv(k, v, layer_idx=layer, label=LABEL)
            mgr.commit(step, ctx)
        return go

    fns = [decoder(m) for m in mgrs]
    times: list[list[float]] = [[], []]
    with no_gc():
        for i in range(total):
            for j in ((0, 1) if i % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                fns[j]()
                dt = (time.perf_counter() - t0) * 1e6
                if i >= warmup:
                    times[j].append(dt)
    base = [n + warmup for n in lengths.values()]  # each length at the first timed step
    return base, times, (held(mgrs[0]), held(mgrs[1]))


def bench_decode(batch: int, steps: int, phases: int, rounds: int = 1,
                 warmup: int = 16) -> DecodeRow:
    """``rounds`` runs of ``steps`` timed decode steps; the steps split into
    ``phases`` equal spans, each reported on its own (the streams grow)."""
    per = steps // phases
    on: list[list[float]] = [[] for _ in range(phases)]
    off: list[list[float]] = [[] for _ in range(phases)]
    lo, hi = [1 << 30] * phases, [0] * phases
    pages = (0, 0)
    for r in range(rounds):
        base, (t_on, t_off), pages = _decode_round(batch, steps, warmup, seed=batch + r)
        for p in range(phases):
            on[p] += t_on[p * per:(p + 1) * per]
            off[p] += t_off[p * per:(p + 1) * per]
            lo[p] = min(lo[p], min(base) + p * per)
            hi[p] = max(hi[p], max(base) + (p + 1) * per - 1)
    rows = [Phase(p * per, (p + 1) * per, lo[p], hi[p], spread(on[p]), spread(off[p]),
                  spread([a / b for a, b in zip(on[p], off[p], strict=True)]))
            for p in range(phases)]
    return DecodeRow(batch, phases * per, rounds, LAYERS, rows, *pages)


# -- the report ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Results:
    quick: bool
    growth: Growth
    decode: DecodeRow


def run(quick: bool = False) -> Results:
    # the growth is the same in --quick: its bound is exact, and cheap
    decode = bench_decode(BATCH, 256, 2) if quick else \
        bench_decode(BATCH, GENERATED, GENERATED // 1024, rounds=3)
    return Results(quick, bench_growth(), decode)


def _us(s: Spread) -> str:
    return f"{s.median:.1f} [{s.p10:.1f}, {s.p90:.1f}]" if s.median < 100 else \
        f"{s.median:.0f} [{s.p10:.0f}, {s.p90:.0f}]"


def growth_table(g: Growth) -> str:
    rows = [[c.generated, c.stored, c.retained, c.full] for c in g.checkpoints]
    return md_table(["tokens generated", "tokens stored",
                     f"pages held, retention W={g.window}", "pages held, no retention"], rows)


def decode_table(d: DecodeRow) -> str:
    rows: list[list[object]] = [
        [f"steps {p.first}–{p.last - 1} (requests of {p.stored_min}–{p.stored_max} "
         "tokens)", _us(p.retained_us), _us(p.full_us),
         f"{p.ratio.median:.2f}", "report"] for p in d.phases]
    rows.append([f"device pages held after {d.steps} steps (+ warmup)", d.held_retained,
                 d.held_full, f"{d.held_retained / d.held_full:.2f}",
                 f"≤ {d.batch} × {BOUND}"])
    return md_table([f"decode B={d.batch}: admit + plan + write_kv × {d.layers} layers + "
                     "commit, µs/step", "retention", "no retention", "ratio", "target"], rows)


def tables(r: Results) -> str:
    g, d = r.growth, r.decode
    return "\n".join([
        growth_table(g), "",
        f"Once the window has filled (≥ {g.window} tokens stored) the windowed stream "
        f"holds {g.min_retained_after_fill}–{g.max_retained_after_fill} pages "
        f"(bound ceil({g.window} / {g.page_size}) + 1 = {g.bound}); without retention "
        f"ceil(stored / {g.page_size}) after every step: "
        f"{'yes' if g.full_linear else 'no'}.", "",
        decode_table(d),
    ])


def report(r: Results, seconds: float, load: tuple[float, float]) -> str:
    d = r.decode
    return "\n".join([
        "### Sliding-window retention" + (" (--quick)" if r.quick else ""), "",
        f"Machine: {machine()}", "",
        f"One request, a {r.growth.prompt}-token prompt, {r.growth.generated} tokens "
        f"decoded one a step; page size {PAGE_SIZE}, W = {WINDOW}. Decode: µs median "
        f"[p10, p90] over {d.rounds} × {d.steps // len(d.phases)} steps a row, the two "
        "managers interleaved; ratio = retention / no retention, the median of per-step "
        "ratios.", "",
        tables(r), "",
        f"_Measured in {seconds:.0f} s with `python -m benchmarks.retention"
        f"{' --quick' if r.quick else ''}`; load average {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end ({os.cpu_count()} CPUs)._",
    ])


def main(argv: list[str] | None = None) -> None:
    run_cli("retention", __doc__, argv, run, report)


if __name__ == "__main__":
    main()
