"""scripts/vllm_copy.py: a copy built from a wheel is checked file by file
against the wheel's RECORD, and one that does not match is refused.  The
wheel here is a small stand-in made from the shared copy's files and their
RECORD lines (the real one is a few hundred MB)."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from kvref.testing import vllm_pool as V

REPO = Path(__file__).resolve().parents[3]
COPY = V.find_copy(REPO)
needs_copy = pytest.mark.skipif(COPY is None, reason=V.HOW_TO_GET_ONE)


def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_copy", REPO / "scripts" / "vllm_copy.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fake_wheel(tmp: Path, copy: Path, tamper: str | None = None) -> Path:
    lines = [ln for ln in (copy / "RECORD.subset").read_text().splitlines()
             if ln and not ln.startswith("#")]
    wheel = tmp / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for ln in lines:
            name = ln.split(",")[0]
            data = (copy / name).read_bytes()
            z.writestr(name, data + b"\n# tampered\n" if name == tamper else data)
        z.writestr("vllm-0.33.0.dist-info/licenses/LICENSE", (copy / "LICENSE").read_bytes())
        z.writestr("vllm-0.33.0.dist-info/RECORD", "\n".join(f"{ln}," for ln in lines))
    return wheel


@needs_copy
def test_a_copy_built_from_the_wheel_is_the_shared_copy(tmp_path: Path) -> None:
    assert COPY is not None
    dest = tmp_path / "copy"
    assert script().main(["--wheel", str(fake_wheel(tmp_path, COPY)), "--dest", str(dest),
                          "--stubs-from", str(COPY)]) == 0
    for f in (COPY / "vllm").rglob("*.py"):
        assert (dest / f.relative_to(COPY)).read_bytes() == f.read_bytes(), f
    assert V.is_copy(dest)


@needs_copy
def test_a_file_that_does_not_match_the_record_is_refused(tmp_path: Path) -> None:
    assert COPY is not None
    wheel = fake_wheel(tmp_path, COPY, tamper="vllm/v1/core/block_pool.py")
    with pytest.raises(SystemExit, match=r"block_pool\.py: sha256 differs"):
        script().main(["--wheel", str(wheel), "--dest", str(tmp_path / "copy"),
                       "--stubs-from", str(COPY)])
