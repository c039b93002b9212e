"""benchmarks/vs_vllm.py runs in a tiny configuration and returns well-formed
rows (no timing is asserted); without a vLLM copy it skips, saying how to get
one; scripts/vllm_copy.py keeps only files matching the wheel's RECORD."""

from __future__ import annotations

import base64
import hashlib
import json
import math
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from benchmarks.vs_vllm import find_copy

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    # a process of its own: the copy's `vllm` package must not stay imported here
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_skips_without_a_copy(tmp_path: Path) -> None:
    got = _run("-m", "benchmarks.vs_vllm", "--tiny", "--vllm", str(tmp_path / "none"))
    assert got.returncode == 0, got.stderr
    assert "skipped" in got.stdout and "vllm_copy.py" in got.stdout


def test_tiny_run_rows(tmp_path: Path) -> None:
    copy = find_copy(None)
    if copy is None:
        pytest.skip("no vLLM KV-manager copy (scripts/vllm_copy.py builds one)")
    out = tmp_path / "rows.json"
    got = _run("-m", "benchmarks.vs_vllm", "--tiny", "--vllm", str(copy), "--json", str(out))
    assert got.returncode == 0, got.stderr
    rows = json.loads(out.read_text())["rows"]
    ops = [r["op"] for r in rows]
    for want in ("decode", "admission", "hash", "free", "samples", "window"):
        assert any(want in op for op in ops), (want, ops)
    for r in rows:
        for side in ("kvref", "vllm", "ratio"):
            s = r[side]
            assert s["n"] > 0 and all(math.isfinite(s[k]) and s[k] > 0
                                      for k in ("p10", "median", "p90")), r
    assert "| operation |" in got.stdout


def _fake_wheel(path: Path, files: dict[str, bytes], tamper: str | None = None) -> None:
    def h(data: bytes) -> str:
        return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(
            b"=").decode()

    with zipfile.ZipFile(path, "w") as z:
        record = []
        for name, data in files.items():
            z.writestr(name, data + (b"# changed\n" if name == tamper else b""))
            record.append(f"{name},{h(data)},{len(data)}")
        z.writestr("vllm-0.33.0.dist-info/RECORD", "\n".join(record) + "\n")


def test_build_script_checks_the_record(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import vllm_copy
    finally:
        sys.path.pop(0)
    files = {name: f"# {name}\n".encode() for name in vllm_copy.FILES}
    good, bad = tmp_path / "vllm-0.33.0-good.whl", tmp_path / "vllm-0.33.0-bad.whl"
    _fake_wheel(good, files)
    _fake_wheel(bad, files, tamper="vllm/v1/core/block_pool.py")
    got = _run("scripts/vllm_copy.py", "--dest", str(tmp_path / "a"), "--wheel", str(good),
               "--no-import-check")
    assert got.returncode == 0, got.stdout + got.stderr
    assert (tmp_path / "a" / "vllm" / "v1" / "core" / "kv_cache_manager.py").is_file()
    assert (tmp_path / "a" / "vllm" / "sampling_params.py").is_file()  # a stub
    got = _run("scripts/vllm_copy.py", "--dest", str(tmp_path / "b"), "--wheel", str(bad),
               "--no-import-check")
    assert got.returncode != 0 and "block_pool.py" in got.stdout + got.stderr
    # a copy changed after it was built fails --verify
    (tmp_path / "a" / "vllm" / "v1" / "request.py").write_text("# edited\n")
    got = _run("scripts/vllm_copy.py", "--dest", str(tmp_path / "a"), "--verify")
    assert got.returncode == 1 and "BAD vllm/v1/request.py" in got.stdout
