"""Shared pages in the manager (issue 18, "Measured"):
``python -m benchmarks.shared_pages [--quick] [--json PATH]``

Each figure is a ratio against a baseline measured in the same run; nothing
here asserts a time. CPU, one torch thread, the cyclic GC held off.

- **Fork** of a 2,048-token stream (page size 16) as a whole pre-fork step
  (admit + plan + commit, ``pre_forks=[("main", "s1")]``): the copy-on-write
  fork (``enable_prefix_caching=True``) against the copying fork of a manager
  with sharing off, timed alternately. The cache is a realistic one (8 layers,
  8 kv heads, head_dim 128, bfloat16: 512 KiB a page). Pages copied are
  counted at `KVCache.copy_pages`. The target is truncated to 0 between
  repetitions (untimed), so each forks the same stream onto an empty target.
  A 2,057-token stream (a partial last page) shows the one page copied.
- **Prefix hit**: a 2,048-token prompt whose first 1,792 tokens are cached
  (held by another request): ``match_prefix`` + admit/plan/commit of the 256
  left, against the same calls with nothing cached (``match_prefix`` misses,
  the step admits 2,048). Both hash (``match_prefix`` hashes page by page up
  to the first miss). A second row adds what an engine does after the
  prefill's commit, ``cache_prefix`` of the 2,048 tokens. Hashing alone is
  `benchmarks.prefix_cache.hashing` (``page_keys`` against a pickling chain).
- **Decode**: one decode step (a token for each of B requests holding
  100–500 tokens, as `benchmarks.control_plane`) with caching on, the engine
  naming a request's tokens (``cache_prefix``) each time its last page fills,
  against caching off; also caching on with no tokens named, and caching on
  with each request's ids handed over once (``follow_tokens``) under each
  page-key hash: SHA-256 (the default) and XXH3-128
  (``KVConfig(page_key_hash="xxh3_128")``, a row only where the ``xxhash``
  package is installed). Interleaved per step; ratio = median of per-step
  ratios.
- **Memory**: 16 requests whose prompts share a 1,024-token system prompt,
  each with 100 tokens of its own: the first computes and caches its prompt,
  the 15 others hit. Device pages held, against the same calls on a manager
  with sharing off (checked exactly by tests/test_benchmarks_shared_smoke.py).
- **Preemption** (S29, issue 28 part 4): the same 16 requests; the last 8 are
  offloaded to the host, then reloaded. Device pages held after, and the
  reloaded requests' private copies of pages whose key the cache still holds,
  with the reload re-attaching what the cache holds against the reload before
  issue 28 (every page copied back: `HostOffload._reattach` answering nothing,
  on the baseline manager only). Reload time: one request of the prompt + 100
  tokens, offloaded (untimed) and reloaded (timed), on the fork's realistic
  cache (512 KiB a page), the two managers alternately.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from benchmarks import Spread, machine, md_table, no_gc, run_cli, spread
from benchmarks import control_plane as cp
from benchmarks.prefix_cache import CACHED, PAGE_SIZE, PROMPT, Pair, hashing, pair
from kvref import KVConfig, KVManager, KVStep, Segment, StepContext
from kvref.core.config import KVReqConfig
from kvref.core.errors import InvalidConfigError
from kvref.prefix.keys import key_hash_named

SALT = "tenant-7"  # every request here is one tenant's: its pages hit each other
FORK_TOKENS = (2048, 2057)  # whole pages, and a partial last page
FORK_CACHE = {"layers": 8, "kv_heads": 8, "head_dim": 128}  # bf16: 512 KiB a page
DECODE_BATCHES = (16, 256)
MEMORY_REQUESTS, MEMORY_SHARED, MEMORY_OWN = 16, 1024, 100
PREEMPTED = 8  # of the memory benchmark's requests, the last ones


def pages_for(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE)


def manager(sharing: bool, pages: int, *, layers: int = 1, kv_heads: int = 1,
            head_dim: int = 8, dtype: torch.dtype = torch.float32,
            host_pages: int = 0, key_hash: str = "sha256") -> KVManager:
    """A CPU manager of ``pages`` usable pages (+ the sink), sharing on or off."""
    cfg = KVConfig(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                   max_seq_len=1 << 20, max_num_pages=pages + 1, page_size=PAGE_SIZE,
                   num_qo_heads=kv_heads, enable_prefix_caching=sharing,
                   cpu_offload_pages=host_pages, page_key_hash=key_hash)
    return KVManager(cfg, "kv", None, None, "cpu", dtype=dtype)


# admit + plan + commit, raising on a refusal (the benchmarks size their pools)
run_step = cp.decode_step


def prompt_step(rid: str, tokens: int) -> KVStep:
    return KVStep([Segment(rid, "main", tokens)])


def token_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(150_000) for _ in range(n)]


# -- fork ---------------------------------------------------------------------


@dataclass(frozen=True)
class ForkRow:
    tokens: int
    page_kib: float
    copied_shared: int  # pages passed to copy_pages per fork, the most over the reps
    copied_copying: int
    shared_us: Spread  # the whole pre-fork step, copy on write
    copying_us: Spread  # the same step, sharing off
    ratio: Spread  # shared / copying, per repetition


def _counted(mgr: KVManager) -> list[int]:
    """Pages each `copy_pages` call of ``mgr``'s cache moves, as it is called."""
    moved: list[int] = []
    orig = mgr.kv_cache.copy_pages

    def counting(src: list[int], dst: list[int]) -> None:
        moved.append(len(src))
        orig(src, dst)

    mgr.kv_cache.copy_pages = counting  # type: ignore[method-assign]
    return moved


def bench_fork(tokens: int, reps: int, *, layers: int = FORK_CACHE["layers"],
               kv_heads: int = FORK_CACHE["kv_heads"],
               head_dim: int = FORK_CACHE["head_dim"]) -> ForkRow:
    ctx = StepContext(("a",))
    fork = KVStep([], pre_forks=[("main", "s1")])
    sides: list[tuple[KVManager, list[int]]] = []
    for sharing in (True, False):
        # the source, and a target's reservation of the whole length at admit
        mgr = manager(sharing, 2 * pages_for(tokens) + 2, layers=layers, kv_heads=kv_heads,
                      head_dim=head_dim, dtype=torch.bfloat16)
        mgr.ingest_request("a")
        run_step(mgr, prompt_step("a", tokens), ctx)
        sides.append((mgr, _counted(mgr)))
    per_fork: list[list[int]] = [[], []]

    def forker(j: int) -> Callable[[], None]:
        mgr, moved = sides[j]

        def go() -> None:
            moved.clear()
            run_step(mgr, fork, ctx)
        return go

    def undo(j: int) -> Callable[[], None]:
        mgr, moved = sides[j]

        def back() -> None:
            assert mgr.stored_len("a", "s1") == tokens
            per_fork[j].append(sum(moved))
            mgr.truncate("a", "s1", 0)  # the next repetition forks onto an empty target
        return back

    for j in (0, 1):  # a warmup each
        forker(j)()
        undo(j)()
    p = pair(forker(0), forker(1), reps, undo=(undo(0), undo(1)))
    page_kib = sides[0][0].kv_cache.tensor[:, 0].numel() * 2 / 1024
    return ForkRow(tokens, page_kib, max(per_fork[0]), max(per_fork[1]), p.ours_us,
                   p.theirs_us, p.ratio)


# -- prefix hit ---------------------------------------------------------------------


@dataclass(frozen=True)
class HitRows:
    attached: int  # tokens match_prefix attached on the hit
    admission: Pair  # match_prefix + admit/plan/commit: hit / nothing cached
    with_cache_prefix: Pair  # the same + cache_prefix of the whole prompt
    hashing: Pair  # page_keys of the prompt / the pickling chain


def _admission(reps: int, name_tokens: bool, attached: list[int]) -> Pair:
    rng = random.Random(3)
    system = token_ids(rng, CACHED)
    # each repetition's prompt: the cached head, then 256 tokens of its own, so
    # pages a repetition cached never lengthen the next one's hit
    prompts = [system + token_ids(rng, PROMPT - CACHED) for _ in range(reps + 1)]
    per = pages_for(PROMPT)
    # room for every repetition's cached tail: nothing is evicted while timed
    warm = manager(True, 2 * per + (reps + 2) * (per - CACHED // PAGE_SIZE))
    cold = manager(True, 2 * per)
    salt = KVReqConfig(cache_salt=SALT)
    warm.ingest_request("seed", salt)
    run_step(warm, prompt_step("seed", CACHED), StepContext())
    warm.cache_prefix("seed", "main", system)  # the cached head, held by another
    ctx = StepContext()
    count = {id(warm): 0, id(cold): 0}  # each side's repetitions so far

    def rid_of(mgr: KVManager) -> str:
        return f"r{count[id(mgr)]}"

    for mgr in (warm, cold):
        mgr.ingest_request(rid_of(mgr), salt)

    def admit(mgr: KVManager, log: list[int] | None) -> Callable[[], None]:
        def go() -> None:
            rid, tokens = rid_of(mgr), prompts[count[id(mgr)] % len(prompts)]
            hit = mgr.match_prefix(rid, "main", tokens)
            run_step(mgr, prompt_step(rid, PROMPT - hit), ctx)
            if name_tokens:
                mgr.cache_prefix(rid, "main", tokens)
            if log is not None:
                log.append(hit)
        return go

    def undo(mgr: KVManager) -> Callable[[], None]:
        def back() -> None:
            mgr.remove_request(rid_of(mgr))
            if mgr is cold:
                mgr.reset_prefix_cache()  # nothing cached next time either
            count[id(mgr)] += 1
            mgr.ingest_request(rid_of(mgr), salt)  # untimed, as the removal
        return back

    return pair(admit(warm, attached), admit(cold, None), reps, undo=(undo(warm), undo(cold)))


def bench_hit(reps: int) -> HitRows:
    attached: list[int] = []
    admission = _admission(reps, False, attached)
    if set(attached) != {CACHED}:
        raise RuntimeError(f"the hit attached {sorted(set(attached))} tokens, not {CACHED}")
    return HitRows(CACHED, admission, _admission(reps, True, []), hashing(reps))


# -- decode ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeRow:
    batch: int
    steps: int
    off_us: Spread  # caching off, µs per step
    on_us: Spread  # caching on, no tokens named
    named_us: Spread  # caching on, cache_prefix of each request whose last page filled
    on_ratio: Spread  # on / off, per step
    named_ratio: Spread  # named / off, per step
    cache_calls_per_step: float
    # caching on, each request's ids handed over once (`follow_tokens`, S33):
    # the commits key the pages that fill
    followed_us: Spread
    followed_ratio: Spread  # followed / off, per step
    # the same with the fast page-key hash (`FAST_HASH`); None where its
    # package is not installed (or a run recorded before it was a choice)
    fast_us: Spread | None = None
    fast_ratio: Spread | None = None  # fast / off, per step


# the fast page-key hash the decode rows measure beside SHA-256
FAST_HASH = "xxh3_128"


def fast_hash() -> str | None:
    """`FAST_HASH` where its package is installed, else None (its rows left out)."""
    try:
        key_hash_named(FAST_HASH)
    except InvalidConfigError:
        return None
    return FAST_HASH


def bench_decode(batch: int, steps: int, warmup: int = 5) -> DecodeRow:
    rng = random.Random(batch)
    lengths = {f"r{i}": rng.randint(cp.MIN_LEN, cp.MAX_LEN) for i in range(batch)}
    total = steps + warmup
    tokens = {rid: token_ids(rng, n + total) for rid, n in lengths.items()}
    pages = sum(pages_for(n + total) for n in lengths.values()) + 1
    fast = fast_hash()
    mgrs = [manager(True, pages), manager(True, pages), manager(False, pages),
            manager(True, pages)]
    if fast is not None:  # the same as followed, keyed with the fast hash
        mgrs.append(manager(True, pages, key_hash=fast))
    for mgr in mgrs:
        cp.prefill(mgr, lengths)
    named = mgrs[0]
    for rid, n in lengths.items():
        named.cache_prefix(rid, "main", tokens[rid][:n])
        for mgr in mgrs[3:]:
            mgr.follow_tokens(rid, tokens[rid])  # ids past the committed are never read
    step = KVStep([Segment(rid, "main", 1) for rid in lengths])
    ctx = StepContext()
    length = dict(lengths)
    calls = [0]

    def decode_named() -> None:
        run_step(named, step, ctx)
        for rid in length:
            n = length[rid] = length[rid] + 1
            if n % PAGE_SIZE == 0:  # a page filled: its tokens are final
                # only the page that filled: the keyed ones end at n - PAGE_SIZE
                named.cache_prefix(rid, "main", tokens[rid][n - PAGE_SIZE:n],
                                   start=n - PAGE_SIZE)
                calls[0] += 1

    def stepper(mgr: KVManager) -> Callable[[], None]:
        return lambda: run_step(mgr, step, ctx)

    fns: list[Callable[[], None]] = [decode_named, *map(stepper, mgrs[1:])]
    times: list[list[float]] = [[] for _ in fns]
    forward = tuple(range(len(fns)))
    with no_gc():
        for i in range(total):
            order = forward if i % 2 == 0 else forward[::-1]
            for j in order:
                t0 = time.perf_counter()
                fns[j]()
                dt = (time.perf_counter() - t0) * 1e6
                if i >= warmup:
                    times[j].append(dt)
            if i == warmup - 1:
                calls[0] = 0
    off = times[2]
    for rid, n in length.items():  # each keyed every page that filled
        assert named.cached_tokens(rid) == n // PAGE_SIZE * PAGE_SIZE
        assert all(mgr.cached_tokens(rid) == n // PAGE_SIZE * PAGE_SIZE for mgr in mgrs[3:])

    def ratio(j: int) -> Spread:
        return spread([a / b for a, b in zip(times[j], off, strict=True)])

    return DecodeRow(batch, steps, spread(off), spread(times[1]), spread(times[0]), ratio(1),
                     ratio(0), calls[0] / steps, spread(times[3]), ratio(3),
                     *((spread(times[4]), ratio(4)) if fast is not None else ()))


# -- memory ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Memory:
    requests: int
    shared_tokens: int
    own_tokens: int
    shared_pages: int  # the prompt's pages, held once
    own_pages: int  # each request's pages past them
    attached: list[int]  # tokens each hit attached (the 15 after the first)
    held: int  # device pages held, sharing on
    held_copying: int  # the same calls, sharing off
    heads_shared: bool  # every request's first pages are the first request's


def _held(mgr: KVManager) -> int:
    return mgr.config.max_num_pages - 1 - mgr.num_free_pages


def bench_memory(requests: int = MEMORY_REQUESTS, shared_tokens: int = MEMORY_SHARED,
                 own_tokens: int = MEMORY_OWN) -> Memory:
    rng = random.Random(4)
    system = token_ids(rng, shared_tokens)
    prompts = {f"r{i}": system + token_ids(rng, own_tokens) for i in range(requests)}
    per = pages_for(shared_tokens + own_tokens)
    out: dict[bool, tuple[KVManager, list[int]]] = {}
    for sharing in (True, False):
        mgr = manager(sharing, requests * per)
        attached = []
        for i, (rid, tokens) in enumerate(prompts.items()):
            mgr.ingest_request(rid, KVReqConfig(cache_salt=SALT))
            hit = mgr.match_prefix(rid, "main", tokens)
            if i:
                attached.append(hit)
            run_step(mgr, prompt_step(rid, len(tokens) - hit), StepContext())
            mgr.cache_prefix(rid, "main", tokens)  # after its commit, as an engine does
        out[sharing] = mgr, attached
    mgr, attached = out[True]
    shared = shared_tokens // PAGE_SIZE
    first = mgr._streams["r0"]["main"].page_indices[:shared]
    heads = all(mgr._streams[rid]["main"].page_indices[:shared] == first for rid in prompts)
    return Memory(requests, shared_tokens, own_tokens, shared, per - shared, attached,
                  _held(mgr), _held(out[False][0]), heads)


# -- preemption: offload and reload (S29) ---------------------------------------------


@dataclass(frozen=True)
class Preemption:
    requests: int
    preempted: int
    held_before: int  # device pages held before the offloads
    held: int  # after offload + reload, the reload re-attaching
    held_copying: int  # the same, every page copied back (the reload before issue 28)
    private_cached: int  # reloaded pages that copy a page the cache holds, re-attaching
    private_cached_copying: int  # the same, copying back
    pages_taken: int  # reload_outcome's pages_taken over the preempted requests
    pages_taken_copying: int
    reload_us: Pair  # one request's reload: re-attaching / copying back


def copying_back(mgr: KVManager) -> KVManager:
    """``mgr`` with the reload before issue 28: nothing re-attached (the baseline)."""
    offload = mgr._host_offload
    assert offload is not None
    offload._reattach = lambda rid, labels: {}  # type: ignore[method-assign]
    return mgr


def _private_cached(mgr: KVManager, rid: str, keys: list[bytes | None]) -> int:
    """Pages of ``rid`` whose key, as it went to the host, the cache holds now
    in another page: a private copy the reload made of a cached page."""
    pages = mgr._streams[rid]["main"].page_indices
    return sum(1 for p, k in zip(pages, keys, strict=False)
               if k is not None and mgr._pages.cached_page(k) not in (None, p))


def _prompts(requests: int, shared_tokens: int, own_tokens: int) -> dict[str, list[int]]:
    rng = random.Random(4)
    system = token_ids(rng, shared_tokens)
    return {f"r{i}": system + token_ids(rng, own_tokens) for i in range(requests)}


def _prefilled(mgr: KVManager, prompts: dict[str, list[int]]) -> None:
    for rid, tokens in prompts.items():
        mgr.ingest_request(rid, KVReqConfig(cache_salt=SALT))
        hit = mgr.match_prefix(rid, "main", tokens)
        run_step(mgr, prompt_step(rid, len(tokens) - hit), StepContext())
        mgr.cache_prefix(rid, "main", tokens)


def bench_preemption(reps: int, requests: int = MEMORY_REQUESTS,
                     shared_tokens: int = MEMORY_SHARED, own_tokens: int = MEMORY_OWN,
                     preempted: int = PREEMPTED) -> Preemption:
    prompts = _prompts(requests, shared_tokens, own_tokens)
    per = pages_for(shared_tokens + own_tokens)
    victims = list(prompts)[-preempted:]
    figures: list[tuple[int, int, int, int]] = []
    for reattach in (True, False):
        # room for every request's own copy: the baseline needs it
        mgr = manager(True, requests * per + preempted * per, host_pages=preempted * per)
        if not reattach:
            copying_back(mgr)
        _prefilled(mgr, prompts)
        before = _held(mgr)
        keys = {rid: [mgr._pages.key_of(p) for p in mgr._streams[rid]["main"].page_indices]
                for rid in victims}
        for rid in victims:
            assert mgr.offload_outcome(rid).reason is None
        taken = 0
        for rid in victims:
            out = mgr.reload_outcome(rid)
            assert out.reason is None, out
            taken += out.pages_taken
        private = sum(_private_cached(mgr, rid, keys[rid]) for rid in victims)
        figures.append((before, _held(mgr), private, taken))
    # the reload's time, on a realistic cache: r0 keeps the prompt, r1 goes and comes
    two = dict(list(prompts.items())[:2])
    sides = []
    for reattach in (True, False):
        mgr = manager(True, 4 * per, layers=FORK_CACHE["layers"],
                      kv_heads=FORK_CACHE["kv_heads"], head_dim=FORK_CACHE["head_dim"],
                      dtype=torch.bfloat16, host_pages=per)
        if not reattach:
            copying_back(mgr)
        _prefilled(mgr, two)
        sides.append(mgr)

    def reload(mgr: KVManager) -> Callable[[], None]:
        def go() -> None:
            assert mgr.reload_outcome("r1").reason is None
        return go

    def offload(mgr: KVManager) -> Callable[[], None]:
        def go() -> None:
            assert mgr.offload_outcome("r1").reason is None
        return go

    for mgr in sides:  # the first offload, untimed
        offload(mgr)()
    p = pair(reload(sides[0]), reload(sides[1]), reps,
             undo=(offload(sides[0]), offload(sides[1])))
    (before, held, private, taken), (_, held_c, private_c, taken_c) = figures
    return Preemption(requests, preempted, before, held, held_c, private, private_c, taken,
                      taken_c, p)


# -- the report -------------------------------------------------------------------------


@dataclass(frozen=True)
class Results:
    quick: bool
    reps: int
    forks: list[ForkRow]
    hit: HitRows
    decode: list[DecodeRow]
    memory: Memory
    preemption: Preemption | None = None  # None: a run recorded before S29's re-attach


def run(quick: bool = False) -> Results:
    reps = 5 if quick else 100
    forks = [bench_fork(n, reps) for n in FORK_TOKENS]
    hit = bench_hit(20 if quick else 1000)
    steps = 20 if quick else 500
    decode = [bench_decode(b, steps if b < 256 else steps * 2 // 5) for b in DECODE_BATCHES]
    return Results(quick, reps, forks, hit, decode, bench_memory(),
                   bench_preemption(5 if quick else 50))


def _us(s: Spread) -> str:
    return f"{s.median:.1f} [{s.p10:.1f}, {s.p90:.1f}]" if s.median < 100 else \
        f"{s.median:.0f} [{s.p10:.0f}, {s.p90:.0f}]"


def _ratio(s: Spread) -> str:
    return f"{s.median:.3f}" if s.median < 0.1 else f"{s.median:.2f}"


def tables(r: Results) -> str:
    rows: list[Sequence[object]] = []
    for f in r.forks:
        rows.append([f"fork of {f.tokens} tokens: pages copied", f.copied_shared,
                     f"{f.copied_copying} (copying fork)", "", "≤ 1"])
        rows.append([f"fork of {f.tokens} tokens: µs per pre-fork step", _us(f.shared_us),
                     _us(f.copying_us), _ratio(f.ratio), "≤ 0.05"])
    h = r.hit
    rows.append([f"admission of {PROMPT} tokens, {h.attached} cached: match_prefix + "
                 "admit/plan/commit, µs", _us(h.admission.ours_us),
                 f"{_us(h.admission.theirs_us)} (nothing cached)",
                 _ratio(h.admission.ratio), "< 1"])
    rows.append(["the same + cache_prefix of the prompt, µs",
                 _us(h.with_cache_prefix.ours_us),
                 f"{_us(h.with_cache_prefix.theirs_us)} (nothing cached)",
                 _ratio(h.with_cache_prefix.ratio), "< 1"])
    rows.append([f"hash {PROMPT} tokens into {PROMPT // PAGE_SIZE} page keys, µs",
                 _us(h.hashing.ours_us), f"{_us(h.hashing.theirs_us)} (pickle chain)",
                 _ratio(h.hashing.ratio), "report"])
    for d in r.decode:
        rows.append([f"decode B={d.batch}, caching on, pages keyed by the commits "
                     "(follow_tokens), µs/step", _us(d.followed_us),
                     f"{_us(d.off_us)} (caching off)", _ratio(d.followed_ratio), "≤ 1.05"])
        if d.fast_us is not None and d.fast_ratio is not None:
            rows.append([f"decode B={d.batch}, caching on, pages keyed by the commits "
                         f"(follow_tokens), {FAST_HASH} keys, µs/step", _us(d.fast_us),
                         f"{_us(d.off_us)} (caching off)", _ratio(d.fast_ratio), "≤ 1.05"])
        rows.append([f"decode B={d.batch}, caching on, tokens named "
                     f"({d.cache_calls_per_step:.1f} cache_prefix/step), µs/step",
                     _us(d.named_us), f"{_us(d.off_us)} (caching off)",
                     _ratio(d.named_ratio), "≤ 1.05"])
        rows.append([f"decode B={d.batch}, caching on, no tokens named, µs/step",
                     _us(d.on_us), f"{_us(d.off_us)} (caching off)", _ratio(d.on_ratio),
                     ""])
    m = r.memory
    rows.append([f"{m.requests} requests sharing a {m.shared_tokens}-token prompt (+ "
                 f"{m.own_tokens} own): device pages held", m.held,
                 f"{m.held_copying} (sharing off)", f"{m.held / m.held_copying:.2f}",
                 f"{m.shared_pages} + {m.requests} × {m.own_pages}"])
    e = r.preemption
    if e is not None:
        rows.append([f"the same after {e.preempted} of them are offloaded and reloaded: "
                     "device pages held", e.held, f"{e.held_copying} (copied back)",
                     f"{e.held / e.held_copying:.2f}", f"{e.held_before} (as before)"])
        rows.append(["reloaded pages that privately copy a page the cache holds",
                     e.private_cached, f"{e.private_cached_copying} (copied back)", "", "0"])
        rows.append(["reload of one request sharing the prompt, µs",
                     _us(e.reload_us.ours_us), f"{_us(e.reload_us.theirs_us)} (copied back)",
                     _ratio(e.reload_us.ratio), "report"])
    return md_table(["what", "kvref, sharing", "baseline", "ratio", "target"], rows)


def report(r: Results, seconds: float, load: tuple[float, float]) -> str:
    m = r.memory
    f = r.forks[0]
    return "\n".join([
        "### Shared pages" + (" (--quick)" if r.quick else ""), "",
        f"Machine: {machine()}", "",
        f"µs: median [p10, p90]; ratio = kvref with sharing / baseline, the median of "
        f"per-repetition ratios, the two timed alternately ({r.reps} forks, "
        f"{r.hit.admission.ours_us.n} admissions, {r.decode[0].steps}/"
        f"{r.decode[-1].steps} decode steps). Fork cache: {f.page_kib:.0f} KiB a page "
        f"(bfloat16, {FORK_CACHE['layers']} layers, {FORK_CACHE['kv_heads']} kv heads, "
        f"head_dim {FORK_CACHE['head_dim']}), page size {PAGE_SIZE}.", "",
        tables(r), "",
        f"Memory: **{m.held} pages held** = {m.shared_pages} shared + {m.requests} × "
        f"{m.own_pages} own (each hit attached {m.shared_tokens} tokens: "
        f"{sorted(set(m.attached))}); without sharing {m.held_copying} = {m.requests} × "
        f"{m.shared_pages + m.own_pages}, of which {m.requests} × {m.shared_pages} = "
        f"{m.requests * m.shared_pages} are copies of the prompt.",
        "",
        *([] if (e := r.preemption) is None else [
            f"Preemption: after {e.preempted} requests are offloaded and reloaded, "
            f"**{e.held} pages held** (as before: {e.held_before}); the reloads took "
            f"{e.pages_taken} pages, against {e.pages_taken_copying} copying every page "
            f"back ({e.held_copying} held, {e.private_cached_copying} of them private "
            "copies of cached pages).", ""]),
        f"_Measured in {seconds:.0f} s with `python -m benchmarks.shared_pages"
        f"{' --quick' if r.quick else ''}`; load average {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end ({os.cpu_count()} CPUs)._",
    ])


def main(argv: list[str] | None = None) -> None:
    run_cli("shared_pages", __doc__, argv, run, report)


if __name__ == "__main__":
    main()
