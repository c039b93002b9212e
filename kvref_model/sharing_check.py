"""Bounded breadth-first check of the stream-level shared-pages model
(kvref_model.sharing).

``python -m kvref_model.sharing_check [--pages 4 --page-size 2 ...] [--salts a,b]
[--variant RULE]``

The protocol (`calls`) is what an engine may do in each state, careless
calls included: a truncate past the end, a fork onto itself or from a
stream that does not exist, a cache_prefix naming uncommitted tokens or
tokens that disagree with the stream's chain, a hit on a stream that is
not empty, a reset of an unknown request, a reset of the prefix cache
while pages are held.  One careless call is left out because no manager
can see it: a cache_prefix whose ids disagree with the KV the stream
computed but not with its chain (Q2 is what catches a manager that
registers such ids; specs/shared-pages.md, S23).

The search is kvref_model.search's generic BFS; states are canonicalised under
the symmetry of page ids (numbered by first appearance: the streams'
tables in stream order, then the LRU, then the free-blank queue), of the
labels of a request, and of the requests that share a salt.  Prints the
state count, the fire counts, each interesting case and, per violated
invariant, its shortest trace; exits 1 on a violation.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

from kvref_model.pages_check import show_trace
from kvref_model.report import report_table, run_check
from kvref_model.search import Report, Spec
from kvref_model.sharing import (
    ACTIONS,
    RULES,
    Action,
    Append,
    CachePrefix,
    Fork,
    Key,
    MatchPrefix,
    NumFree,
    Offload,
    Reclaimable,
    Reload,
    Remove,
    Reset,
    ResetPrefixCache,
    Scope,
    SharingModel,
    State,
    Truncate,
    variant,
)
from kvref_model.sharing_invariants import (
    CASE_ACTION,
    INTERESTING,
    INVARIANTS,
    state_violations,
    transition_violations,
)

# the default scope: every action fires, every interesting case arises (but the
# salt miss, which needs two salts: SALTED), in well under a minute.  Three
# pages, not four: at four, depth 5 reaches no eviction.  Depth 6 (--depth 6)
# takes 409,763 states and about 5 minutes since labels key their pages
# (no label symmetry, S25)
SCOPE = Scope(pages=3, page_size=2, alphabet=2, labels=2, salts=("a", "a"), max_len=4,
              depth=5)
# two tenants: a hit under another salt misses, and no page is shared across them
SALTED = Scope(pages=3, page_size=2, alphabet=2, labels=2, salts=("a", "b"), max_len=4,
               depth=5)


def _tokens_of(key: Key | None) -> tuple[int, ...]:
    return () if key is None else _tokens_of(key.parent) + key.tokens


def calls(m: SharingModel, s: State) -> Iterator[Action]:
    """Every call of the protocol in state `s`, in a fixed order."""
    sc, ps = m.scope, m.scope.page_size
    streams = [(r, label) for r in range(sc.requests) for label in range(sc.labels)]
    prompts = sorted({()} | {t for pg in s.pool.pages if pg.key is not None
                                    for u in [_tokens_of(pg.key)] for t in (u, (*u, 0))})
    for r, label in streams:
        st = s.streams[m.holder(r, label)]
        n = st.n if st is not None else 0
        for k in sorted({1, ps}):
            if n + k <= sc.max_len:
                for toks in itertools.product(range(sc.alphabet), repeat=k):
                    yield Append(r, label, toks)
        if st is None:  # careless: a stream that does not exist
            yield Truncate(r, label, 0)
            yield CachePrefix(r, label, ())
        else:
            for m_len in range(n + 2):  # n: a no-op; n + 1: past the end (careless)
                yield Truncate(r, label, m_len)
            for j in range(1, n // ps + 1):  # truthful: the stream's own tokens
                yield CachePrefix(r, label, st.tokens[:j * ps])
            if n % ps:
                yield CachePrefix(r, label, st.tokens)  # a part page: not registered
            yield CachePrefix(r, label, (*st.tokens, 0))  # careless: uncommitted
            if st.chain:  # careless: ids that disagree with the chain
                flipped = ((st.tokens[0] + 1) % sc.alphabet, *st.tokens[1:])
                yield CachePrefix(r, label, flipped[:len(st.chain) * ps])
                end = len(st.chain) * ps - 1  # ... in a part of a page it keyed
                if end % ps:
                    yield CachePrefix(r, label, (*st.tokens[:end - 1],
                                                 (st.tokens[end - 1] + 1) % sc.alphabet))
        if n == 0:
            for t in prompts:
                yield MatchPrefix(r, label, t)
        else:  # careless: a hit on a stream that is not empty
            yield MatchPrefix(r, label, prompts[-1])
    for r in range(sc.requests):
        for src, dst in itertools.permutations(range(sc.labels), 2):
            yield Fork(r, src, dst)
    yield Fork(0, 0, 0)  # careless: onto itself
    yield Truncate(0, 0, -1)  # careless
    for r in range(sc.requests):
        yield Reset(r, False)
        yield Reset(r, True)
        yield Remove(r)
        yield Reclaimable(r)
        yield Offload(r)
        yield Reload(r)
    yield NumFree()
    yield ResetPrefixCache()


# ------------------------------------------------------------- symmetry


class Canon:
    """Canonical bytes of a state: the least encoding over the renamings of
    labels within a request, of requests with one salt and of token ids,
    pages renumbered by first appearance."""

    def __init__(self, scope: Scope, tokens: bool = True) -> None:
        self.scope = scope
        # labels are not interchangeable: each is an extra key of its pages (S25)
        labels = [tuple(range(scope.labels))]
        self.perms: list[tuple[int, ...]] = []
        for rperm in itertools.permutations(range(scope.requests)):
            if any(scope.salts[a] != scope.salts[b] for a, b in enumerate(rperm)):
                continue
            for lperms in itertools.product(labels, repeat=scope.requests):
                # new holder (r, l) is old holder (rperm[r], lperms[r][l])
                self.perms.append(tuple(rperm[r] * scope.labels + lperms[r][lab]
                                        for r in range(scope.requests)
                                        for lab in range(scope.labels)))
        ids = range(scope.alphabet)
        self.renames = list(itertools.permutations(ids)) if tokens else [tuple(ids)]
        self.pages = range(1, scope.pages + 1)

    def __call__(self, s: State) -> bytes:
        pool = s.pool
        # the streams first: only the renamings that put them least go on to
        # the pages (usually one or two of them)
        heads: list[tuple[tuple[object, ...], tuple[int, ...], tuple[int, ...]]] = []
        for rename in self.renames:
            def tok(ts: tuple[int, ...], rename: tuple[int, ...] = rename
                    ) -> tuple[int, ...]:
                return tuple(rename[t] for t in ts)

            streams = [(-1,) if st is None else
                       (*tok(st.tokens), -2, len(st.chain), -2, len(pool.tables[h]),
                        -3 if st.offloaded else -4, -5 if st.space is None else st.space,
                        -6, *(i for i, k in enumerate(st.host_keys) if k is not None))
                       for h, st in enumerate(s.streams)]
            heads += [(tuple(streams[h] for h in perm), rename, perm) for perm in self.perms]
        least = min(h[0] for h in heads)
        best: tuple[object, ...] | None = None
        for head, rename, perm in heads:
            if head != least:
                continue
            order: dict[int, int] = {}
            for h in perm:
                for p in pool.tables[h]:
                    order.setdefault(p, len(order) + 1)
            for p in itertools.chain(pool.lru, pool.blank, self.pages):
                order.setdefault(p, len(order) + 1)
            new_h = {old: new for new, old in enumerate(perm)}
            enc = (
                head,
                tuple(tuple(order[p] for p in pool.tables[h]) for h in perm),
                tuple(order[p] for p in pool.lru), tuple(order[p] for p in pool.blank),
                tuple((tuple(sorted(new_h[h] for h in pool.page(p).holders)),
                       self._key(pool.page(p).key, rename),
                       tuple(-1 if t is None else rename[t] for t in s.slots[p - 1]))
                      for p in order),
                tuple(self._key(st.chain[-1] if st is not None and st.chain else None,
                                rename) for st in (s.streams[h] for h in perm)),
            )
            if best is None or enc < best:
                best = enc
        assert best is not None
        return repr(best).encode()

    @staticmethod
    def _key(k: Key | None, rename: tuple[int, ...]) -> tuple[object, ...]:
        if k is None:
            return ()
        return (*(rename[t] for t in _tokens_of(k)), -2, *(v for _, v in k.extras))


def _observe(m: SharingModel, s: State, a: object, r: object, n: State,
             counts: Counter[str]) -> list[tuple[str, str]]:
    """The interesting cases about this action, then the transition checks."""
    for name, pred in _CASES.get(type(a), ()):
        if pred(m, s, a, r, n):
            counts[name] += 1
    return transition_violations(m, s, a, r, n)


_CASES: dict[type, list[tuple[str, Any]]] = {}
for _name, _pred in INTERESTING.items():
    _CASES.setdefault(CASE_ACTION[_name], []).append((_name, _pred))


def make_spec(model: SharingModel, reduce: bool = True) -> Spec:
    key = Canon(model.scope) if reduce else (lambda s: repr(s).encode())
    return Spec(
        model=model, enabled=calls, state_checks=state_violations,
        transition_checks=transition_violations, interesting=INTERESTING, key=key,
        depth=model.scope.depth, observe=_observe,
        identity=f"sharing {type(model).__qualname__} {model.scope} reduce={reduce}",
    )


def check(model: SharingModel, *, keep_going: bool = False, reduce: bool = True,
          workers: int = 1) -> Report:
    """Search every reachable state; violations (with traces) land in the report."""
    return run_check(make_spec(model, reduce), keep_going=keep_going, workers=workers)


# ------------------------------------------------------------- display
# (the trace is kvref_model.pages_check's rendering: keys as their tokens per page)


def table(rep: Report, scope: Scope) -> str:
    return report_table(rep, scope, ACTIONS, INTERESTING, INVARIANTS, show_trace)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvref_model.sharing_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=SCOPE.pages)
    ap.add_argument("--page-size", type=int, default=SCOPE.page_size)
    ap.add_argument("--alphabet", type=int, default=SCOPE.alphabet)
    ap.add_argument("--labels", type=int, default=SCOPE.labels)
    ap.add_argument("--salts", default=",".join(SCOPE.salts),
                    help="each request's cache_salt, comma separated (a,b: two tenants)")
    ap.add_argument("--max-len", type=int, default=SCOPE.max_len)
    ap.add_argument("--depth", type=int, default=SCOPE.depth, help="0: until no new state")
    ap.add_argument("--variant", choices=RULES, help="check the model with this rule off")
    ap.add_argument("--keep-going", action="store_true", help="every invariant's trace")
    ap.add_argument("--no-reduce", action="store_true", help="no symmetry reduction")
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args(argv)
    scope = Scope(pages=args.pages, page_size=args.page_size, alphabet=args.alphabet,
                  labels=args.labels, salts=tuple(args.salts.split(",")),
                  max_len=args.max_len, depth=args.depth)
    cls = variant(args.variant) if args.variant else SharingModel
    rep = check(cls(scope), keep_going=args.keep_going, reduce=not args.no_reduce,
                workers=args.workers)
    print(table(rep, scope))
    return 1 if rep.violations else 0


if __name__ == "__main__":
    sys.exit(main())
