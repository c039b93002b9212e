"""kvref's KVManager with sliding-window retention, in lockstep with
kvref_model.retention (specs/retention.md, W1-W14; issue 19).

Hypothesis drives the manager (``KVConfig.retention`` windows two of its
three labels) and the retention model through the same calls: appends
(admit, plan, write, commit of one segment, then the window's release),
copy-on-write forks between labels of one window (and refused ones between
a windowed and a full label), truncates (the refused ones into the released
prefix too), removals, offload and reload, `cache_prefix` and
`match_prefix`. After every call it compares:

- the answer (a count, a refusal with its `pages_short`, a misuse's kind);
- every stream's length, `released` and `position`, and its page table,
  page for page (kvref's ``page_indices`` holds the retained slots, the
  model's table less its released ones);
- the pool: each page's holders and key, the LRU order and the free-blank
  queue;
- the bytes: every resident stream reads back its window (`read_stream`)
  as the K/V of its own tokens at their positions;
- `check_device_pages`.

The model's invariants (kvref_model/retention_invariants.py: the bound of W3
among them) hold on every state along kvref's runs. Plants in kvref, found
by this machine within the same budget: test_retention_kvref_plants.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from kvref import (
    KVConfig,
    KVManager,
    KVRefError,
    KVStep,
    OffloadOutcome,
    ReloadOutcome,
    ReloadReason,
    RetentionPolicy,
    Segment,
    StepContext,
)
from kvref.stepping.step import AllocationFailed, RequestOffloading
from kvref.testing.page_checks import check_device_pages
from kvref.transfer.engine import TransferEngineInfo
from kvref_model import retention as R
from kvref_model.retention_invariants import violations

SCOPE = R.Scope(pages=8, page_size=2, windows=(3, 3, None), requests=2, alphabet=2,
                max_len=9)
LAYERS = 2
LABELS = ("w0", "w1", "full")
NL = len(LABELS)

BUDGET = settings(max_examples=500, stateful_step_count=40, derandomize=True,
                  database=None, deadline=None, phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=[HealthCheck.too_slow], print_blob=False)


def rid_name(rid: int) -> str:
    return f"r{rid}"


def value(token: int, pos: int, layer: int) -> float:
    return float((token * 100 + pos) * 4 + layer)


TOKENS = st.lists(st.integers(0, SCOPE.alphabet - 1), min_size=1, max_size=3).map(tuple)
RIDS = st.integers(0, SCOPE.requests - 1)
LBLS = st.integers(0, NL - 1)


class RetentionLockstep(RuleBasedStateMachine):
    seen: ClassVar[set[str]] = set()

    def __init__(self, scope: R.Scope = SCOPE) -> None:
        super().__init__()
        self.scope = scope
        self.model = R.RetentionModel(scope)
        self.state = self.model.init()
        margins = scope.margins or (0,) * scope.labels
        retention = {LABELS[i]: RetentionPolicy(w, rollback_margin=margins[i])
                     for i, w in enumerate(scope.windows) if w is not None}
        cfg = KVConfig(num_layers=LAYERS, num_kv_heads=1, head_dim=1, max_seq_len=64,
                       max_num_pages=scope.pages + 1, page_size=scope.page_size,
                       cpu_offload_pages=scope.requests * NL * scope.max_len,
                       num_qo_heads=1, retention=retention,
                       enable_prefix_caching=scope.sharing)
        self.kv = KVManager(cfg, "kv", None, TransferEngineInfo(), "cpu",
                            dtype=torch.float32)
        self.cfg = cfg
        self._peer: KVManager | None = None  # a retrieve's publisher, made on first use

    # ------------------------------------------------------------ lockstep

    def step(self, action: R.Action, call: Any) -> R.Result:
        want, after = self.model.step(self.state, action)
        try:
            got = call()
        except KVRefError as err:
            got = R.Misuse(type(err).__name__)
        got = self.as_model(got)
        assert got == want, f"{action}: kvref {got}, model {want}"
        self.seen.add(f"{type(action).__name__}:{type(want).__name__}")
        broken = violations(self.model, after, action, want, self.state)
        assert not broken, f"{action}: the model's invariants broke along kvref's run: {broken}"
        self.state = after
        return want

    def live(self, s: R.State, rid: int, label: int) -> set[int]:
        st_ = s.streams[self.model.holder(rid, label)]
        return set() if st_ is None else {p for p in st_.table if p is not None}

    def leaves_spares(self, before: R.State, after: R.State, fork: R.Fork) -> bool:
        """Whether a copying fork (sharing off) let go of target pages past the
        source's retained slots: kvref keeps them as spares, the model's slot
        tables (V1) cannot, so such a fork is not compared."""
        return bool(self.live(before, fork.rid, fork.dst) - self.live(after, fork.rid, fork.dst))

    def step_many(self, actions: tuple[R.Append | R.Fork, ...], call: Any) -> None:
        """One kvref step that is several model actions in order (a write and a
        post-fork, a pre-fork and a write onto its target), sharing off. kvref
        admits the whole step before its commit releases anything (R1): it
        needs every page the actions allocate, and with fewer free it refuses
        the step, changing nothing. Not compared where the model refuses one
        of the actions (kvref answers for the whole step) or a fork leaves
        spares (`leaves_spares`)."""
        path, s, need = [], self.state, 0
        for a in actions:
            want, after = self.model.step(s, a)
            if not isinstance(want, R.Ok):
                return
            if isinstance(a, R.Fork) and self.leaves_spares(s, after, a):
                return
            # the stream the action gives pages: the writer, or the fork's target
            rid, label = (a.rid, a.dst) if isinstance(a, R.Fork) else (a.rid, a.label)
            need += len(self.live(after, rid, label) - self.live(s, rid, label))
            path.append((s, a, want, after))
            s = after
        free = self.model.num_free(self.state)
        result: R.Result = R.Ok() if need <= free else R.AllocationFailed(need - free)
        try:
            got = call()
        except KVRefError as err:
            got = R.Misuse(type(err).__name__)
        got = self.as_model(got)
        assert got == result, f"{actions}: kvref {got}, model {result}"
        name = "+".join(type(a).__name__ for a in actions)
        self.seen.add(f"{name}:{type(result).__name__}")
        if isinstance(result, R.Ok):
            for before, a, want, after in path:
                broken = violations(self.model, after, a, want, before)
                assert not broken, f"{a}: the model's invariants broke along kvref's run: {broken}"
            self.state = s

    @staticmethod
    def as_model(got: Any) -> R.Result:
        if isinstance(got, R.Misuse):
            return got
        if got is None:
            return R.Ok()
        if isinstance(got, AllocationFailed):
            return R.AllocationFailed(got.pages_short)
        if isinstance(got, RequestOffloading):
            return R.Misuse(R.UNAVAILABLE)
        if isinstance(got, OffloadOutcome | ReloadOutcome):
            if got.reason is None:
                return R.Count(got.pages_freed if isinstance(got, OffloadOutcome)
                               else got.pages_taken)
            if got.reason is ReloadReason.DEVICE_FULL:
                return R.AllocationFailed(got.pages_short)
            return R.Refused(got.reason.name)
        assert isinstance(got, int) and not isinstance(got, bool), got
        return R.Count(got)

    def ingest(self, rid: int) -> None:
        name = rid_name(rid)
        if not self.kv.has_request(name):
            self.kv.ingest_request(name)
            # every label's stream, empty, in the model's order: a removal or
            # an offload goes through them in the order they were made, the
            # model in label order
            for lb in LABELS:
                self.kv.match_prefix(name, lb, [])

    def stream(self, rid: int, label: int) -> R.Stream | None:
        return self.state.streams[self.model.holder(rid, label)]

    def known(self, rid: int) -> bool:
        return any(self.stream(rid, lb) is not None for lb in range(NL))

    def length(self, rid: int, label: int) -> int:
        st_ = self.stream(rid, label)
        return st_.n if st_ is not None else 0

    def run_step(self, rid: int, label: int, tokens: tuple[int, ...],
                 pre_forks: tuple[tuple[str, str], ...] = (), kv: KVManager | None = None,
                 name: str | None = None, post_forks: tuple[tuple[str, str], ...] = ()
                 ) -> Any:
        """One admit, plan, write, commit on `kv` (this manager; or the peer)."""
        kv = self.kv if kv is None else kv
        name, lb = rid_name(rid) if name is None else name, LABELS[label]
        step = KVStep([Segment(name, lb, len(tokens))], pre_forks=pre_forks,
                      post_forks=post_forks)
        ctx = StepContext((name,))
        out = kv.admit(step, ctx)
        if not out.ok:
            return out.reason
        plans = kv.plan(step, ctx)
        if tokens:
            (view,) = [v for out in plans.values() for v in out.views]
            stream = kv._streams[name][lb]
            # W1, W4: the view starts at the first retained page
            assert view.offset == stream.released, (view, stream)
            # the absolute position of the first token written
            start = view.offset + view.length - view.to_compute
            for layer in range(LAYERS):
                k = torch.tensor([value(t, start + i, layer) for i, t in enumerate(tokens)])
                kv.write_kv(k.view(-1, 1, 1), -k.view(-1, 1, 1), layer_idx=layer, label=lb)
        kv.commit(step, ctx)
        return None

    def run_retrieve(self, rid: int, label: int, tokens: tuple[int, ...]) -> Any:
        """A peer of this config commits `tokens` to the label in one step and
        publishes; this manager retrieves, and the copy lands (W16, W17)."""
        if self._peer is None:
            self._peer = KVManager(self.cfg.copy(), "peer", None, TransferEngineInfo(), "cpu",
                                   dtype=torch.float32)
        peer, name, lb = self._peer, rid_name(rid), LABELS[label]
        peer.ingest_request("p")
        try:
            peer.match_prefix("p", lb, [])
            assert self.run_step(rid, label, tokens, kv=peer, name="p") is None
            pub = peer.publish("p")
            assert pub, pub
            info, ps = pub.get(0)[lb], self.scope.page_size
            # W17: the publication names the retained pages only
            assert len(info.page_indices) == -(-len(tokens) // ps) - info.released // ps
            out = self.kv.admit_retrieve(name, None, None, pub)
            if not out.ok:
                return out.reason
            for s in self.kv._streams[name].values():
                if s.read_future is not None:
                    s.read_future.result(timeout=10)
            done = self.kv.admit_retrieve(name, None, None, pub)
            assert done.ok and done.ready, done
            return None
        finally:
            peer.release_published("p")
            peer.remove_request("p")

    # ------------------------------------------------------------ rules

    @rule(rid=RIDS, label=LBLS, tokens=TOKENS)
    def append(self, rid: int, label: int, tokens: tuple[int, ...]) -> None:
        if self.length(rid, label) + len(tokens) > self.scope.max_len:
            return
        self.ingest(rid)
        self.step(R.Append(rid, label, tokens), lambda: self.run_step(rid, label, tokens))

    @rule(rid=RIDS, label=LBLS, n=st.integers(1, 4))
    def decode_many(self, rid: int, label: int, n: int) -> None:
        """Decode steps one token each: the window slides page by page."""
        for i in range(n):
            self.append(rid, label, (i % self.scope.alphabet,))

    @rule(rid=RIDS, src=LBLS, dst=LBLS)
    def fork(self, rid: int, src: int, dst: int) -> None:
        if src == dst or self.stream(rid, src) is None:
            # a fork onto itself is a malformed step; kvref's fork from a label
            # the request lacks copies nothing (R20)
            return
        action = R.Fork(rid, src, dst)
        if self.stream(rid, dst) is not None:
            # with sharing, a target that already holds pages keeps its private
            # ones (R51), where the model releases them; without, kvref keeps
            # a copy target's surplus as spares: neither compared
            if self.scope.sharing:
                return
            _, after = self.model.step(self.state, action)
            if self.leaves_spares(self.state, after, action):
                return
        self.step(action, lambda: self.run_step(
            rid, src, (), pre_forks=((LABELS[src], LABELS[dst]),)))

    def same_retention(self, src: int, dst: int) -> bool:
        sc = self.scope
        margins = sc.margins or (0,) * sc.labels
        return src != dst and (sc.windows[src], margins[src]) == (sc.windows[dst], margins[dst])

    @rule(rid=RIDS, src=LBLS, dst=LBLS, tokens=TOKENS)
    def write_then_fork(self, rid: int, src: int, dst: int, tokens: tuple[int, ...]) -> None:
        """Sharing off: one step writes `tokens` to `src` and post-forks it onto
        `dst`, which may have released more than the source holds (issue 27,
        defect 2: admit reserved nothing and commit failed after the span)."""
        if self.scope.sharing or not self.same_retention(src, dst) or (
                self.length(rid, src) + len(tokens) > self.scope.max_len):
            return
        self.ingest(rid)
        self.step_many((R.Append(rid, src, tokens), R.Fork(rid, src, dst)),
                       lambda: self.run_step(rid, src, tokens,
                                             post_forks=((LABELS[src], LABELS[dst]),)))

    @rule(rid=RIDS, src=LBLS, dst=LBLS, tokens=TOKENS)
    def fork_then_write(self, rid: int, src: int, dst: int, tokens: tuple[int, ...]) -> None:
        """Sharing off: one step pre-forks `src` onto `dst` and writes `tokens`
        to the target (issue 27, defect 1: the fork reserved a page for every
        slot from token 0, the released ones too)."""
        if self.scope.sharing or not self.same_retention(src, dst) or (
                self.stream(rid, src) is None or not self.length(rid, src)
                or self.length(rid, src) + len(tokens) > self.scope.max_len):
            return
        self.step_many((R.Fork(rid, src, dst), R.Append(rid, dst, tokens)),
                       lambda: self.run_step(rid, dst, tokens,
                                             pre_forks=((LABELS[src], LABELS[dst]),)))

    @rule(rid=RIDS, label=LBLS, back=st.integers(-1, SCOPE.max_len))
    def truncate(self, rid: int, label: int, back: int) -> None:
        if self.stream(rid, label) is None:
            return
        n = max(0, self.length(rid, label) - back) if back >= 0 else self.length(
            rid, label) + 1
        st_ = self.stream(rid, label)
        released, old_len = (0, 0) if st_ is None else (st_.released, st_.n)
        got = self.step(R.Truncate(rid, label, n),
                        lambda: self.kv.truncate(rid_name(rid), LABELS[label], n))
        if released and n < old_len and isinstance(got, R.Count):
            # a rollback over a stream that already let pages go (W15's case)
            self.seen.add("Truncate:Count:released")

    @rule(rid=RIDS, label=LBLS, tokens=TOKENS, reject=st.integers(0, 3))
    def speculate(self, rid: int, label: int, tokens: tuple[int, ...], reject: int) -> None:
        """A verify step: commit the drafts, then truncate the rejected ones
        (the rollback a margin keeps legal, W15; refused past it, W6)."""
        if self.stream(rid, label) is None:
            return
        before = self.length(rid, label)
        self.append(rid, label, tokens)
        if self.length(rid, label) > before:
            self.truncate(rid, label, min(reject, len(tokens)))

    @rule(rid=RIDS, label=LBLS, tokens=st.lists(st.integers(0, SCOPE.alphabet - 1),
                                                max_size=SCOPE.max_len).map(tuple))
    def retrieve(self, rid: int, label: int, tokens: tuple[int, ...]) -> None:
        """A peer's tokens; those up to this stream's length are not copied, so
        a prefix unlike its own shows a copy that starts too early."""
        if len(tokens) > self.scope.max_len:
            return
        st_ = self.stream(rid, label)
        released = 0 if st_ is None else st_.released
        self.ingest(rid)
        got = self.step(R.Retrieve(rid, label, tokens),
                        lambda: self.run_retrieve(rid, label, tokens))
        st_ = self.stream(rid, label)
        if isinstance(got, R.Ok) and st_ is not None and st_.released > released:
            self.seen.add("Retrieve:Ok:released")  # it took the peer's released prefix

    @rule(rid=RIDS)
    def remove(self, rid: int) -> None:
        self.step(R.Remove(rid), lambda: self.kv.remove_request(rid_name(rid)))

    @rule(rid=RIDS)
    def offload(self, rid: int) -> None:
        if not self.known(rid):
            return
        self.step(R.Offload(rid), lambda: self.kv.offload_outcome(rid_name(rid)))

    @rule(rid=RIDS)
    def reload(self, rid: int) -> None:
        if not self.known(rid):
            return
        self.step(R.Reload(rid), lambda: self.kv.reload_outcome(rid_name(rid)))

    @rule(rid=RIDS, label=LBLS)
    def cache_prefix(self, rid: int, label: int) -> None:
        st_ = self.stream(rid, label)
        if st_ is None:
            return
        tokens = list(st_.tokens)
        self.step(R.CachePrefix(rid, label),
                  lambda: self.kv.cache_prefix(rid_name(rid), LABELS[label], tokens))

    @rule(rid=RIDS, label=LBLS, donor=st.integers(0, SCOPE.requests * NL - 1), tail=TOKENS)
    def match_prefix(self, rid: int, label: int, donor: int, tail: tuple[int, ...]) -> None:
        st_ = self.stream(rid, label)
        if st_ is not None and st_.n:
            return
        d = self.state.streams[donor]
        prompt = (d.tokens if d is not None else ()) + tail
        self.ingest(rid)
        self.step(R.MatchPrefix(rid, label, prompt),
                  lambda: self.kv.match_prefix(rid_name(rid), LABELS[label], list(prompt)))

    # ------------------------------------------------------------ checks

    @invariant()
    def same_pages_and_bytes(self) -> None:
        kv, s = self.kv, self.state
        check_device_pages(kv)
        assert kv.num_free_pages == self.model.num_free(s), (
            f"free: kvref {kv.num_free_pages}, model {self.model.num_free(s)}")
        snap = kv._pages.snapshot()
        for p in range(1, self.scope.pages + 1):
            pg = s.pool.page(p)
            owners = {(rid_name(h // NL), LABELS[h % NL]) for h in pg.holders}
            assert snap.holders[p - 1] == owners, (
                f"page {p}: kvref holders {set(snap.holders[p - 1])}, model {owners}")
            # the model keys pages without extras, kvref with the label: with one
            # full-attention label (windowed ones never register, W9) the same
            # pages are keyed and found; compare which are
            assert (snap.keys[p - 1] is None) == (pg.key is None), f"page {p}: keys differ"
        assert snap.lru == s.pool.lru, f"LRU: kvref {snap.lru}, model {s.pool.lru}"
        assert snap.blank == s.pool.blank, f"blank: kvref {snap.blank}, model {s.pool.blank}"
        ps = self.scope.page_size
        for rid in range(self.scope.requests):
            name = rid_name(rid)
            for label in range(NL):
                st_ = self.stream(rid, label)
                stream = kv._streams.get(name, {}).get(LABELS[label])
                where = f"{name}/{LABELS[label]}"
                if st_ is None:
                    assert stream is None or (stream.stored_len == 0
                                              and not stream.page_indices), where
                    continue
                assert stream is not None, f"{where}: kvref has none, model {st_}"
                assert stream.stored_len == st_.n, (where, stream, st_)
                assert stream.released == st_.released, (
                    f"{where}: released kvref {stream.released}, model {st_.released}")
                assert stream.position == st_.position, (
                    f"{where}: position kvref {stream.position}, model {st_.position}")
                assert stream.offloaded == st_.offloaded, (where, stream, st_)
                table = tuple(p for p in st_.table if p is not None)
                assert tuple(stream.page_indices) == table, (
                    f"{where}: kvref pages {stream.page_indices}, model {st_.table}")
                if st_.n and not st_.offloaded:
                    got = kv.read_stream(name, LABELS[label])
                    first = self.model.window_start(self.model.holder(rid, label), st_.n)
                    want = torch.tensor([[value(st_.tokens[i], i, layer)
                                          for i in range(first, st_.n)]
                                         for layer in range(LAYERS)])
                    assert torch.equal(got[:, :, 0].flatten(1), want), (
                        f"{where} reads back other K than its window's tokens")
                    assert len(stream.page_indices) <= -(-(st_.n - stream.released) // ps)


def test_retention_lockstep() -> None:
    RetentionLockstep.seen.clear()
    run_state_machine_as_test(RetentionLockstep, settings=BUDGET)
    # the run reached what it claims to check
    wanted = {"Append:Ok", "Append:AllocationFailed", "Fork:Ok", "Fork:Misuse",
              "Truncate:Count", "Truncate:Misuse", "Offload:Count", "Reload:Count",
              "CachePrefix:Count", "MatchPrefix:Count", "Retrieve:Ok", "Retrieve:Ok:released",
              "Retrieve:AllocationFailed"}
    missing = wanted - RetentionLockstep.seen
    assert not missing, f"never arose: {sorted(missing)}"


# W15: each windowed label keeps a rollback margin of one token
MARGIN = replace(SCOPE, margins=(1, 1, 0), max_len=11)


def with_margin() -> RetentionLockstep:
    """The machine over MARGIN; one named factory, so its plants replay the
    clean run's examples (derandomize seeds from the factory)."""
    return RetentionLockstep(MARGIN)


def test_retention_lockstep_with_a_rollback_margin() -> None:
    """The same machine where commits keep W + k tokens: releases, the bound,
    and truncates of up to k over a released prefix, all as the model says."""
    RetentionLockstep.seen.clear()
    run_state_machine_as_test(with_margin, settings=BUDGET)
    missing = {"Append:Ok", "Truncate:Count:released", "Truncate:Misuse",
               "Fork:Ok"} - RetentionLockstep.seen
    assert not missing, f"never arose: {sorted(missing)}"


# KVConfig(enable_prefix_caching=False): a fork copies, nothing is cached; the
# windows hold as with sharing (issue 27: each mechanism's lockstep with the
# other's setting changed)
UNSHARED = replace(SCOPE, sharing=False)
UNSHARED_MARGIN = replace(MARGIN, sharing=False)


def unshared() -> RetentionLockstep:
    return RetentionLockstep(UNSHARED)


def unshared_with_margin() -> RetentionLockstep:
    return RetentionLockstep(UNSHARED_MARGIN)


def test_retention_lockstep_without_sharing() -> None:
    """Forks of windowed streams reserve and copy only the retained slots:
    a fork of a stream that released pages, onto a fresh target or one that
    released more than the source holds, in one step with a write."""
    RetentionLockstep.seen.clear()
    run_state_machine_as_test(unshared, settings=BUDGET)
    missing = {"Append:Ok", "Fork:Ok", "Append+Fork:Ok", "Fork+Append:Ok", "Offload:Count",
               "Reload:Count", "Retrieve:Ok", "CachePrefix:Count"} - RetentionLockstep.seen
    assert not missing, f"never arose: {sorted(missing)}"


def test_retention_lockstep_without_sharing_with_a_rollback_margin() -> None:
    """The same with a rollback margin: a truncated target holds fewer pages
    than the slots it released, the case of issue 27's defect 2."""
    RetentionLockstep.seen.clear()
    run_state_machine_as_test(unshared_with_margin, settings=BUDGET)
    missing = {"Append:Ok", "Truncate:Count:released", "Fork:Ok", "Fork:AllocationFailed",
               "Append+Fork:Ok", "Append+Fork:AllocationFailed",
               "Fork+Append:Ok"} - RetentionLockstep.seen
    assert not missing, f"never arose: {sorted(missing)}"
