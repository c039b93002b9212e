"""Every call of kvref_model.retention's protocol, in every state it reaches to a
bounded depth, replayed on kvref's manager (issue 19: the exhaustive layer
for sliding-window retention).

Breadth first over the model's states, canonicalised as its checker does
(`kvref_model.retention_check.Canon`). Each (state, call) is replayed on a fresh
manager along the shortest trace to the state, then the call, through the
retention lockstep's rules, so every answer, released count, position,
table, pool structure and window byte is compared as the lockstep compares
them. The lockstep's rules leave out, each with its reason, the calls whose
kvref form differs from the model's by construction (a fork onto a stream
that exists, a call on an empty stream of an offloaded request); those are
not replayed here either.
"""

from __future__ import annotations

import os
from dataclasses import replace

from kvref_model import retention as R
from kvref_model.retention_check import SCOPE, Canon, calls
from tests.conformance.test_retention_lockstep import LABELS, RetentionLockstep, rid_name

# 5 in CI (about 11 s); KVREF_RETENTION_DEPTH sets more
DEPTH = int(os.environ.get("KVREF_RETENTION_DEPTH", "5"))


def replay(m: RetentionLockstep, a: R.Action) -> None:
    """The call through the lockstep's rule for it (its guards included)."""
    kv = m.kv
    if isinstance(a, R.Append):
        m.append(a.rid, a.label, a.tokens)
    elif isinstance(a, R.Fork):
        m.fork(a.rid, a.src, a.dst)
    elif isinstance(a, R.Truncate):
        st = m.stream(a.rid, a.label)
        if st is None or a.new_len < 0:
            return
        m.step(a, lambda: kv.truncate(rid_name(a.rid), LABELS[a.label], a.new_len))
    elif isinstance(a, R.Remove):
        m.remove(a.rid)
    elif isinstance(a, R.Offload):
        m.offload(a.rid)
    elif isinstance(a, R.Reload):
        m.reload(a.rid)
    elif isinstance(a, R.CachePrefix):
        m.cache_prefix(a.rid, a.label)
    elif isinstance(a, R.Retrieve):
        m.retrieve(a.rid, a.label, a.tokens)
    else:
        assert isinstance(a, R.MatchPrefix)
        st = m.stream(a.rid, a.label)
        if st is not None and st.n:
            return
        m.ingest(a.rid)
        m.step(a, lambda: kv.match_prefix(rid_name(a.rid), LABELS[a.label], list(a.tokens)))
    m.same_pages_and_bytes()


def _count_calls(m: RetentionLockstep) -> list[object]:
    """A list the machine's next compared calls are appended to."""
    done: list[object] = []
    step = m.step

    def counted(action: R.Action, call: object) -> R.Result:
        done.append(action)
        return step(action, call)

    m.step = counted  # type: ignore[method-assign]
    return done


def explore(depth: int, scope: R.Scope = SCOPE) -> tuple[int, int]:
    model = R.RetentionModel(scope)
    canon = Canon(scope)
    init = model.init()
    seen = {canon(init)}
    frontier: list[tuple[tuple[R.Action, ...], R.State]] = [((), init)]
    replayed = 0
    for _ in range(depth):
        nxt: list[tuple[tuple[R.Action, ...], R.State]] = []
        for trace, s in frontier:
            for a in calls(model, s):
                m = RetentionLockstep(scope)
                for past in trace:
                    replay(m, past)
                done = _count_calls(m)
                try:
                    replay(m, a)
                except AssertionError as err:
                    raise AssertionError(f"after {list(trace)} then {a}: {err}") from None
                if not done:
                    continue  # left out by the lockstep's rules: not compared
                replayed += 1
                key = canon(m.state)
                if key not in seen:
                    seen.add(key)
                    nxt.append(((*trace, a), m.state))
        frontier = nxt
    return len(seen), replayed


def test_every_call_in_every_state_to_a_bounded_depth() -> None:
    states, replayed = explore(DEPTH)
    print(f"\nretention, exhaustive to depth {DEPTH}: {states} states, {replayed} calls "
          "replayed on kvref")
    assert states > 50 and replayed > 500, (states, replayed)  # the scope is what it claims


def test_every_call_in_every_state_without_sharing() -> None:
    """The same with KVConfig(enable_prefix_caching=False): forks copy the
    retained slots (a fork onto a target that exists included, where it
    leaves no spare page), and nothing is cached (issue 27)."""
    states, replayed = explore(DEPTH, replace(SCOPE, sharing=False))
    print(f"\nretention without sharing, exhaustive to depth {DEPTH}: {states} states, "
          f"{replayed} calls replayed on kvref")
    assert states > 50 and replayed > 500, (states, replayed)
