"""The smoke tests' run of a benchmark's ``--quick`` mode: what it printed
and the JSON it wrote; and the check of one timing spread's shape (never
its value: the box is shared and noisy)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def quick_run(main: Callable[[list[str]], None], out: Path) -> tuple[str, dict[str, Any]]:
    """``main(["--quick", "--json", out])``, its printed lines captured."""
    capture = pytest.MonkeyPatch()
    lines: list[str] = []
    capture.setattr("builtins.print", lambda *a, **k: lines.append(" ".join(map(str, a))))
    try:
        main(["--quick", "--json", str(out)])
    finally:
        capture.undo()
    return "\n".join(lines), json.loads(out.read_text())


def check_spread(s: dict[str, Any]) -> None:
    assert s["n"] > 0
    assert all(math.isfinite(s[k]) and s[k] > 0 for k in ("p10", "median", "p90"))
    assert s["p10"] <= s["median"] <= s["p90"]
