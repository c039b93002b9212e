"""benchmarks/hybrid.py runs in a tiny configuration and returns well-formed
results (no timing or ratio is asserted); without a vLLM copy it skips,
saying how to get one."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.vs_vllm import find_copy

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    # a process of its own: the copy's `vllm` package must not stay imported here
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_skips_without_a_copy(tmp_path: Path) -> None:
    got = _run("-m", "benchmarks.hybrid", "--tiny", "--vllm", str(tmp_path / "none"))
    assert got.returncode == 0, got.stderr
    assert "skipped" in got.stdout and "vllm_copy.py" in got.stdout


def test_tiny_run_results(tmp_path: Path) -> None:
    copy = find_copy(None)
    if copy is None:
        pytest.skip("no vLLM KV-manager copy (scripts/vllm_copy.py builds one)")
    out = tmp_path / "hybrid.json"
    got = _run("-m", "benchmarks.hybrid", "--tiny", "--vllm", str(copy), "--json", str(out))
    assert got.returncode == 0, got.stderr
    res = json.loads(out.read_text())["results"]
    mem = res["memory"]
    for side in ("kvref", "vllm"):
        assert 0 < mem[f"{side}_pages"] <= mem[f"{side}_peak"]
        assert len(mem[f"{side}_per_request"]) == 6  # 1 full + 5 window groups
    assert [c["occupancy"] for c in res["chat"]] == [0.25, 0.5, 0.75]
    for c in res["chat"]:
        assert c["prompted"] > 0 and c["pool"] > 0
        assert 0 <= c["kvref_hit"] <= c["prompted"] and 0 <= c["vllm_hit"] <= c["prompted"]
    rows = [d["row"] for d in res["decode"]]
    assert [r["op"].split(",")[0] for r in rows] == ["hybrid decode B=2", "hybrid decode B=4"]
    assert all(0 < d["plan_share"] < 1 for d in res["decode"])
    for r in rows:
        for side in ("kvref", "vllm", "ratio"):
            s = r[side]
            assert s["n"] > 0 and all(math.isfinite(s[k]) and s[k] > 0
                                      for k in ("p10", "median", "p90")), r
    for head in ("Memory held", "Multi-turn chat", "| operation |"):
        assert head in got.stdout
