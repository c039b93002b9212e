"""kvref_model/ is the spec made executable: it must not import torch or kvref,
or the lockstep check would be checking kvref against itself."""

import ast
from pathlib import Path

MODEL = Path(__file__).resolve().parents[2] / "kvref_model"


def test_model_imports_neither_torch_nor_kvref() -> None:
    files = sorted(MODEL.glob("*.py"))
    assert files
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for n in names:
                root = n.split(".")[0]
                assert root not in {"torch", "kvref"}, f"{f.name} imports {n}"
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "__import__":
                raise AssertionError(f"{f.name} uses __import__")
