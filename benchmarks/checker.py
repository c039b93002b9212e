"""The model checker's cost: per state, and on Ray (issue 41).

    python -m benchmarks.checker cost --base DIR [--depth 8] [--repeat 2]
        the counting scope (no sharing, no windows) at --depth, run by the
        kvref_model of DIR (a checkout of the baseline) and of this tree,
        alternately, in one run: CPU microseconds per state (one worker),
        states/s at two workers, bytes per state; ratios baseline / this tree
    python -m benchmarks.checker scopes [--ray]
        the scope table of docs/verification/at-scale.md: states, wall time,
        CPU, peak memory per worker at 1 and 2 workers, in processes and
        (--ray, a local two-node ray.cluster_utils.Cluster) on Ray, with
        the bytes sent per state

Each check runs in a child process, timed by its own and its workers' CPU
(getrusage of the children); the machine's load is printed beside each row,
since wall time on a shared box says more about the neighbours than the code.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTING = ["--no-sharing", "--windows", ""]  # README: the counting scope


def _load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def check(tree: str, args: list[str]) -> dict[str, Any]:
    """`python -m kvref_model.check ARGS --json -` with `tree` first on the path:
    its report, with the wall time and the CPU it and its workers used."""
    env = dict(os.environ, PYTHONPATH=tree)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "report.json")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.monotonic()
        subprocess.run([sys.executable, "-m", "kvref_model.check", *args, "--quiet",
                        "--json", path], env=env, capture_output=True, check=True,
                       cwd=tmp)  # not this checkout: `-m` puts the cwd first on the path
        wall = time.monotonic() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        with open(path) as f:
            doc: dict[str, Any] = json.load(f)
    doc["wall"] = wall
    doc["cpu"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return doc


def cost(o: argparse.Namespace) -> None:
    depth = ["--depth", str(o.depth)]
    rows: dict[str, list[dict[str, Any]]] = {"base": [], "this": []}
    for _ in range(o.repeat):
        for name, tree in (("base", o.base), ("this", HERE)):
            load = _load()
            one = check(tree, [*COUNTING, *depth, "--workers", "1"])
            two = check(tree, [*COUNTING, *depth, "--workers", "2"])
            row = {"load": load, "states": one["states"], "transitions": one["transitions"],
                   "us_per_state": 1e6 * one["cpu"] / one["states"],
                   "states_per_s_2w": two["states"] / two["wall"],
                   "cpu_2w_us_per_state": 1e6 * two["cpu"] / two["states"],
                   "peak_bytes_per_state": one["peak_rss_bytes"] / one["states"],
                   "peak_2w_bytes_per_state": (two["peak_rss_bytes"]
                                               + two["peak_rss_workers_bytes"]) / two["states"]}
            assert (one["states"], one["transitions"]) == (two["states"], two["transitions"])
            rows[name].append(row)
            print(f"{name:5} load {load:>5}  states {row['states']:,}  transitions "
                  f"{row['transitions']:,}  1 worker {row['us_per_state']:.0f} us CPU/state  "
                  f"2 workers {row['states_per_s_2w']:,.0f} states/s "
                  f"({row['cpu_2w_us_per_state']:.0f} us CPU/state)  peak "
                  f"{row['peak_bytes_per_state']:.0f} B/state (2 workers "
                  f"{row['peak_2w_bytes_per_state']:.0f})", flush=True)
    b, t = rows["base"], rows["this"]
    assert {r["states"] for r in b} == {r["states"] for r in t}, "the state counts differ"
    assert {r["transitions"] for r in b} == {r["transitions"] for r in t}

    def best(rs: list[dict[str, Any]], k: str, low: bool = True) -> float:
        vals = [float(r[k]) for r in rs]
        return min(vals) if low else max(vals)
    print(f"ratio base/this, best of {o.repeat}: CPU per state "
          f"{best(b, 'us_per_state') / best(t, 'us_per_state'):.2f}x, states/s at 2 workers "
          f"{best(t, 'states_per_s_2w', False) / best(b, 'states_per_s_2w', False):.2f}x")
    if o.json:
        with open(o.json, "w") as f:
            json.dump(rows, f, indent=1)


SCOPES: dict[str, list[str]] = {
    "counting d4": [*COUNTING, "--depth", "4"],
    "counting d5": [*COUNTING, "--depth", "5"],
    "default d4": ["--depth", "4"],
}


def scopes(o: argparse.Namespace) -> None:
    for name, args in SCOPES.items():
        for w in (1, 2):
            load = _load()
            got = check(HERE, [*args, "--workers", str(w)])
            per = (got["peak_rss_workers_bytes"] / w) if w > 1 else got["peak_rss_bytes"]
            print(f"processes {name:12} workers {w}  states {got['states']:>9,}  wall "
                  f"{got['wall']:6.1f}s  CPU {got['cpu']:6.1f}s  peak/worker "
                  f"{per / 2**20:5.0f} MiB  main {got['peak_rss_bytes'] / 2**20:4.0f} MiB  "
                  f"load {load}", flush=True)
    if o.ray:
        ray_scopes()


def ray_scopes() -> None:
    import ray
    from ray.cluster_utils import Cluster

    import kvref_model
    from kvref_model.check import CHECK_DEFAULT, _parser, make_spec, scope_of
    from kvref_model.core import Model
    from kvref_model.ray_search import RaySearch

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    here = os.path.dirname(os.path.abspath(kvref_model.__file__))
    ray.init(address=c.address, log_to_driver=False, runtime_env={"py_modules": [here]})
    del CHECK_DEFAULT
    try:
        for name, args in SCOPES.items():
            scope = scope_of(_parser().parse_args(args))
            model = Model(scope)
            for w in (1, 2):
                load = _load()
                t, cpu = time.monotonic(), time.process_time()
                search = RaySearch(functools.partial(make_spec, model), workers=w, keep_going=True,
                                   want_states=False)
                for _ in search.run():
                    pass
                wall = time.monotonic() - t
                merge = time.process_time() - cpu  # this process: the merge and the rest
                rep, tr = search.report, search.traffic
                n = rep.states
                per_exp = max(search.worker_peaks)
                per_part = max(p for _, _, p in search.partition_stats)
                sent = (tr["states_sent"] + tr["results_received"] + tr["fingerprints_asked"]
                        + tr["fingerprints_merged"]) / n
                print(f"ray       {name:12} workers {w}  states {n:>9,}  wall {wall:6.1f}s  "
                      f"driver CPU {1e6 * merge / n:4.0f} us/state  "
                      f"peak/expander {per_exp / 2**20:5.0f} MiB  peak/partition "
                      f"{per_part / 2**20:4.0f} MiB  visited {rep.visited_bytes / n:4.1f} B/state  "
                      f"sent {sent:5.0f} B/state (states out {tr['states_sent'] / n:.0f}, "
                      f"results {tr['results_received'] / n:.0f}, fingerprints asked "
                      f"{tr['fingerprints_asked'] / n:.0f}, merged "
                      f"{tr['fingerprints_merged'] / n:.0f})  load {load}", flush=True)
    finally:
        ray.shutdown()
        c.shutdown()  # type: ignore[no-untyped-call]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.checker",
                                 description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cost")
    c.add_argument("--base", required=True, help="a checkout whose kvref_model is the baseline")
    c.add_argument("--depth", type=int, default=8)
    c.add_argument("--repeat", type=int, default=1)
    c.add_argument("--json", default=None)
    s = sub.add_parser("scopes")
    s.add_argument("--ray", action="store_true")
    o = ap.parse_args()
    cost(o) if o.cmd == "cost" else scopes(o)


if __name__ == "__main__":
    main()
