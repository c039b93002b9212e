#!/usr/bin/env python3
"""Build (or check) a copy of vLLM's KV-manager files that imports on CPU:
for ``python -m kvref.testing.vllm_pool --vllm DEST`` (issue 30) and for
``python -m benchmarks.vs_vllm --vllm DEST`` (issue 28).

    python scripts/vllm_copy.py --dest /tmp/vllm_kv                   # vLLM 0.33.0
    python scripts/vllm_copy.py --version 0.34.0 --dest /tmp/vllm_kv034
    python scripts/vllm_copy.py --wheel vllm-0.34.0-...whl --dest /tmp/vllm_kv034
    python scripts/vllm_copy.py --dest /tmp/vllm_kv --verify          # check a copy

The wheel comes from ``pip download vllm==VERSION --no-deps`` (a few hundred MB)
unless --wheel names one.  The files the lockstep and the benchmark run are
copied out of it byte for byte and each is checked against the wheel's RECORD
(sha256); their lines go to DEST/RECORD.subset, which ``--verify`` checks
later without the wheel.  What they import from the rest of vLLM (CUDA,
configs, the model registry) is stood in for by small stubs: by default
``benchmarks/vllm_stubs/``, or those of an existing copy (--stubs-from: every
file there that its RECORD.subset does not list).  A module the new version
imports that no stub stands for is taken from the wheel too, checked the same
way, when the trial import names it (``--no-import-check`` skips that import).
Last, with --stubs-from a copy, the script says which files changed against it.
"""

from __future__ import annotations

import argparse
import base64
import difflib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STUBS = REPO / "benchmarks" / "vllm_stubs"

# vLLM's own files, unmodified: the block manager and what it needs
FILES = (
    "vllm/v1/core/__init__.py",
    "vllm/v1/core/block_pool.py",
    "vllm/v1/core/kv_cache_utils.py",
    "vllm/v1/core/kv_cache_manager.py",
    "vllm/v1/core/kv_cache_coordinator.py",
    "vllm/v1/core/single_type_kv_cache_manager.py",
    "vllm/v1/core/kv_cache_metrics.py",
    "vllm/v1/__init__.py",
    "vllm/v1/request.py",
    "vllm/v1/kv_cache_interface.py",
    "vllm/v1/kv_cache_layout.py",
    "vllm/v1/kv_cache_spec_registry.py",
    "vllm/v1/hisparse/__init__.py",
    "vllm/v1/hisparse/block_pool.py",
    "vllm/v1/metrics/cache_hit_source.py",
    "vllm/utils/__init__.py",
    "vllm/utils/math_utils.py",
    "vllm/utils/hashing.py",
)


def sha(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(
        b"=").decode()


def download(version: str, into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={version}",
                    "--no-deps", "-d", str(into)], check=True)
    wheels = sorted(into.glob(f"vllm-{version}-*.whl"))
    if not wheels:
        raise SystemExit(f"no vllm {version} wheel in {into}")
    return wheels[0]


class Wheel:
    def __init__(self, path: Path) -> None:
        self.zip = zipfile.ZipFile(path)
        self.name = path.name
        self.record_name = next(n for n in self.zip.namelist()
                                if n.endswith(".dist-info/RECORD"))
        self.record: dict[str, str] = {}
        for line in self.zip.read(self.record_name).decode().splitlines():
            parts = line.rsplit(",", 2)
            if len(parts) == 3 and parts[1]:
                self.record[parts[0]] = parts[1]

    def checked(self, name: str) -> bytes:
        """The file's bytes, after checking them against the RECORD."""
        if name not in self.record:
            raise KeyError(f"{name} is not in {self.name}")
        data = self.zip.read(name)
        if sha(data) != self.record[name]:
            raise SystemExit(f"{name}: sha256 differs from {self.record_name}")
        return data


def stubs_of(base: Path) -> list[str]:
    """The stubs a folder holds: every .py of a copy that its RECORD.subset
    does not list, or every .py of a stubs-only folder (no RECORD.subset)."""
    record = base / "RECORD.subset"
    listed = {ln.split(",")[0] for ln in record.read_text().splitlines()
              if ln and not ln.startswith("#")} if record.is_file() else set()
    return sorted(p.relative_to(base).as_posix() for p in (base / "vllm").rglob("*.py")
                  if p.relative_to(base).as_posix() not in listed)


def verify(dest: Path) -> int:
    """Check every file DEST/RECORD.subset names; returns how many differ."""
    bad = 0
    for line in (dest / "RECORD.subset").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        name, want = line.rsplit(",", 1)
        path = dest / name
        ok = path.is_file() and sha(path.read_bytes()) == want
        bad += not ok
        print(("ok  " if ok else "BAD ") + name)
    print(f"{bad or 'all'} file(s) {'differ from' if bad else 'match'} the wheel's RECORD")
    return bad


def trial_import(dest: Path) -> str | None:
    """None if the copy imports; else the missing module's name (or the error)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "from kvref.testing import vllm_pool as V\n"
            "v = V.load(sys.argv[1]); V.VllmPool(v, V.ENGINE_SCOPE)\n")
    r = subprocess.run([sys.executable, "-c", code, str(dest)], capture_output=True,
                       text=True, cwd=REPO, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    if r.returncode == 0:
        return None
    last = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "?"
    if last.startswith("ModuleNotFoundError") and "'vllm." in last:
        return last.split("'")[1]
    return last


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default="0.33.0")
    ap.add_argument("--wheel", type=Path, help="a downloaded wheel (no download)")
    ap.add_argument("--dest", type=Path, required=True)
    ap.add_argument("--stubs-from", type=Path, default=STUBS,
                    help="a copy (or a folder of stubs) whose stubs to take "
                         "(default: benchmarks/vllm_stubs)")
    ap.add_argument("--also", nargs="*", default=[], help="more of vLLM's files")
    ap.add_argument("--verify", action="store_true",
                    help="only check the copy at --dest against its RECORD.subset")
    ap.add_argument("--no-import-check", action="store_true",
                    help="skip the trial import (and so the modules it would add)")
    args = ap.parse_args(argv)
    if args.verify:
        return 1 if verify(args.dest) else 0
    base: Path = args.stubs_from
    if not (base / "vllm").is_dir():
        raise SystemExit(f"{base}: no vllm/ folder of stubs (--stubs-from)")
    with tempfile.TemporaryDirectory(prefix="kvref-vllm-wheel-") as tmp:
        wheel = Wheel(args.wheel or download(args.version, Path(tmp)))
        dest: Path = args.dest
        if dest.exists():
            shutil.rmtree(dest)
        for name in stubs_of(base):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(base / name, dest / name)
        files = [*FILES, *args.also]
        for name in files:
            out = dest / name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(wheel.checked(name))
        for _ in range(10):  # what the new version imports that no stub stands for
            missing = None if args.no_import_check else trial_import(dest)
            if missing is None:
                break
            name = missing.replace(".", "/") + ".py"
            if name not in wheel.record or name in files:
                raise SystemExit(f"the copy does not import: {missing}")
            print(f"  + {name} (imported by this version; from the wheel, checked)")
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(wheel.checked(name))
            files.append(name)
        else:
            raise SystemExit("the copy still does not import")
        # vLLM's own licence (the wheel also carries vendored projects' ones)
        lic = [n for n in wheel.zip.namelist()
               if ".dist-info/" in n and n.endswith("LICENSE")]
        if lic:
            (dest / "LICENSE").write_bytes(wheel.zip.read(lic[0]))
        elif (base / "LICENSE").is_file():
            shutil.copyfile(base / "LICENSE", dest / "LICENSE")
        (dest / "RECORD.subset").write_text(
            f"# from {wheel.name} {wheel.record_name}\n"
            + "".join(f"{n},{wheel.record[n]}\n" for n in files))
        print(f"{dest}: {len(files)} files of {wheel.name}, each matching its RECORD "
              f"sha256; {len(stubs_of(base))} stubs from {base}")
    bad = verify(dest)
    if not (base / "RECORD.subset").is_file():
        return 1 if bad else 0
    for name in files:  # what changed against the --stubs-from copy
        old = base / name
        new = (dest / name).read_text().splitlines()
        if not old.is_file():
            print(f"  new      {name}")
            continue
        diff = [ln for ln in difflib.unified_diff(old.read_text().splitlines(), new,
                                                  lineterm="", n=0)
                if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
        if diff:
            plus = sum(ln.startswith("+") for ln in diff)
            print(f"  changed  {name}: +{plus} -{len(diff) - plus}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
