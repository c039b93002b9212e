#!/usr/bin/env python3
"""Build a copy of vLLM's KV-manager files that imports on CPU, for
``python -m kvref.testing.vllm_pool --vllm DEST`` (issue 30).

    python scripts/vllm_copy.py --version 0.34.0 --dest /tmp/vllm_kv034
    python scripts/vllm_copy.py --wheel vllm-0.34.0-...whl --dest /tmp/vllm_kv034

The wheel comes from ``pip download vllm==VERSION --no-deps`` (a few hundred MB)
unless --wheel names one.  The files the lockstep runs are copied out of it
byte for byte and each is checked against the wheel's RECORD (sha256); their
lines go to DEST/RECORD.subset.  What they import from the rest of vLLM (CUDA,
configs, the model registry) is stood in for by the small stubs of an existing
copy (--stubs-from, by default ../shared/anchors/vllm_kv): every file there
that its RECORD.subset does not list.  A module the new version imports that
neither has is taken from the wheel too, checked the same way, when the
trial import names it.  Last, the script compares the files with those of the
--stubs-from copy and says which changed.
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
    listed = {ln.split(",")[0] for ln in (base / "RECORD.subset").read_text().splitlines()
              if ln and not ln.startswith("#")}
    return sorted(str(p.relative_to(base)) for p in (base / "vllm").rglob("*.py")
                  if str(p.relative_to(base)) not in listed)


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


def _default_copy() -> Path | None:
    sys.path.insert(0, str(REPO))
    from kvref.testing.vllm_pool import find_copy

    return find_copy(REPO)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default="0.33.0")
    ap.add_argument("--wheel", type=Path, help="a downloaded wheel (no download)")
    ap.add_argument("--dest", type=Path, required=True)
    ap.add_argument("--stubs-from", type=Path, default=_default_copy(),
                    help="a copy whose stubs to take (default: $KVREF_VLLM_COPY, "
                         "else ../shared/anchors/vllm_kv)")
    ap.add_argument("--also", nargs="*", default=[], help="more of vLLM's files")
    args = ap.parse_args(argv)
    base: Path | None = args.stubs_from
    if base is None or not (base / "RECORD.subset").is_file():
        raise SystemExit(f"{base}: not a copy with RECORD.subset (--stubs-from)")
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
            missing = trial_import(dest)
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
        (dest / "RECORD.subset").write_text(
            f"# from {wheel.name} {wheel.record_name}\n"
            + "".join(f"{n},{wheel.record[n]}\n" for n in files))
        print(f"{dest}: {len(files)} files of {wheel.name}, each matching its RECORD "
              f"sha256; {len(stubs_of(base))} stubs from {base}")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
