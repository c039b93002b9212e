"""A stream's fields are written only by its own transitions (issue 29).

`CacheStream` (kvref/core/streams.py) keeps its state in slots that other
modules read and never write: they request a transition, so one transition
is the only writer of what it changes and the generation bump cannot be
forgotten at a call site. The slots are not hidden behind properties (a
property read is a Python call, on the decode step's hottest loop), so this
lint is what holds the rule: it reads every module under `kvref/` with
`ast` and fails on any write of a stream field outside streams.py, on any
path, run by a test or not.

A write is: an assignment, augmented or annotated assignment, or ``del`` whose
target (or a tuple, list or subscript around it) is ``<expr>.<field>``; a
mutating method called on ``<expr>.<field>`` (``stream.keys.append(k)``);
``setattr``/``object.__setattr__``/``delattr`` naming a field; and a class
outside streams.py that subclasses `CacheStream`. ``<field>`` is a public
slot of the class (`__slots__`, private ones included) or a property. ``self.x``
is exempt: another class's own attribute of the same name (a plan view's
``generation``) is its business, and a `CacheStream` method is in
streams.py. Writes to a field name on an object that is not a stream are
listed in `NOT_STREAMS`, each with what the object is.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import kvref
from kvref.core.streams import CacheStream

ROOT = Path(kvref.__file__).parent
OWN = ROOT / "core" / "streams.py"

SLOTS = frozenset(CacheStream.__slots__)
# derived states (``retrieve``): assigning one is a write meant for a field
PROPERTIES = frozenset(
    name for name, v in vars(CacheStream).items() if isinstance(v, property))
FIELDS = PROPERTIES | SLOTS

MUTATORS = frozenset({"append", "extend", "insert", "pop", "remove", "clear", "sort",
                      "reverse", "__setitem__", "__delitem__", "__iadd__", "update"})

# (module, source of the target) for field names written on objects that are
# not streams; a stale entry fails `test_not_streams_entries_are_used`
NOT_STREAMS = {
    # the plan's per-row view of a stream (`kvref.stepping.plan.SequenceView`):
    # its fast constructor and the decode table's in-place refresh
    ("kvref/stepping/plan.py", "v.generation"),
    ("kvref/stepping/admit_plan_commit.py", "view.generation"),
}


def _field_attr(node: ast.expr) -> ast.Attribute | None:
    """The ``<expr>.<field>`` a target writes into (through subscripts), if any."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and node.attr in FIELDS:
        return node
    return None


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    if isinstance(node, ast.Assign):
        stack = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        stack = [node.target]
    elif isinstance(node, ast.Delete):
        stack = list(node.targets)
    elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
        stack = [node.target]
    elif isinstance(node, ast.withitem) and node.optional_vars is not None:
        stack = [node.optional_vars]
    elif isinstance(node, ast.NamedExpr):
        stack = [node.target]
    else:
        return
    while stack:
        t = stack.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            stack.extend(t.elts)
        elif isinstance(t, ast.Starred):
            stack.append(t.value)
        else:
            yield t


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def field_writes(source: str, module: str) -> list[str]:
    """Every write of a stream field in ``source``, as ``module:line: what``."""
    found: list[str] = []

    def hit(node: ast.AST, what: str) -> None:
        found.append(f"{module}:{getattr(node, 'lineno', '?')}: {what}")

    for node in ast.walk(ast.parse(source)):
        for target in _targets(node):
            attr = _field_attr(target)
            if attr is not None and not _is_self(attr.value):
                text = ast.unparse(attr)
                if (module, text) not in NOT_STREAMS:
                    hit(node, f"writes {text}")
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in MUTATORS:
                attr = _field_attr(func.value)
                if attr is not None and not _is_self(attr.value):
                    hit(node, f"mutates {ast.unparse(attr)} in place ({func.attr})")
            name = ast.unparse(func)
            if name in {"setattr", "delattr", "object.__setattr__", "object.__delattr__"}:
                args = node.args
                if (len(args) >= 2 and isinstance(args[1], ast.Constant)
                        and args[1].value in FIELDS):
                    hit(node, f"{name}(..., {args[1].value!r})")
        if isinstance(node, ast.ClassDef) and any(
                ast.unparse(b).split(".")[-1] == "CacheStream" for b in node.bases):
            hit(node, f"class {node.name} subclasses CacheStream")
    return found


def _modules() -> Iterator[tuple[str, str]]:
    for path in sorted(ROOT.rglob("*.py")):
        if path != OWN:
            yield path.relative_to(ROOT.parent).as_posix(), path.read_text()


def test_only_the_stream_writes_its_fields() -> None:
    writes = [w for module, src in _modules() for w in field_writes(src, module)]
    assert not writes, "stream fields written outside kvref/core/streams.py:\n" + "\n".join(
        writes)


def test_the_field_names_are_the_streams() -> None:
    """The lint's names come from the class: a field added later is covered."""
    assert {"page_indices", "stored_len", "generation", "offload", "offloaded", "keys",
            "_pages_buf"} <= SLOTS
    assert "retrieve" in PROPERTIES


def test_not_streams_entries_are_used() -> None:
    sources = dict(_modules())
    for module, text in NOT_STREAMS:
        assert text in sources[module], f"stale NOT_STREAMS entry {module}: {text}"


PLANTS = [
    ("stream.stored_len = 3", "writes stream.stored_len"),
    ("stream.generation += 1", "writes stream.generation"),
    ("s.position: int = 0", "writes s.position"),
    ("a, table[k].released = 1, 2", "writes table[k].released"),
    ("del stream.keys[full:]", "writes stream.keys"),
    ("stream.page_indices[0] = 7", "writes stream.page_indices"),
    ("stream._pages_n = 3", "writes stream._pages_n"),
    ("stream.retrieve = state", "writes stream.retrieve"),
    ("for x.space in names: pass", "writes x.space"),
    ("stream.keys.append(k)", "mutates stream.keys in place (append)"),
    ("stream.key_tokens.extend(raw)", "mutates stream.key_tokens in place (extend)"),
    ("setattr(stream, 'received', True)", "setattr(..., 'received')"),
    ("object.__setattr__(stream, 'offload', x)", "object.__setattr__(..., 'offload')"),
    ("class Leaky(streams.CacheStream): pass", "class Leaky subclasses CacheStream"),
]


def test_each_planted_write_is_found() -> None:
    """Each form of write, planted alone, is reported (and named)."""
    for code, what in PLANTS:
        got = field_writes(code, "kvref/planted.py")
        assert got == [f"kvref/planted.py:1: {what}"], (code, got)


def test_reads_and_own_attributes_pass() -> None:
    clean = "\n".join([
        "n = stream.stored_len + len(stream.page_indices)",
        "self.generation = generation  # a view's own field",
        "pages = list(stream.keys); pages.append(k)",
        "stream.append_tokens(span)",
        "keys = d.keys()",
    ])
    assert field_writes(clean, "kvref/planted.py") == []
