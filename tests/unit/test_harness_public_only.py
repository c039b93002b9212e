"""The packaged harness (`kvref/testing`) reads kvref only through public
calls and `KVManager.observe` (issue 27, part 6): no attribute whose name
starts with ``_`` is read, written or deleted on anything but ``self`` or
``cls``, neither directly nor through ``getattr``/``setattr``/``delattr``/
``hasattr`` with a literal name. Dunders (``type(x).__name__``) are Python's
protocol, not anyone's private state, and are allowed.

So a manager that wraps `KVManager` by composition (tests/support/
composed_manager.py) can be driven, and a refactor of kvref's internals
cannot silently break the harness engine teams install.
"""

from __future__ import annotations

import ast
from pathlib import Path

HARNESS = Path(__file__).resolve().parents[2] / "kvref" / "testing"
REFLECTION = {"getattr", "setattr", "delattr", "hasattr"}
# the vLLM and transformers adapters observe another engine's block pool,
# which offers no read-only view of its hash map or free list: they read that
# engine's privates, never kvref's (they import no kvref manager at all, as
# the second test checks)
# the adapters to other engines, and the search they share (engine_search,
# pages_replay): none of them may drive kvref's manager
OTHER_ENGINE = frozenset({"vllm_pool.py", "vllm_plants.py", "transformers_pool.py",
                          "transformers_plants.py", "transformers_window.py",
                          "engine_search.py", "pages_replay.py"})


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def own(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def private_accesses(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: expression`` for each access to another object's private name."""
    found: list[tuple[int, int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute):
            hit = private(node.attr) and not own(node.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            args = node.args
            hit = (node.func.id in REFLECTION and len(args) >= 2
                   and isinstance(args[1], ast.Constant) and isinstance(args[1].value, str)
                   and private(args[1].value) and not own(args[0]))
        else:
            hit = False
        if hit:
            found.append((node.lineno, node.col_offset, ast.unparse(node)))
    # in source order (the walk is breadth first)
    return [f"{filename}:{line}: {text}" for line, _, text in sorted(found)]


def test_the_harness_reads_no_private_attribute() -> None:
    files = sorted(f for f in HARNESS.glob("*.py") if f.name not in OTHER_ENGINE)
    assert len(files) >= 7, files  # the walk found the harness
    found = [hit for f in files
             for hit in private_accesses(f.read_text(), f"kvref/testing/{f.name}")]
    assert not found, "the harness reads private state:\n" + "\n".join(found)


def test_the_other_engine_adapters_do_not_drive_kvref() -> None:
    for name in sorted(OTHER_ENGINE):
        tree = ast.parse((HARNESS / name).read_text(), name)
        imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        kvref_parts = {i for i in imported if i == "kvref" or i.startswith("kvref.")}
        # each other (the adapters share vLLM's Disagreement), never a manager
        assert kvref_parts <= {f"kvref.testing.{n.removesuffix('.py')}"
                               for n in OTHER_ENGINE}, (name, kvref_parts)


def test_the_check_finds_what_the_harness_used_to_read() -> None:
    # lines of the harness before part 6: each one is found
    old = '''
for rname, labels in kv._streams.items():
    claimed = kv._offloads.get(rname)
leases = kv._table.leases.leased()
pool._copy_out = broken
del transfer._copy
phases = self.kv._host_offload
hook = getattr(pool, "_copy_in")
'''
    found = private_accesses(old)
    assert [h.split(": ", 1)[1] for h in found] == [
        "kv._streams", "kv._offloads", "kv._table", "pool._copy_out", "transfer._copy",
        "self.kv._host_offload", "getattr(pool, '_copy_in')"], found


def test_own_privates_and_dunders_are_allowed() -> None:
    ok = '''
self._memo = {}
cls._cache = None
name = type(action).__name__
'''
    assert private_accesses(ok) == []
