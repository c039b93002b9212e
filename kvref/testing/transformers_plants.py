"""Defect classes transformers' paged cache is exposed to, planted by text
patches into a scratch copy of its continuous_batching folder (never into the
installed package), for kvref.testing.transformers_pool to find (issue 43).

Each patch names its file, the exact text it replaces (which must occur once,
so a transformers version that moved the code says so instead of planting
nothing) and the defect's text.  The copy is imported as a sibling package of
the installed one (`transformers_pool.load_copy`), so the rest of
transformers is the installed code.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Patch:
    file: str  # relative to the continuous_batching folder
    old: str
    new: str


@dataclass(frozen=True)
class Plant:
    anchor: str  # where the class is known from
    where: str
    why: str
    patches: tuple[Patch, ...]


LEDGER = "cache_allocators/cache_allocator.py"

PLANTS: dict[str, Plant] = {
    "dedup_frees_a_held_duplicate": Plant(
        "mini-sglang PR 142 (kvref's DEDUP_KEEPS_PAGE)", "CacheAllocator.mark_complete_blocks",
        "the duplicate a registration replaces goes back to the pool as if the request "
        "held it alone, while a fork of the request still reads it",
        (Patch(LEDGER,
               "                    if self.ledger.release(block_id):\n"
               "                        self.pool.free_blocks(self.index, [block_id])\n",
               "                    self.ledger.release(block_id)\n"
               "                    self.pool.free_blocks(self.index, [block_id])\n"),)),
    "hash_left_on_a_freed_block": Plant(
        "vLLM PR 4761 (kvref's EVICT_DROPS_KEY)", "BlockLedger.release(no_cache=True)",
        "a complete block released with no_cache goes back to the pool keeping its "
        "hash, so a later match aliases a block that is free or someone else's",
        (Patch(LEDGER,
               "            if no_cache:\n"
               "                block_hash = self.block_to_hash.pop(block_id)\n"
               "                self.hash_to_block.pop(block_hash)\n",
               "            if no_cache:\n"
               "                pass\n"),)),
    "explicit_count_of_one": Plant(
        "issue 43: implicit reference counts", "BlockLedger.acquire",
        "the first share stores the count as 1, forgetting the implicit reference, "
        "so the two holders' releases decrement it twice to zero: the first frees the "
        "block while the other holder reads it, the second frees it again",
        (Patch(LEDGER,
               "self.shared_ref_counts.get(block_id, 1) + 1\n",
               "self.shared_ref_counts.get(block_id, 0) + 1\n"),)),
}


class PatchMissing(Exception):
    """The text a patch replaces is not in the copy exactly once."""


def apply(root: Path, plant: Plant) -> None:
    for p in plant.patches:
        n = (root / p.file).read_text().count(p.old)
        if n != 1:
            raise PatchMissing(f"{p.file}: the text to replace occurs {n} times, not once")
    for p in plant.patches:
        path = root / p.file
        path.write_text(path.read_text().replace(p.old, p.new))


@contextmanager
def planted_copy(folder: Path, plant: Plant | None) -> Iterator[Path]:
    """A scratch copy of the continuous_batching `folder` with `plant` applied
    (None: unmodified), removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="kvref-tf-plant-") as tmp:
        dest = Path(tmp) / "continuous_batching"
        shutil.copytree(folder, dest, ignore=shutil.ignore_patterns("__pycache__"))
        if plant is not None:
            apply(dest, plant)
        yield dest
