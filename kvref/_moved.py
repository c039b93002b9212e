"""Import paths from before kvref/ moved into packages (0.1.0, commit d5ade8e),
kept for one release with a `DeprecationWarning` naming the new path.

Engine code imported names such as ``kvref.attention.PagedAttention`` and
``kvref.distributed.CommGroup``; the move broke them. Each old module maps
to the module its code moved to, whole: a public name the new module has is
found through the old path. The old module files are not kept: a finder on
``sys.meta_path`` makes each old name a module whose ``__getattr__`` warns,
so the record of what moved is this one table, deleted in `REMOVED_IN`.
The four old modules that are packages now (``kvref.attention``, ``offload``,
``stepping``, ``transfer``) call `moved_attr` from their ``__getattr__``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Sequence

REMOVED_IN = "0.3.0"

# old module -> the module its code is in now (docs/api/deprecations.md)
MOVED: dict[str, str] = {
    "kvref.admission": "kvref.stepping.admission",
    "kvref.allocator": "kvref.core.allocator",
    "kvref.attention": "kvref.attention.paged",
    "kvref.attention_flashinfer": "kvref.attention.flashinfer",
    "kvref.attention_sdpa": "kvref.attention.sdpa",
    "kvref.base": "kvref.core.resource",
    "kvref.cache": "kvref.core.cache",
    "kvref.config": "kvref.core.config",
    "kvref.distributed": "kvref.parallel.groups",
    "kvref.errors": "kvref.core.errors",
    "kvref.eviction_calls": "kvref.offload.calls",
    "kvref.forks": "kvref.stepping.forks",
    "kvref.graph_staging": "kvref.stepping.graph_staging",
    "kvref.host_pool": "kvref.offload.host_pool",
    "kvref.layer_io": "kvref.stepping.layer_io",
    "kvref.lease": "kvref.transfer.lease",
    "kvref.offload": "kvref.offload.handle",
    "kvref.offload_phases": "kvref.offload.phases",
    "kvref.outcomes": "kvref.offload.outcomes",
    "kvref.page_needs": "kvref.stepping.page_needs",
    "kvref.page_pool": "kvref.core.page_pool",
    "kvref.plan": "kvref.stepping.plan",
    "kvref.prefix_cache": "kvref.prefix.cache",
    "kvref.prefix_hash": "kvref.prefix.keys",
    "kvref.published": "kvref.transfer.published",
    "kvref.rank_check": "kvref.parallel.rank_check",
    "kvref.retrieval": "kvref.transfer.retrieval",
    "kvref.running_step": "kvref.stepping.running_step",
    "kvref.runtime": "kvref.core.runtime",
    "kvref.step": "kvref.stepping.step",
    "kvref.stepping": "kvref.stepping.admit_plan_commit",
    "kvref.stream_table": "kvref.core.stream_table",
    "kvref.streams": "kvref.core.streams",
    "kvref.transfer": "kvref.transfer.engine",
    "kvref.transfer_calls": "kvref.transfer.calls",
    "kvref.transfer_memory": "kvref.transfer.memory",
    "kvref.transfer_types": "kvref.transfer.engine_types",
    "kvref.truncation": "kvref.stepping.truncation",
}

# old modules that are packages now: their own __init__ forwards
PACKAGES = frozenset({"kvref.attention", "kvref.offload", "kvref.stepping", "kvref.transfer"})


def new_path(old: str, name: str) -> str:
    """The one documented import path of ``name``: ``kvref`` where the
    package exports it, else the module it moved to."""
    top = sys.modules.get("kvref")
    if name in getattr(top, "__all__", ()):
        return f"from kvref import {name}"
    return f"from {MOVED[old]} import {name}"


_NONE = object()


def moved_attr(old: str, name: str) -> object:
    """``name`` looked up through the old module ``old``, with a warning.

    AttributeError for a private name, a name the new module lacks, and a
    module (an import of the new module's, or a package's own submodule,
    which the import system must then load itself)."""
    missing = AttributeError(f"module {old!r} has no attribute {name!r}")
    if name.startswith("_"):
        raise missing
    if old in PACKAGES and importlib.util.find_spec(f"{old}.{name}") is not None:
        # the package's own submodule, not loaded yet: the import system
        # loads it once this says "no such attribute"
        raise missing
    value = getattr(importlib.import_module(MOVED[old]), name, _NONE)
    if value is _NONE or isinstance(value, types.ModuleType):
        raise missing
    warnings.warn(
        f"{old}.{name} moved: use `{new_path(old, name)}`; "
        f"the old path is removed in kvref {REMOVED_IN}",
        DeprecationWarning, stacklevel=3)
    return value


class _Loader(importlib.abc.Loader):
    def exec_module(self, module: types.ModuleType) -> None:
        old = module.__name__

        def __getattr__(name: str) -> object:
            return moved_attr(old, name)

        module.__getattr__ = __getattr__  # type: ignore[method-assign]
        module.__doc__ = f"Deprecated: moved to {MOVED[old]} (removed in kvref {REMOVED_IN})."


class _Finder(importlib.abc.MetaPathFinder):
    """Finds only the old module names that no longer exist as files."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname in MOVED and fullname not in PACKAGES:
            return importlib.machinery.ModuleSpec(fullname, _LOADER)
        return None


_LOADER = _Loader()


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (kvref's import runs this)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
