"""Each label's attention type answers the per-label decisions (issue 29).

`kvref.core.labels` is the one home of what differs between full attention
and a sliding window with a rollback margin; the table and the prefix cache
ask it. These pin each behaviour's answers against the rules it states.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvref
from kvref.core.config import RetentionPolicy
from kvref.core.labels import (
    FULL_ATTENTION,
    FullAttention,
    SlidingWindow,
    behaviour_of,
    behaviours_of,
)


def test_a_label_without_retention_is_full_attention() -> None:
    assert behaviour_of({}, "main") is FULL_ATTENTION
    assert behaviour_of({"draft": RetentionPolicy(4)}, "main") is FULL_ATTENTION
    assert behaviours_of({}) == {}


def test_a_windowed_label_carries_its_window_and_margin() -> None:
    chosen = behaviour_of({"main": RetentionPolicy(6, rollback_margin=2)}, "main")
    assert chosen == SlidingWindow(6, 2)
    assert (chosen.releases, chosen.cacheable) == (True, False)
    assert behaviours_of({"main": RetentionPolicy(6, rollback_margin=2)}) == {"main": chosen}


def test_full_attention_keeps_everything_and_is_cached() -> None:
    full = FullAttention()
    assert (full.releases, full.cacheable) == (False, True)
    assert full.released_after(0, 1000, 4) == 0
    assert full.first_read(1000) == 0


@pytest.mark.parametrize(("length", "expected"), [(0, 0), (5, 0), (6, 0), (7, 1), (20, 14)])
def test_a_window_reads_its_last_w_tokens_whatever_its_margin(
        length: int, expected: int) -> None:
    # W1: the margin is kept (W15), not read
    assert SlidingWindow(6, 2).first_read(length) == expected
    assert SlidingWindow(6, 0).first_read(length) == expected


@pytest.mark.parametrize(("released", "length", "expected"), [
    (0, 5, 0),     # shorter than W + k: nothing goes
    (0, 12, 4),    # first token kept is 12 - 8 = 4: slot 0 goes, slot 1 holds it
    (0, 15, 4),    # 7 is kept: its page (4..7) stays
    (8, 12, 8),    # a truncate left more released: never less (W2)
])
def test_a_window_releases_whole_pages_before_its_kept_tokens(
        released: int, length: int, expected: int) -> None:
    assert SlidingWindow(6, 2).released_after(released, length, 4) == expected


def test_forks_compare_behaviours_window_and_margin() -> None:
    # W5: a fork joins labels of the same retention only
    assert SlidingWindow(6, 2) != SlidingWindow(6, 0)
    assert SlidingWindow(6, 0) != FULL_ATTENTION
    assert SlidingWindow(6, 2) == SlidingWindow(6, 2)


# -- one home: no mechanism asks which attention type a label is -----------

# what only the behaviours, the config and the attention kernels may name:
# the window's own fields and the concrete types
WINDOW_NAMES = frozenset({
    "SlidingWindow", "FullAttention", "FULL_ATTENTION", "window_tokens", "margin", "margins",
    "retention", "RetentionPolicy", "context_budget", "rollback_margin", "window", "windows",
    "window_left",
})
KVREF = Path(kvref.__file__).parent
# the home, the config it is chosen from, the kernels that mask to a window,
# and the harness that maps the model's scope onto a config; then the one
# place each other module may name one (the export, the build, the default)
HOMES = ("core/labels.py", "core/config.py", "core/groups.py", "attention/", "testing/")
ALLOWED = {"__init__.py": {"RetentionPolicy"}, "manager.py": {"retention"},
           "core/stream_table.py": {"FULL_ATTENTION"}}


def window_names(source: str) -> list[tuple[int, str]]:
    """The identifiers of ``source`` (not its comments or strings) that name
    a window or an attention type."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.keyword) and node.arg:
            names = [node.arg]
        else:
            continue
        found += [(getattr(node, "lineno", 0), n) for n in names if n in WINDOW_NAMES]
    return found


def test_the_scan_finds_a_mechanism_that_tests_for_a_window() -> None:
    branch = "if table.windows and label in windows:\n    keep = table.window(label)\n"
    assert {n for _, n in window_names(branch)} == {"windows", "window"}
    assert window_names("if table.behaviour(label).releases:\n    pass\n") == []


def test_no_mechanism_names_a_window_outside_the_behaviours() -> None:
    found = []
    for path in sorted(KVREF.rglob("*.py")):
        rel = path.relative_to(KVREF).as_posix()
        if rel.startswith(HOMES):
            continue
        allowed = ALLOWED.get(rel, set())
        found += [f"{rel}:{line}: {name}" for line, name in window_names(path.read_text())
                  if name not in allowed]
    assert found == [], "ask the label's LabelBehaviour (kvref.core.labels) instead"
