"""Prefix cache: hashing cost and pages saved. ``python -m benchmarks.prefix_cache [--quick]``

- **Hashing** a 2,048-token prompt into its 128 chained page keys (page size
  16): kvref's chained SHA-256 over the token ids' bytes
  (`kvref.prefix.keys.page_keys`) against the anchors' default, a chained
  SHA-256 over ``pickle.dumps((parent, tuple(tokens), extra_keys))`` per page,
  written here as that default does it. The two are timed alternately in the
  same run; the ratio is the median of the per-repetition ratios.
- **Pool-level prefill** of that prompt with its first 1,792 tokens cached,
  against the same with nothing cached: `PagePool.match`, `allocate` for the
  rest and `register` of each new full page (hashing included). Only the
  pool's part of an admission: the manager is not wired to it yet.
- **Memory**: 16 requests whose prompts share a 1,024-token system prompt,
  each with 100 tokens of its own, at page size 16: the pages they hold
  with the prefix cache, against 16 private copies.

Nothing here asserts a time; the memory figure is checked by
tests/unit/test_page_pool.py.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pickle
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from benchmarks import Spread, machine, md_table, no_gc, spread
from kvref.core.page_pool import PagePool
from kvref.prefix.keys import ExtraKeys, PageKey, page_keys

PAGE_SIZE = 16
PROMPT = 2048
CACHED = 1792
EXTRAS: ExtraKeys = (("salt", "tenant-7"),)


def pickle_chain(tokens: Sequence[int], page_size: int, extras: ExtraKeys) -> list[bytes]:
    """The anchors' default: SHA-256 of each page's pickled (parent, tokens, extras)."""
    out: list[bytes] = []
    parent: bytes | None = None
    extra = tuple(extras)
    for i in range(len(tokens) // page_size):
        block = tuple(tokens[i * page_size:(i + 1) * page_size])
        parent = hashlib.sha256(pickle.dumps((parent, block, extra),
                                             protocol=pickle.HIGHEST_PROTOCOL)).digest()
        out.append(parent)
    return out


@dataclass(frozen=True)
class Pair:
    ours_us: Spread
    theirs_us: Spread
    ratio: Spread  # ours / theirs, per repetition


def pair(ours: Callable[[], object], theirs: Callable[[], object], reps: int, *,
         undo: Sequence[Callable[[], object] | None] = (None, None)) -> Pair:
    """Time ``ours`` and ``theirs`` alternately, ``reps`` times each; ``undo[j]``,
    if given, runs untimed after each call of side ``j`` (puts its state back)."""
    a: list[float] = []
    b: list[float] = []
    fns = [ours, theirs]
    with no_gc():
        for i in range(reps):
            times = [0.0, 0.0]
            for j in ((0, 1) if i % 2 == 0 else (1, 0)):  # alternate who goes first
                t0 = time.perf_counter()
                fns[j]()
                times[j] = (time.perf_counter() - t0) * 1e6
                after = undo[j]
                if after is not None:
                    after()
            a.append(times[0])
            b.append(times[1])
    return Pair(spread(a), spread(b), spread([x / y for x, y in zip(a, b, strict=True)]))


def hashing(reps: int) -> Pair:
    rng = random.Random(0)
    tokens = [rng.randrange(150_000) for _ in range(PROMPT)]
    assert len(page_keys(tokens, PAGE_SIZE, EXTRAS)) == PROMPT // PAGE_SIZE
    return pair(lambda: page_keys(tokens, PAGE_SIZE, EXTRAS),
                 lambda: pickle_chain(tokens, PAGE_SIZE, EXTRAS), reps)


def _prefill(pool: PagePool, owner: str, tokens: list[int]) -> list[int]:
    hit = pool.match(owner, tokens, EXTRAS)
    own = pool.allocate(owner, -(-len(tokens) // PAGE_SIZE) - len(hit.pages))
    assert isinstance(own, list)
    parent: PageKey | None = hit.keys[-1] if hit.keys else None
    for i, p in enumerate(own, len(hit.pages)):
        page = tokens[i * PAGE_SIZE:(i + 1) * PAGE_SIZE]
        if len(page) == PAGE_SIZE:
            parent = pool.register(p, parent, page, EXTRAS).key
    return [*hit.pages, *own]


def prefill(reps: int) -> Pair:
    """Pool-level prefill with 1,792 tokens cached, against none cached."""
    rng = random.Random(1)
    tokens = [rng.randrange(150_000) for _ in range(PROMPT)]
    warm = PagePool(2 * PROMPT // PAGE_SIZE + 1, PAGE_SIZE)
    cold = PagePool(PROMPT // PAGE_SIZE + 1, PAGE_SIZE)
    _prefill(warm, "seed", tokens[:CACHED])  # the cached prefix, held by another
    state = {"n": 0}

    def run(pool: PagePool) -> None:
        state["n"] += 1
        owner = f"r{state['n']}"
        pages = _prefill(pool, owner, tokens)
        pool.release(owner, pages[::-1])
        if pool is cold:
            pool.reset_prefix_cache()  # nothing cached next time either

    return pair(lambda: run(warm), lambda: run(cold), reps)


@dataclass(frozen=True)
class Memory:
    requests: int
    shared_tokens: int
    own_tokens: int
    held: int
    shared_pages: int
    own_pages: int
    private_copies: int
    shared_refcount: int
    reclaimable_one: int


def memory(requests: int = 16, shared_tokens: int = 1024, own_tokens: int = 100) -> Memory:
    rng = random.Random(2)
    system = [rng.randrange(150_000) for _ in range(shared_tokens)]
    per = -(-(shared_tokens + own_tokens) // PAGE_SIZE)
    pool = PagePool(requests * per + 1, PAGE_SIZE)
    tables = {f"r{i}": _prefill(pool, f"r{i}", system + [rng.randrange(150_000)
                                                          for _ in range(own_tokens)])
              for i in range(requests)}
    shared = shared_tokens // PAGE_SIZE
    return Memory(requests, shared_tokens, own_tokens, pool.capacity - pool.num_free,
                  shared, per - shared, requests * per, pool.refcount(tables["r0"][0]),
                  pool.reclaimable({"r3": tables["r3"]}))


def report(quick: bool = False) -> str:
    reps = 50 if quick else 400
    h, p, m = hashing(reps), prefill(reps // 2), memory()
    pages = PROMPT // PAGE_SIZE
    return "\n".join([
        "### Prefix cache", "", f"Machine: {machine()}", "",
        f"Load average at the start: {os.getloadavg()[0]:.1f}", "",
        f"µs, median [p10, p90] over {reps} repetitions, the two timed alternately; "
        "ratio = kvref / baseline, the median of per-repetition ratios.", "",
        md_table(["what", "kvref µs", "[p10, p90]", "baseline", "baseline µs", "ratio"], [
            [f"hash {PROMPT} tokens into {pages} chained page keys", h.ours_us.median,
             f"[{h.ours_us.p10:.0f}, {h.ours_us.p90:.0f}]", "pickle + SHA-256 chain",
             h.theirs_us.median, h.ratio.median],
            [f"pool prefill of {PROMPT} tokens, {CACHED} cached (match + allocate + "
             "register)", p.ours_us.median, f"[{p.ours_us.p10:.0f}, {p.ours_us.p90:.0f}]",
             "nothing cached", p.theirs_us.median, p.ratio.median],
        ]), "",
        f"Memory: {m.requests} requests, each a {m.shared_tokens}-token shared prompt + "
        f"{m.own_tokens} tokens of its own, page size {PAGE_SIZE}: **{m.held} pages "
        f"held** = {m.shared_pages} shared + {m.requests} × {m.own_pages} own; without "
        f"sharing {m.private_copies} ({m.requests} × {m.shared_pages + m.own_pages}). "
        f"Each shared page has {m.shared_refcount} holders; releasing one request would "
        f"free {m.reclaimable_one} pages (its own).",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a smoke run of a few seconds")
    print(report(ap.parse_args().quick))


if __name__ == "__main__":
    main()
