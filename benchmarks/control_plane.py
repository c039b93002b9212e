"""Control plane: what one step costs in the manager's bookkeeping.

A decode step is ``admit`` + ``plan`` + ``commit`` over ``batch`` requests, one
new token each, every request holding a prefilled stream of 100–500 tokens
(page_size 16, pages to spare). A mixed step is the same decode batch plus one
64-token chunk of a 512-token prompt being prefilled (continuous batching with
chunked prefill). Timed per step with ``perf_counter``, the cyclic GC held
off, after a warmup; reported as the median with p10/p90.

The same-run baseline ("reference") is `benchmarks.reference_manager`: the
reference manager's step written straightforwardly, with the same API, on the
same streams, timed interleaved with kvref so drift on a shared box hits both.
"""

from __future__ import annotations

import cProfile
import pstats
import random
import time
from dataclasses import dataclass

import torch

from benchmarks import Spread, no_gc, spread
from benchmarks.reference_manager import ReferenceManager
from kvref import KVConfig, KVManager, KVStep, Segment, StepContext
from kvref.transfer.engine import TransferEngineInfo

# both managers step through the same API
Stepper = KVManager | ReferenceManager

PAGE_SIZE = 16
MIN_LEN, MAX_LEN = 100, 500
BATCHES = (1, 16, 64, 256, 1024)
MIXED_BATCHES = (1, 16, 256)
CHUNK = 64  # tokens of the prefill chunk a mixed step carries
CHUNKS_PER_PROMPT = 8  # a prompt of 512 tokens, prefilled 64 at a time
# the prompt in flight, and the one freed before the next is ingested
CHUNK_PAGES = 2 * -(-CHUNK * CHUNKS_PER_PROMPT // PAGE_SIZE)


def make_manager(pages: int, cpu_offload_pages: int = 0, *, layers: int = 1,
                 kv_heads: int = 1, head_dim: int = 8) -> KVManager:
    """A CPU float32 manager; the cache is tiny per page, the control plane does not care."""
    cfg = KVConfig(
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_seq_len=1 << 20,
        max_num_pages=pages + 1,  # + the sink
        page_size=PAGE_SIZE,
        num_qo_heads=kv_heads,
        cpu_offload_pages=cpu_offload_pages,
    )
    return KVManager(cfg, "kv", None, TransferEngineInfo(), "cpu", dtype=torch.float32)


def prefill(mgr: Stepper, lengths: dict[str, int], chunk: int = 64) -> None:
    """Ingest each request and fill its main stream with ``lengths[rid]`` tokens."""
    rids = list(lengths)
    for rid in rids:
        mgr.ingest_request(rid)
    ctx = StepContext()
    for i in range(0, len(rids), chunk):
        step = KVStep([Segment(rid, "main", lengths[rid]) for rid in rids[i : i + chunk]])
        outcome = mgr.admit(step, ctx)
        if not outcome.ok:
            raise RuntimeError(f"prefill refused: {outcome.reason}")
        mgr.plan(step, ctx)
        mgr.commit(step, ctx)


def _pages(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE)


def decode_setup(batch: int, steps: int, seed: int = 0) -> tuple[KVManager, KVStep, list[int]]:
    rng = random.Random(seed)
    lengths = {f"r{i}": rng.randint(MIN_LEN, MAX_LEN) for i in range(batch)}
    pages = sum(_pages(n + steps) for n in lengths.values())
    mgr = make_manager(pages + CHUNK_PAGES)
    prefill(mgr, lengths)
    step = KVStep([Segment(rid, "main", 1) for rid in lengths])
    return mgr, step, list(lengths.values())


def decode_step(mgr: Stepper, step: KVStep, ctx: StepContext) -> None:
    outcome = mgr.admit(step, ctx)
    if not outcome.ok:
        raise RuntimeError(f"decode refused: {outcome.reason}")
    mgr.plan(step, ctx)
    mgr.commit(step, ctx)


# -- the baseline -------------------------------------------------------------------


def reference_setup(lengths: list[int], spare_tokens: int) -> ReferenceManager:
    """The baseline holding the same prefilled streams as `decode_setup`'s manager."""
    ref = ReferenceManager(sum(_pages(n + spare_tokens) for n in lengths) + CHUNK_PAGES,
                           PAGE_SIZE)
    prefill(ref, {f"r{i}": n for i, n in enumerate(lengths)})
    return ref


# -- measurements -----------------------------------------------------------------


@dataclass(frozen=True)
class DecodeRow:
    batch: int
    steps: int
    step_us: Spread  # kvref, µs per step
    ref_step_us: Spread  # the baseline, µs per step

    @property
    def req_us(self) -> Spread:
        return self.step_us.scaled(1.0 / self.batch)

    @property
    def ref_req_us(self) -> Spread:
        return self.ref_step_us.scaled(1.0 / self.batch)

    @property
    def ratio(self) -> float:
        """kvref / reference, medians (lower is better; the target is <= 1/3)."""
        return self.step_us.median / self.ref_step_us.median


def steps_for(batch: int, quick: bool) -> int:
    # about the same request-steps per batch size, bounded either way
    budget = 3_000 if quick else 40_000
    return max(10 if quick else 40, min(400 if quick else 2000, budget // batch))


def bench_decode(batch: int, steps: int, warmup: int = 5, seed: int = 0) -> DecodeRow:
    spare = 2 * (steps + warmup)
    mgr, step, lengths = decode_setup(batch, spare, seed)
    ref = reference_setup(lengths, spare)
    ctx = StepContext()
    ours: list[float] = []
    theirs: list[float] = []
    clock = time.perf_counter
    for _ in range(warmup):
        decode_step(mgr, step, ctx)
        decode_step(ref, step, ctx)
    with no_gc():
        # interleaved, so drift on a shared box hits both alike
        for _ in range(steps):
            t0 = clock()
            decode_step(mgr, step, ctx)
            t1 = clock()
            decode_step(ref, step, ctx)
            t2 = clock()
            ours.append((t1 - t0) * 1e6)
            theirs.append((t2 - t1) * 1e6)
    return DecodeRow(batch, steps, spread(ours), spread(theirs))


@dataclass(frozen=True)
class MixedRow:
    """Decode-only and mixed steps of one batch, kvref and the reference, one run."""

    batch: int
    steps: int
    decode_us: Spread
    mixed_us: Spread
    ref_decode_us: Spread
    ref_mixed_us: Spread
    # mixed - decode, each the mean over two iterations (one with each step
    # first, `paired_extras`): the steps ran back to back, so the difference
    # cancels the drift of a shared box that the medians carry
    extra_us: Spread
    ref_extra_us: Spread

    @property
    def ratio(self) -> float:
        """kvref mixed / reference mixed, medians."""
        return self.mixed_us.median / self.ref_mixed_us.median


class _Prompt:
    """One prompt prefilled a chunk per mixed step; a fresh one once it is full.

    The swap (remove + ingest) runs outside the timed region.
    """

    def __init__(self, mgr: Stepper, tag: str) -> None:
        self.mgr, self.tag, self.n, self.done = mgr, tag, 0, CHUNKS_PER_PROMPT

    def next_segment(self) -> Segment:
        if self.done == CHUNKS_PER_PROMPT:
            if self.n:
                self.mgr.remove_request(f"{self.tag}{self.n}")
            self.n += 1
            self.mgr.ingest_request(f"{self.tag}{self.n}")
            self.done = 0
        self.done += 1
        return Segment(f"{self.tag}{self.n}", "main", CHUNK)


def bench_mixed(batch: int, steps: int, warmup: int = 5, seed: int = 0) -> MixedRow:
    """Per iteration: a decode step and a mixed step on kvref, then on the reference."""
    spare = 2 * (steps + warmup)
    mgr, step, lengths = decode_setup(batch, spare, seed)
    ref = reference_setup(lengths, spare)
    prompts = {id(mgr): _Prompt(mgr, "p"), id(ref): _Prompt(ref, "p")}
    ctx = StepContext()
    samples: dict[tuple[int, bool], list[float]] = {
        (id(m), mixed): [] for m in (mgr, ref) for mixed in (False, True)}
    clock = time.perf_counter
    with no_gc():
        for i in range(warmup + steps):
            # alternate which of the two steps goes first: the first one
            # follows the other manager's step and finds the caches colder
            order = (False, True) if i % 2 else (True, False)
            # the reference's order flips every two iterations, so each of
            # kvref's orders follows each of the reference's steps as often
            # (in kvref's order, kvref's mixed step went first only after the
            # reference's mixed step, the one that evicts most: issue 42)
            orders = {id(mgr): order, id(ref): (False, True) if i // 2 % 2 else (True, False)}
            for m in (mgr, ref):
                chunk = prompts[id(m)].next_segment()
                for mixed in orders[id(m)]:
                    # each step a new KVStep, as an engine builds one per step:
                    # the decode step passed as the very object the validator
                    # remembered (after a decode step, every other iteration)
                    # skipped the walk a mixed step, always a new object, paid
                    # (issue 42: about 3 µs of the extra was that memo hit)
                    run = KVStep([*step.segments, chunk] if mixed else step.segments)
                    t0 = clock()
                    decode_step(m, run, ctx)
                    t1 = clock()
                    if i >= warmup:
                        samples[(id(m), mixed)].append((t1 - t0) * 1e6)
    extras = [spread(paired_extras(samples[(id(m), False)], samples[(id(m), True)]))
              for m in (mgr, ref)]
    return MixedRow(batch, steps, *(spread(samples[(id(m), mixed)])
                                    for m in (mgr, ref) for mixed in (False, True)), *extras)


def paired_extras(decode: list[float], mixed: list[float]) -> list[float]:
    """Mixed - decode per pair of iterations, one with each step first.

    Whichever step goes first runs colder, so the difference of one
    iteration is the extra work plus or minus that cold penalty: two modes
    tens of µs apart, whose median is no midpoint and moved 15 to 35 µs
    between runs (issue 42). The mean over two consecutive iterations (one
    each way round) cancels the penalty where it is the same for both steps.
    """
    diffs = [b - a for a, b in zip(decode, mixed, strict=True)]
    return [(diffs[k] + diffs[k + 1]) / 2 for k in range(0, len(diffs) - 1, 2)]


@dataclass(frozen=True)
class PrefillRow:
    requests: int
    tokens: int
    steps: int
    step_us: Spread

    @property
    def token_us(self) -> Spread:
        return self.step_us.scaled(1.0 / (self.requests * self.tokens))


def bench_prefill(requests: int = 16, tokens: int = 512, steps: int = 30,
                  warmup: int = 3) -> PrefillRow:
    """Fresh requests each step, ``tokens`` each: the packed plan path."""
    mgr = make_manager(requests * _pages(tokens) + 1)
    ctx = StepContext()
    samples: list[float] = []
    clock = time.perf_counter
    for i in range(warmup + steps):
        rids = [f"p{i}_{j}" for j in range(requests)]
        for rid in rids:
            mgr.ingest_request(rid)
        step = KVStep([Segment(rid, "main", tokens) for rid in rids])
        with no_gc():
            t0 = clock()
            decode_step(mgr, step, ctx)
            t1 = clock()
        if i >= warmup:
            samples.append((t1 - t0) * 1e6)
        for rid in rids:
            mgr.remove_request(rid)
    return PrefillRow(requests, tokens, steps, spread(samples))


@dataclass(frozen=True)
class ProfileEntry:
    function: str
    calls_per_step: float
    self_us_per_step: float
    cum_us_per_step: float


def profile_decode(batch: int, steps: int, top: int = 12) -> list[ProfileEntry]:
    """cProfile of ``steps`` decode steps, by self time; cProfile inflates small calls."""
    mgr, step, _ = decode_setup(batch, steps + 5)
    ctx = StepContext()
    for _ in range(5):
        decode_step(mgr, step, ctx)
    prof = cProfile.Profile()
    with no_gc():
        prof.enable()
        for _ in range(steps):
            decode_step(mgr, step, ctx)
        prof.disable()
    stats = pstats.Stats(prof)
    raw = stats.stats  # type: ignore[attr-defined]
    entries: list[ProfileEntry] = []
    for (path, line, name), (_, ncalls, tottime, cumtime, _callers) in raw.items():
        where = name if path == "~" else f"{path.rsplit('/kvref/', 1)[-1]}:{line}({name})"
        if path.endswith(".py") and "/kvref/" in path:
            where = "kvref/" + where
        entries.append(ProfileEntry(where, ncalls / steps, tottime / steps * 1e6,
                                    cumtime / steps * 1e6))
    entries.sort(key=lambda e: e.self_us_per_step, reverse=True)
    return entries[:top]


def run(quick: bool = False, batches: tuple[int, ...] = BATCHES,
        mixed_batches: tuple[int, ...] = MIXED_BATCHES) -> tuple[
    list[DecodeRow], list[MixedRow], PrefillRow, dict[int, list[ProfileEntry]]
]:
    rows = [bench_decode(b, steps_for(b, quick)) for b in batches]
    mixed = [bench_mixed(b, steps_for(b, quick)) for b in mixed_batches]
    pre = bench_prefill(steps=5 if quick else 30, warmup=1 if quick else 3)
    prof_batches: list[int] = [b for b in (1, 256) if b in batches] or [batches[0]]
    profiles = {b: profile_decode(b, steps_for(b, quick)) for b in prof_batches}
    return rows, mixed, pre, profiles
