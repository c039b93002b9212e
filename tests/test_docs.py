"""The documentation keeps up with the code.

- every public name (``kvref.__all__``) and every public member of
  `KVManager` has a docstring, so the API reference (mkdocstrings) renders
  something for each;
- every public name has a page in the API reference;
- the README's test command is the one CI runs, and the usage examples
  (README, getting started) run and print what their comments say;
- the performance figures are what the committed benchmark JSON renders to;
- the planted-bug catalogue lists every plant the tests register.

The site itself is built by CI (``mkdocs build --strict``, `.ci/run`).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import inspect
import io
import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import kvref
from kvref import KVManager

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

# public names allowed to lack a docstring for now: none. A name added here
# must leave once it gains one (the second test fails until it does)
DOCSTRING_PENDING: set[str] = set()


def _own_doc(obj: Any) -> str:
    """The docstring written for ``obj`` itself, or ""."""
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__") or ""
        # generated, not written: a dataclass's signature, Enum's default
        if doc.startswith(obj.__name__ + "(") or doc.strip() == "An enumeration.":
            return ""
        return doc.strip()
    return (getattr(obj, "__doc__", None) or "").strip()


def _public_documentables() -> dict[str, Any]:
    """Every name ``kvref`` exports that can carry a docstring, and every
    public member of `KVManager` (inherited ones included)."""
    out: dict[str, Any] = {}
    for name in kvref.__all__:
        obj = getattr(kvref, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            out[name] = obj
    for name in dir(KVManager):
        if name.startswith("_"):
            continue
        member = inspect.getattr_static(KVManager, name)
        if isinstance(member, property):
            out[f"KVManager.{name}"] = member.fget
        elif isinstance(member, classmethod | staticmethod):
            out[f"KVManager.{name}"] = member.__func__
        elif inspect.isfunction(member):
            out[f"KVManager.{name}"] = member
    return out


def _missing() -> set[str]:
    return {name for name, obj in _public_documentables().items() if not _own_doc(obj)}


def test_every_public_name_has_a_docstring() -> None:
    missing = _missing() - DOCSTRING_PENDING
    assert not missing, f"public names without a docstring: {sorted(missing)}"


def test_docstring_pending_only_shrinks() -> None:
    known = set(_public_documentables())
    gone = DOCSTRING_PENDING - known
    assert not gone, f"no longer public names; drop them from DOCSTRING_PENDING: {sorted(gone)}"
    documented = DOCSTRING_PENDING - _missing()
    assert not documented, (f"these have a docstring now; drop them from DOCSTRING_PENDING: "
                            f"{sorted(documented)}")


def test_every_public_name_is_in_the_api_reference() -> None:
    text = "\n".join(p.read_text() for p in sorted((DOCS / "api").glob("*.md")))
    listed = set(re.findall(r"^::: kvref\.(\w+)\s*$", text, re.M))
    missing = set(kvref.__all__) - listed
    assert not missing, f"kvref.__all__ names with no `::: kvref.NAME` in docs/api: {missing}"


def _ci_test_command() -> str:
    ci = (ROOT / ".ci" / "run").read_text()
    (command,) = re.findall(r'^run "tests" (.+)$', ci, re.M)
    return str(command).strip()


def test_readme_test_command_is_the_one_ci_runs() -> None:
    command = _ci_test_command()
    assert command.startswith("python -m pytest"), command
    for page in (README, DOCS / "getting-started.md", DOCS / "verification" / "index.md"):
        assert command in page.read_text(), f"{page.name} does not give CI's command {command!r}"


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_usage_example_runs(page: str) -> None:
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / page).read_text(), re.M | re.S)
    assert blocks, f"{page} has no python example"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[0], f"{page}:usage", "exec"), {"__name__": "usage_example"})
    # the comments beside the prints say what they print
    for printed in out.getvalue().splitlines():
        assert printed in blocks[0], f"the example printed {printed!r}, not what it says"


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_performance_figures_are_rendered_from_the_committed_json() -> None:
    figures = _load(ROOT / "scripts" / "docs_figures.py")
    page = DOCS / "performance" / "figures.md"
    assert page.read_text() == figures.render(), (
        "docs/performance/figures.md is not what docs/performance/data/*.json renders to: "
        "run python scripts/docs_figures.py (never edit the page by hand)")


def test_every_performance_figure_records_a_clean_commit() -> None:
    """Each benchmark JSON the figures render from names the commit it measured
    (`benchmarks.measured_commit`), a clean one: a figure of uncommitted code
    could not be reproduced (issue 28)."""
    for path in sorted((DOCS / "performance" / "data").glob("*.json")):
        commit = json.loads(path.read_text()).get("commit", "")
        assert re.fullmatch(r"[0-9a-f]{7,40}", commit), (
            f"{path.name} records commit {commit!r}: rerun its benchmark with --json from "
            "a committed tree")


PLANT_REGISTRIES = (
    "tests/conformance/test_mutations.py",
    "tests/support/sched_planted.py",
    "tests/concurrency/test_publish_races.py",
    "tests/conformance/test_page_pool_plants.py",
    "tests/conformance/test_feature_plants.py",
    "tests/conformance/test_behaviour_plants.py",
    "tests/conformance/test_interaction_plants.py",
    "tests/model/test_mutations.py",
    "tests/unit/_plant_validate.py",
    "kvref/testing/vllm_plants.py",
)


@functools.cache
def _plants() -> dict[str, set[str]]:
    """Every planted bug's name, by the file that registers it."""
    from kvref.testing.vllm_plants import PLANTS as VLLM
    from tests.concurrency.test_publish_races import PLANTED
    from tests.conformance.test_behaviour_plants import PLANTS as BEHAVIOURS
    from tests.conformance.test_feature_plants import PLANTS as FEATURES
    from tests.conformance.test_interaction_plants import FOUND_AT
    from tests.conformance.test_mutations import MUTANTS
    from tests.conformance.test_page_pool_plants import PLANTS as POOL
    from tests.support.sched_planted import DATA_RACES, RACES

    validate = _load(ROOT / "tests" / "unit" / "_plant_validate.py")
    source = (ROOT / "tests" / "model" / "test_mutations.py").read_text()
    model_mutants = {node.name for node in ast.parse(source).body
                     if isinstance(node, ast.ClassDef)}
    return {
        "tests/conformance/test_mutations.py": set(MUTANTS),
        "tests/support/sched_planted.py": {race.name for race in (*RACES, *DATA_RACES)},
        "tests/concurrency/test_publish_races.py": set(PLANTED),
        "tests/conformance/test_page_pool_plants.py": set(POOL),
        "tests/conformance/test_feature_plants.py": set(FEATURES),
        "tests/conformance/test_behaviour_plants.py": set(BEHAVIOURS),
        "tests/conformance/test_interaction_plants.py": {
            n.split("@")[0] for n in FOUND_AT},
        "tests/model/test_mutations.py": model_mutants,
        "tests/unit/_plant_validate.py": {plant[0] for plant in validate.PLANTS},
        "kvref/testing/vllm_plants.py": set(VLLM),
    }


@pytest.mark.parametrize("where", PLANT_REGISTRIES)
def test_the_planted_bug_catalogue_lists_every_plant(where: str) -> None:
    page = (DOCS / "verification" / "planted-bugs.md").read_text()
    missing = {name for name in _plants()[where] if f"`{name}`" not in page}
    assert not missing, f"{where} plants missing from docs/verification/planted-bugs.md: {missing}"


def test_benchmark_json_renders_back_to_the_benchmark_tables(tmp_path: Path) -> None:
    """What ``--json`` writes, `scripts/docs_figures.py` reads back into the
    benchmarks' own row types and renders with their own tables (tiny sizes)."""
    from benchmarks import attention, write_json
    from benchmarks import control_plane as cp
    from benchmarks import data_plane as dp
    from benchmarks.__main__ import control_tables, data_tables

    small = {"layers": 1, "kv_heads": 1, "head_dim": 8}
    decode = [cp.bench_decode(2, steps=3, warmup=1)]
    mixed = [cp.bench_mixed(2, steps=9, warmup=1)]
    prefill = cp.bench_prefill(requests=2, tokens=40, steps=2, warmup=1)
    profiled = {2: cp.profile_decode(2, steps=3, top=3)}
    control = {"decode": decode, "mixed": mixed, "prefill": prefill, "profiles": profiled}
    data = [dp.bench_copy_pages(4, 2, False, **small)]
    rows = [attention.bench(attention.Case("tiny", (20,), (1,)), rounds=1, warmup=0)]
    run = {"quick": True, "machine": "test", "cpus": 1, "load_start": 0.0, "load_end": 0.0,
           "seconds": 1.0}
    write_json(str(tmp_path / "benchmarks.json"),
               {"benchmark": "benchmarks", **run, "control": control, "data": data})
    write_json(str(tmp_path / "attention.json"),
               {"benchmark": "benchmarks.attention", **run, "rows": rows})
    figures = _load(ROOT / "scripts" / "docs_figures.py")
    page = figures.render(tmp_path)
    profiles = {b: [figures.short(e) for e in entries] for b, entries in profiled.items()}
    for table in (control_tables(decode, mixed, prefill, profiles),
                  data_tables(data), attention.tables(rows)):
        assert table in page
