"""Shared pages under free-running threads (issue 18): prefix hits racing
offloads, removals, resets and evictions, with the race detector on.

An engine thread runs requests whose prompts share a system prompt: it
asks `match_prefix` for each new one, computes the rest, decodes, and calls
`cache_prefix` after each commit. A worker offloads and reloads, a
lifecycle thread resets and removes requests, and the small cache evicts
cached pages as it goes. Every K/V value is a function of the token id, its
position and the layer only, so a page computed by one request and found
by another must read back exactly as the second one's own tokens: a
checker thread reads every settled stream back, and checks the page
invariant (`check_device_pages`: reference counts equal the tables naming
each page, spare pages private), under the manager's lock.

The model of shared pages is the one model (`kvref_model.core` with sharing
on); this layer checks what a
model of one thread cannot: the lock discipline over the page pool and the
streams together (the detector, R31), and that no interleaving of a hit
with an offload, a removal or an eviction loses a page or serves wrong KV.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

from kvref import KVConfig, KVManager, KVStep, Segment, StepContext
from kvref.core.config import KVReqConfig
from kvref.core.runtime import Runtime, ThreadingRuntime
from kvref.prefix import cache as prefix_cache
from kvref.testing.page_checks import check_device_pages
from kvref.transfer.engine import TransferEngineInfo
from tests.support.free_threads import remove_all_and_check_nothing_leaked, run_roles
from tests.support.lockset import Detector, TracedRuntime

PS = 4
REQUESTS = 5
SYSTEM = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 3]  # 11 tokens: two full pages and a part
LAYERS, HEADS, DIM = 2, 1, 2


def token_of(rid: int, pos: int) -> int:
    """Every request's tokens: the system prompt, then its own."""
    return SYSTEM[pos] if pos < len(SYSTEM) else 100 + 13 * rid + pos


def value(token: int, pos: int, layer: int) -> float:
    return float((token * 1000 + pos) * 4 + layer)


def expected(rid: int, n: int) -> torch.Tensor:
    out = torch.empty(LAYERS, n, 2, HEADS, DIM)
    for layer in range(LAYERS):
        for p in range(n):
            out[layer, p, 0] = value(token_of(rid, p), p, layer)
            out[layer, p, 1] = -value(token_of(rid, p), p, layer)
    return out


def name(rid: int) -> str:
    return f"r{rid}"


def run_threads(runtime: Runtime, seconds: float, detector: Detector | None = None
                ) -> dict[str, int]:
    cfg = KVConfig(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, max_seq_len=64,
                   max_num_pages=17, page_size=PS, num_qo_heads=HEADS,
                   cpu_offload_pages=24)
    kv = KVManager(cfg, "kv", None, TransferEngineInfo(), "cpu", dtype=torch.float32,
                   runtime=runtime)
    if detector is not None:
        detector.watch_manager(kv)
        detector.forget()
    counts = dict.fromkeys(("steps", "hit tokens", "cached pages", "offloads", "reloads",
                            "resets", "removals", "checks", "streams read"), 0)

    def engine(rng: random.Random) -> None:
        rid = rng.randrange(REQUESTS)
        rn = name(rid)
        if not kv.has_request(rn):
            # one request of five is another tenant: it never hits the others
            kv.ingest_request(rn, KVReqConfig(cache_salt="other" if rid == 4 else None))
        n = kv.stored_len(rn)
        if n == 0:
            want = [token_of(rid, p) for p in range(len(SYSTEM) + 2)]
            counts["hit tokens"] += kv.match_prefix(rn, "main", want)
            n = kv.stored_len(rn)
        span = rng.randint(1, 4) if n < len(SYSTEM) else 1
        if n + span >= cfg.max_seq_len:
            kv.remove_request(rn)
            return
        step, ctx = KVStep([Segment(rn, "main", span)]), StepContext((rn,))
        if not kv.admit(step, ctx).ok:
            return  # offloaded, or short of pages: an engine would evict or wait
        try:
            out = kv.plan(step, ctx)
            (view,) = out["main"].views
            start = view.length - view.to_compute
            for layer in range(LAYERS):
                k = torch.tensor([[value(token_of(rid, p), p, layer)] * DIM
                                  for p in range(start, view.length)]).view(-1, HEADS, DIM)
                kv.write_kv(k, -k, layer_idx=layer, label="main")
        finally:
            kv.commit(step, ctx)
        counts["steps"] += 1
        done = kv.stored_len(rn)
        counts["cached pages"] += kv.cache_prefix(
            rn, "main", [token_of(rid, p) for p in range(done)])

    def worker(rng: random.Random) -> None:
        rn = name(rng.randrange(REQUESTS))
        if rng.random() < 0.5:
            counts["offloads"] += kv.offload(rn) > 0
        else:
            counts["reloads"] += kv.reload(rn)

    def life(rng: random.Random) -> None:
        rn = name(rng.randrange(REQUESTS))
        if rng.random() < 0.5:
            kv.remove_request(rn)
            counts["removals"] += 1
        else:
            kv.reset_request(rn, free=rng.random() < 0.5)
            counts["resets"] += 1
        time.sleep(0.002)

    def checker(rng: random.Random) -> None:
        with kv._lock:
            check_device_pages(kv)
            for rn, streams in list(kv._streams.items()):
                s = streams.get("main")
                if s is None or s.offloaded or s.read_pending or not s.stored_len:
                    continue
                got = kv.kv_cache.gather_stream(s.page_indices, s.stored_len)
                want = expected(int(rn[1:]), s.stored_len)
                assert torch.equal(got, want), f"{rn} reads back wrong KV: {s!r}"
                counts["streams read"] += 1
        counts["checks"] += 1
        time.sleep(0.003)

    run_roles((engine, worker, life, checker), seconds)
    if detector is not None:
        detector.forget()
    remove_all_and_check_nothing_leaked(kv, map(name, range(REQUESTS)))
    assert isinstance(kv.reset_prefix_cache(), int)
    assert kv.num_cached_pages == 0
    return counts


def _report(what: str, counts: dict[str, int]) -> None:
    print(f"\n{what}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))


SECONDS = float(os.environ.get("KVREF_STRESS_SECONDS", "3"))


def test_hits_race_offloads_removals_and_evictions() -> None:
    counts = run_threads(ThreadingRuntime(), SECONDS)
    _report("shared pages, threads", counts)
    # the run exercised what it claims to: hits, caching, offloads, removals
    assert counts["hit tokens"] and counts["cached pages"] and counts["steps"], counts
    assert counts["streams read"] and counts["removals"], counts


def _detect(seconds: float) -> tuple[dict[str, int], Detector]:
    detector = Detector()
    counts = run_threads(TracedRuntime(detector), seconds, detector)
    counts["races"] = len(detector.reports)
    return counts, detector


def test_hits_race_with_the_race_detector_on() -> None:
    counts, detector = _detect(SECONDS)
    _report("shared pages, threads, race detector on", counts)
    assert not detector.reports, detector.report_text()


@pytest.mark.nightly
def test_hits_race_with_the_race_detector_on_for_longer() -> None:
    counts, detector = _detect(max(SECONDS, 20.0))
    _report("shared pages, threads, race detector on", counts)
    assert not detector.reports, detector.report_text()


def test_the_detector_finds_a_hit_taken_without_the_lock(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The plant: `match_prefix` with the manager's lock dropped. The same
    budget as the clean run above finds it (or the page check does)."""
    def unlocked(self: KVManager, rid: str, label: str, token_ids: list[int]) -> int:
        return prefix_cache.match_prefix(self._table, rid, label, token_ids)

    monkeypatch.setattr(KVManager, "match_prefix", unlocked)
    try:
        counts, detector = _detect(SECONDS)
    except AssertionError:
        return  # a checker thread saw the torn state first
    assert detector.reports, f"no race reported: {counts}"
    assert any("match_prefix" in str(r) for r in detector.reports), detector.report_text()
