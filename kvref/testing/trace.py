"""Failures that travel: a verification layer's failure as a JSON file.

A trace holds what a replay needs and nothing drawn: the layer (``kind``:
``lockstep``, ``exhaustive`` or ``sched``), the model's scope, kvref's
version, the driver's settings, the calls in the order they ran, and the
disagreement. ``python -m kvref.testing.replay FILE`` runs it again on
another machine, CPU or GPU, without Hypothesis's draws.

Files go to ``$KVREF_TRACE_DIR`` (the suite points it into pytest's
temporary directory, ``scripts/nightly.sh`` into its artifacts), else to
``kvref-traces`` under the system's temporary directory. A file is named by
a digest of its calls and disagreement, so the same failure found twice
lands in the same file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from kvref.stepping import decode_table
from kvref_model import core as m

FORMAT = 1
KINDS = ("lockstep", "exhaustive", "sched")

# the dataclasses a trace may name, by class name: decoding builds only
# these, never an arbitrary import named by a file
TYPES: dict[str, type] = {t.__name__: t for t in (*m.ACTIONS, m.Seg, m.Step, m.Scope)}


def register(*types: type) -> None:
    """Let traces name ``types`` (the scheduler harness's programs and events)."""
    for t in types:
        TYPES[t.__name__] = t


def encode(obj: Any) -> Any:
    """JSON-ready form: a dataclass as {"__": name, field: value}, tuples as lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        name = type(obj).__name__
        if TYPES.get(name) is not type(obj):
            raise TypeError(f"{name} is not registered with kvref.testing.trace")
        out: dict[str, Any] = {"__": name}
        for f in dataclasses.fields(obj):
            out[f.name] = encode(getattr(obj, f.name))
        return out
    if isinstance(obj, dict):
        if "__" in obj or not all(isinstance(k, str) for k in obj):
            raise TypeError(f"a trace's mappings have string keys, not '__': {obj!r}")
        return {k: encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode(x) for x in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot encode {type(obj).__name__} in a trace: {obj!r}")


def decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        if "__" not in obj:  # a plain mapping (the scheduler's options)
            return {k: decode(v) for k, v in obj.items()}
        name = obj["__"]
        if name not in TYPES:
            raise ValueError(f"a trace names an unknown type {name!r}")
        return TYPES[name](**{k: decode(v) for k, v in obj.items() if k != "__"})
    if isinstance(obj, list):
        return tuple(decode(x) for x in obj)  # the model's fields are tuples
    return obj


def kvref_version() -> str:
    try:
        return metadata.version("kvref")
    except metadata.PackageNotFoundError:  # a source tree never installed
        return "unknown"


def config_of(config: Any) -> dict[str, Any]:
    """The `DriverConfig` fields a replay can rebuild (device, dtype, hash,
    ids); the factory by its import path, which a replay names with --factory."""
    return {"device": str(config.device), "dtype": str(config.dtype).removeprefix("torch."),
            "page_key_hash": config.page_key_hash, "reuse_ids": config.reuse_ids,
            "factory": import_path(config.factory),
            # a check run before each admit (kvref's own tests: admission's
            # fast path against its rules); a replay runs it where it imports
            "before_admit": import_path(config.before_admit)}


def import_path(obj: Any) -> str | None:
    if obj is None or not hasattr(obj, "__qualname__"):
        return None
    return f"{obj.__module__}:{obj.__qualname__}"


def knobs() -> dict[str, Any]:
    """kvref's module settings the tests change that steer its behaviour:
    the lockstep runs the kept decode table from one row (test_lockstep.py)."""
    return {"decode_table.SMALL_BATCH": decode_table.SMALL_BATCH}


def trace_dir() -> Path:
    env = os.environ.get("KVREF_TRACE_DIR")
    return Path(env) if env else Path(tempfile.gettempdir()) / "kvref-traces"


def build(kind: str, scope: m.Scope, calls: Sequence[Any], error: BaseException | str,
          config: Any = None, **extra: Any) -> dict[str, Any]:
    """The trace of one failure, as the JSON object written."""
    if kind not in KINDS:
        raise ValueError(f"unknown trace kind {kind!r}")
    message = error if isinstance(error, str) else str(error)
    etype = "Mismatch" if isinstance(error, str) else type(error).__name__
    return {
        "format": FORMAT, "kind": kind, "kvref": kvref_version(),
        "scope": encode(scope), "config": config_of(config) if config is not None else None,
        "knobs": knobs(), "calls": encode(list(calls)),
        "disagreement": {"type": etype, "message": message},
        **{k: encode(v) for k, v in extra.items()},
    }


def digest(trace: Mapping[str, Any]) -> str:
    """Of what makes the failure: the layer, the scope, the calls, the disagreement."""
    core = {k: trace.get(k) for k in ("kind", "scope", "calls", "disagreement", "programs",
                                      "setup", "schedule")}
    return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()[:12]


def write(trace: Mapping[str, Any], directory: Path | None = None) -> Path:
    out = directory or trace_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{trace['kind']}-{digest(trace)}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(trace, indent=1) + "\n")
    tmp.replace(path)  # a reader never sees half a file
    return path


def load(path: str | Path) -> dict[str, Any]:
    trace = json.loads(Path(path).read_text())
    if not isinstance(trace, dict) or trace.get("format") != FORMAT:
        raise ValueError(f"{path}: not a kvref trace of format {FORMAT}")
    if trace.get("kind") not in KINDS:
        raise ValueError(f"{path}: unknown trace kind {trace.get('kind')!r}")
    return trace


def final_example() -> bool:
    """Whether a failure now is one to keep: outside Hypothesis always;
    inside, only on the final run of the example it reports (not each
    failing example it tried while shrinking)."""
    try:
        from hypothesis.control import current_build_context
        from hypothesis.errors import InvalidArgument
    except ImportError:
        return True
    try:
        return bool(current_build_context().is_final)
    except InvalidArgument:  # no test running under Hypothesis
        return True


def keep(err: BaseException, make: Callable[[], Mapping[str, Any]]) -> Path | None:
    """Write the trace ``make`` builds for ``err`` and name it in the report.
    A trace that cannot be written is said in the report too, and never
    replaces the failure it was for."""
    try:
        path = write(make())
    except Exception as why:  # the failure is what must reach the user
        err.add_note(f"kvref trace not written: {type(why).__name__}: {why}")
        return None
    note(err, path)
    return path


def note(err: BaseException, path: Path) -> None:
    """Name the trace file in the failure's report (and on stderr, which
    pytest shows with a failure when a test framework re-raises another)."""
    line = f"kvref trace written: {path} (replay: python -m kvref.testing.replay {path})"
    err.add_note(line)
    print(line, file=sys.stderr)
