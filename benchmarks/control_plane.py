"""Control plane: what one step costs in the manager's bookkeeping.

A decode step is ``admit`` + ``plan`` + ``commit`` over ``batch`` requests, one
new token each, every request holding a prefilled stream of 100–500 tokens
(page_size 16, pages to spare). Timed per step with ``perf_counter``, the
cyclic GC held off, after a warmup; reported as the median with p10/p90.

The same-run baseline ("naive") is a straightforward manager written the
obvious way, doing the bookkeeping the reference does per request: a dict
lookup and page top-up per request under a lock (admit), a view dataclass and a
``torch.tensor`` of its pages per request, concatenated into the CSR page
table, plus the per-token write slots as tensors (plan), then a loop that
clears the marks and adds the span (commit). It does less than kvref (no
refusal checks, forks, preplan, generations), so the ratio is conservative.
"""

from __future__ import annotations

import cProfile
import pstats
import random
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from benchmarks import Spread, no_gc, spread
from kvref import KVConfig, KVManager, KVStep, Segment, StepContext
from kvref.transfer import TransferEngineInfo

PAGE_SIZE = 16
MIN_LEN, MAX_LEN = 100, 500
BATCHES = (1, 16, 64, 256, 1024)


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


def prefill(mgr: KVManager, lengths: dict[str, int], chunk: int = 64) -> None:
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
    mgr = make_manager(pages)
    prefill(mgr, lengths)
    step = KVStep([Segment(rid, "main", 1) for rid in lengths])
    return mgr, step, list(lengths.values())


def decode_step(mgr: KVManager, step: KVStep, ctx: StepContext) -> None:
    outcome = mgr.admit(step, ctx)
    if not outcome.ok:
        raise RuntimeError(f"decode refused: {outcome.reason}")
    mgr.plan(step, ctx)
    mgr.commit(step, ctx)


# -- the straightforward baseline -----------------------------------------------


@dataclass
class _NaiveStream:
    pages: list[int]
    stored_len: int
    in_flight: bool = False


@dataclass
class _NaiveView:
    rid: str
    pages: list[int]
    length: int
    to_compute: int


class NaiveManager:
    """The obvious implementation: per-request Python objects and tensors."""

    def __init__(self, lengths: list[int], spare_tokens: int) -> None:
        total = sum(_pages(n + spare_tokens) for n in lengths)
        self.free: deque[int] = deque(range(1, total + 1))
        self.lock = threading.RLock()
        self.streams: dict[str, _NaiveStream] = {}
        for i, n in enumerate(lengths):
            self.streams[f"r{i}"] = _NaiveStream([self.free.popleft() for _ in range(_pages(n))], n)

    def step(self, rids: list[str]) -> tuple[torch.Tensor, ...]:
        ps = PAGE_SIZE
        with self.lock:  # admit
            for rid in rids:
                s = self.streams[rid]
                short = _pages(s.stored_len + 1) - len(s.pages)
                for _ in range(short):
                    s.pages.append(self.free.popleft())
                s.in_flight = True
        with self.lock:  # plan
            views = []
            for rid in rids:
                s = self.streams[rid]
                length = s.stored_len + 1
                views.append(_NaiveView(rid, s.pages[: _pages(length)], length, 1))
            page_tables = [torch.tensor(v.pages, dtype=torch.int32) for v in views]
            indices = torch.cat(page_tables)
            indptr = torch.tensor([0] + [len(v.pages) for v in views], dtype=torch.int32).cumsum(0)
            last = torch.tensor([(v.length - 1) % ps + 1 for v in views], dtype=torch.int32)
            qo = torch.arange(len(views) + 1, dtype=torch.int32)
            slots = [torch.tensor([v.pages[(v.length - 1) // ps], (v.length - 1) % ps])
                     for v in views]
            write = torch.stack(slots)
        with self.lock:  # commit
            for rid in rids:
                s = self.streams[rid]
                s.in_flight = False
                s.stored_len += 1
        return qo, indptr, indices, last, write


# -- measurements -----------------------------------------------------------------


@dataclass(frozen=True)
class DecodeRow:
    batch: int
    steps: int
    step_us: Spread  # kvref, µs per step
    naive_step_us: Spread  # the baseline, µs per step

    @property
    def req_us(self) -> Spread:
        return self.step_us.scaled(1.0 / self.batch)

    @property
    def naive_req_us(self) -> Spread:
        return self.naive_step_us.scaled(1.0 / self.batch)

    @property
    def ratio(self) -> float:
        """kvref / naive, medians (lower is better)."""
        return self.step_us.median / self.naive_step_us.median


def steps_for(batch: int, quick: bool) -> int:
    # about the same request-steps per batch size, bounded either way
    budget = 3_000 if quick else 40_000
    return max(10 if quick else 40, min(400 if quick else 2000, budget // batch))


def bench_decode(batch: int, steps: int, warmup: int = 5, seed: int = 0) -> DecodeRow:
    mgr, step, lengths = decode_setup(batch, 2 * (steps + warmup), seed)
    naive = NaiveManager(lengths, 2 * (steps + warmup))
    rids = [s.request_id for s in step.segments]
    ctx = StepContext()
    ours: list[float] = []
    theirs: list[float] = []
    clock = time.perf_counter
    for _ in range(warmup):
        decode_step(mgr, step, ctx)
        naive.step(rids)
    with no_gc():
        # interleaved, so drift on a shared box hits both alike
        for _ in range(steps):
            t0 = clock()
            decode_step(mgr, step, ctx)
            t1 = clock()
            naive.step(rids)
            t2 = clock()
            ours.append((t1 - t0) * 1e6)
            theirs.append((t2 - t1) * 1e6)
    return DecodeRow(batch, steps, spread(ours), spread(theirs))


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


def run(quick: bool = False, batches: tuple[int, ...] = BATCHES) -> tuple[
    list[DecodeRow], PrefillRow, dict[int, list[ProfileEntry]]
]:
    rows = [bench_decode(b, steps_for(b, quick)) for b in batches]
    pre = bench_prefill(steps=5 if quick else 30, warmup=1 if quick else 3)
    prof_batches: list[int] = [b for b in (1, 256) if b in batches] or [batches[0]]
    profiles = {b: profile_decode(b, steps_for(b, quick)) for b in prof_batches}
    return rows, pre, profiles
