"""vLLM's historic pool defects, re-introduced by text patches into a scratch copy
of vLLM's KV-manager files (never into the copy itself), for the lockstep of
kvref.testing.vllm_pool to find.

Each patch names its file, the exact text it replaces (which must occur once,
so a vLLM version that moved the code says so instead of planting nothing) and
the defect's text.  The defects are the pool-level ones issue 18 planted in
kvref; vLLM 42571 (a block twice in one free list) is not among them: vLLM's
BlockPool.free_blocks has no duplicate guard to take out, since its caller
keeps the tables (docs/verification/vllm-block-pool.md).
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
    file: str  # relative to the copy's root
    old: str
    new: str


@dataclass(frozen=True)
class Plant:
    anchor: str  # the vLLM report it re-introduces
    layer: str
    why: str
    patches: tuple[Patch, ...]
    # the same defect where a later vLLM moved the code: tried when `patches` is
    # not there, each as (the versions it is for, its patches)
    moved: tuple[tuple[str, tuple[Patch, ...]], ...] = ()


POOL = "vllm/v1/core/block_pool.py"
UTILS = "vllm/v1/core/kv_cache_utils.py"
MANAGER = "vllm/v1/core/kv_cache_manager.py"
REQUEST = "vllm/v1/request.py"

PLANTS: dict[str, Plant] = {
    "evicted_block_stays_in_map": Plant(
        "vLLM PR 4761", "BlockPool._maybe_evict_cached_block",
        "eviction resets the block's hash but leaves the hash map's entry, so the "
        "key still names the block after it is handed out again",
        (Patch(POOL,
               "        evicted_hashes = self._remove_cached_block_hashes(block)\n",
               "        evicted_hashes = [block.block_hash] if block.block_hash else []\n"
               "        block.reset_hash()\n"),)),
    "touch_leaves_block_queued": Plant(
        "vLLM 16825", "BlockPool.touch",
        "a hit on a free cached block takes a reference but leaves the block in the "
        "free queue: the eviction queue and the free table out of sync",
        (Patch(POOL,
               "            if block.ref_cnt == 0:\n"
               "                self.free_block_queue.remove(block)\n",
               "            if block.ref_cnt == 0:\n"
               "                pass\n"),)),
    "untagged_extra_keys": Plant(
        "vLLM 44701", "kv_cache_utils.generate_block_hash_extra_keys",
        "extra keys without their tags: a LoRA named x and a cache salt x give one "
        "key, so one tenant's blocks hit for another",
        (Patch(UTILS,
               '    return [("lora", lora_request.lora_name, lora_request.lora_path)]\n',
               "    return [lora_request.lora_name]\n"),
         Patch(UTILS,
               '        [("cache_salt", request.cache_salt)]\n',
               "        [request.cache_salt]\n"))),
    "fully_cached_prompt_not_capped": Plant(
        "vLLM PR 11186", "KVCacheManager.get_computed_blocks (the hit a Match takes)",
        "a fully cached prompt hits every block, leaving no token to compute "
        "(the cap is len(tokens) - 1)",
        (Patch(MANAGER,
               "        if max_cache_hit_length is None:\n"
               "            max_cache_hit_length = request.num_tokens - 1\n"
               "        computed_blocks, num_new_computed_tokens, num_uncached = (\n",
               "        if max_cache_hit_length is None:\n"
               "            max_cache_hit_length = request.num_tokens\n"
               "        computed_blocks, num_new_computed_tokens, num_uncached = (\n"),),
        moved=(("0.34: Request.get_max_cache_hit_length", (Patch(
            REQUEST,
            "        limits = (self.num_tokens - 1, self.prefix_cache_hit_limit, bound)\n",
            "        limits = (self.num_tokens, self.prefix_cache_hit_limit, bound)\n"),)),)),
}


class PatchMissing(Exception):
    """The text a patch replaces is not in the copy exactly once."""


def _missing(root: Path, patches: tuple[Patch, ...]) -> str | None:
    for p in patches:
        n = (root / p.file).read_text().count(p.old)
        if n != 1:
            return f"{p.file}: the text to replace occurs {n} times, not once"
    return None


def apply(root: Path, plant: Plant) -> str:
    """Plant it in the copy at `root`; which of its forms was planted."""
    forms = (("0.33.0's text", plant.patches), *plant.moved)
    why = []
    for label, patches in forms:
        missing = _missing(root, patches)
        if missing is None:
            for p in patches:
                path = root / p.file
                path.write_text(path.read_text().replace(p.old, p.new))
            return label
        why.append(f"{label}: {missing}")
    raise PatchMissing("; ".join(why))


@contextmanager
def planted_copy(root: str | Path, plant: Plant) -> Iterator[tuple[Path, str]]:
    """A scratch copy of `root` with `plant` applied, and the form planted;
    removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="kvref-vllm-plant-") as tmp:
        dest = Path(tmp) / "copy"
        shutil.copytree(Path(root) / "vllm", dest / "vllm",
                        ignore=shutil.ignore_patterns("__pycache__"))
        form = apply(dest, plant)
        yield dest, form


# ------------------------------------------------------------------ hybrid

COORDINATOR = "vllm/v1/core/kv_cache_coordinator.py"
SINGLE = "vllm/v1/core/single_type_kv_cache_manager.py"

# vLLM's historic hybrid-coordinator defects, for kvref.testing.vllm_hybrid's
# lockstep (issue 40, item 4). Each is planted where 0.33's code still has the
# place; vllm-ascend PR 13330 (a compressed group's hit under-counted) is not
# among them: 0.33 has no compressed group.
HYBRID_PLANTS: dict[str, Plant] = {
    "hit_length_one_scalar": Plant(
        "vllm-ascend PR 12394", "HybridKVCacheCoordinator.find_longest_cache_hit",
        "the groups' hit lengths come back as one scalar, the longest group's: the "
        "full group's hit is returned while the window group's blocks are shorter, so "
        "the request attaches more tokens than every group serves",
        (Patch(COORDINATOR,
               "        return cache_hit_blocks, hit_length, num_uncached_common_prefix_tokens\n",
               "        return cache_hit_blocks, longest_hit_length, 0\n"),)),
    "window_hit_stops_at_first_miss": Plant(
        "vLLM 57610", "SlidingWindowManager.find_longest_cache_hit",
        "the right-to-left scan gives up at the first block that is not cached, so "
        "ids that go past a cached prompt's last block (diverge there) miss the "
        "window hit the blocks before them serve",
        (Patch(SINGLE,
               "                    match_found = True\n"
               "                    break\n"
               "            else:\n"
               "                num_contiguous_blocks = 0\n",
               "                    match_found = True\n"
               "                    break\n"
               "            else:\n"
               "                num_contiguous_blocks = 0\n"
               "                break\n"),)),
    "full_hit_not_reconciled": Plant(
        "vLLM PR 50457", "HybridKVCacheCoordinator.find_longest_cache_hit",
        "the full-attention group's blocks are not cut back to the hit every group "
        "serves: it attaches its own longer hit beside the reconciled length",
        (Patch(COORDINATOR,
               "                    del blks[num_blocks:]\n"
               "                    hit_length_by_group[group_id] = hit_length\n",
               "                    hit_length_by_group[group_id] = hit_length\n"),)),
    "allocation_evicts_own_hit": Plant(
        "vLLM 42948", "KVCacheManager.allocate_slots",
        "the hit's blocks are taken (touched) only after the new blocks are "
        "allocated, so the allocation may evict the free cached blocks its own "
        "lookup is about to attach",
        (Patch(SINGLE,
               "        # Touch the computed blocks to make sure they won't be evicted.\n"
               "        if self.enable_caching:\n"
               "            self.block_pool.touch(new_computed_blocks)\n",
               "        if self.enable_caching:\n"
               "            pass\n"),
         Patch(MANAGER,
               "            num_encoder_tokens,\n"
               "        )\n"
               "\n"
               "        # P/D: delay caching blocks",
               "            num_encoder_tokens,\n"
               "        )\n"
               "        for hit_blocks in new_computed_block_list:\n"
               "            self.block_pool.touch([b for b in hit_blocks if not b.is_null])\n"
               "\n"
               "        # P/D: delay caching blocks"))),
}
