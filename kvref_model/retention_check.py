"""Bounded breadth-first check of the sliding-window retention model
(kvref_model.retention).

``python -m kvref_model.retention_check [--pages 5 --page-size 2 --windows 3,3,full
--requests 1 ...] [--variant RULE]``

The protocol (`calls`) is what an engine may do in each state, careless
calls included: a truncate past the end or into the released prefix, a
fork onto itself, from a stream that does not exist or between labels of
other windows, a cache_prefix or a hit on a windowed label, a hit onto a
stream that is not empty, an offload of what is on the host, a reload of
what is on the device, any call on an offloaded request.

The search is kvref_model.search's generic BFS; states are canonicalised under
the symmetry of page ids (numbered by first appearance: the streams' tables
in stream order, then the LRU, then the free-blank queue), of the labels of
a request that have one window, and of the requests.  Prints the state
count, the fire counts, each interesting case and, per violated invariant,
its shortest trace; exits 1 on a violation.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator
from dataclasses import replace

from kvref_model.pages_check import show_trace
from kvref_model.report import report_table, run_check
from kvref_model.retention import (
    ACTIONS,
    RULES,
    Action,
    Append,
    CachePrefix,
    Fork,
    Key,
    MatchPrefix,
    Offload,
    Reload,
    Remove,
    RetentionModel,
    Retrieve,
    Scope,
    State,
    Truncate,
    variant,
)
from kvref_model.retention_invariants import (
    INTERESTING,
    INVARIANTS,
    state_violations,
    transition_violations,
)
from kvref_model.search import Report, Spec

# the default scope: every action fires and every interesting case arises, in
# seconds: one request with two labels of window 3 (forks between them) and one
# full-attention label, pages of 2 tokens, 5 pages, streams of up to 7 tokens
SCOPE = Scope(pages=5, page_size=2, windows=(3, 3, None), requests=1, alphabet=1,
              max_len=7)
# two requests, each a windowed and a full-attention label: window pages and
# another request's cached prefix compete for the pool
TWO = Scope(pages=5, page_size=2, windows=(3, None), requests=2, alphabet=1, max_len=7)


def _tokens_of(key: Key | None) -> tuple[int, ...]:
    return () if key is None else _tokens_of(key.parent) + key.tokens


def calls(m: RetentionModel, s: State) -> Iterator[Action]:
    """Every call of the protocol in state `s`, in a fixed order."""
    sc, ps = m.scope, m.scope.page_size
    prompts = sorted({(0,) * (ps + 1)} | {(*_tokens_of(pg.key), 0) for pg in s.pool.pages
                                          if pg.key is not None})
    for r in range(sc.requests):
        for label in range(sc.labels):
            st = s.streams[m.holder(r, label)]
            n = st.n if st is not None else 0
            for k in sorted({1, ps}):
                if n + k <= sc.max_len:
                    for toks in itertools.product(range(sc.alphabet), repeat=k):
                        yield Append(r, label, toks)
            if st is None:  # careless: a stream that does not exist
                yield Truncate(r, label, 0)
                yield CachePrefix(r, label)
            else:
                for m_len in range(n + 2):  # n: a no-op; n + 1: past the end (careless)
                    yield Truncate(r, label, m_len)
                yield CachePrefix(r, label)
            if n == 0:
                for t in prompts:
                    yield MatchPrefix(r, label, t)
            else:  # careless: a hit onto a stream that is not empty
                yield MatchPrefix(r, label, prompts[-1])
            # a peer's publication one token longer, and one to max_len (past the
            # window: every copied slot new); the consumer's own tokens before n
            own = st.tokens if st is not None else ()
            for k in sorted({1, sc.max_len - n}):
                if k > 0 and n + k <= sc.max_len:
                    tails = itertools.product(range(sc.alphabet), repeat=k) if k == 1 else [
                        (0,) * k]
                    for tail in tails:
                        yield Retrieve(r, label, own + tail)
            if n:  # careless: nothing past what it holds
                yield Retrieve(r, label, own)
        for src, dst in itertools.permutations(range(sc.labels), 2):
            yield Fork(r, src, dst)
        yield Remove(r)
        yield Offload(r)
        yield Reload(r)
    yield Fork(0, 0, 0)  # careless: onto itself
    yield Truncate(0, 0, -1)  # careless


# ------------------------------------------------------------- symmetry


class Canon:
    """Canonical bytes of a state: the least encoding over the renamings of
    requests and of the labels of a request that share a window, pages
    renumbered by first appearance."""

    def __init__(self, scope: Scope) -> None:
        labels = [perm for perm in itertools.permutations(range(scope.labels))
                  if all(scope.windows[a] == scope.windows[b]
                         and _margin(scope, a) == _margin(scope, b)
                         for a, b in enumerate(perm))]
        self.perms: list[tuple[int, ...]] = []
        for rperm in itertools.permutations(range(scope.requests)):
            for lperms in itertools.product(labels, repeat=scope.requests):
                self.perms.append(tuple(rperm[r] * scope.labels + lperms[r][lab]
                                        for r in range(scope.requests)
                                        for lab in range(scope.labels)))
        self.pages = range(1, scope.pages + 1)
        self.full = [scope.windows[h % scope.labels] is None
                     for h in range(scope.requests * scope.labels)]

    def __call__(self, s: State) -> bytes:
        pool = s.pool
        heads = []
        for perm in self.perms:
            # `received` changes only a full label's cache_prefix, and a fork
            # never joins a windowed label to a full one: forgotten elsewhere
            head = tuple((-1,) if (st := s.streams[h]) is None else
                         (*st.tokens, -2, len(st.table), st.released, st.position,
                          st.cached, int(st.offloaded), len(st.retired),
                          int(st.received and self.full[h]))
                         for h in perm)
            heads.append((head, perm))
        least = min(h for h, _ in heads)
        best: tuple[object, ...] | None = None
        for head, perm in heads:
            if head != least:
                continue
            order: dict[int, int] = {}
            for h in perm:
                st = s.streams[h]
                if st is not None:
                    for p in (*st.table, *st.retired):
                        if p is not None:
                            order.setdefault(p, len(order) + 1)
            for p in itertools.chain(pool.lru, pool.blank, self.pages):
                order.setdefault(p, len(order) + 1)
            new_h = {old: new for new, old in enumerate(perm)}
            enc = (
                head,
                tuple(() if (st := s.streams[h]) is None else
                      (tuple(0 if p is None else order[p] for p in st.table),
                       tuple(order[p] for p in st.retired)) for h in perm),
                tuple(order[p] for p in pool.lru), tuple(order[p] for p in pool.blank),
                tuple((tuple(sorted(new_h[h] for h in pool.page(p).holders)),
                       str(pool.page(p).key) if pool.page(p).key else "",
                       tuple((-1, -1) if v is None else v for v in s.slots[p - 1]))
                      for p in order),
                s.fault,
            )
            if best is None or enc < best:
                best = enc
        assert best is not None
        return repr(best).encode()


def make_spec(model: RetentionModel, reduce: bool = True) -> Spec:
    key = Canon(model.scope) if reduce else (lambda s: repr(s).encode())
    return Spec(
        model=model, enabled=calls, state_checks=state_violations,
        transition_checks=transition_violations, interesting=INTERESTING, key=key,
        depth=model.scope.depth,
        identity=f"retention {type(model).__qualname__} {model.scope} reduce={reduce}",
    )


def check(model: RetentionModel, *, keep_going: bool = False, reduce: bool = True,
          workers: int = 1) -> Report:
    """Search every reachable state; violations (with traces) land in the report."""
    return run_check(make_spec(model, reduce), keep_going=keep_going, workers=workers)


# ------------------------------------------------------------- display


def table(rep: Report, scope: Scope) -> str:
    return report_table(rep, scope, ACTIONS, INTERESTING, INVARIANTS, show_trace)


def _margin(scope: Scope, label: int) -> int:
    return scope.margins[label] if scope.margins else 0


def _windows(text: str) -> tuple[int | None, ...]:
    return tuple(None if w in ("full", "none", "") else int(w) for w in text.split(","))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvref_model.retention_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=SCOPE.pages)
    ap.add_argument("--page-size", type=int, default=SCOPE.page_size)
    ap.add_argument("--windows", default="3,3,full",
                    help="each label's window, comma separated; full: full attention")
    ap.add_argument("--margins", default="",
                    help="each label's rollback margin, comma separated (W15); empty: 0")
    ap.add_argument("--requests", type=int, default=SCOPE.requests)
    ap.add_argument("--alphabet", type=int, default=SCOPE.alphabet)
    ap.add_argument("--max-len", type=int, default=SCOPE.max_len)
    ap.add_argument("--depth", type=int, default=SCOPE.depth, help="0: until no new state")
    ap.add_argument("--two", action="store_true",
                    help="the TWO scope: two requests, each a windowed and a full label")
    ap.add_argument("--variant", choices=RULES, help="check the model with this rule off")
    ap.add_argument("--keep-going", action="store_true", help="every invariant's trace")
    ap.add_argument("--no-reduce", action="store_true", help="no symmetry reduction")
    ap.add_argument("--workers", type=int, default=1)
    args = ap.parse_args(argv)
    scope = replace(TWO, depth=args.depth) if args.two else Scope(
        pages=args.pages, page_size=args.page_size, windows=_windows(args.windows),
        margins=tuple(int(k) for k in args.margins.split(",")) if args.margins else (),
        requests=args.requests, alphabet=args.alphabet, max_len=args.max_len,
        depth=args.depth)
    cls = variant(args.variant) if args.variant else RetentionModel
    rep = check(cls(scope), keep_going=args.keep_going, reduce=not args.no_reduce,
                workers=args.workers)
    print(table(rep, scope))
    return 1 if rep.violations else 0


if __name__ == "__main__":
    sys.exit(main())
