"""The one model's hybrid scope (`Scope.groups`) in lockstep with vLLM's own
`HybridKVCacheCoordinator`: one full-attention group and one sliding-window
group over one BlockPool.

    python -m kvref.testing.vllm_hybrid --vllm PATH [--examples 200] [--depth 5]
        [--plants] [--round-robin]

PATH is a copy of vLLM's KV-manager files, as for `kvref.testing.vllm_pool`
(whose loader this module uses).  The adapter (`VllmHybrid`) plays vLLM's
scheduler over an unmodified `KVCacheManager`; each engine operation is a few
model actions on one side and the calls vLLM's scheduler makes on the other:

- start(rid, L, span): a new request of L prompt tokens, its prefix hit and
  its first chunk of `span` tokens.
  Model: Ingest, MatchPrefix(rid, 0, L), then compute(span) below.
  vLLM: get_computed_blocks (HybridKVCacheCoordinator.find_longest_cache_hit),
  then one allocate_slots(request, span, hit, hit blocks), as the scheduler
  admits a waiting request.  A refused first chunk changes nothing in vLLM
  (the request stays waiting, unallocated): the driver keeps the model's
  state from before the match, the match and admit undone as one.
- compute(rid, span): the next chunk of the prompt.
  Model: Admit(Step((Seg(rid, 0, span),), padded=(rid,))), Plan, Write,
  Commit (the window retires what it passed, W2), CachePrefix(rid, 0).
  vLLM: allocate_slots(request, span, delay_cache_blocks=True) (refused:
  None), num_computed_tokens += span, remove_skipped_blocks, cache_blocks:
  the scheduler's calls, with caching after the step (see `SAME_UNDER_NAMES`).
- finish(rid): Model Remove(rid); vLLM KVCacheManager.free.
- reset: Model ResetPrefixCache; vLLM KVCacheManager.reset_prefix_cache.

`observe` reads vLLM's state as the model's: each request's table per group
(the null block as an empty slot, 0), each block's ref count and key (its
chain depth, group and salt, read back from the block hash), the free queue,
the hash map's blocks per key.  Page ids are compared up to renaming.  vLLM's
documented behaviour differs from kvref's rules in ways stated as settings of
the model (`DIFFERENCES`, `VllmHybridModel`, `hybrid_scope`), never as special
cases of the comparison.

Out of scope (no such call in vLLM's KV manager, or not in this sub-protocol):
forks and copy-on-write (vLLM shares blocks only through the prefix cache),
truncate (a rejected draft is rolled back by the scheduler's token counts,
not by a manager call that frees), offload, reload, publish and retrieve
(KV connectors, outside the manager), preplans (vLLM schedules one step at
a time), Read, Reset of one request (vLLM preempts by free), several labels
per request (a vLLM request has one sequence), and decode past the prompt
(the prompt's ids are all the model's hit needs).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from kvref.testing.engine_search import Agreed, Differed, LockstepReport, budget, explore
from kvref.testing.engine_search import run_lockstep as run_machine
from kvref.testing.vllm_pool import Vllm, load
from kvref_model import pages as P
from kvref_model.core import (
    Admit,
    CachePrefix,
    Commit,
    Count,
    Ingest,
    MatchPrefix,
    Model,
    Ok,
    Plan,
    Refused,
    Remove,
    ResetPrefixCache,
    Result,
    Scope,
    Seg,
    State,
    Step,
    Write,
)

TOKEN = 7  # every prompt's token id: the model's ids of a label are all one identity

# the model's rules vLLM's coordinator departs from (see DIFFERENCES)
VLLM_RULES: dict[str, bool] = {"H3_window_release_blank": False,
                               "H4_window_frees_head_first": False}
VllmHybridModel: type[Model] = type("VllmHybridModel", (Model,), dict(VLLM_RULES))

DIFFERENCES: tuple[tuple[str, str], ...] = (
    ("Scope.groups = (None, W - 1)", "vLLM's sliding_window W counts the token being "
     "computed: it keeps the W - 1 tokens before the next one (get_num_skipped_tokens "
     "= n - W + 1) and a hit needs cdiv(W - 1, block_size) blocks; the model's window "
     "W' keeps W' tokens before the next (W2's max(0, n - W' - k)), so vLLM's W is the "
     "model's W - 1 with margin 0"),
    ("Model.H3_window_release_blank = False", "blocks a window passes stay cached: "
     "remove_skipped_blocks frees them through free_blocks, a hashed block to the "
     "back of the free queue (the LRU); kvref's H3 returns them blank"),
    ("Model.H4_window_frees_head_first = False", "a request's blocks are freed tail "
     "first in every group (SingleTypeKVCacheManager.free, and _remove_blocks_in_range "
     "for what a window passes); kvref's H4 frees a window's head first"),
    ("Scope.duplicates = True", "vLLM keeps every block cached under one hash (two "
     "requests that computed the same prefix each cache theirs; a hit takes the oldest); "
     "kvref dedups on register (S11)"),
    ("Scope.blank_to_front = True", "a freed block with no hash goes to the front of "
     "the free queue (LIFO reuse); kvref queues it last"),
)
SAME_UNDER_NAMES: tuple[tuple[str, str], ...] = (
    ("null block", "vLLM's block 0 fills a table's skipped slots and is never "
     "freed or cached: the model's released slot, 0 in a stream's table"),
    ("group id in the hash", "vLLM files a block under its hash and its group id; "
     "the model's key names the group through the token identity (internal label)"),
    ("caching after the step", "vLLM's scheduler caches a chunk's full blocks at "
     "allocate_slots, before computing it, and frees what the window passed at the "
     "next chunk's allocate_slots; the adapter asks allocate_slots to delay caching "
     "(its P/D option) and calls remove_skipped_blocks and cache_blocks once the "
     "chunk is computed, the model's Commit and CachePrefix; a block filled and "
     "passed within one chunk is then never cached on either side"),
    ("one free queue", "vLLM's one free queue is the model's blank queue then its LRU "
     "(blank blocks only join at the front, hashed ones at the back)"),
)


def hybrid_scope(page_size: int = 1, window: int = 3, pages: int = 6, requests: int = 2,
                 max_span: int = 3, salts: tuple[str, ...] = (),
                 vllm: bool = True) -> Scope:
    """The model's scope for vLLM's config: one full group and one sliding-window
    group of vLLM window `window` (the model's `window - 1`).  `vllm=False`: the
    same workload under kvref's own rules (the pool settings off)."""
    if window < 2:
        raise ValueError("vLLM's sliding window keeps W - 1 tokens: W >= 2")
    return Scope(requests=requests, labels=1, device_pages=pages, host_pages=0,
                 page_size=page_size, max_span=max_span, depth=0, sharing=True,
                 groups=(None, window - 1), window_cache=True, salts=salts,
                 duplicates=vllm, blank_to_front=vllm)


# ------------------------------------------------------------------ observation


KeyName = tuple[int, int, str]  # (chain depth, group, salt)
# page ids compared up to renaming (pages numbered by first appearance in each
# state); off: as they are
RENAME = False


@dataclass(frozen=True)
class Observed:
    """A pool of hybrid streams, pages renamed by first appearance (tables in
    request and group order, then the free queue)."""

    tables: tuple[tuple[int, tuple[tuple[int, ...], ...]], ...]  # rid -> per group
    refs: tuple[int, ...]  # per renamed page 1..n
    keys: tuple[KeyName | None, ...]
    queue: tuple[int, ...]
    index: tuple[tuple[KeyName, tuple[int, ...]], ...]  # key -> its pages, map order

    def diff(self, other: Observed) -> str:
        out = []
        for name in ("tables", "queue", "refs", "keys", "index"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                out.append(f"{name}: vLLM {a}, model {b}")
        return "; ".join(out)


def _canon(tables: dict[int, tuple[tuple[int, ...], ...]], queue: tuple[int, ...],
           refs: dict[int, int], keys: dict[int, KeyName | None],
           index: dict[KeyName, tuple[int, ...]], n: int) -> Observed:
    name: dict[int, int] = {0: 0}
    if RENAME:
        walk = [p for rid in sorted(tables) for t in tables[rid] for p in t]
        for p in [*walk, *queue]:
            name.setdefault(p, len(name))
    for p in range(1, n + 1):
        name.setdefault(p, p if not RENAME else len(name))
    inv = {v: k for k, v in name.items()}
    return Observed(
        tables=tuple((rid, tuple(tuple(name[p] for p in t) for t in tables[rid]))
                     for rid in sorted(tables)),
        refs=tuple(refs.get(inv[i], 0) for i in range(1, n + 1)),
        keys=tuple(keys.get(inv[i]) for i in range(1, n + 1)),
        queue=tuple(name[p] for p in queue),
        index=tuple(sorted((k, tuple(name[p] for p in ps)) for k, ps in index.items())))


def _depth(k: P.Key) -> int:
    return 1 + (_depth(k.parent) if k.parent is not None else 0)


def model_view(m: Model, s: State) -> Observed:
    """The model's state as `observe` shows vLLM's."""
    g, pool = m.scope.group_count, s.pool
    assert pool is not None
    tables: dict[int, list[tuple[int, ...]]] = {}
    for (rid, lb), v in s.streams:
        tables.setdefault(rid, [()] * g)[lb % g] = v.table
    keys: dict[int, KeyName | None] = {}
    for p, pg in enumerate(pool.pages, 1):
        k = pg.key
        keys[p] = None if k is None else (_depth(k), k.tokens[0] % g, dict(k.extras)["salt"])
    index: dict[KeyName, list[int]] = {}
    for p in [*pool.order, *(q for q in range(1, len(pool.pages) + 1) if q not in pool.order)]:
        kn = keys[p]
        if kn is not None:
            index.setdefault(kn, []).append(p)
    return _canon({r: tuple(t) for r, t in tables.items()}, pool.blank + pool.lru,
                  {p: len(pg.holders) for p, pg in enumerate(pool.pages, 1)}, keys,
                  {k: tuple(v) for k, v in index.items()}, len(pool.pages))


# ------------------------------------------------------------------ adapter


class VllmHybrid:
    """vLLM's KVCacheManager over one full and one sliding-window group, played
    by the model's scheduler."""

    MAX_DEPTH = 16  # the longest chain of blocks a key is read back for

    def __init__(self, v: Vllm, scope: Scope) -> None:
        import torch  # vLLM's specs need a dtype; nothing is allocated

        self.v, self.scope = v, scope
        ps = scope.page_size
        w = scope.groups[1]
        assert scope.groups[0] is None and w is not None
        spec = dict(block_size=ps, num_kv_heads=1, head_size=8, dtype=torch.float32)
        iface = v.interface
        groups = [iface.KVCacheGroupSpec(["layers.0.attn"], iface.FullAttentionSpec(**spec)),
                  iface.KVCacheGroupSpec(["layers.1.attn"], iface.SlidingWindowSpec(
                      sliding_window=w + 1, **spec))]
        cfg = iface.KVCacheConfig(num_blocks=scope.device_pages + 1, kv_cache_tensors=[],
                                  kv_cache_groups=groups)
        self.manager = v.manager.KVCacheManager(
            kv_cache_config=cfg, max_model_len=1 << 12, scheduler_block_size=ps,
            hash_block_size=ps, enable_caching=True)
        self.pool = self.manager.block_pool
        self._hasher = v.utils.get_request_block_hasher(ps, v.hash_fn)
        self.requests: dict[int, Any] = {}  # rid -> its vLLM Request
        self._made = 0
        self._names: dict[bytes, KeyName] = {}

    def salt(self, rid: int) -> str:
        return self.scope.salts[rid] if self.scope.salts else ""

    def new_request(self, rid: int, length: int) -> Any:
        self._made += 1  # vLLM's request ids are never reused
        return self.v.request.Request(
            request_id=f"r{rid}.{self._made}", prompt_token_ids=[TOKEN] * length,
            sampling_params=self.v.sampling.SamplingParams(max_tokens=1),
            pooling_params=None, cache_salt=self.salt(rid) or None,
            block_hasher=self._hasher)

    def key_name(self, h: Any) -> KeyName:
        """The model's name of a block hash (with its group id)."""
        got = self._names.get(bytes(h))
        if got is None:
            for salt in {"", *self.scope.salts}:
                req = self.v.request.Request(
                    request_id="probe", prompt_token_ids=[TOKEN] * (
                        self.MAX_DEPTH * self.scope.page_size),
                    sampling_params=self.v.sampling.SamplingParams(max_tokens=1),
                    pooling_params=None, cache_salt=salt or None, block_hasher=self._hasher)
                for d, bh in enumerate(req.block_hashes, 1):
                    for g in range(2):
                        name = bytes(self.v.utils.make_block_hash_with_group_id(bh, g))
                        self._names[name] = (d, g, salt)
            got = self._names[bytes(h)]
        return got

    # ------------------------------------------------------------ operations

    def start(self, rid: int, length: int, span: int) -> tuple[int, bool]:
        """The hit, and whether the first chunk was allocated."""
        req = self.new_request(rid, length)
        blocks, hit, _ = self.manager.get_computed_blocks(req)
        span = min(span, length - hit)
        got = self.manager.allocate_slots(req, span, hit, blocks, delay_cache_blocks=True)
        if got is None:
            return hit, False
        self.requests[rid] = req
        req.num_computed_tokens = hit
        self._computed(req, span)
        return hit, True

    def compute(self, rid: int, span: int) -> bool:
        req = self.requests[rid]
        if self.manager.allocate_slots(req, span, delay_cache_blocks=True) is None:
            return False
        self._computed(req, span)
        return True

    def _computed(self, req: Any, span: int) -> None:
        req.num_computed_tokens += span
        self.manager.remove_skipped_blocks(req.request_id, req.num_computed_tokens)
        self.manager.cache_blocks(req, req.num_computed_tokens)

    def finish(self, rid: int) -> None:
        self.manager.free(self.requests.pop(rid))

    def reset(self) -> bool:
        return bool(self.manager.reset_prefix_cache())

    # ------------------------------------------------------------ observation

    def _queue(self) -> tuple[int, ...]:
        q = self.pool.free_block_queue
        out: list[int] = []
        b = q.fake_free_list_head.next_free_block
        while b is not None and b is not q.fake_free_list_tail and len(out) <= len(
                self.pool.blocks):
            out.append(b.block_id)
            b = b.next_free_block
        return tuple(out)

    def observe(self) -> Observed:
        from kvref.testing.vllm_pool import _map_entries

        n, pool = self.scope.device_pages, self.pool
        tables = {rid: tuple(tuple(b.block_id for b in blocks)
                             for blocks in self.manager.coordinator.get_blocks(req.request_id))
                  for rid, req in self.requests.items()}
        keys = {p: None if pool.blocks[p].block_hash is None
                else self.key_name(pool.blocks[p].block_hash) for p in range(1, n + 1)}
        index = {self.key_name(h): ids for h, ids in _map_entries(
            pool.cached_block_hash_to_block)}
        return _canon(tables, self._queue(), {p: pool.blocks[p].ref_cnt for p in range(1, n + 1)},
                      keys, index, n)


# ------------------------------------------------------------------ one operation


@dataclass(frozen=True)
class Op:
    kind: str  # start, compute, finish, reset
    rid: int = 0
    length: int = 0  # start: the prompt's tokens
    span: int = 0

    def __str__(self) -> str:
        if self.kind == "start":
            return f"start(r{self.rid}, {self.length} tokens, first chunk {self.span})"
        if self.kind == "compute":
            return f"compute(r{self.rid}, {self.span})"
        return f"{self.kind}(r{self.rid})" if self.kind == "finish" else "reset()"


@dataclass(frozen=True)
class World:
    """The model's state and what the driver knows of each request (its prompt's
    length): what the next operation is drawn from."""

    state: State
    prompts: tuple[tuple[int, int], ...] = ()  # rid -> prompt length, active requests

    def stored(self, rid: int) -> int:
        return dict(self.state.streams)[(rid, 0)].stored_len

    def todo(self, rid: int) -> int:
        return dict(self.prompts)[rid] - self.stored(rid)


def model_op(m: Model, w: World, op: Op) -> tuple[tuple[Any, ...], World]:
    """The model's actions for one operation: what it answers, and the world after."""
    s = w.state

    def run(*actions: Any) -> list[Result]:
        nonlocal s
        out = []
        for a in actions:
            r, s = m.step(s, a)
            out.append(r)
        return out

    def chunk(rid: int, span: int) -> bool:
        r, = run(Admit(Step((Seg(rid, 0, span),), padded=(rid,))))
        if isinstance(r, Refused):
            return False
        assert r == Ok(), r
        assert run(Plan(), Write(), Commit()) == [Ok()] * 3
        assert isinstance(run(CachePrefix(rid, 0))[0], Count)
        return True

    if op.kind == "start":
        _, hit = run(Ingest(op.rid), MatchPrefix(op.rid, 0, op.length))
        assert isinstance(hit, Count), hit
        if not chunk(op.rid, min(op.span, op.length - hit.n)):
            return (hit.n, False), w  # as vLLM's waiting request: nothing taken
        return (hit.n, True), World(s, tuple(sorted((*w.prompts, (op.rid, op.length)))))
    if op.kind == "compute":
        ok = chunk(op.rid, op.span)
        return (ok,), (World(s, w.prompts) if ok else w)
    if op.kind == "finish":
        assert run(Remove(op.rid)) == [Ok()]
        return (), World(s, tuple(p for p in w.prompts if p[0] != op.rid))
    r, = run(ResetPrefixCache())
    return (isinstance(r, Count),), World(s, w.prompts)


def vllm_op(vh: VllmHybrid, op: Op) -> tuple[Any, ...]:
    if op.kind == "start":
        return vh.start(op.rid, op.length, op.span)
    if op.kind == "compute":
        return (vh.compute(op.rid, op.span),)
    if op.kind == "finish":
        vh.finish(op.rid)
        return ()
    return (vh.reset(),)


@dataclass(frozen=True)
class Disagreement:
    op: Op
    want: tuple[Any, ...]
    got: str
    detail: str

    def __str__(self) -> str:
        return (f"{self.op}: vLLM {self.got}, model {self.want}"
                + (f" ({self.detail})" if self.detail else ""))


def compare(m: Model, w: World, op: Op, vh: VllmHybrid) -> tuple[World, Disagreement | None]:
    """Both sides run `op`; the model's world after, and what differed."""
    want, after = model_op(m, w, op)
    try:
        got = vllm_op(vh, op)
    except Exception as err:  # a vLLM assertion or error: a disagreement too
        return after, Disagreement(op, want, f"raised {type(err).__name__}: {err}"[:200], "")
    if got != want:
        return after, Disagreement(op, want, str(got), "")
    seen, expected = vh.observe(), model_view(m, after.state)
    if seen != expected:
        return after, Disagreement(op, want, str(got), seen.diff(expected))
    return after, None


def ops(m: Model, w: World, lengths: tuple[int, ...], spans: tuple[int, ...]) -> Iterator[Op]:
    """Every operation of the sub-protocol in `w`: a start of each idle request
    (each prompt length, each first chunk), each chunk of an active prompt not
    yet computed, a finish of each active request, and a reset."""
    active = dict(w.prompts)
    for rid in range(m.scope.requests):
        if rid not in active:
            for n in lengths:
                for span in spans:
                    yield Op("start", rid, n, span)
        else:
            for span in spans:
                if span <= w.todo(rid):
                    yield Op("compute", rid, span=span)
            yield Op("finish", rid)
    yield Op("reset")


# ------------------------------------------------------------------ lockstep


ENGINE_SCOPE = hybrid_scope(page_size=1, window=3, pages=6, requests=3, max_span=3)
ENGINE_SCOPE_2 = hybrid_scope(page_size=2, window=3, pages=7, requests=3, max_span=4)
MAX_PROMPT = 8


def lockstep_machine(v: Vllm, scope: Scope = ENGINE_SCOPE,
                     model: type[Model] = VllmHybridModel) -> type[RuleBasedStateMachine]:
    """A Hypothesis machine that plays vLLM's scheduler over both: requests
    start (a hit, a first chunk), compute their prompts in chunks, finish;
    resets.  Every operation is compared by `compare`."""
    rids = range(scope.requests)

    class HybridLockstep(RuleBasedStateMachine):
        runs = 0
        hits: ClassVar[list[int]] = []  # the non-zero hits seen (the tests ask for some)

        def __init__(self) -> None:
            super().__init__()
            type(self).runs += 1
            self.m = model(scope)
            self.w = World(self.m.init())
            self.vh = VllmHybrid(v, scope)

        def do(self, op: Op) -> tuple[Any, ...]:
            want, _ = model_op(self.m, self.w, op)
            self.w, bad = compare(self.m, self.w, op, self.vh)
            assert bad is None, str(bad)
            return want

        def idle(self) -> list[int]:
            return [r for r in rids if r not in dict(self.w.prompts)]

        def busy(self) -> list[int]:
            return [r for r, _ in self.w.prompts if self.w.todo(r) > 0]

        @precondition(lambda self: self.idle())
        @rule(data=st.data(), n=st.integers(1, MAX_PROMPT), span=st.integers(1, scope.max_span))
        def start(self, data: st.DataObject, n: int, span: int) -> None:
            rid = data.draw(st.sampled_from(self.idle()))
            hit, _ = self.do(Op("start", rid, n, span))
            if hit:
                self.hits.append(hit)

        @precondition(lambda self: self.busy())
        @rule(data=st.data(), span=st.integers(1, scope.max_span))
        def compute(self, data: st.DataObject, span: int) -> None:
            rid = data.draw(st.sampled_from(self.busy()))
            self.do(Op("compute", rid, span=min(span, self.w.todo(rid))))

        @precondition(lambda self: self.w.prompts)
        @rule(data=st.data())
        def finish(self, data: st.DataObject) -> None:
            rid = data.draw(st.sampled_from([r for r, _ in self.w.prompts]))
            self.do(Op("finish", rid))

        @rule()
        def reset(self) -> None:
            self.do(Op("reset"))

    return HybridLockstep


def run_lockstep(v: Vllm, examples: int = 200, steps: int = 30, scope: Scope = ENGINE_SCOPE,
                 machine: type[RuleBasedStateMachine] | None = None) -> LockstepReport:
    return run_machine(machine or lockstep_machine(v, scope), budget(examples, steps))


# ------------------------------------------------------------------ replay

# two scopes: pages of one token (a window of two pages, so head and tail
# differ: H4), and of two (part pages, freed blank: blank_to_front)
REPLAY_SCOPE = hybrid_scope(page_size=1, window=3, pages=6, requests=2, max_span=4)
REPLAY_SCOPE_2 = hybrid_scope(page_size=2, window=3, pages=5, requests=2, max_span=4)
REPLAY_LENGTHS = (3, 5)
REPLAY_SPANS = (1, 2, 4)


@dataclass
class ReplayReport:
    scope: Scope
    states: int = 0
    edges: int = 0
    unexpressible: int = 0  # every operation has a vLLM call: stays 0
    seconds: float = 0.0
    findings: dict[str, tuple[list[Op], Disagreement]] = field(default_factory=dict)

    def table(self) -> str:
        lines = [f"states {self.states}   operations compared {self.edges}   "
                 f"{self.seconds:.1f}s"]
        if not self.findings:
            lines.append("disagreements: none")
        for kind, (trace, bad) in sorted(self.findings.items()):
            lines.append(f"disagreement on {kind}, shortest trace:")
            lines += [f"    {i}. {op}" for i, op in enumerate(trace, 1)]
            lines.append(f"    {len(trace) + 1}. {bad}")
        return "\n".join(lines)


def replay(v: Vllm, scope: Scope = REPLAY_SCOPE, depth: int = 5,
           lengths: tuple[int, ...] = REPLAY_LENGTHS, spans: tuple[int, ...] = REPLAY_SPANS,
           model: type[Model] = VllmHybridModel, first: bool = False) -> ReplayReport:
    """Every world the model reaches within `depth` operations, each operation
    compared on a fresh vLLM manager brought there by the trace; see
    `engine_search.explore`."""
    m, rep = model(scope), ReplayReport(scope)

    def judge(trace: list[Op], w: World, op: Op) -> Agreed[World, Op] | Differed[Disagreement]:
        vh = VllmHybrid(v, scope)
        for b in trace:
            vllm_op(vh, b)
        after, bad = compare(m, w, op, vh)
        return Differed(op.kind, bad) if bad is not None else Agreed(after, op)

    explore(rep, World(m.init()), depth, lambda w: w, lambda w: ops(m, w, lengths, spans),
            judge, first)
    return rep


# ------------------------------------------------------------------ round robin


def round_robin(v: Vllm | None, sessions: int = 3, turns: int = 4, pages: int = 16,
                page_size: int = 2, window: int = 5, first: int = 6, grow: int = 4,
                model: type[Model] = VllmHybridModel, vllm_rules: bool = True
                ) -> list[list[int]]:
    """vLLM 48435's shape: `sessions` chats take turns, each turn re-sending its
    prompt grown by `grow` tokens (a salt per session keeps their prefixes
    apart), computed in one chunk and finished.  The hit of each turn, per
    session: on vLLM when `v` is given (checked against the model step by step),
    else on the model alone."""
    salts = tuple(f"s{i}" for i in range(sessions))
    scope = hybrid_scope(page_size=page_size, window=window, pages=pages, requests=sessions,
                         max_span=first + grow * turns, salts=salts, vllm=vllm_rules)
    m = model(scope)
    w = World(m.init())
    vh = VllmHybrid(v, scope) if v is not None else None
    hits: list[list[int]] = [[] for _ in range(sessions)]
    for t in range(turns):
        n = first + grow * t
        for rid in range(sessions):
            for op in (Op("start", rid, n, n), Op("finish", rid)):
                if op.kind == "finish" and rid not in dict(w.prompts):
                    continue  # refused: nothing to finish
                if vh is None:
                    want, w = model_op(m, w, op)
                else:
                    want, _ = model_op(m, w, op)
                    w, bad = compare(m, w, op, vh)
                    assert bad is None, str(bad)
                if op.kind == "start":
                    hits[rid].append(want[0])
    return hits


# ------------------------------------------------------------------ CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvref.testing.vllm_hybrid",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm", required=True, help="a copy of vLLM's KV-manager files")
    ap.add_argument("--examples", type=int, default=100)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--plants", action="store_true",
                    help="plant vLLM's historic hybrid defects in scratch copies")
    ap.add_argument("--round-robin", action="store_true",
                    help="vLLM 48435's sessions: hits per session, vLLM and kvref's rules")
    args = ap.parse_args(argv)
    v = load(args.vllm)
    print(f"vLLM copy: {v.root}")
    print("differences, as settings of the model:")
    print("\n".join(f"  {name}: {what}" for name, what in DIFFERENCES))
    bad = False
    for sc, rsc in ((ENGINE_SCOPE, REPLAY_SCOPE), (ENGINE_SCOPE_2, REPLAY_SCOPE_2)):
        lock = run_lockstep(v, args.examples, args.steps, sc)
        rep = replay(v, rsc, depth=args.depth)
        bad |= lock.failure is not None or bool(rep.findings)
        print(f"page size {sc.page_size}: lockstep {lock.examples} examples, "
              f"{lock.seconds:.1f}s: " + (lock.failure or "no disagreement"))
        print("  exhaustive replay: " + rep.table().replace("\n", "\n  "))
    if args.plants:
        from kvref.testing.vllm_plants import HYBRID_PLANTS, PatchMissing, planted_copy

        for name, plant in HYBRID_PLANTS.items():
            try:
                with planted_copy(v.root, plant) as (root, form):
                    pv = load(root)
                    got = [run_lockstep(pv, args.examples, args.steps, sc)
                           for sc in (ENGINE_SCOPE, ENGINE_SCOPE_2)]
            except PatchMissing as err:
                bad = True
                print(f"plant {name} ({plant.anchor}): NOT PLANTED: {err}")
                continue
            found = [g for g in got if g.failure is not None]
            bad |= not found
            print(f"plant {name} ({plant.anchor}, {form}): " + (
                "; ".join(f"found at example {g.examples}, {g.seconds:.1f}s: "
                          f"{(g.failure or '')[:200]}" for g in found) or "NOT FOUND"))
        load(args.vllm)
    if args.round_robin:
        for pages in (16, 24, 32, 48):
            print(f"round robin, {pages} pages: vLLM {round_robin(v, pages=pages)}, "
                  f"kvref's rules {round_robin(None, pages=pages, model=Model, vllm_rules=False)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
