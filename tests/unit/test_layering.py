"""kvref's ground floor imports nothing above it (issue 29).

`kvref/core/` holds what every mechanism stands on (configuration, errors,
streams, the page pool, the step and refusal vocabulary): a core module
that imports a mechanism (`kvref.stepping`, `kvref.transfer`, ...) ties the
floor to what sits on it, and the next change there reaches every module.
`kvref.validate` checks what `kvref.stepping` is handed, so stepping imports
validate and never the other way (they imported each other before).

Imports are read from the source with `ast`, wherever they are written: at
module level, inside a function, or under ``if TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvref

ROOT = Path(kvref.__file__).parent
CORE = ROOT / "core"

# Type-only imports core may make, each with why it stays; a stale entry
# (the import is gone) fails `test_type_only_allowances_are_used`. None now:
# `EngineResourceInfo.joint_comm_group` is typed by core's own protocol
# (`kvref.core.resource.ProcessGroups`), which kvref.parallel's groups meet.
TYPE_ONLY_ALLOWED: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports(path: Path, source: str) -> list[tuple[str, bool]]:
    """Every module ``source`` (the file at ``path``) imports, absolute, and
    whether the import sits under ``if TYPE_CHECKING``. ``from a import b``
    names ``a.b`` too, since ``b`` may be a submodule."""
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" \
        else module_name(path)
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, type_only: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, type_only)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, type_only) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((base, type_only))
            found.extend((f"{base}.{alias.name}", type_only) for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child, type_only)

    visit(ast.parse(source, filename=str(path)), False)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def above_core(name: str) -> bool:
    """A kvref module outside kvref.core (``kvref`` itself included: it
    imports every mechanism)."""
    return (name == "kvref" or name.startswith("kvref.")) and not (
        name == "kvref.core" or name.startswith("kvref.core."))


def upward(path: Path, source: str) -> list[tuple[str, bool]]:
    return [(name, t) for name, t in imports(path, source) if above_core(name)]


def _core_files() -> list[Path]:
    return sorted(CORE.glob("*.py"))


def test_core_imports_nothing_above_it() -> None:
    found = {
        f"{path.name}: {name}"
        for path in _core_files()
        for name, type_only in upward(path, path.read_text())
        if not (type_only and _allowed(path.name, name))
    }
    assert not found, f"kvref/core imports from above it: {sorted(found)}"


def _allowed(file: str, name: str) -> bool:
    return any(file == f and (name == m or name.startswith(m + "."))
               for f, m in TYPE_ONLY_ALLOWED)


def test_type_only_allowances_are_used() -> None:
    for file, name in TYPE_ONLY_ALLOWED:
        path = CORE / file
        assert (name, True) in upward(path, path.read_text()), f"stale allowance {file}: {name}"


def test_allowance_is_for_type_only_imports() -> None:
    # the same import at runtime is not allowed
    path = CORE / "resource.py"
    source = path.read_text() + "from kvref.parallel.groups import JointGroups\n"
    assert ("kvref.parallel.groups", False) in upward(path, source)


def _graph() -> dict[str, set[str]]:
    """kvref module -> the kvref modules it imports (any import, anywhere)."""
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        graph[mod] = {name for name, _ in imports(path, path.read_text()) if name in files}
    return graph


def reaches(graph: dict[str, set[str]], start: str, prefix: str) -> list[str]:
    """A path of imports from ``start`` to a module under ``prefix``, or []."""
    parent: dict[str, str | None] = {start: None}
    todo = [start]
    while todo:
        mod = todo.pop()
        if mod == prefix or mod.startswith(prefix + "."):
            path = [mod]
            while (p := parent[path[-1]]) is not None:
                path.append(p)
            return path[::-1]
        for nxt in graph.get(mod, ()):
            if nxt not in parent:
                parent[nxt] = mod
                todo.append(nxt)
    return []


def test_validate_does_not_reach_stepping() -> None:
    """Stepping imports validate; validate reaches no stepping module, even
    through another (kvref.transfer.published once took it there)."""
    graph = _graph()
    assert "kvref.validate" in graph["kvref.stepping.admission"]  # the one direction
    assert reaches(graph, "kvref.validate", "kvref.stepping") == []


# The checker earns its place: each way of writing an upward import is found.
PLANTS = {
    "absolute": "from kvref.stepping.step import AllocationFailed\n",
    "import": "import kvref.transfer.lease\n",
    "package": "from kvref import stepping\n",
    "top level": "from kvref import SINK_PAGE\n",
    "relative": "from ..prefix import keys\n",
    "in a function": "def f() -> None:\n    from kvref.prefix.keys import page_key\n",
    "type only": "from typing import TYPE_CHECKING\n"
                 "if TYPE_CHECKING:\n    from kvref.stepping.step import KVStep\n",
}


@pytest.mark.parametrize("how", sorted(PLANTS))
def test_planted_upward_import_is_found(how: str) -> None:
    path = CORE / "page_pool.py"
    clean = path.read_text()
    assert upward(path, clean) == []
    assert upward(path, clean + PLANTS[how]), how


def test_planted_validate_to_stepping_is_found() -> None:
    graph = _graph()
    graph["kvref.transfer.published"] = {*graph["kvref.transfer.published"],
                                         "kvref.stepping.step"}
    assert reaches(graph, "kvref.validate", "kvref.stepping") == [
        "kvref.validate", "kvref.transfer.published", "kvref.stepping.step"]
