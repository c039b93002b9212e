"""The page-pool model (kvref_model.pages) in lockstep with vLLM's own BlockPool.

    python -m kvref.testing.vllm_pool --vllm PATH [--examples 200] [--depth 6]
        [--plants]

PATH is a copy of vLLM's KV-manager files that imports on CPU: a folder holding
``vllm/v1/core/block_pool.py`` and what it needs (``../shared/anchors/vllm_kv``,
or one built by ``scripts/vllm_copy.py``).  Each copy is imported afresh: the
``vllm`` modules already loaded are dropped and PATH goes first on sys.path.

The adapter (`VllmPool`) plays vLLM's caller.  Each model action is one call:

- Allocate      -> BlockPool.get_new_blocks (its ValueError: AllocationFailed)
- Match, Lookup -> KVCacheManager.get_computed_blocks (the hit, capped at
                   len(tokens) - 1 there), then BlockPool.touch for a Match
- Write         -> BlockPool.is_block_writable (the write check; vLLM holds no KV)
- Register      -> BlockPool.cache_full_blocks, one block, hashes from the
                   Request's own block hasher (LoRA and cache salt as extra keys)
- Share         -> BlockPool.touch
- Release       -> BlockPool.free_blocks, in the order given
- Reclaimable   -> no vLLM call: answered from vLLM's ref counts
- NumFree       -> BlockPool.get_num_free_blocks
- ResetPrefixCache -> BlockPool.reset_prefix_cache

`observe` reads vLLM's state as the model's: each block's ref count and hash,
the free queue's order, the hash map's blocks per key.  vLLM's documented
behaviour differs from kvref's rules in ways stated as scope settings of the
model (`VLLM_SCOPE`, `DIFFERENCES`), never as special cases of the comparison.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, ClassVar

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from kvref.testing.engine_search import LockstepReport, Unexpressible, budget
from kvref.testing.engine_search import run_lockstep as run_machine
from kvref.testing.pages_replay import (
    Disagreement,
    ReplayReport,
    Trace,
    print_clean_run,
    print_plant,
    replay_pages,
)
from kvref_model import pages as M
from kvref_model.pages_check import show
from kvref_model.pages_invariants import (
    INTERESTING,
    state_violations,
    transition_violations,
)

# the model's scope settings that state vLLM's pool (see DIFFERENCES)
VLLM_FLAGS: dict[str, bool] = {"duplicates": True, "blank_to_front": True,
                               "trusts_caller": True, "blank_release": False}
# the extra keys the checks use: a LoRA named "a" and a cache salt "a" differ only
# by their tags (vLLM 44701), and no extra key at all
EXTRAS: tuple[M.Extras, ...] = ((), (("lora", "a"),), (("salt", "a"),))
# the exhaustive replay's scope: two pages, so that an eviction is 6 calls deep
REPLAY_SCOPE = M.Scope(pages=2, holders=2, page_size=1, alphabet=2, extras=EXTRAS,
                       depth=7, **VLLM_FLAGS)

DIFFERENCES: tuple[tuple[str, str], ...] = (
    ("duplicates", "vLLM keeps every block registered under one hash (no dedup: a "
     "block table stays append-only); a hit takes the oldest registered of them, "
     "and each is dropped from the map on its own eviction"),
    ("blank_to_front", "a release puts freed blocks that have no hash at the front "
     "of the free queue, in the order given (LIFO reuse); kvref queues them last"),
    ("trusts_caller", "BlockPool keeps ref counts, not holders, and checks nothing of "
     "its caller: a double release, a release of a block not held, a touch of a "
     "free block as a share, a repeated register are its manager's to prevent; "
     "the protocol leaves them out (the careless replay shows what vLLM does)"),
    ("blank_release", "free_blocks keeps a freed block's hash until it is evicted: "
     "there is no release that sends a block back blank (kvref's window passing "
     "pages, H3); the protocol leaves it out"),
)
# correspondences that need no setting (stated in docs/verification/vllm-block-pool.md)
SAME_UNDER_NAMES: tuple[tuple[str, str], ...] = (
    ("null block", "vLLM's block 0 is its null block, never freed or cached: the "
     "model's sink, page 0, which is outside the pool too; block p is page p"),
    ("one free queue", "vLLM keeps free blocks in one queue, blank ones before cached "
     "ones (blank ones only ever join at the front, cached ones at the back, and a "
     "reset un-hashes in place): the model's free-blank queue, then its LRU"),
    ("salt on the first block", "vLLM puts the cache salt in the first block's "
     "extra keys only and the LoRA in every block's; under a chained hash that "
     "names the same chains as the model's key, which carries the extras per page"),
    ("reset's answer", "reset_prefix_cache answers True or False; the adapter "
     "reads the count of cached free blocks (and of held ones) before the call"),
)

HASH_GROUP = 0  # one KV-cache group: full attention


def vllm_scope(**kw: Any) -> M.Scope:
    return M.Scope(**{**VLLM_FLAGS, "extras": EXTRAS, **kw})


# ------------------------------------------------------------------ loading


@dataclass(frozen=True)
class Vllm:
    """The modules of one imported copy of vLLM's KV-manager files."""

    root: Path
    pool: ModuleType  # vllm.v1.core.block_pool
    utils: ModuleType  # vllm.v1.core.kv_cache_utils
    manager: ModuleType  # vllm.v1.core.kv_cache_manager
    interface: ModuleType  # vllm.v1.kv_cache_interface
    request: ModuleType  # vllm.v1.request
    sampling: ModuleType  # vllm.sampling_params
    hash_fn: Callable[[Any], bytes]


_loaded: list[str] = []  # the sys.path entry of the copy imported last


def is_copy(path: str | Path) -> bool:
    return (Path(path) / "vllm" / "v1" / "core" / "block_pool.py").is_file()


ENV = "KVREF_VLLM_COPY"
HOW_TO_GET_ONE = (
    f"no copy of vLLM's KV-manager files: set {ENV}=PATH, put one at "
    "../shared/anchors/vllm_kv beside the checkout, or build one with "
    "`python scripts/vllm_copy.py --version 0.33.0 --dest PATH` "
    "(pip download vllm --no-deps, files checked against the wheel's RECORD)")


def find_copy(repo: str | Path) -> Path | None:
    """$KVREF_VLLM_COPY, else ../shared/anchors/vllm_kv beside the checkout (for a
    git worktree, beside its main checkout too); None when there is none."""
    env = os.environ.get(ENV)
    if env:
        return Path(env) if is_copy(env) else None
    roots = [Path(repo).resolve()]
    dot_git = roots[0] / ".git"
    if dot_git.is_file():  # a worktree: .git names its git dir, under the main one
        gitdir = Path(dot_git.read_text().split(":", 1)[1].strip())
        common = gitdir / "commondir"
        if common.is_file():
            roots.append((gitdir / common.read_text().strip()).resolve().parent)
    for root in roots:
        cand = root.parent / "shared" / "anchors" / "vllm_kv"
        if is_copy(cand):
            return cand
    return None


def load(path: str | Path) -> Vllm:
    """Import the copy at `path` afresh (the previous copy's modules dropped)."""
    root = Path(path).resolve()
    if not is_copy(root):
        raise FileNotFoundError(f"{root}: no vllm/v1/core/block_pool.py there")
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]
    while _loaded:  # the copy's folder stays on sys.path while it is in use:
        sys.path.remove(_loaded.pop())  # vLLM imports some modules lazily
    sys.path.insert(0, str(root))
    _loaded.append(str(root))
    importlib.invalidate_caches()

    def mod(name: str) -> ModuleType:
        m = importlib.import_module(name)
        where = Path(m.__file__ or "").resolve()
        if root not in where.parents:  # an installed vllm shadowing the copy
            raise ImportError(f"{name} came from {where}, not from {root}")
        return m

    hashing = mod("vllm.utils.hashing")
    v = Vllm(root, mod("vllm.v1.core.block_pool"), mod("vllm.v1.core.kv_cache_utils"),
             mod("vllm.v1.core.kv_cache_manager"), mod("vllm.v1.kv_cache_interface"),
             mod("vllm.v1.request"), mod("vllm.sampling_params"),
             hashing.get_hash_fn_by_name("sha256"))  # vLLM's default algorithm
    v.utils.init_none_hash(v.hash_fn)
    # a refused reset is a warning there, an expected answer here
    logging.getLogger("vllm").setLevel(logging.ERROR)
    return v


# ------------------------------------------------------------------ adapter


def tokens_of(key: M.Key | None) -> M.Tokens:
    return () if key is None else tokens_of(key.parent) + key.tokens


@dataclass(frozen=True)
class Observed:
    """vLLM's pool as the model's state, or the model's as vLLM would show it."""

    refs: tuple[int, ...]  # pages 1..n
    keys: tuple[bytes | None, ...]  # each page's hash (with its group id)
    queue: tuple[int, ...]  # the free queue, front first
    num_free: int
    index: tuple[tuple[bytes, tuple[int, ...]], ...]  # hash -> its blocks, in map order

    def diff(self, other: Observed) -> str:
        out = []
        for name in ("refs", "queue", "num_free"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                out.append(f"{name}: vLLM {a}, model {b}")
        for p, (a, b) in enumerate(zip(self.keys, other.keys, strict=True), 1):
            if a != b:
                out.append(f"page {p} hash: vLLM {_short(a)}, model {_short(b)}")
        if self.index != other.index:
            out.append(f"hash map: vLLM {_index(self.index)}, model {_index(other.index)}")
        return "; ".join(out)


def _map_entries(vllm_map: Any) -> Iterator[tuple[bytes, tuple[int, ...]]]:
    """BlockHashToBlockMap's keys and their block ids, oldest first.  0.33 maps
    a key to a block or to a dict of them; 0.34 to one block id, the ids of a
    key with several blocks kept apart in `_dup_ids` (so the GC skips the map)."""
    # vLLM's map, not kvref's manager: it offers no public walk of its entries
    dups = getattr(vllm_map, "_dup_ids", None)
    for h, v in vllm_map._cache.items():
        if dups is not None:
            yield h, tuple(dups[h]) if h in dups else (v,)
        elif isinstance(v, dict):
            yield h, tuple(v)
        else:
            yield h, (v.block_id,)


def _short(h: bytes | None) -> str:
    return "none" if h is None else h[:3].hex()


def _index(ix: tuple[tuple[bytes, tuple[int, ...]], ...]) -> str:
    return "{" + ", ".join(f"{_short(h)}: {list(ps)}" for h, ps in ix) + "}"


class VllmPool:
    """One vLLM BlockPool (in a KVCacheManager, whose hit path a Match takes),
    driven by the model's actions."""

    def __init__(self, v: Vllm, scope: M.Scope) -> None:
        import torch  # vLLM's spec needs a dtype; nothing is allocated

        self.v, self.scope, ps = v, scope, scope.page_size
        spec = v.interface.FullAttentionSpec(block_size=ps, num_kv_heads=1, head_size=8,
                                             dtype=torch.float32)
        cfg = v.interface.KVCacheConfig(
            num_blocks=scope.pages + 1, kv_cache_tensors=[],  # + the null block
            kv_cache_groups=[v.interface.KVCacheGroupSpec(["layers.0.attn"], spec)])
        self.manager = v.manager.KVCacheManager(
            kv_cache_config=cfg, max_model_len=1 << 12, scheduler_block_size=ps,
            hash_block_size=ps, enable_caching=True)
        self.pool = self.manager.block_pool
        self._hasher = v.utils.get_request_block_hasher(ps, v.hash_fn)
        self._requests: dict[tuple[M.Tokens, M.Extras], Any] = {}

    # ------------------------------------------------------------ requests

    def request(self, tokens: M.Tokens, extras: M.Extras) -> Any:
        """A vLLM Request for `tokens` whose extra keys come from `extras`."""
        got = self._requests.get((tokens, extras))
        if got is None:
            tags = dict(extras)
            if set(tags) - {"lora", "salt"} or len(tags) != len(extras):
                raise Unexpressible(f"extras {extras}: vLLM has a LoRA and a salt")
            lora = None if "lora" not in tags else SimpleNamespace(
                lora_name=tags["lora"], lora_path=f"/adapters/{tags['lora']}",
                adapter_id=1, name=tags["lora"], lora_int_id=1)
            got = self.v.request.Request(
                request_id=f"r{len(self._requests)}", prompt_token_ids=list(tokens),
                sampling_params=self.v.sampling.SamplingParams(max_tokens=1),
                pooling_params=None, lora_request=lora, cache_salt=tags.get("salt"),
                block_hasher=self._hasher)
            self._requests[(tokens, extras)] = got
        return got

    def key_hash(self, key: M.Key) -> bytes:
        """The hash vLLM files a page of this chain under (group id appended)."""
        req = self.request(tokens_of(key), key.extras)
        return bytes(self.v.utils.make_block_hash_with_group_id(req.block_hashes[-1],
                                                                HASH_GROUP))

    def blocks(self, pages: tuple[int, ...]) -> list[Any]:
        return [self.pool.blocks[p] for p in pages]

    # ------------------------------------------------------------ actions

    def step(self, a: M.Action) -> M.Result:
        return getattr(self, "_" + type(a).__name__)(a)  # type: ignore[no-any-return]

    def _Allocate(self, a: M.Allocate) -> M.Result:
        try:
            got = self.pool.get_new_blocks(a.n)
        except ValueError:  # "Cannot get n free blocks": nothing taken
            return M.AllocationFailed(a.n - self.pool.get_num_free_blocks())
        return M.Pages(tuple(b.block_id for b in got))

    def _hit(self, tokens: M.Tokens, extras: M.Extras) -> tuple[list[Any], int]:
        blocks, num_tokens, _ = self.manager.get_computed_blocks(
            self.request(tokens, extras))
        return list(blocks.blocks[HASH_GROUP]), num_tokens

    def _Match(self, a: M.Match) -> M.Result:
        blocks, n = self._hit(a.tokens, a.extras)
        self.pool.touch(blocks)
        return M.Hit(tuple(b.block_id for b in blocks), n)

    def _Lookup(self, a: M.Lookup) -> M.Result:
        blocks, n = self._hit(a.tokens, a.extras)
        return M.Hit(tuple(b.block_id for b in blocks), n)

    def _Write(self, a: M.Write) -> M.Result:
        ok = self.pool.is_block_writable(self.pool.blocks[a.page])
        return M.Ok() if ok else M.Misuse(M.WRITE)

    def _Register(self, a: M.Register) -> M.Result:
        ps = self.scope.page_size
        if len(a.tokens) != ps:
            raise Unexpressible("cache_full_blocks caches full blocks only")
        full = tokens_of(a.parent) + a.tokens
        i = len(full) // ps - 1  # the block's place in its request
        table = [self.pool.null_block] * i + [self.pool.blocks[a.page]]
        self.pool.cache_full_blocks(self.request(full, a.extras), table, i, i + 1, ps,
                                    HASH_GROUP)
        return M.Registered(a.page)

    def _Share(self, a: M.Share) -> M.Result:
        self.pool.touch(self.blocks(a.pages))
        return M.Ok()

    def _Take(self, a: M.Take) -> M.Result:
        # a hit's pages found one by one (a window's, H2): touch takes a
        # cached block whether free or held, as a hit does
        self.pool.touch(self.blocks(a.pages))
        return M.Ok()

    def _Release(self, a: M.Release) -> M.Result:
        if a.blank:
            raise Unexpressible("free_blocks keeps a freed block's hash: no blank release")
        before = self.pool.get_num_free_blocks()
        self.pool.free_blocks(self.blocks(a.pages))
        return M.Count(self.pool.get_num_free_blocks() - before)

    def _Reclaimable(self, a: M.Reclaimable) -> M.Result:
        # vLLM has no such query: a block is reclaimed when every reference
        # it has is among those released
        refs = Counter(p for _, ps in a.released for p in ps)
        return M.Count(sum(1 for p, k in refs.items() if self.pool.blocks[p].ref_cnt == k))

    def _NumFree(self, a: M.NumFree) -> M.Result:
        return M.Count(self.pool.get_num_free_blocks())

    def _ResetPrefixCache(self, a: M.ResetPrefixCache) -> M.Result:
        queue = self._queue()
        cached = sum(1 for p in queue if self.pool.blocks[p].block_hash is not None)
        held = self.scope.pages - len(queue)
        return M.Count(cached) if self.pool.reset_prefix_cache() else M.ResetRefused(held)

    # ------------------------------------------------------------ observation

    def _queue(self) -> tuple[int, ...]:
        """The free queue front first, walked at most a pool's length past its
        end (a corrupt queue may loop)."""
        q = self.pool.free_block_queue
        out: list[int] = []
        b = q.fake_free_list_head.next_free_block
        while b is not None and b is not q.fake_free_list_tail and len(out) <= len(
                self.pool.blocks):
            out.append(b.block_id)
            b = b.next_free_block
        return tuple(out)

    def observe(self) -> Observed:
        n, pool = self.scope.pages, self.pool
        index = [(bytes(h), ids) for h, ids in _map_entries(pool.cached_block_hash_to_block)]
        return Observed(
            refs=tuple(pool.blocks[p].ref_cnt for p in range(1, n + 1)),
            keys=tuple(None if pool.blocks[p].block_hash is None
                       else bytes(pool.blocks[p].block_hash) for p in range(1, n + 1)),
            queue=self._queue(), num_free=pool.get_num_free_blocks(),
            index=tuple(sorted(index)))

    def expect(self, s: M.State) -> Observed:
        """The model's state `s` as `observe` would show it."""
        n = self.scope.pages
        keys = tuple(None if (k := s.page(p).key) is None else self.key_hash(k)
                     for p in range(1, n + 1))
        by_key: dict[bytes, list[int]] = {}
        first = [*s.order, *(p for p in range(1, n + 1) if p not in s.order)]
        for p in first:  # the map keeps a key's blocks in registration order
            h = keys[p - 1]
            if h is not None:
                by_key.setdefault(h, []).append(p)
        queue = s.blank + s.lru
        return Observed(refs=tuple(len(s.page(p).holders) for p in range(1, n + 1)),
                        keys=keys, queue=queue, num_free=len(queue),
                        index=tuple(sorted((h, tuple(ps)) for h, ps in by_key.items())))


# ------------------------------------------------------------------ one step


def compare(model: M.PagesModel, s: M.State, a: M.Action, vp: VllmPool
            ) -> tuple[M.State, Disagreement | None]:
    """Step both; the model's next state and what differed, if anything."""
    want, after = model.step(s, a)
    try:
        got = vp.step(a)
    except Unexpressible:
        raise
    except Exception as err:  # a vLLM assertion or error: a disagreement too
        return after, Disagreement(a, want, f"raised {type(err).__name__}: {err}"[:200], "")
    if got != want:
        return after, Disagreement(a, want, show(got), "")
    seen, expected = vp.observe(), vp.expect(after)
    if seen != expected:
        return after, Disagreement(a, want, show(got), seen.diff(expected))
    broken = state_violations(model, after) + transition_violations(model, s, a, want, after)
    if broken:  # the model's own invariants, under the vLLM scope
        return after, Disagreement(a, want, show(got), f"model invariant {broken}")
    return after, None


# ------------------------------------------------------------------ lockstep


ENGINE_SCOPE = M.Scope(pages=5, holders=3, page_size=2, extras=EXTRAS, **VLLM_FLAGS)
BASE = (1, 2, 3, 4, 5, 6, 7, 8)  # one shared prompt: prefixes of it hit
TWO_BLOCKS_ONE_KEY = "two blocks under one key"  # Scope.duplicates at work


def prompt(k: int, at: int | None) -> M.Tokens:
    """The first `k` tokens of the shared prompt, one changed at `at`."""
    t = list(BASE[:k])
    if at is not None and at < k:
        t[at] = 9
    return tuple(t)


def lockstep_machine(v: Vllm, scope: M.Scope = ENGINE_SCOPE) -> type[RuleBasedStateMachine]:
    """A Hypothesis machine that plays an engine over both pools, as
    tests/conformance/test_page_pool_lockstep.py does for kvref's: prefill (a
    hit, then allocate, write and register the rest), decode (copy-on-write when
    the last page is shared or cached), fork (share the full pages, copy the part
    page), finish (release, tail first), reset, lookups and counts.  Every pool
    call is one model action, compared by `compare`."""
    ps, holders = scope.page_size, range(scope.holders)

    class VllmLockstep(RuleBasedStateMachine):
        runs = 0  # examples begun (the plant tests report where one was found)
        seen: ClassVar[Counter[str]] = Counter()  # the model's interesting cases

        def __init__(self) -> None:
            super().__init__()
            type(self).runs += 1
            self.model = M.PagesModel(scope)
            self.state = self.model.init()
            self.vp = VllmPool(v, scope)
            self.streams: dict[int, tuple[M.Tokens, M.Extras]] = {}

        def do(self, a: M.Action) -> M.Result:
            want, after = self.model.step(self.state, a)
            for name, pred in INTERESTING.items():
                if pred(self.model, self.state, a, want, after):
                    self.seen[name] += 1
            keys = [pg.key for pg in after.pages if pg.key is not None]
            if len(set(keys)) < len(keys):
                self.seen[TWO_BLOCKS_ONE_KEY] += 1
            self.state, bad = compare(self.model, self.state, a, self.vp)
            assert bad is None, str(bad)
            return want

        def table(self, h: int) -> tuple[int, ...]:
            return self.state.tables[h]

        @staticmethod
        def contents(tokens: M.Tokens, ex: M.Extras) -> list[M.Key]:
            out: list[M.Key] = []
            for i in range(0, len(tokens), ps):
                out.append(M.Key(out[-1] if out else None, tokens[i:i + ps], ex))
            return out

        def write(self, h: int, page: int, content: M.Key) -> bool:
            return isinstance(self.do(M.Write(h, page, content)), M.Ok)

        def register(self, page: int, content: M.Key) -> None:
            self.do(M.Register(page, content.parent, content.tokens, content.extras))

        def release_all(self, h: int) -> None:
            if self.table(h):
                self.do(M.Release(h, self.table(h)[::-1]))  # tail first

        def idle(self) -> list[int]:
            return [h for h in holders if not self.table(h)]

        @precondition(lambda self: self.idle())
        @rule(data=st.data(), k=st.integers(1, len(BASE)),
              at=st.one_of(st.none(), st.integers(0, len(BASE) - 1)),
              ex=st.sampled_from(scope.extras))
        def prefill(self, data: st.DataObject, k: int, at: int | None, ex: M.Extras) -> None:
            h = data.draw(st.sampled_from(self.idle()))
            tokens = prompt(k, at)
            hit = self.do(M.Match(h, tokens, ex))
            assert isinstance(hit, M.Hit)
            want = self.contents(tokens, ex)
            got = self.do(M.Allocate(h, len(want) - len(hit.pages)))
            if not isinstance(got, M.Pages):
                self.release_all(h)
                return
            for page, content in zip(got.pages, want[len(hit.pages):], strict=True):
                assert self.write(h, page, content)
                if len(content.tokens) == ps:  # committed and full
                    self.register(page, content)
            self.streams[h] = (tokens, ex)

        @precondition(lambda self: self.streams)
        @rule(data=st.data(), token=st.integers(1, 9))
        def decode(self, data: st.DataObject, token: int) -> None:
            h = data.draw(st.sampled_from(sorted(self.streams)))
            tokens, ex = self.streams[h]
            new = (*tokens, token)
            content = self.contents(new, ex)[-1]
            last = self.table(h)[-1]
            if len(tokens) % ps == 0 or not self.write(h, last, content):
                # a new page, or a private copy of a shared or cached last page
                got = self.do(M.Allocate(h, 1))
                if not isinstance(got, M.Pages):
                    return
                assert self.write(h, got.pages[0], content)
                if len(tokens) % ps:
                    self.do(M.Release(h, (last,)))
            self.streams[h] = (new, ex)
            if len(new) % ps == 0:
                self.register(self.table(h)[-1], content)

        @precondition(lambda self: self.streams and self.idle())
        @rule(data=st.data(), share_part=st.booleans())
        def fork(self, data: st.DataObject, share_part: bool) -> None:
            """Share the full pages; the part page is copied, or shared too and
            copied by whichever stream appends to it first (copy-on-write)."""
            src = data.draw(st.sampled_from(sorted(self.streams)))
            dst = data.draw(st.sampled_from(self.idle()))
            tokens, ex = self.streams[src]
            table = self.table(src)
            shared = table if share_part else table[:len(tokens) // ps]
            if shared:
                self.do(M.Share(dst, shared))
            if len(shared) < len(table):  # the part page: a copy
                got = self.do(M.Allocate(dst, 1))
                if not isinstance(got, M.Pages):
                    self.release_all(dst)
                    return
                assert self.write(dst, got.pages[0], self.contents(tokens, ex)[-1])
            self.streams[dst] = (tokens, ex)

        @precondition(lambda self: self.streams)
        @rule(data=st.data())
        def finish(self, data: st.DataObject) -> None:
            h = data.draw(st.sampled_from(sorted(self.streams)))
            self.release_all(h)
            del self.streams[h]

        @rule(pick=st.sets(st.sampled_from(list(holders)), min_size=1))
        def reclaimable(self, pick: set[int]) -> None:
            self.do(M.Reclaimable(tuple((h, self.table(h)[::-1]) for h in sorted(pick))))

        @rule()
        def reset_prefix_cache(self) -> None:
            self.do(M.ResetPrefixCache())

        @rule(k=st.integers(1, len(BASE)), at=st.one_of(st.none(), st.integers(0, 7)),
              ex=st.sampled_from(scope.extras))
        def lookup(self, k: int, at: int | None, ex: M.Extras) -> None:
            self.do(M.Lookup(prompt(k, at), ex))
            self.do(M.NumFree())

        @rule(h=st.sampled_from(list(holders)))
        def allocate_too_many(self, h: int) -> None:
            self.do(M.Allocate(h, scope.pages + 1))

    return VllmLockstep


def run_lockstep(v: Vllm, cfg: settings | None = None, scope: M.Scope = ENGINE_SCOPE,
                 machine: type[RuleBasedStateMachine] | None = None) -> LockstepReport:
    return run_machine(machine or lockstep_machine(v, scope), cfg or budget())


# ------------------------------------------------------------------ replay


def replay(v: Vllm, scope: M.Scope = REPLAY_SCOPE, first: bool = False) -> ReplayReport:
    """Every state the model reaches within `scope.depth` calls of its protocol,
    each call compared on a fresh vLLM pool brought to the state by its trace
    (cheaper than a copy).  `first`: stop at the first disagreement."""

    def bring(trace: Trace) -> VllmPool:
        vp = VllmPool(v, scope)
        for b, _ in trace:
            vp.step(b)
        return vp

    return replay_pages(scope, bring, compare, first)


# ------------------------------------------------------------------ CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvref.testing.vllm_pool",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm", required=True, help="a copy of vLLM's KV-manager files")
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--depth", type=int, default=REPLAY_SCOPE.depth)
    ap.add_argument("--careless", action="store_true",
                    help="also replay kvref's careless calls (the checked protocol)")
    ap.add_argument("--plants", action="store_true",
                    help="plant vLLM's historic pool defects in scratch copies")
    args = ap.parse_args(argv)
    v = load(args.vllm)
    print(f"vLLM copy: {v.root}")
    bad = print_clean_run(DIFFERENCES, run_lockstep(v, budget(args.examples, args.steps)),
                          replay(v, replace(REPLAY_SCOPE, depth=args.depth)))
    if args.careless:
        care = replay(v, replace(REPLAY_SCOPE, depth=min(args.depth, 4),
                                 trusts_caller=False))
        print("careless calls (kvref's checked protocol; findings about vLLM's "
              "unchecked pool, not failures):\n" + care.table())
    if args.plants:
        from kvref.testing.vllm_plants import PLANTS, PatchMissing, planted_copy

        for name, plant in PLANTS.items():
            try:
                with planted_copy(v.root, plant) as (root, form):
                    got = run_lockstep(load(root), budget(args.examples, args.steps))
                    short = replay(load(root), replace(REPLAY_SCOPE, depth=args.depth),
                                   first=True)
            except PatchMissing as err:
                bad = True
                print(f"plant {name} ({plant.anchor}): NOT PLANTED: {err}")
                continue
            bad |= print_plant(f"{name} ({plant.anchor}, {form})", got, short)
        load(args.vllm)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
