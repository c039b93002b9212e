"""Every call of kvref_model.sharing's protocol, in every state it reaches to a
bounded depth, replayed on kvref's manager (issue 18: the exhaustive layer
for shared pages).

Breadth first over the model's states, canonicalised as the checker does
(`kvref_model.sharing_check.Canon`: page ids, labels of a request, requests of
one salt). Each (state, call) is replayed on a fresh manager along the
shortest trace to the state, then the call, through the lockstep machine,
so every answer, table, key, pool structure and byte is compared as the
lockstep compares them. The careless calls of the protocol come too: a
truncate past the end or of a stream that does not exist, a cache_prefix of
uncommitted ids or of ids that disagree with the keyed pages, a hit onto a
stream that holds tokens, a reset of the prefix cache while pages are held.
"""

from __future__ import annotations

import os
from typing import Any

from kvref_model import sharing as S
from kvref_model.sharing_check import Canon, calls
from tests.conformance.test_sharing_lockstep import LABELS, SharingLockstep, rid_name

SCOPE = S.Scope(pages=3, page_size=2, alphabet=2, labels=2, salts=("a", "a"), max_len=4)
# 3 in CI (about 10 s); the nightly profile sets 5
DEPTH = int(os.environ.get("KVREF_SHARING_DEPTH", "3"))


def replay(m: SharingLockstep, a: S.Action) -> None:
    """One model action on the machine's manager and model, compared."""
    kv, r = m.kv, getattr(a, "rid", 0)
    name = rid_name(r)
    call: Any
    if isinstance(a, S.Append):
        m.ingest(r)
        call = lambda: m.run_step(r, a.label, a.tokens)  # noqa: E731
    elif isinstance(a, S.Fork):
        m.ingest(r)
        call = lambda: m.run_step(r, a.src, (), pre_forks=((LABELS[a.src],  # noqa: E731
                                                            LABELS[a.dst]),))
    elif isinstance(a, S.Truncate):
        call = lambda: kv.truncate(name, LABELS[a.label], a.new_len)  # noqa: E731
    elif isinstance(a, S.Reset):
        call = lambda: kv.reset_request(name, a.free)  # noqa: E731
    elif isinstance(a, S.Remove):
        call = lambda: kv.remove_request(name)  # noqa: E731
    elif isinstance(a, S.CachePrefix):
        call = lambda: kv.cache_prefix(name, LABELS[a.label], list(a.tokens))  # noqa: E731
    elif isinstance(a, S.MatchPrefix):
        m.ingest(r)
        call = lambda: kv.match_prefix(name, LABELS[a.label], list(a.tokens))  # noqa: E731
    elif isinstance(a, S.ResetPrefixCache):
        call = kv.reset_prefix_cache
    elif isinstance(a, S.Offload):
        call = lambda: kv.offload_outcome(name)  # noqa: E731
    elif isinstance(a, S.Reload):
        call = lambda: kv.reload_outcome(name)  # noqa: E731
    elif isinstance(a, S.NumFree):
        call = lambda: kv.num_free_pages  # noqa: E731
    else:
        assert isinstance(a, S.Reclaimable)
        call = lambda: kv.reclaimable(name)  # noqa: E731
    m.step(a, call)
    m.same_pages_and_bytes()


def replayable(model: S.SharingModel, s: S.State, a: S.Action) -> bool:
    """Calls whose kvref form differs from the model's by construction, not
    by a rule: kvref knows a request from its ingest, the model from its
    streams. A self-fork or a reclaimable of a request the model does not
    know would be a call on a request kvref never ingested."""
    if isinstance(a, S.Fork | S.Reclaimable | S.Offload | S.Reload) and not model._known(
            s, a.rid):
        return False
    # kvref's ingest made an empty "main" the model knows nothing of: a call
    # naming it has another answer there (a truncate of 0 tokens, a fork
    # from an empty source, which empties its target)
    main = (a.label == 0 if isinstance(a, S.Truncate | S.CachePrefix)
            else a.src == 0 if isinstance(a, S.Fork) else False)
    if main and model._known(s, a.rid) and s.streams[model.holder(a.rid, 0)] is None:
        return False
    return not (isinstance(a, S.Truncate | S.CachePrefix) and a.rid >= SCOPE.requests)


def explore(depth: int) -> tuple[int, int]:
    model = S.SharingModel(SCOPE)
    canon = Canon(SCOPE)
    init = model.init()
    seen = {canon(init)}
    frontier: list[tuple[tuple[S.Action, ...], S.State]] = [((), init)]
    edges = 0
    for _ in range(depth):
        nxt: list[tuple[tuple[S.Action, ...], S.State]] = []
        for trace, s in frontier:
            for a in calls(model, s):
                if not replayable(model, s, a):
                    continue
                m = SharingLockstep(SCOPE)
                for past in trace:
                    replay(m, past)
                try:
                    replay(m, a)
                except AssertionError as err:
                    raise AssertionError(f"after {list(trace)} then {a}: {err}") from None
                edges += 1
                key = canon(m.state)
                if key not in seen:
                    seen.add(key)
                    nxt.append(((*trace, a), m.state))
        frontier = nxt
    return len(seen), edges


def test_every_call_in_every_state_to_a_bounded_depth() -> None:
    states, edges = explore(DEPTH)
    print(f"\nshared pages, exhaustive to depth {DEPTH}: {states} states, {edges} calls "
          "replayed on kvref")
    assert states > 100 and edges > 1000, (states, edges)  # the scope is what it claims
