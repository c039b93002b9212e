"""Sliding-window retention under free-running threads (issue 19): window
releases at commit racing offloads, reloads, resets and removals, with the
race detector on.

An engine thread decodes requests that each hold a windowed label ("swa",
W = 8 at page size 4) and a full-attention one; a worker offloads and
reloads; a lifecycle thread resets and removes. Every K/V value is a function
of the token's position and the layer only, so a checker thread can read
every settled stream back (`read_stream` answers a windowed stream's window)
and check it, with the page invariant (`check_device_pages`) and the bound
a settled windowed stream keeps: ceil(W / page_size) + 1 pages.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

from kvref import KVConfig, KVManager, KVStep, RetentionPolicy, Segment, StepContext
from kvref.core.runtime import Runtime, ThreadingRuntime
from kvref.testing.page_checks import check_device_pages
from kvref.transfer.engine import TransferEngineInfo
from tests.support.free_threads import remove_all_and_check_nothing_leaked, run_roles
from tests.support.lockset import Detector, TracedRuntime

PS, W, REQUESTS, LAYERS = 4, 8, 4, 2
LABELS = ("swa", "full")
BOUND = -(-W // PS) + 1


def value(pos: int, layer: int) -> float:
    return float(pos * 4 + layer)


def expected(first: int, n: int) -> torch.Tensor:
    out = torch.empty(LAYERS, n - first, 2, 1, 1)
    for layer in range(LAYERS):
        for i, p in enumerate(range(first, n)):
            out[layer, i, 0] = value(p, layer)
            out[layer, i, 1] = -value(p, layer)
    return out


def run_threads(runtime: Runtime, seconds: float, detector: Detector | None = None
                ) -> dict[str, int]:
    cfg = KVConfig(num_layers=LAYERS, num_kv_heads=1, head_dim=1, max_seq_len=64,
                   max_num_pages=17, page_size=PS, num_qo_heads=1, cpu_offload_pages=40,
                   retention={"swa": RetentionPolicy(W)})
    kv = KVManager(cfg, "kv", None, TransferEngineInfo(), "cpu", dtype=torch.float32,
                   runtime=runtime)
    if detector is not None:
        detector.watch_manager(kv)
        detector.forget()
    counts = dict.fromkeys(("steps", "offloads", "reloads", "resets", "removals",
                            "checks", "windows read", "pages released"), 0)

    def engine(rng: random.Random) -> None:
        rn, label = f"r{rng.randrange(REQUESTS)}", rng.choice(LABELS)
        kv.ingest_request(rn)
        if kv.stored_len(rn) >= 40:
            kv.remove_request(rn)
            return
        span = rng.randint(1, 3)
        step, ctx = KVStep([Segment(rn, label, span)]), StepContext((rn,))
        if not kv.admit(step, ctx).ok:
            return  # offloaded, or short of pages
        try:
            (view,) = kv.plan(step, ctx)[label].views
            start = view.offset + view.length - view.to_compute
            for layer in range(LAYERS):
                k = torch.tensor([value(start + i, layer) for i in range(span)])
                kv.write_kv(k.view(-1, 1, 1), -k.view(-1, 1, 1), layer_idx=layer, label=label)
        finally:
            kv.commit(step, ctx)
        counts["steps"] += 1

    def worker(rng: random.Random) -> None:
        rn = f"r{rng.randrange(REQUESTS)}"
        if rng.random() < 0.5:
            counts["offloads"] += kv.offload(rn) > 0
        else:
            counts["reloads"] += kv.reload(rn)

    def life(rng: random.Random) -> None:
        rn = f"r{rng.randrange(REQUESTS)}"
        if rng.random() < 0.4:
            kv.remove_request(rn)
            counts["removals"] += 1
        else:
            kv.reset_request(rn, free=rng.random() < 0.5)
            counts["resets"] += 1
        time.sleep(0.003)

    def checker(rng: random.Random) -> None:
        with kv._lock:
            check_device_pages(kv)
            for rn, streams in list(kv._streams.items()):
                s = streams.get("swa")
                if s is None or s.offloaded or s.step_in_flight or not s.stored_len:
                    continue
                assert len(s.page_indices) <= BOUND, f"{rn}: {s!r} past the bound"
                counts["pages released"] += s.released // PS
                first = max(0, s.stored_len - W)
                got = kv.read_stream(rn, "swa")
                assert torch.equal(got, expected(first, s.stored_len)), f"{rn}: {s!r}"
                counts["windows read"] += 1
        counts["checks"] += 1
        time.sleep(0.003)

    run_roles((engine, worker, life, checker), seconds)
    if detector is not None:
        detector.forget()
    remove_all_and_check_nothing_leaked(kv, (f"r{r}" for r in range(REQUESTS)))
    return counts


SECONDS = float(os.environ.get("KVREF_STRESS_SECONDS", "3"))


def _report(what: str, counts: dict[str, int]) -> None:
    print(f"\n{what}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))


def test_window_releases_race_offloads_and_removals() -> None:
    counts = run_threads(ThreadingRuntime(), SECONDS)
    _report("retention, threads", counts)
    assert counts["steps"] and counts["windows read"] and counts["pages released"], counts


@pytest.mark.parametrize("seconds", [SECONDS, pytest.param(20.0, marks=pytest.mark.nightly)])
def test_window_releases_with_the_race_detector_on(seconds: float) -> None:
    detector = Detector()
    counts = run_threads(TracedRuntime(detector), seconds, detector)
    counts["races"] = len(detector.reports)
    _report("retention, threads, race detector on", counts)
    assert not detector.reports, detector.report_text()
