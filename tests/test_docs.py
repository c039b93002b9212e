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
import kvref._moved
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


def _call_table() -> dict[str, str]:
    """docs/api/index.md's "What each call answers": each call its first
    column names (``KVManager.build`` as ``build``), to its row."""
    text = (DOCS / "api" / "index.md").read_text()
    section = text.split("## What each call answers", 1)[1]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first = line[2:].split(" | ", 1)[0]
        for name in re.findall(r"`([A-Za-z_.]+)[(`]", first):
            rows[name.removeprefix("KVManager.")] = rows.get(name, "") + line
    return rows


def _manager_calls() -> list[str]:
    return [name for name in dir(KVManager) if not name.startswith("_")]


def test_every_public_manager_call_has_a_row_in_the_call_table() -> None:
    """Issue 29: the table had no row for match_prefix, cache_prefix or
    reset_prefix_cache; a call added without one fails here."""
    rows = _call_table()
    missing = [name for name in _manager_calls() if name not in rows]
    assert not missing, f"KVManager calls with no row in docs/api/index.md's call table: {missing}"


# an error a docstring names that the call itself does not raise
NAMED_NOT_RAISED = {
    "publish": {"PublishLeasedError"},  # what reset and remove raise while it leases
}


def test_a_call_row_names_every_error_the_call_documents() -> None:
    """The call table and the docstrings agree on what each call raises, at
    least where the docstring is specific (truncate's `ReleasedPrefixError`
    was missing from its row)."""
    rows = _call_table()
    gaps = {}
    for name in _manager_calls():
        doc = inspect.getdoc(getattr(KVManager, name)) or ""
        named = set(re.findall(r"\b([A-Z]\w+Error)\b", doc)) - NAMED_NOT_RAISED.get(name, set())
        lacking = sorted(e for e in named if e not in rows.get(name, ""))
        if lacking:
            gaps[name] = lacking
    assert not gaps, f"errors a call's docstring names that its table row does not: {gaps}"


def test_every_error_the_spec_and_docs_name_exists() -> None:
    """S23 and S28 once named `TokenMismatchError`, which kvref never
    defined (it raises `InvalidArgumentError`, R56): an error class the spec
    or the docs name is one kvref defines, or Python's own."""
    import builtins

    from kvref.core.errors import KVRefError
    from kvref.core.refusals import AdmitFailedReason

    def subclasses(cls: type) -> set[str]:
        return {cls.__name__}.union(*(subclasses(sub) for sub in cls.__subclasses__()))

    # raised (KVRefError's) or answered (a refusal reason such as AdmitRuntimeError)
    defined = (subclasses(KVRefError) | subclasses(AdmitFailedReason)
               | {n for n in dir(builtins) if n.endswith("Error")})
    pages = [*sorted((ROOT / "specs").glob("*.md")), *sorted(DOCS.rglob("*.md")), README]
    unknown = {f"{page.relative_to(ROOT)}: {name}" for page in pages
               for name in re.findall(r"\b([A-Z]\w*Error)\b", page.read_text())
               if name not in defined}
    assert not unknown, f"error names that kvref does not define: {sorted(unknown)}"


def _resolve(path: str) -> tuple[object, list[str]]:
    """The object a dotted path names (its longest importable module, then
    attributes), and the DeprecationWarnings the lookup gave; AttributeError
    or ModuleNotFoundError as raised."""
    import importlib
    import warnings

    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                obj: object = importlib.import_module(".".join(parts[:i]))
                for attr in parts[i:]:
                    obj = getattr(obj, attr)
        except ModuleNotFoundError:
            if i == 1:
                raise
            continue
        return obj, [str(w.message) for w in seen if w.category is DeprecationWarning]
    raise AssertionError(path)  # unreachable: i == 1 returns or raises


# paths the deprecations page names as not carried over the package move
NOT_CARRIED = ("kvref.admission.validate_step", "kvref.running_step.released_after")


def test_every_kvref_path_the_docs_name_imports() -> None:
    """Every ``kvref.*`` path the docs and the README name (``::: kvref.X``
    reference targets, module and attribute paths in the text) imports, and
    without a DeprecationWarning outside the deprecations page, whose
    not-carried paths must not resolve (issue 29:
    one documented import path per name, tested; each old path's warning is
    tests/unit/test_deprecated_paths.py's)."""
    deprecations = DOCS / "api" / "deprecations.md"
    pages = [*sorted(DOCS.rglob("*.md")), README]
    broken, deprecated = set(), set()
    for page in pages:
        for path in set(re.findall(r"(?<![\w.])(kvref(?:_model)?(?:\.\w+)+)", page.read_text())):
            where = f"{page.relative_to(ROOT)}: {path}"
            if path in NOT_CARRIED:
                with pytest.raises(AttributeError):
                    _resolve(path)
                continue
            try:
                _, warned = _resolve(path)
            except (AttributeError, ModuleNotFoundError) as err:
                broken.add(f"{where} ({err})")
                continue
            if warned and page != deprecations:
                deprecated.add(where)
    assert not broken, f"paths the docs name that do not import: {sorted(broken)}"
    assert not deprecated, f"docs naming a deprecated path: {sorted(deprecated)}"


def test_the_changelog_has_this_release_and_the_deprecations_it_promises() -> None:
    """CHANGELOG.md exists from 0.2.0 on (issue 29): its newest section is the
    release after the packaged version, each kind of entry once in it, and
    its Deprecated entries name the release `kvref._moved` removes the old
    import paths in and the page that lists them."""
    import tomllib

    text = (ROOT / "CHANGELOG.md").read_text()
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    releases = re.findall(r"^## (.+)$", text, re.M)
    assert releases, "CHANGELOG.md has no release section"
    newest = re.split(r"^## .+$", text, flags=re.M)[1]
    shipping = re.fullmatch(r"(?:Unreleased \()?(\d+\.\d+\.\d+)\)?", releases[0])
    assert shipping, f"newest section {releases[0]!r} names no version"
    as_tuple = [tuple(map(int, v.split("."))) for v in (shipping[1], version)]
    assert as_tuple[0] >= as_tuple[1], (
        f"the changelog's newest release {shipping[1]} is older than pyproject's {version}")
    kinds = re.findall(r"^### (.+)$", newest, re.M)
    assert len(kinds) == len(set(kinds)), f"a heading twice in {releases[0]}: {kinds}"
    deprecated = newest.split("### Deprecated", 1)[1].split("\n### ", 1)[0]
    assert f"until {kvref._moved.REMOVED_IN}" in deprecated
    assert "docs/api/deprecations.md" in deprecated


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
    "tests/support/hybrid_plants.py",
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
    from tests.support.hybrid_plants import PLANTS as HYBRID
    from tests.support.sched_planted import DATA_RACES, LOCK_RACES, RACES

    validate = _load(ROOT / "tests" / "unit" / "_plant_validate.py")
    source = (ROOT / "tests" / "model" / "test_mutations.py").read_text()
    model_mutants = {node.name for node in ast.parse(source).body
                     if isinstance(node, ast.ClassDef)}
    return {
        "tests/conformance/test_mutations.py": set(MUTANTS),
        "tests/support/sched_planted.py": {
            race.name for race in (*RACES, *DATA_RACES, *LOCK_RACES)},
        "tests/concurrency/test_publish_races.py": set(PLANTED),
        "tests/conformance/test_page_pool_plants.py": set(POOL),
        "tests/conformance/test_feature_plants.py": set(FEATURES),
        "tests/conformance/test_behaviour_plants.py": set(BEHAVIOURS),
        "tests/conformance/test_interaction_plants.py": {
            n.split("@")[0] for n in FOUND_AT},
        "tests/model/test_mutations.py": model_mutants,
        "tests/unit/_plant_validate.py": {plant[0] for plant in validate.PLANTS},
        "kvref/testing/vllm_plants.py": set(VLLM),
        "tests/support/hybrid_plants.py": set(HYBRID),
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
