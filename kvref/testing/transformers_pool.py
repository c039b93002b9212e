"""The page-pool model (kvref_model.pages) in lockstep with transformers'
continuous-batching paged cache (issue 43).

    python -m kvref.testing.transformers_pool [--examples 100] [--depth 7] [--plants]

It drives the transformers installed beside kvref (the dev extra pins it), on
CPU: a real `PagedAttentionCache` for a one-layer Llama config, one
full-attention `CacheAllocator`, its `BlockLedger` and its `CachePool`.
`TfPool` plays the cache's caller; each model action is one call:

- Allocate      -> PagedAttentionCache.can_store_request_tokens (n pages of tokens
                   past the request's whole pages; False: AllocationFailed)
- Match         -> PagedAttentionCache.search_prefix_match (match_prefix_blocks,
                   then acquire_prefix_blocks), into a request with no blocks
- Lookup        -> CacheAllocator.match_prefix_blocks
- Write         -> no call: transformers has no write check; answered from the
                   ledger (one reference, no hash), as vLLM's is_block_writable
- Register      -> PagedAttentionCache.mark_complete_blocks for one block, the
                   holder's first unhashed one (the walk starts at the table's head)
- Share         -> PagedAttentionCache.prepare_fork_request of the holder's whole
                   table into a request with no blocks (a fork that copies nothing)
- Release       -> PagedAttentionCache.free_blocks(no_cache=Release.blank), the
                   holder's whole table
- Reclaimable   -> no call: answered from the ledger's counts
- NumFree       -> CachePool free blocks + free sectors' blocks
- ResetPrefixCache -> PagedAttentionCache.evict_cached_blocks, then
                   CachePool.try_to_free_sectors (as the scheduler calls them)

Where transformers' behaviour differs from kvref's rules, the difference is a
scope setting of the model (`TF_FLAGS`, `DIFFERENCES`), never a special case
of the comparison.  Calls transformers has no form for (a window's Take, a
Match into a request that holds blocks, a release of part of a table...) are
`Unexpressible` and counted.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import logging
import sys
import types
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from kvref.testing.engine_search import LockstepReport, Unexpressible, budget, run_lockstep
from kvref.testing.pages_replay import (
    Disagreement,
    ReplayReport,
    Trace,
    print_clean_run,
    print_plant,
    replay_pages,
)
from kvref.testing.vllm_pool import tokens_of
from kvref_model import pages as M
from kvref_model.pages_invariants import (
    INTERESTING,
    state_violations,
    transition_violations,
)

# the model's scope settings that state transformers' cache (see DIFFERENCES)
TF_FLAGS: dict[str, bool] = {"dedup_adopts": True, "allocate_evicts": False,
                             "reset_while_held": True, "trusts_caller": True}
EXTRAS: tuple[M.Extras, ...] = ((),)  # transformers' block hash has no extra keys
# the exhaustive replay's scope: three holders, so that a fork can hold the
# duplicate a registration replaces within 7 calls
REPLAY_SCOPE = M.Scope(pages=2, holders=3, page_size=1, alphabet=2, extras=EXTRAS,
                       depth=7, **TF_FLAGS)
ENGINE_SCOPE = M.Scope(pages=8, holders=3, page_size=2, extras=EXTRAS, **TF_FLAGS)

DIFFERENCES: tuple[tuple[str, str], ...] = (
    ("dedup_adopts", "mark_complete_blocks de-duplicates on the spot: a block whose "
     "hash another block has is replaced, in the registering request's table, by that "
     "block (acquired, taken out of the cache if it was there), and the duplicate is "
     "released; kvref's register answers the page that has the key and leaves the "
     "caller's page alone"),
    ("allocate_evicts=False", "unreferenced hashed blocks stay in the ledger "
     "(cached_blocks), out of the pool: an allocation takes free blocks only and fails "
     "when they are short even with cached blocks left; the free count leaves them out"),
    ("reset_while_held", "evict_cached_blocks evicts every cached block at once, "
     "whatever requests hold (the scheduler calls it under memory pressure); kvref "
     "refuses a reset while anything is held and otherwise evicts LRU first, one page "
     "per page short"),
    ("trusts_caller", "the ledger keeps implicit counts, not holders, and checks "
     "nothing of its caller (a double free_blocks, a fork into a request that has "
     "blocks...): those are the scheduler's to prevent, and the protocol leaves them out"),
    ("extras=((),)", "compute_block_hash chains the parent's hash and the tokens only: "
     "no LoRA, salt or other extra key, so the protocol uses none"),
)
# correspondences that need no setting (docs/verification/vllm-block-pool.md)
SAME_UNDER_NAMES: tuple[tuple[str, str], ...] = (
    ("blank order", "the pool hands out free blocks from sector trees and a stack of "
     "free sectors (RegularTrees, CachePool), in an order of its own; the model's "
     "states are symmetric under renaming blank pages (pages_check.Canon), so the "
     "adapter names each blank block an allocation hands out after the model's page. "
     "A block that was not blank keeps its name, so handing one out still disagrees"),
    ("cache order", "cached blocks leave the cache all at once (or one by one when a "
     "hit takes them), never oldest first, so the order of the model's LRU is not "
     "observable and is compared as a set"),
    ("implicit count", "a block one request holds has no entry in shared_ref_counts; "
     "the observation reads the stored counts as they are, so an explicit count of 1 "
     "disagrees"),
    ("sink", "transformers' two trash sectors (read and write) are outside the pool: "
     "the model's sink, page 0"),
)

GROUP = "full_attention"


# ------------------------------------------------------------------ loading


@dataclass(frozen=True)
class Tf:
    """The modules of one import of transformers' continuous-batching cache."""

    where: str  # the folder the modules came from
    version: str
    cache: ModuleType  # continuous_batching.cache (PagedAttentionCache)
    ledger: ModuleType  # continuous_batching.cache_allocators.cache_allocator
    requests: ModuleType  # continuous_batching.requests (RequestState)
    distributed: ModuleType  # continuous_batching.distributed (DistributedHelper)


PACKAGE = "transformers.generation.continuous_batching"


def _quiet() -> None:
    # on CPU without psutil the memory handler logs an error and sizes the
    # cache from num_blocks alone, which is what the adapter asks for
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)


def load() -> Tf:
    """The installed transformers, unmodified."""
    import transformers

    pkg = importlib.import_module(PACKAGE)
    _quiet()
    return Tf(str(Path(pkg.__file__ or "").parent), transformers.__version__,
              importlib.import_module(PACKAGE + ".cache"),
              importlib.import_module(PACKAGE + ".cache_allocators.cache_allocator"),
              importlib.import_module(PACKAGE + ".requests"),
              importlib.import_module(PACKAGE + ".distributed"))


_scratch = [0]


def load_copy(folder: Path) -> Tf:
    """A scratch copy of the continuous_batching folder, imported as a sibling
    package of the installed one (so its relative imports of transformers resolve
    as the original's do) without running its __init__ (the engine, not needed)."""
    import transformers

    _scratch[0] += 1
    name = f"transformers.generation._kvref_scratch_{_scratch[0]}"
    pkg = types.ModuleType(name)
    pkg.__path__ = [str(folder)]
    pkg.__package__ = name
    sys.modules[name] = pkg
    _quiet()

    def mod(sub: str) -> ModuleType:
        m = importlib.import_module(f"{name}.{sub}")
        if Path(folder).resolve() not in Path(m.__file__ or "").resolve().parents:
            raise ImportError(f"{m.__name__} came from {m.__file__}, not from {folder}")
        return m

    return Tf(str(folder), transformers.__version__, mod("cache"),
              mod("cache_allocators.cache_allocator"), mod("requests"), mod("distributed"))


# ------------------------------------------------------------------ adapter


@dataclass(frozen=True)
class Observed:
    """transformers' cache as the model's state, or the model's as it would show."""

    tables: tuple[tuple[int, ...], ...]  # each holder's block table, as pages
    counts: tuple[int | None, ...]  # pages 1..n: the ledger's stored count (None: none)
    keys: tuple[int | None, ...]  # pages 1..n: the block's hash
    index: tuple[tuple[int, int], ...]  # the hash table, (hash, page), sorted
    cached: tuple[int, ...]  # pages kept for their content, sorted
    free: tuple[int, ...]  # pages free in the pool, sorted (twice: listed twice)
    num_free: int

    def diff(self, other: Observed) -> str:
        out = []
        for name in ("tables", "counts", "cached", "free", "num_free"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                out.append(f"{name}: transformers {a}, model {b}")
        for p, (a, b) in enumerate(zip(self.keys, other.keys, strict=True), 1):
            if a != b:
                out.append(f"page {p} hash: transformers {_short(a)}, model {_short(b)}")
        if self.index != other.index:
            out.append(f"hash table: transformers {_index(self.index)}, model "
                       f"{_index(other.index)}")
        return "; ".join(out)


def _short(h: int | None) -> str:
    return "none" if h is None else f"{h & 0xffffff:06x}"


def _index(ix: tuple[tuple[int, int], ...]) -> str:
    return "{" + ", ".join(f"{_short(h)}: {p}" for h, p in ix) + "}"


@functools.cache
def _llama_config(head_dim: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=16, num_attention_heads=1, num_key_value_heads=1,
                       head_dim=head_dim, num_hidden_layers=1, intermediate_size=16,
                       vocab_size=16)


class TfPool:
    """One PagedAttentionCache driven by the model's actions.  `sector` blocks
    make a sector: 1 for any real model's full-attention group (a block is a
    multiple of the 128-byte alignment); more as in a hybrid model, whose sector
    is the lcm of its groups' blocks (the adapter's `sector` is set through the
    block's size: head_dim = 16 / (sector * page_size), float32, one KV head)."""

    def __init__(self, tf: Tf, scope: M.Scope, sector: int = 1) -> None:
        import torch
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.tf, self.scope, self.ps = tf, scope, scope.page_size
        head_dim, odd = divmod(16, sector * self.ps)
        if odd or not head_dim or scope.pages % sector:
            raise ValueError(f"no cache of {scope.pages} blocks in sectors of {sector}")
        cb = ContinuousBatchingConfig(page_size=self.ps, num_blocks=scope.pages,
                                      max_batch_tokens=16, max_memory_percent=0.5)
        self.cache = tf.cache.PagedAttentionCache(
            _llama_config(head_dim), cb, "cpu", tf.distributed.DistributedHelper(None, None),
            dtype=torch.float32)
        self.alloc = self.cache.cache_allocators[GROUP]
        self.ledger = self.alloc.ledger
        got = (self.cache.num_sectors * self.alloc.blocks_per_sector,
               self.alloc.blocks_per_sector, self.cache.use_prefix_sharing)
        if got != (scope.pages, sector, True):
            raise RuntimeError(f"transformers {tf.version} sized the cache as (blocks, "
                               f"blocks per sector, prefix sharing) {got}, not "
                               f"{(scope.pages, sector, True)}")
        self.reset()

    def reset(self) -> None:
        """transformers' own reset (every request freed, ledger and pool reset):
        the replay's fresh cache, cheaper than building one."""
        self.cache.reset()
        blocks = sorted(self.free_blocks())
        self.m2t = dict(zip(range(1, self.scope.pages + 1), blocks, strict=True))
        self.t2m = {b: p for p, b in self.m2t.items()}

    # ------------------------------------------------------------ helpers

    @staticmethod
    def rid(h: int) -> str:
        return f"h{h}"

    def table(self, h: int) -> list[int]:
        return list(self.alloc.block_table.get(self.rid(h), []))

    def pages(self, blocks: list[int]) -> tuple[int, ...]:
        return tuple(self.t2m.get(b, -b) for b in blocks)  # -b: a block off the pool

    def state(self, h: int, tokens: M.Tokens, length: int) -> Any:
        st = self.tf.requests.RequestState(request_id=self.rid(h), initial_tokens=list(tokens),
                                           position_offset=length)
        st.status = self.tf.requests.RequestStatus.DECODING
        return st

    def free_blocks(self) -> list[int]:
        """The pool's free blocks: its trees' leaves and its free sectors' blocks."""
        pool, e = self.cache.pool, self.alloc.blocks_per_sector
        # RegularTrees offers only a count; the leaves are read to tell which
        # blocks are free (and whether one is listed twice)
        out = [b for leaves in pool._free_blocks[self.alloc.index].trees.values()
               for b in leaves]
        return out + [s * e + i for s in pool.free_sectors for i in range(e)]

    def num_free(self) -> int:
        pool = self.cache.pool
        return int(pool.count_free_blocks(self.alloc.index)
                   + pool.num_free_sectors * self.alloc.blocks_per_sector)

    def blank(self, b: int) -> bool:
        held = any(b in t for t in self.alloc.block_table.values())
        return not held and b not in self.ledger.block_to_hash and (
            b not in self.ledger.cached_blocks)

    def rename(self, got: list[int], want: M.Result, blank_before: set[int]) -> None:
        """Name the blank blocks an allocation handed out after the model's pages
        (a renaming among blank pages, under which the model is symmetric)."""
        if not isinstance(want, M.Pages) or len(want.pages) != len(got):
            return
        for b, p in zip(got, want.pages, strict=True):
            if b not in blank_before or b not in self.t2m:
                continue  # not blank before: keeps its name, and disagrees
            p_old, b_old = self.t2m[b], self.m2t[p]
            self.m2t[p], self.t2m[b] = b, p
            self.m2t[p_old], self.t2m[b_old] = b_old, p_old

    def fork(self, src: int, dst: int, length: int, want: M.Result) -> tuple[int, ...]:
        """prepare_fork_request of src's first `length` tokens into dst, and the
        copy: full pages shared, the rest fresh (whose pages are returned)."""
        if self.table(dst):
            raise Unexpressible("a fork builds a new request's table")
        blank = {b for b in self.t2m if self.blank(b)}
        copy: dict[str, tuple[list[int], list[int]]] = {GROUP: ([], [])}
        forked = self.cache.prepare_fork_request(self.state(src, (), length), [self.rid(dst)],
                                                 copy)
        if forked != [self.rid(dst)]:
            return ()
        self.cache.perform_cache_copy(copy)
        fresh = copy[GROUP][1]
        self.rename(fresh, want, blank)
        return self.pages(fresh)

    # ------------------------------------------------------------ actions

    def step(self, a: M.Action, want: M.Result) -> M.Result:
        return getattr(self, "_" + type(a).__name__)(a, want)  # type: ignore[no-any-return]

    def _Allocate(self, a: M.Allocate, want: M.Result) -> M.Result:
        if a.n < 0:
            raise Unexpressible("a request's length only grows")
        before = self.table(a.holder)
        blank = {b for b in self.t2m if self.blank(b)}
        st = self.state(a.holder, (), len(before) * self.ps)
        if not self.cache.can_store_request_tokens(st, a.n * self.ps):
            return M.AllocationFailed(a.n - self.num_free())
        got = self.table(a.holder)[len(before):]
        self.rename(got, want, blank)
        return M.Pages(self.pages(got))

    def _Match(self, a: M.Match, want: M.Result) -> M.Result:
        if a.extras or self.table(a.holder):
            raise Unexpressible("a prefix match starts a request's table, with no extra keys")
        n = self.cache.search_prefix_match(self.rid(a.holder), list(a.tokens))
        return M.Hit(self.pages(self.table(a.holder)), n)

    def _Lookup(self, a: M.Lookup, want: M.Result) -> M.Result:
        if a.extras:
            raise Unexpressible("no extra keys")
        got = self.alloc.match_prefix_blocks(list(a.tokens))
        return M.Hit(self.pages(got), len(got) * self.ps)

    def _Write(self, a: M.Write, want: M.Result) -> M.Result:
        b = self.m2t.get(a.page)
        ok = (b in self.table(a.holder) and b not in self.ledger.shared_ref_counts
              and b not in self.ledger.block_to_hash)
        return M.Ok() if ok else M.Misuse(M.WRITE)

    def _Register(self, a: M.Register, want: M.Result) -> M.Result:
        ps, h, b = self.ps, a.holder, self.m2t.get(a.page)
        full = tokens_of(a.parent) + a.tokens
        i = len(full) // ps - 1
        if h is None or a.extras or len(a.tokens) != ps:
            raise Unexpressible("mark_complete_blocks: a request's full blocks, no extra keys")
        t = self.table(h)
        hashed = self.ledger.block_to_hash
        if i >= len(t) or t[i] != b or b in hashed or any(x not in hashed for x in t[:i]):
            raise Unexpressible("mark_complete_blocks registers the first unhashed block")
        if i and hashed[t[i - 1]] != self.key_hash(a.parent):
            raise Unexpressible("the hash chains to the table's own blocks")
        self.cache.mark_complete_blocks(self.state(h, full, len(full)), {GROUP: 1})
        return M.Registered(self.pages(self.table(h)[i:i + 1])[0])

    def _Share(self, a: M.Share, want: M.Result) -> M.Result:
        src = [g for g in range(self.scope.holders)
               if g != a.holder and a.pages and self.pages(self.table(g)) == a.pages]
        if not src:
            raise Unexpressible("a fork shares a source's whole table")
        self.fork(src[0], a.holder, len(a.pages) * self.ps, want)
        return M.Ok()

    def _Take(self, a: M.Take, want: M.Result) -> M.Result:
        raise Unexpressible("a hit is a chain from the first block (match_prefix_blocks)")

    def _Release(self, a: M.Release, want: M.Result) -> M.Result:
        t = self.pages(self.table(a.holder))
        if sorted(t) != sorted(a.pages) or not t:
            raise Unexpressible("free_blocks releases a request's whole table")
        before = self.num_free() + len(self.ledger.cached_blocks)
        self.cache.free_blocks(self.rid(a.holder), no_cache=a.blank)
        return M.Count(self.num_free() + len(self.ledger.cached_blocks) - before)

    def _Reclaimable(self, a: M.Reclaimable, want: M.Result) -> M.Result:
        # no such call: a block is reclaimed when every reference it has goes
        refs = Counter(p for _, ps in a.released for p in ps)
        counts = self.ledger.shared_ref_counts
        return M.Count(sum(1 for p, k in refs.items()
                           if counts.get(self.m2t.get(p), 1) == k))

    def _NumFree(self, a: M.NumFree, want: M.Result) -> M.Result:
        return M.Count(self.num_free())

    def _ResetPrefixCache(self, a: M.ResetPrefixCache, want: M.Result) -> M.Result:
        before = self.num_free()
        self.cache.evict_cached_blocks()
        self.cache.pool.try_to_free_sectors()
        return M.Count(self.num_free() - before)

    # ------------------------------------------------------------ observation

    def key_hash(self, key: M.Key | None) -> int | None:
        if key is None:
            return None
        return int(self.tf.ledger.compute_block_hash(self.key_hash(key.parent),
                                                     list(key.tokens)))

    def observe(self) -> Observed:
        n, lg = self.scope.pages, self.ledger
        blocks = [self.m2t[p] for p in range(1, n + 1)]
        return Observed(
            tables=tuple(self.pages(self.table(h)) for h in range(self.scope.holders)),
            counts=tuple(lg.shared_ref_counts.get(b) for b in blocks),
            keys=tuple(lg.block_to_hash.get(b) for b in blocks),
            index=tuple(sorted((h, self.t2m.get(b, -b)) for h, b in lg.hash_to_block.items())),
            cached=tuple(sorted(self.pages(list(lg.cached_blocks)))),
            free=tuple(sorted(self.pages(self.free_blocks()))), num_free=self.num_free())

    def expect(self, s: M.State) -> Observed:
        n = self.scope.pages
        keys = tuple(self.key_hash(s.page(p).key) for p in range(1, n + 1))
        refs = [len(s.page(p).holders) for p in range(1, n + 1)]
        return Observed(
            tables=s.tables, counts=tuple(r if r > 1 else None for r in refs), keys=keys,
            index=tuple(sorted((k, p) for p, k in enumerate(keys, 1) if k is not None)),
            cached=tuple(sorted(s.lru)), free=tuple(sorted(s.blank)), num_free=len(s.blank))


# ------------------------------------------------------------------ one step


def _check(model: M.PagesModel, s: M.State, a: M.Action, want: M.Result, after: M.State,
           got: M.Result, tp: TfPool) -> Disagreement | None:
    if got != want:
        return Disagreement(a, want, show_result(got), "", "transformers")
    seen, expected = tp.observe(), tp.expect(after)
    if seen != expected:
        return Disagreement(a, want, show_result(got), seen.diff(expected), "transformers")
    broken = state_violations(model, after) + transition_violations(model, s, a, want, after)
    if broken:  # the model's own invariants, under the transformers scope
        return Disagreement(a, want, show_result(got), f"model invariant {broken}",
                            "transformers")
    return None


def show_result(r: M.Result) -> str:
    from kvref_model.pages_check import show

    return show(r)


def compare(model: M.PagesModel, s: M.State, a: M.Action, tp: TfPool
            ) -> tuple[M.State, Disagreement | None]:
    """Step both; the model's next state and what differed, if anything."""
    want, after = model.step(s, a)
    try:
        got = tp.step(a, want)
    except Unexpressible:
        raise
    except Exception as err:  # an error inside transformers: a disagreement too
        return after, Disagreement(a, want, f"raised {type(err).__name__}: {err}"[:200], "",
                                   "transformers")
    return after, _check(model, s, a, want, after, got, tp)


# ------------------------------------------------------------------ lockstep


BASE = (1, 2, 3, 4, 5, 6, 7, 8)  # one shared prompt: prefixes of it hit


def prompt(k: int, at: int | None) -> M.Tokens:
    """The first `k` tokens of the shared prompt, one changed at `at`."""
    t = list(BASE[:k])
    if at is not None and at < k:
        t[at] = 9
    return tuple(t)


def lockstep_machine(tf: Tf, scope: M.Scope = ENGINE_SCOPE) -> type[RuleBasedStateMachine]:
    """A Hypothesis machine that plays transformers' scheduler over both: prefill
    (a prefix match, allocate the rest), decode (one token; a new page when the
    last is full), marking complete blocks after the forward or, as async batching
    does, a batch later (`defer`), fork (prepare_fork_request: full pages shared,
    the part page copied into a fresh one), finish with and without no_cache,
    evict, lookups and counts.  Every call is compared."""
    ps, holders = scope.page_size, range(scope.holders)
    LATE = st.booleans()  # marked after the forward, or a batch late (async batching)
    pool: list[TfPool] = []

    class TfLockstep(RuleBasedStateMachine):
        runs = 0
        seen: ClassVar[Counter[str]] = Counter()

        def __init__(self) -> None:
            super().__init__()
            type(self).runs += 1
            self.model = M.PagesModel(scope)
            self.state = self.model.init()
            if not pool:  # one cache for the run, reset by transformers per example
                pool.append(TfPool(tf, scope))
            self.tp = pool[0]
            self.tp.reset()
            self.streams: dict[int, M.Tokens] = {}
            self.pending: Counter[int] = Counter()  # blocks completed, not yet marked
            self.prompts: dict[int, M.Tokens] = {}  # each running request's prompt

        def note(self, a: M.Action, want: M.Result, after: M.State) -> None:
            for name, pred in INTERESTING.items():
                if pred(self.model, self.state, a, want, after):
                    self.seen[name] += 1

        def do(self, a: M.Action) -> M.Result:
            want, after = self.model.step(self.state, a)
            self.note(a, want, after)
            self.state, bad = compare(self.model, self.state, a, self.tp)
            assert bad is None, str(bad)
            return want

        def table(self, h: int) -> tuple[int, ...]:
            return self.state.tables[h]

        @staticmethod
        def contents(tokens: M.Tokens) -> list[M.Key]:
            out: list[M.Key] = []
            for i in range(0, len(tokens), ps):
                out.append(M.Key(out[-1] if out else None, tokens[i:i + ps], ()))
            return out

        def mark(self, h: int) -> None:
            """mark_complete_blocks' walk: from the table's head, each full page
            with no key is registered, as many as blocks were completed."""
            n, self.pending[h] = self.pending[h], 0
            for p in self.table(h):
                pg = self.state.page(p)
                if pg.key is not None:
                    continue
                c = pg.content
                if n == 0 or c is None or len(c.tokens) < ps:
                    break
                self.do(M.Register(p, self.model.chain_key(c.parent), c.tokens, (), h))
                n -= 1

        def complete(self, h: int, blocks: int, defer: bool) -> None:
            self.pending[h] += blocks
            if not defer and self.pending[h]:
                self.mark(h)

        def release_all(self, h: int, no_cache: bool = False) -> None:
            self.pending[h] = 0
            if self.table(h):
                self.do(M.Release(h, self.table(h)[::-1], blank=no_cache))

        def idle(self) -> list[int]:
            return [h for h in holders if not self.table(h)]

        def admit(self, h: int, tokens: M.Tokens) -> bool:
            """A prefill's cache calls: the prefix match, the rest allocated and
            written; its completed blocks wait for their mark."""
            hit = self.do(M.Match(h, tokens))
            assert isinstance(hit, M.Hit)
            want = self.contents(tokens)
            got = self.do(M.Allocate(h, len(want) - len(hit.pages)))
            if not isinstance(got, M.Pages):
                self.release_all(h)
                return False
            for page, content in zip(got.pages, want[len(hit.pages):], strict=True):
                assert isinstance(self.do(M.Write(h, page, content)), M.Ok)
            self.streams[h], self.prompts[h] = tokens, tokens
            self.pending[h] += len(tokens) // ps - len(hit.pages)
            return True

        @precondition(lambda self: self.idle())
        @rule(data=st.data(), k=st.integers(1, len(BASE)),
              at=st.one_of(st.none(), st.integers(0, len(BASE) - 1)), defer=LATE,
              twin=st.booleans())
        def prefill(self, data: st.DataObject, k: int, at: int | None, defer: bool,
                    twin: bool) -> None:
            """A new request; a `twin` repeats a running request's prompt."""
            h = data.draw(st.sampled_from(self.idle()))
            tokens = prompt(k, at)
            if twin and self.prompts:
                tokens = data.draw(st.sampled_from(sorted(set(self.prompts.values()))))
            if self.admit(h, tokens):
                self.complete(h, 0, defer)

        @precondition(lambda self: len(self.idle()) >= 2)
        @rule(data=st.data(), k=st.integers(2, len(BASE)), child=st.booleans(),
              late=st.booleans())
        def group(self, data: st.DataObject, k: int, child: bool, late: bool) -> None:
            """An RL rollout's group in one batch: the same prompt twice, neither
            matching the other (nothing is marked before the forward), then the
            marks in a drawn order; with `child`, a parallel sample of the first
            forked before the marks land (async batching marks a batch late)."""
            a, b = self.idle()[:2]
            tokens = prompt(k, None)
            if not self.admit(a, tokens):
                return
            if not self.admit(b, tokens):
                self.mark(a)
                return
            if child and self.idle():
                self.fork_into(a, self.idle()[0])
            for h in ((b, a) if late else (a, b)):
                self.mark(h)

        @precondition(lambda self: self.streams)
        @rule(data=st.data(), token=st.integers(1, 9), defer=LATE)
        def decode(self, data: st.DataObject, token: int, defer: bool) -> None:
            h = data.draw(st.sampled_from(sorted(self.streams)))
            tokens = self.streams[h]
            new = (*tokens, token)
            if len(tokens) % ps == 0:
                got = self.do(M.Allocate(h, 1))
                if not isinstance(got, M.Pages):
                    return
            last = self.table(h)[-1]
            assert isinstance(self.do(M.Write(h, last, self.contents(new)[-1])), M.Ok)
            self.streams[h] = new
            self.complete(h, int(len(new) % ps == 0), defer)

        @precondition(lambda self: any(self.pending.values()))
        @rule(data=st.data())
        def mark_late(self, data: st.DataObject) -> None:
            self.mark(data.draw(st.sampled_from(sorted(h for h, n in self.pending.items()
                                                       if n))))

        @precondition(lambda self: self.streams and self.idle())
        @rule(data=st.data())
        def fork(self, data: st.DataObject) -> None:
            src = data.draw(st.sampled_from(sorted(self.streams)))
            self.fork_into(src, data.draw(st.sampled_from(self.idle())))

        def fork_into(self, src: int, dst: int) -> None:
            """prepare_fork_request: one call, which the model takes as sharing
            the full pages and allocating the part page's copy."""
            tokens = self.streams[src]
            full = len(tokens) // ps
            part = len(self.table(src)) - full
            free = self.do(M.NumFree())
            if part and isinstance(free, M.Count) and free.n < part:
                return  # transformers forks nothing then; the scheduler waits
            share = M.Share(dst, self.table(src)[:full])
            self.prompts[dst] = self.prompts[src]
            self.streams[dst] = tokens
            if not part:
                self.do(share)
                return
            w1, s1 = self.model.step(self.state, share)
            alloc = M.Allocate(dst, part)
            w2, s2 = self.model.step(s1, alloc)
            self.note(share, w1, s1)
            got = M.Pages(self.tp.fork(src, dst, len(tokens), w2))
            bad = _check(self.model, s1, alloc, w2, s2, got, self.tp)
            assert w1 == M.Ok() and bad is None, f"fork: {bad}"
            self.state = s2
            assert isinstance(w2, M.Pages)
            assert isinstance(self.do(M.Write(dst, w2.pages[0],
                                              self.contents(tokens)[-1])), M.Ok)

        @precondition(lambda self: self.streams)
        @rule(data=st.data(), no_cache=st.sampled_from((False, False, True)))
        def finish(self, data: st.DataObject, no_cache: bool) -> None:
            h = data.draw(st.sampled_from(sorted(self.streams)))
            self.release_all(h, no_cache)
            del self.streams[h]
            self.prompts.pop(h, None)

        @rule()
        def evict(self) -> None:
            self.do(M.ResetPrefixCache())

        # the queries are one rule, so they do not crowd out the engine's steps
        @rule(data=st.data(), which=st.integers(0, 2), k=st.integers(1, len(BASE)),
              at=st.one_of(st.none(), st.integers(0, 7)))
        def query(self, data: st.DataObject, which: int, k: int, at: int | None) -> None:
            if which == 0:
                self.do(M.Lookup(prompt(k, at)))
                self.do(M.NumFree())
            elif which == 1:
                pick = data.draw(st.sets(st.sampled_from(list(holders)), min_size=1))
                self.do(M.Reclaimable(tuple((h, self.table(h)[::-1]) for h in sorted(pick))))
            else:
                self.do(M.Allocate(data.draw(st.sampled_from(list(holders))),
                                   scope.pages + 1))

    return TfLockstep


def run_tf_lockstep(tf: Tf, examples: int = 100, steps: int = 25,
                    scope: M.Scope = ENGINE_SCOPE,
                    machine: type[RuleBasedStateMachine] | None = None) -> LockstepReport:
    return run_lockstep(machine or lockstep_machine(tf, scope), budget(examples, steps))


# ------------------------------------------------------------------ replay


def replay(tf: Tf, scope: M.Scope = REPLAY_SCOPE, first: bool = False,
           sector: int = 1) -> ReplayReport:
    """Every state the model reaches within `scope.depth` calls of its protocol,
    each call compared on the cache reset and brought to the state by its trace
    (a reset costs less than building a cache).  `first`: stop at the first
    disagreement."""
    tp = TfPool(tf, scope, sector)

    def bring(trace: Trace) -> TfPool:
        tp.reset()
        for b, want in trace:
            tp.step(b, want)
        return tp

    return replay_pages(scope, bring, compare, first)


# ------------------------------------------------------------------ CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvref.testing.transformers_pool",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=100)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--depth", type=int, default=REPLAY_SCOPE.depth)
    ap.add_argument("--plants", action="store_true",
                    help="plant the classes this cache is exposed to in scratch copies")
    args = ap.parse_args(argv)
    tf = load()
    print(f"transformers {tf.version}: {tf.where}")
    bad = print_clean_run(DIFFERENCES, run_tf_lockstep(tf, args.examples, args.steps),
                          replay(tf, replace(REPLAY_SCOPE, depth=args.depth)))
    if args.plants:
        from kvref.testing.transformers_plants import PLANTS, PatchMissing, planted_copy

        for name, plant in PLANTS.items():
            try:
                with planted_copy(Path(tf.where), plant) as root:
                    planted = load_copy(root)
                    got = run_tf_lockstep(planted, args.examples, args.steps)
                    short = replay(planted, replace(REPLAY_SCOPE, depth=args.depth),
                                   first=True)
            except PatchMissing as err:
                bad = True
                print(f"plant {name}: NOT PLANTED: {err}")
                continue
            bad |= print_plant(name, got, short)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
