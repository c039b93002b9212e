#!/usr/bin/env python3
"""Build a copy of vLLM 0.33.0's KV-cache manager for `benchmarks/vs_vllm.py`.

    python scripts/build_vllm_kv.py --dest DIR [--wheel PATH]   # build
    python scripts/build_vllm_kv.py --dest DIR --verify          # check a copy

Without ``--wheel`` it runs ``pip download vllm==0.33.0 --no-deps`` (a 336 MB
wheel; only a few hundred kB of it are kept). Every file taken from the wheel
is checked against the sha256 the wheel's RECORD lists for it, and the copy
keeps those lines in ``RECORD.subset`` so ``--verify`` can check it later
without the wheel. The stubs in ``benchmarks/vllm_stubs/`` fill in the heavy
modules those files import. Then:

    python -m benchmarks.vs_vllm --vllm DIR
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "0.33.0"
STUBS = Path(__file__).resolve().parent.parent / "benchmarks" / "vllm_stubs"

# the KV manager and what it imports, byte for byte from the wheel
FROM_WHEEL = (
    "vllm/v1/core/__init__.py",
    "vllm/v1/core/kv_cache_manager.py",
    "vllm/v1/core/kv_cache_coordinator.py",
    "vllm/v1/core/single_type_kv_cache_manager.py",
    "vllm/v1/core/block_pool.py",
    "vllm/v1/core/kv_cache_utils.py",
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


def record_hash(data: bytes) -> str:
    """A RECORD line's hash field: urlsafe base64 of the sha256, unpadded."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def download(into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", f"vllm=={VERSION}", "--no-deps",
                    "--only-binary", ":all:", "-d", str(into)], check=True)
    wheels = sorted(into.glob(f"vllm-{VERSION}-*.whl"))
    if not wheels:
        raise SystemExit(f"pip download left no vllm-{VERSION} wheel in {into}")
    return wheels[0]


def build(wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        record_name = next(n for n in names if n.endswith(".dist-info/RECORD"))
        record: dict[str, str] = {}
        for line in z.read(record_name).decode().splitlines():
            path, _, rest = line.partition(",")
            record[path] = rest.split(",")[0]
        lines = [f"# from {wheel.name} {record_name}"]
        for name in FROM_WHEEL:
            data = z.read(name)
            if record.get(name) != record_hash(data):
                raise SystemExit(f"{name}: its bytes do not match the wheel's RECORD")
            out = dest / name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)
            lines.append(f"{name},{record[name]}")
        licence = next((n for n in names if n.endswith(".dist-info/licenses/LICENSE")
                        or n.endswith(".dist-info/LICENSE")), None)
        if licence is not None:
            (dest / "LICENSE").write_bytes(z.read(licence))
    for stub in STUBS.rglob("*.py"):
        rel = stub.relative_to(STUBS).as_posix()
        if rel in FROM_WHEEL:
            raise SystemExit(f"stub {rel} would replace a file from the wheel")
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(stub, out)
    if not (dest / "LICENSE").exists():
        shutil.copyfile(STUBS / "LICENSE", dest / "LICENSE")
    (dest / "RECORD.subset").write_text("\n".join(lines) + "\n")


def verify(dest: Path) -> int:
    """Check every file RECORD.subset names; returns how many differ."""
    bad = 0
    for line in (dest / "RECORD.subset").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        name, want = line.rsplit(",", 1)
        path = dest / name
        ok = path.is_file() and record_hash(path.read_bytes()) == want
        bad += not ok
        print(("ok  " if ok else "BAD ") + name)
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", required=True, help="the folder to build (or verify)")
    ap.add_argument("--wheel", help="a downloaded vllm-0.33.0 wheel (default: pip download)")
    ap.add_argument("--verify", action="store_true", help="check a built copy only")
    args = ap.parse_args()
    dest = Path(args.dest)
    if not args.verify:
        if args.wheel:
            build(Path(args.wheel), dest)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                build(download(Path(tmp)), dest)
    bad = verify(dest)
    print(f"{bad or 'all'} file(s) {'differ from' if bad else 'match'} "
          "the wheel's RECORD")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
