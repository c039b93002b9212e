"""The suite's results do not depend on which tests ran before (issue 17).

Hypothesis now and then draws a constant found in the local modules loaded so
far; `tests/support/preload.py` loads all of the project's before the first
test, so a module a test imports lazily adds nothing to draw from. Before it,
the model checker's modules, imported by the exhaustive replay, changed what
every later lockstep run generated, and a planted bug went unfound.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvref_model import core as m
from tests.support.preload import EXAMPLES, local_module_names

TINY = m.Scope(requests=1, labels=1, device_pages=1, host_pages=1, page_size=1,
               max_span=1, depth=2)


def test_every_local_module_is_loaded_before_any_test() -> None:
    missing = [n for n in [*local_module_names(), *EXAMPLES] if n not in sys.modules]
    assert not missing, f"not preloaded: {missing}"


def _constant_pool() -> Callable[[], Any]:
    try:
        from hypothesis.internal.conjecture.providers import _get_local_constants
    except ImportError:  # private to Hypothesis: the test above still holds
        pytest.skip("this Hypothesis has no local constant pool to compare")
    return _get_local_constants


def test_a_module_loaded_later_adds_no_constant(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    pool = _constant_pool()
    before = set(pool().set_for_type("integer"))
    (tmp_path / "kvref_late_module.py").write_text("UNLIKELY = 982_451_653\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("kvref_late_module")
    try:
        assert 982_451_653 not in pool().set_for_type("integer")
        assert set(pool().set_for_type("integer")) == before
    finally:
        sys.modules.pop("kvref_late_module", None)


def test_what_the_exhaustive_replay_imports_changes_no_draw() -> None:
    pool = _constant_pool()
    before = {kind: set(pool().set_for_type(kind))
              for kind in ("integer", "float", "bytes", "string")}
    from kvref_model.check import reachable  # what test_exhaustive.py imports lazily

    assert sum(1 for _ in reachable(TINY)) > 1
    after = {kind: set(pool().set_for_type(kind)) for kind in before}
    assert after == before
