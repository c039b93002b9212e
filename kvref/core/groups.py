"""Attention groups: a hybrid model's layers, one group per attention type (issue 40).

Gemma 3, gpt-oss, Cohere2 and Llama 4 mix full-attention layers with
sliding-window ones. A group is a set of layers of one type; a group's pages
hold only its layers, and every group takes pages from the one pool, so the
split between them follows the workload. Inside the manager, group ``g`` of
label ``L`` is the stream of the *group label* ``L@name`` (the first group's
is ``L`` itself), under its group's window: admission, plan, commit, forks,
offload and retrieve already act per stream, and a page key already names
the label whose KV it holds, so a hit never crosses groups. H1-H5 of
specs/retention.md state the rules; `kvref.hybrid` applies them at the API.

Every page has the same bytes: a page holds ``layers_per_page`` layers, so
every group has that many layers. Types whose layer counts differ split
into several groups of one type (`groups_for`), as vLLM does: Gemma 3's
5:1 becomes five window groups and one full group of equal size.

Core: imports nothing above `kvref.core`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvref.core.config import RetentionPolicy
from kvref.core.errors import InvalidConfigError

# between a label and its group's name in a group label; a hybrid config's
# labels and group names never hold it
GROUP_SEP = "@"


@dataclass(frozen=True)
class ChunkedAttention:
    """Chunked local attention (Llama 4's ``attention_chunk_size``): the
    tokens fall into chunks of ``size``, and a token reads only the tokens
    of its own chunk, from ``n // size * size`` (H7 of specs/retention.md).
    ``size`` is a multiple of the page size, so a chunk starts on a page and
    a decode step's table is exactly its chunk."""

    size: int

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise InvalidConfigError(f"ChunkedAttention.size must be an int >= 1, "
                                     f"got {self.size!r}")


@dataclass(frozen=True)
class AttentionGroup:
    """Layers of one attention type whose pages the pool hands out together.

    ``retention`` is what the group's layers read: None, full attention; a
    `RetentionPolicy`, a sliding window W with its rollback margin (W1-W16
    of specs/retention.md); a `ChunkedAttention`, its chunk (H7)."""

    name: str
    layers: tuple[int, ...]
    retention: RetentionPolicy | ChunkedAttention | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or GROUP_SEP in self.name:
            raise InvalidConfigError(
                f"AttentionGroup.name must be a non-empty str without {GROUP_SEP!r}, "
                f"got {self.name!r}")
        layers = self.layers
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers \
                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                           for i in layers):
            raise InvalidConfigError(
                f"AttentionGroup {self.name!r}: layers must be a non-empty sequence of "
                f"layer indices >= 0, got {layers!r}")
        object.__setattr__(self, "layers", tuple(layers))
        if self.retention is not None and not isinstance(self.retention,
                                                          (RetentionPolicy, ChunkedAttention)):
            raise InvalidConfigError(
                f"AttentionGroup {self.name!r}: retention must be a RetentionPolicy, a "
                f"ChunkedAttention or None, got {self.retention!r}")


def check_groups(groups: Sequence[AttentionGroup], num_layers: int, page_size: int) -> None:
    """Raise `InvalidConfigError` unless ``groups`` cover each of the
    ``num_layers`` layers once, with one layer count (one page size in bytes)
    and distinct names, and each chunk is whole pages."""
    if not groups:
        return
    if not all(isinstance(g, AttentionGroup) for g in groups):
        raise InvalidConfigError(f"KVConfig.groups must hold AttentionGroup, got {groups!r}")
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise InvalidConfigError(f"KVConfig.groups: names repeat: {names}")
    sizes = {len(g.layers) for g in groups}
    if len(sizes) != 1:
        raise InvalidConfigError(
            "KVConfig.groups: every group holds the same number of layers, so every page "
            f"has the same bytes; got {[(g.name, len(g.layers)) for g in groups]} "
            "(split a type into several groups: kvref.core.groups.groups_for)")
    for g in groups:
        if isinstance(g.retention, ChunkedAttention) and g.retention.size % page_size:
            # a chunk starting inside a page: its decode table would name the
            # tokens before it, which only a mask could hide
            raise InvalidConfigError(
                f"AttentionGroup {g.name!r}: its chunk of {g.retention.size} tokens must be "
                f"a multiple of page_size {page_size}")
    seen = sorted(i for g in groups for i in g.layers)
    if seen != list(range(num_layers)):
        raise InvalidConfigError(
            f"KVConfig.groups must name each layer 0..{num_layers - 1} once, got {seen}")


Reads = RetentionPolicy | ChunkedAttention | None  # what a layer reads: `AttentionGroup.retention`


def groups_for(layer_retention: Sequence[Reads]) -> tuple[AttentionGroup, ...]:
    """Equal-size groups for a model whose layer ``i`` has attention type
    ``layer_retention[i]`` (None: full attention), as a hybrid model's
    ``layer_types`` says: each type's layers, in order, cut into groups of
    the greatest size that divides every type's count. Full attention's
    groups come first, then windows, then chunks, so a label's bare name is
    a full-attention stream where there is one."""
    by_type: dict[Reads, list[int]] = {}
    for i, r in enumerate(layer_retention):
        by_type.setdefault(r, []).append(i)
    if not by_type:
        raise InvalidConfigError("groups_for: no layers")
    size = math.gcd(*(len(v) for v in by_type.values()))
    out: list[AttentionGroup] = []
    order = sorted(by_type, key=_type_order)
    for r in order:
        layers = by_type[r]
        kind = "full" if r is None else f"c{r.size}" if isinstance(r, ChunkedAttention) \
            else f"w{r.context_budget}"
        for j in range(0, len(layers), size):
            name = kind if len(layers) == size else f"{kind}.{j // size}"
            out.append(AttentionGroup(name, tuple(layers[j:j + size]), r))
    return tuple(out)


def _type_order(r: Reads) -> tuple[int, int]:
    if r is None:
        return (0, 0)
    if isinstance(r, ChunkedAttention):
        return (2, r.size)
    return (1, r.context_budget)
