"""`python -m kvref_model.check` as a command: help, errors, the JSON report, packaging."""

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from kvref_model.check import _parser, main

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--device-pages", "2", "--host-pages", "1", "--max-span", "1", "--depth", "3",
        "--quiet", "--workers", "1"]


def test_help_explains_every_option_and_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for action in _parser()._actions:
        if action.dest == "help":
            continue
        assert action.help, action.dest
        assert action.option_strings[0] in text
        if action.default not in (None, False):
            assert f"(default: {action.default})" in text, action.dest


@pytest.mark.parametrize("args", [
    ["--without", "R99"], ["--page-size", "0"], ["--requests", "0"], ["--workers", "0"],
    ["--depth", "-1"], ["--labels", "two"], ["--resume", "/nonexistent/ck"], ["--bogus"],
])
def test_a_bad_option_is_one_line(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([*args, "--quiet"])
    assert e.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0] and not captured.out, captured.err
    assert "Traceback" not in captured.err


def test_resume_of_another_scope_is_one_line(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    ck = str(tmp_path / "ck")
    assert main([*TINY, "--checkpoint", ck, "--checkpoint-every", "1"]) == 0
    assert Path(ck).exists()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*TINY[:-5], "--depth", "4", "--quiet", "--resume", ck])
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "another search" in lines[0]


def test_json_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    assert main([*TINY, "--model", "reference", "--keep-going", "--json", str(out)]) == 1
    doc = json.loads(out.read_text())
    table = capsys.readouterr().out
    assert f"states {doc['states']} " in table and doc["complete"]
    assert doc["violations"] and all(v["trace"] for v in doc["violations"].values())
    assert set(doc["fired"]) >= {"Ingest", "Admit"} and doc["scope"]["depth"] == 3
    assert 0 <= doc["collision_odds"] < 1e-9 and doc["fingerprint_bits"] == 64


def test_installed_as_a_console_script() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["kvref-model-check"] == "kvref_model.check:main"
    # kvref* takes kvref_model too; no pattern may take a bare `model`
    include = meta["tool"]["setuptools"]["packages"]["find"]["include"]
    assert include == ["kvref*"]


def test_model_imports_neither_torch_nor_kvref() -> None:
    code = ("import sys, kvref_model.check, kvref_model.search, kvref_model.symmetry, "
            "kvref_model.render; "
            "bad = {'torch', 'kvref', 'numpy'} & set(sys.modules); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize("group", [False, True])
def test_sigterm_stops_the_workers_and_keeps_the_checkpoint(tmp_path: Path, group: bool) -> None:
    # group: as `timeout` and CI runners send it, to the workers as well
    ck = tmp_path / "ck"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvref_model.check", "--depth", "9", "--workers", "2", "--quiet",
         "--checkpoint", str(ck), "--checkpoint-every", "1"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    children: set[str] = set()
    try:
        for _ in range(600):  # until the first checkpoint (at most a minute)
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                children |= set(f.read().split())
            if ck.exists():
                break
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        assert ck.exists() and len(children) >= 2
        time.sleep(1)  # into the search proper, chunks in flight
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.terminate()
        assert proc.wait(timeout=60) in (128 + 15, -15)
    finally:
        proc.kill()
    assert b"Traceback" not in proc.stderr.read()  # type: ignore[union-attr]
    assert not [c for c in children if Path(f"/proc/{c}").exists()], "workers left running"
