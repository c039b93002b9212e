"""Data plane: how fast kvref moves page bytes, against a plain copy of the same bytes.

Every path is timed back to back with ``dst.copy_(src)`` on two contiguous
tensors of exactly the bytes the path moves; the ratio is taken per repetition
and its median reported, so a noisy neighbour slows both sides alike.
Bandwidth counts the bytes copied once (not read + write).

Paths:
- ``copy_pages``: `KVCache.copy_pages` (a fork copy), pages contiguous or shuffled.
- ``offload`` / ``reload``: `KVManager.offload(rid)` / `KVManager.reload(rid)` of
  one request holding N full pages (``cpu_offload_pages`` set), bookkeeping included.
- ``index``: one advanced-index gather/scatter ``t[:, dst] = t[:, src]``;
  ``runs``: `kvref.core.cache.copy_page_blocks`, one slice copy per run of
  consecutive pages (what kvref does on CPU). Contiguous pages make one run;
  shuffled pages make runs of length 1.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks import Spread, no_gc, spread
from benchmarks.control_plane import make_manager, prefill
from kvref import KVManager
from kvref.core.cache import copy_page_blocks

PAGE_SIZE = 16
# 4 layers x (K, V) x 16 tokens x 2 heads x 64 dims x fp32 = 64 KiB a page
LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 64
PAGE_COUNTS = (64, 256, 1024)


@dataclass(frozen=True)
class CopyRow:
    path: str
    pages: int
    bytes: int
    gbps: Spread  # this path, GB/s
    plain_gbps: Spread  # dst.copy_(src) of the same bytes, GB/s
    ratio: Spread  # this path / plain, per repetition

    @property
    def below_half(self) -> bool:
        return self.ratio.median < 0.5


def _measure(path: str, pages: int, nbytes: int, fn: Callable[[], object],
             plain: Callable[[], object], reps: int, warmup: int = 2) -> CopyRow:
    clock = time.perf_counter
    for _ in range(warmup):
        fn()
        plain()
    ours: list[float] = []
    theirs: list[float] = []
    ratios: list[float] = []
    with no_gc():
        for i in range(reps):
            # alternate which side goes first: caches stay warm for neither
            if i % 2:
                t0 = clock(); fn(); t1 = clock(); plain(); t2 = clock()  # noqa: E702
                a, b = t1 - t0, t2 - t1
            else:
                t0 = clock(); plain(); t1 = clock(); fn(); t2 = clock()  # noqa: E702
                a, b = t2 - t1, t1 - t0
            ours.append(nbytes / a / 1e9)
            theirs.append(nbytes / b / 1e9)
            ratios.append(b / a)
    return CopyRow(path, pages, nbytes, spread(ours), spread(theirs), spread(ratios))


def _plain_copy(nbytes: int) -> Callable[[], object]:
    n = nbytes // 4
    src = torch.randn(n)
    dst = torch.zeros(n)
    dst.copy_(src)  # fault both in
    return lambda: dst.copy_(src)


def _reps(pages: int, quick: bool) -> int:
    if quick:
        return 3
    return 40 if pages <= 256 else 15


def bench_copy_pages(pages: int, reps: int, shuffled: bool = False,
                     *, layers: int = LAYERS, kv_heads: int = KV_HEADS,
                     head_dim: int = HEAD_DIM) -> CopyRow:
    mgr = make_manager(2 * pages, layers=layers, kv_heads=kv_heads, head_dim=head_dim)
    cache = mgr.kv_cache
    cache.tensor.normal_()
    src = list(range(1, pages + 1))
    dst = list(range(pages + 1, 2 * pages + 1))
    if shuffled:
        rng = random.Random(1)
        rng.shuffle(src)
        rng.shuffle(dst)
    nbytes = pages * cache.bytes_per_page
    name = "copy_pages (fork), shuffled" if shuffled else "copy_pages (fork)"
    return _measure(name, pages, nbytes, lambda: cache.copy_pages(src, dst),
                    _plain_copy(nbytes), reps)


def _offload_manager(pages: int, layers: int, kv_heads: int, head_dim: int
                     ) -> tuple[KVManager, str]:
    # room for the request twice over, so a reload never waits on the sink
    mgr = make_manager(2 * pages, cpu_offload_pages=pages,
                       layers=layers, kv_heads=kv_heads, head_dim=head_dim)
    mgr.kv_cache.tensor.normal_()
    prefill(mgr, {"victim": pages * PAGE_SIZE})
    return mgr, "victim"


def bench_offload_reload(pages: int, reps: int, *, layers: int = LAYERS,
                         kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM
                         ) -> tuple[CopyRow, CopyRow]:
    """`mgr.offload` then `mgr.reload` of one request holding ``pages`` full pages."""
    mgr, rid = _offload_manager(pages, layers, kv_heads, head_dim)
    pool = mgr._cpu_pool
    assert pool is not None
    pool.tensor.normal_()  # fault the host pool in
    nbytes = pages * mgr.kv_cache.bytes_per_page
    plain = _plain_copy(nbytes)
    state = {"on_host": False}

    def off() -> None:
        if state["on_host"]:
            raise RuntimeError("offload of a request already on the host")
        freed = mgr.offload(rid)
        if freed != pages:
            raise RuntimeError(f"offload freed {freed} pages, expected {pages}")
        state["on_host"] = True

    def back() -> None:
        if not mgr.reload(rid):
            raise RuntimeError("reload refused")
        state["on_host"] = False

    # time offload with reload untimed, and vice versa, pairing each with a plain copy
    clock = time.perf_counter
    for _ in range(2):
        off()
        back()
    out_t: list[float] = []
    in_t: list[float] = []
    plain_t: list[float] = []
    plain2_t: list[float] = []
    with no_gc():
        for _ in range(reps):
            t0 = clock(); plain(); t1 = clock(); off(); t2 = clock()  # noqa: E702
            back(); t3 = clock(); plain(); t4 = clock()  # noqa: E702
            plain_t.append(t1 - t0)
            out_t.append(t2 - t1)
            in_t.append(t3 - t2)
            plain2_t.append(t4 - t3)
    mgr.remove_request(rid)

    def row(name: str, path_t: list[float], base_t: list[float]) -> CopyRow:
        return CopyRow(
            name, pages, nbytes,
            spread([nbytes / t / 1e9 for t in path_t]),
            spread([nbytes / t / 1e9 for t in base_t]),
            spread([b / a for a, b in zip(path_t, base_t, strict=True)]),
        )

    return row("offload (mgr.offload)", out_t, plain_t), row("reload (mgr.reload)", in_t, plain2_t)


def bench_index_vs_runs(pages: int, reps: int, shuffled: bool, *, layers: int = LAYERS,
                        kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM
                        ) -> tuple[CopyRow, CopyRow]:
    """The choice in `copy_page_blocks`: one indexed gather/scatter vs a slice copy per run."""
    mgr = make_manager(2 * pages, layers=layers, kv_heads=kv_heads, head_dim=head_dim)
    t = mgr.kv_cache.tensor
    t.normal_()
    src = list(range(1, pages + 1))
    dst = list(range(pages + 1, 2 * pages + 1))
    if shuffled:
        rng = random.Random(2)
        rng.shuffle(src)
        rng.shuffle(dst)
    src_i = torch.tensor(src, dtype=torch.long)
    dst_i = torch.tensor(dst, dtype=torch.long)
    nbytes = pages * mgr.kv_cache.bytes_per_page
    plain = _plain_copy(nbytes)
    tag = "shuffled (runs of 1)" if shuffled else "contiguous (1 run)"

    def index() -> None:
        t[:, dst_i] = t[:, src_i]

    def runs() -> None:
        copy_page_blocks(t, dst, t, src)

    return (
        _measure(f"index t[:, dst] = t[:, src], {tag}", pages, nbytes, index, plain, reps),
        _measure(f"runs (copy_page_blocks), {tag}", pages, nbytes, runs, plain, reps),
    )


def run(quick: bool = False, page_counts: tuple[int, ...] = PAGE_COUNTS) -> list[CopyRow]:
    rows: list[CopyRow] = []
    for pages in page_counts:
        reps = _reps(pages, quick)
        rows.append(bench_copy_pages(pages, reps))
        rows.append(bench_copy_pages(pages, reps, shuffled=True))
        rows.extend(bench_offload_reload(pages, reps))
        for shuffled in (False, True):
            rows.extend(bench_index_vs_runs(pages, reps, shuffled))
    return rows
