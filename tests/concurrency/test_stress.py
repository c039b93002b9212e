"""Nightly: free-running real threads on the default `ThreadingRuntime`.

No scheduler and no model (results depend on timing): an engine thread runs
steps and retrieves, a worker offloads and reloads, a lifecycle thread resets
and re-ingests, all with a tiny ``sys.setswitchinterval`` so the interpreter
switches threads often. A checker takes the manager's lock at intervals and
checks device page ownership (I1, I2); at the end, every page and host page
is checked, and removing everything must give every page back (I12). Each
run prints what it did (steps, offloads, reloads, retrieves, checks).

The second test runs the same threads with the lockset race detector on
(`tests.support.lockset.TracedRuntime`): every access to the manager's shared
state is recorded, and a clean tree must report no data race.

    KVREF_STRESS_SECONDS=60 python -m pytest -s -m nightly tests/concurrency/test_stress.py
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

import pytest

from kvref import KVManager
from kvref.core.runtime import ThreadingRuntime
from kvref.testing.driver import Driver, DriverConfig, label_name, rid_name
from kvref.testing.page_checks import check_device_pages
from kvref_model import core as m
from tests.support.free_threads import run_roles
from tests.support.lockset import Detector, TracedRuntime
from tests.support.sched_harness import SCOPE


def device_pages_ok(kv: KVManager) -> None:
    check_device_pages(kv)


def stress(runtime: ThreadingRuntime, detector: Detector | None = None) -> dict[str, int]:
    """Run the threads for KVREF_STRESS_SECONDS; returns what they did."""
    seconds = float(os.environ.get("KVREF_STRESS_SECONDS", "20"))

    def factory(**kwargs: Any) -> KVManager:
        kwargs["runtime"] = runtime
        return KVManager(**kwargs)

    d = Driver(SCOPE, DriverConfig(factory=factory))
    kv = d.kv
    if detector is not None:
        detector.watch_manager(kv)
    infos = {}
    for rid in range(SCOPE.requests):
        d.apply(m.Ingest(rid))
        for label in range(SCOPE.labels):
            src = d.publisher(rid, label, 4)
            infos[(rid, label)] = src.publish(rid_name(rid))
    if detector is not None:
        detector.forget()  # the set-up happens-before the threads start
    # each count is written by one thread only
    counts = dict.fromkeys(("steps", "offloads", "reloads", "retrieves", "resets",
                            "checks"), 0)

    def engine(rng: random.Random) -> None:
        rid = rng.randrange(SCOPE.requests)
        if rng.random() < 0.2:
            label = rng.randrange(SCOPE.labels)
            kv.admit_retrieve(rid_name(rid), "node", label_name(label), infos[(rid, label)])
            counts["retrieves"] += 1
            return
        with kv._lock:  # an engine's own readiness check; the lock: streams change
            streams = kv._streams.get(rid_name(rid), {})
            waiting = any(s.read_pending or s.read_error is not None
                          for s in streams.values())
        if waiting:
            return  # not ready: the engine waits for its retrieve
        step = m.Step((m.Seg(rid, rng.randrange(SCOPE.labels), rng.randrange(3)),),
                      padded=(rid,))
        if d.apply(m.Admit(step)) == m.Ok():
            d.apply(m.Plan())
            if step.segments[0].span:
                d.apply(m.Write())
            d.apply(m.Commit())
            counts["steps"] += 1

    def worker(rng: random.Random) -> None:
        rid = rid_name(rng.randrange(SCOPE.requests))
        if rng.random() < 0.5:
            counts["offloads"] += kv.offload(rid) > 0
        else:
            counts["reloads"] += kv.reload(rid)

    def life(rng: random.Random) -> None:
        rid = rng.randrange(SCOPE.requests)
        if rng.random() < 0.3:
            kv.reset_request(rid_name(rid), free=rng.random() < 0.5)
            counts["resets"] += 1
        kv.ingest_request(rid_name(rid))

    def checker(rng: random.Random) -> None:
        with kv._lock:
            device_pages_ok(kv)
        counts["checks"] += 1
        time.sleep(0.005)

    run_roles((engine, worker, life, checker), seconds)
    if detector is not None:
        detector.forget()  # joined: the threads' accesses happen-before the checks below
    runtime.shutdown()
    d.check_pages()
    for rid in range(SCOPE.requests):
        kv.remove_request(rid_name(rid))
    assert kv.num_free_pages == SCOPE.device_pages, "I12: device pages leaked"
    pool = kv._cpu_pool
    assert pool is not None and pool.num_free == pool.capacity, "I12: host pages leaked"
    assert counts["steps"] and counts["checks"], counts
    counts["final checks"] = 3  # pages and host lengths (I1, I2, I6), I12 device, I12 host
    return counts


def report(what: str, counts: dict[str, int], seconds: float) -> None:
    done = ", ".join(f"{v} {k}" for k, v in counts.items())
    print(f"\n{what}: {seconds:.0f} s: {done}")


@pytest.mark.nightly
def test_free_running_threads() -> None:
    t0 = time.monotonic()
    counts = stress(ThreadingRuntime())
    report("stress", counts, time.monotonic() - t0)


@pytest.mark.nightly
def test_free_running_threads_race_detector() -> None:
    detector = Detector()
    t0 = time.monotonic()
    counts = stress(TracedRuntime(detector), detector)
    counts["accesses recorded"] = detector.accesses
    counts["races"] = len(detector.reports)
    report("stress, race detector on", counts, time.monotonic() - t0)
    assert not detector.reports, detector.report_text()
