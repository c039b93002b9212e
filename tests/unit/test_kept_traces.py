"""Every trace kept under tests/traces/ replays (issue 41, failures that travel).

A planted bug's trace must fail again under its plant, with the
disagreement it recorded, and pass on the clean tree; a trace without a
plant (a bug found and fixed) must pass. The trace format round-trips, and
``python -m kvref.testing.replay`` gives its verdict as an exit status.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvref.testing import trace as tr
from kvref.testing.replay import replay
from kvref_model import core as m
from tests.support.kept_traces import KEPT, kept_files, plant_of

ROOT = Path(__file__).resolve().parents[2]


def test_every_layer_keeps_a_trace() -> None:
    names = {tr.load(p).get("planted") for p in kept_files()}
    assert names == set(KEPT), f"kept traces {sorted(map(str, names))}, plants {sorted(KEPT)}"
    assert {tr.load(p)["kind"] for p in kept_files()} == set(tr.KINDS)


@pytest.mark.parametrize("path", kept_files(), ids=lambda p: p.stem)
def test_a_kept_trace_fails_under_its_plant_and_passes_clean(path: Path) -> None:
    trace = tr.load(path)
    plant = plant_of(trace)
    if plant is not None:
        with plant:
            planted = replay(trace)
        assert planted.failed and planted.same, (
            f"{path.name} no longer reproduces under its plant: {planted.verdict()}\n"
            f"recorded: {trace['disagreement']['message'][:500]}")
    clean = replay(trace)
    assert not clean.failed, f"{path.name} fails on the clean tree: {clean.message[:2000]}"


def test_the_codec_round_trips_every_action_shape() -> None:
    step = m.Step((m.Seg(0, 1, 2), m.Seg(1, 0, 1)), ((0, 1),), (), (0, 1), False)
    calls = [m.Admit(step, preplan=True), m.Plan(fork_error=True), m.Truncate(0, 1, -1),
             m.RetrieveStart(1, 0, 2, stale=True), m.CachePrefix(0, 0, drafts=1, start=2)]
    scope = m.Scope(windows=(None, 2), margins=(0, 1), salts=("a", "lora=b"), sharing=True)
    text = json.dumps(tr.build("exhaustive", scope, calls, AssertionError("x")))
    back = json.loads(text)
    assert tr.decode(back["calls"]) == tuple(calls)
    assert tr.decode(back["scope"]) == scope
    with pytest.raises(ValueError, match="unknown type"):
        tr.decode({"__": "os.system"})


def test_the_same_failure_lands_in_the_same_file(tmp_path: Path) -> None:
    t = tr.build("exhaustive", m.Scope(), [m.Ingest(0)], AssertionError("differs"))
    first, second = tr.write(t, tmp_path), tr.write(dict(t), tmp_path)
    assert first == second and len(list(tmp_path.iterdir())) == 1
    other = tr.write(tr.build("exhaustive", m.Scope(), [m.Ingest(1)], AssertionError("differs")),
                     tmp_path)
    assert other != first


def test_the_replay_command_exits_by_its_verdict(tmp_path: Path) -> None:
    scope = m.Scope(sharing=True)
    path = tr.write(tr.build("exhaustive", scope, [m.Ingest(0), m.NumFree()],
                             AssertionError("recorded")), tmp_path)

    def command(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvref.testing.replay", str(path),
                               *extra], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)

    clean = command()
    assert clean.returncode == 0 and "PASSED" in clean.stdout, clean.stdout + clean.stderr
    # the same trace against a manager that miscounts: reproduced, exit 1
    broken = command("--factory", "tests.support.kept_traces:miscounts_free")
    assert broken.returncode == 1 and "REPRODUCED" in broken.stdout, (
        broken.stdout + broken.stderr)


FIXED = sorted((Path(__file__).resolve().parents[1] / "traces" / "fixed").glob("*.json"))


@pytest.mark.parametrize("path", FIXED, ids=lambda p: p.stem)
def test_a_fixed_bugs_trace_passes(path: Path) -> None:
    """A trace of a bug found by a layer and fixed (no plant: the bug was
    kvref's own) replays clean; it failed, with its recorded disagreement,
    before the fix."""
    trace = tr.load(path)
    assert trace.get("planted") is None and trace.get("disagreement"), path.name
    got = replay(trace)
    assert not got.failed, f"{path.name}: {got.verdict()}"
