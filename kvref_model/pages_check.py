"""Bounded breadth-first check of the shared-pages model (kvref_model.pages).

``python -m kvref_model.pages_check [--pages 3 --holders 2 ...] [--variant RULE]``

The protocol (`calls`) is what an engine may do in each state, careless
calls included: double releases, releases of pages it does not hold,
writes into shared or registered pages, registers of a part page or under
other tokens, hits with another salt, a hit for a holder that is not empty.
Only one careless call is left out, because the pool cannot see it:
registering a page under tokens other than those written into it (the
manager registers from its committed tokens; P4 is what catches one that
does not).

The search is kvref_model.search's generic BFS; states are canonicalised under
the symmetry of page ids (numbered by first appearance: holders' tables in
holder order, then the LRU, then the free-blank queue) and of holder ids.
Prints the state count, the fire counts, each invariant's interesting case
and, per violated invariant, its shortest trace; exits 1 on a violation.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator
from dataclasses import fields, is_dataclass
from typing import Any

from kvref_model.pages import (
    ACTIONS,
    RULES,
    Action,
    Allocate,
    Key,
    Lookup,
    Match,
    Misuse,
    NumFree,
    PagesModel,
    Reclaimable,
    Register,
    Release,
    ResetPrefixCache,
    Scope,
    Share,
    State,
    Take,
    Write,
    variant,
)
from kvref_model.pages_invariants import (
    INTERESTING,
    INVARIANTS,
    state_violations,
    transition_violations,
)
from kvref_model.report import report_table, run_check
from kvref_model.search import Report, Spec, Trace

# the default scope: every action fires, every interesting case arises, in seconds
SCOPE = Scope(pages=3, holders=2, page_size=1, alphabet=2, depth=8)


def _tokens_of(key: Key | None) -> tuple[int, ...]:
    return () if key is None else _tokens_of(key.parent) + key.tokens


def calls(m: PagesModel, s: State) -> Iterator[Action]:
    """Every call of the protocol in state `s`, in a fixed order.  Under
    `Scope.trusts_caller` only the calls the pool accepts (and the write check):
    the careless ones are its caller's to refuse, a repeated register among them."""
    if not m.scope.trusts_caller:
        yield from _calls(m, s)
        return
    for a in _calls(m, s):
        if isinstance(a, Register) and s.page(a.page).key is not None:
            continue
        if isinstance(a, Write) or not isinstance(m.step(s, a)[0], Misuse):
            yield a


def _calls(m: PagesModel, s: State) -> Iterator[Action]:
    sc, ps = m.scope, m.scope.page_size
    holders, pages = range(sc.holders), range(1, sc.pages + 1)
    free = len(s.blank) + len(s.lru)
    for h in holders:
        yield Allocate(h, 1)
        yield Allocate(h, free + 1)  # refused: short by one
    yield Allocate(0, -1)
    # prompts that hit: each registered chain (+1 token, and exactly: the cap),
    # under each extra-key tuple (the others are another tenant's salt)
    prompts = {(0,) * ps}
    for pg in s.pages:
        if pg.content is not None and pg.key is not None:
            t = _tokens_of(pg.content)
            prompts |= {(*t, 0), t}
    for t in sorted(prompts):
        for e in sc.extras:
            yield Lookup(t, e)
            for h in holders:
                yield Match(h, t, e)
    for h in holders:
        table = s.tables[h]
        for i, p in enumerate(table):
            pg = s.page(p)
            parent = s.page(table[i - 1]).content if i else None
            if pg.holders != {h} or pg.key is not None:  # careless: refused
                yield Write(h, p, Key(parent, (0,) * ps, sc.extras[0]))
            elif pg.content is None and (i == 0 or parent is not None):
                extras = sc.extras if parent is None else (parent.extras,)
                for t in itertools.product(range(sc.alphabet), repeat=ps):
                    for e in extras:
                        yield Write(h, p, Key(parent, t, e))
    for p in pages:
        pg = s.page(p)
        c = pg.content
        if c is None or not pg.holders:
            continue
        parent = m.chain_key(c.parent)
        # under dedup_adopts a register names its holder: each of the page's
        who: list[int | None] = [*sorted(pg.holders)] if sc.dedup_adopts else [None]
        for who_h in who:
            yield Register(p, parent, c.tokens, c.extras, who_h)  # a repeat: idempotent
        yield Register(p, parent, c.tokens[:-1], c.extras, who[0])  # careless: part page
        if pg.key is not None:  # careless: other tokens for a registered page
            yield Register(p, parent, tuple((x + 1) % sc.alphabet for x in c.tokens),
                           c.extras, who[0])
    for h in holders:
        for g in holders:
            if g != h and s.tables[g]:
                yield Share(h, s.tables[g])  # a fork; refused if h holds one already
        if s.lru or s.blank:
            yield Share(h, ((s.lru or s.blank)[0],))  # careless: a free page
        if s.lru:  # a window hit: the newest cached page, found past a gap (H2)
            yield Take(h, (s.lru[-1],))
        if s.blank:
            yield Take(h, (s.blank[0],))  # careless: a page no key names
    for h in holders:
        table = s.tables[h]
        if table:
            yield Release(h, table[::-1])
            if sc.blank_release:  # a window passing its first page (H3)
                yield Release(h, table[:1], blank=True)
            yield Reclaimable(((h, table[::-1]),))
            yield Release(h, (table[-1], table[-1]))  # careless: twice in one list
            if len(table) > 1:
                yield Release(h, (table[-1],))
        for p in pages:
            if p not in table:
                yield Release(h, (p,))  # careless: a page it does not hold
    held = tuple((h, s.tables[h][::-1]) for h in holders if s.tables[h])
    if len(held) > 1:
        yield Reclaimable(held)
    yield NumFree()
    yield ResetPrefixCache()


# ------------------------------------------------------------- symmetry


class Canon:
    """Canonical bytes of a state: the least encoding over holder permutations,
    pages renumbered by first appearance."""

    def __init__(self, scope: Scope) -> None:
        self.perms = list(itertools.permutations(range(scope.holders)))
        self.pages = scope.pages

    def __call__(self, s: State) -> bytes:
        best: bytes | None = None
        for perm in self.perms:
            order: dict[int, int] = {}
            for p in itertools.chain(*(s.tables[h] for h in perm), s.lru, s.blank,
                                     range(1, self.pages + 1)):
                order.setdefault(p, len(order) + 1)
            new_h = {old: new for new, old in enumerate(perm)}
            enc = repr((
                tuple(tuple(order[p] for p in s.tables[h]) for h in perm),
                tuple(order[p] for p in s.lru), tuple(order[p] for p in s.blank),
                tuple((sorted(new_h[h] for h in s.page(p).holders), s.page(p).key,
                       s.page(p).content) for p in order),
                # registration order only where a scope keeps it (duplicates)
                *((tuple(order[p] for p in s.order),) if s.order else ()),
            )).encode()
            if best is None or enc < best:
                best = enc
        assert best is not None
        return best


def make_spec(model: PagesModel, reduce: bool = True) -> Spec:
    key = Canon(model.scope) if reduce else (lambda s: repr(s).encode())
    return Spec(
        model=model, enabled=calls, state_checks=state_violations,
        transition_checks=transition_violations, interesting=INTERESTING, key=key,
        depth=model.scope.depth,
        identity=f"pages {type(model).__qualname__} {model.scope} reduce={reduce}",
    )


def check(model: PagesModel, *, keep_going: bool = False, reduce: bool = True) -> Report:
    """Search every reachable state; violations (with traces) land in the report."""
    return run_check(make_spec(model, reduce), keep_going=keep_going)


# ------------------------------------------------------------- display


def show(x: Any) -> str:
    """A compact rendering: a key as its tokens per page and its extras."""
    if isinstance(x, Key):
        return str(x)
    if is_dataclass(x) and not isinstance(x, type):
        inner = ", ".join(show(getattr(x, f.name)) for f in fields(x))
        return f"{type(x).__name__}({inner})"
    if isinstance(x, tuple):
        return "(" + ", ".join(show(v) for v in x) + ("," if len(x) == 1 else "") + ")"
    return repr(x)


def show_trace(trace: Trace) -> str:
    return "\n".join(f"    {i + 1}. {show(a)} -> {show(r)}" for i, (a, r) in enumerate(trace))


def table(rep: Report, scope: Scope) -> str:
    return report_table(rep, scope, ACTIONS, INTERESTING, INVARIANTS, show_trace)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvref_model.pages_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=SCOPE.pages)
    ap.add_argument("--holders", type=int, default=SCOPE.holders)
    ap.add_argument("--page-size", type=int, default=SCOPE.page_size)
    ap.add_argument("--alphabet", type=int, default=SCOPE.alphabet)
    ap.add_argument("--depth", type=int, default=SCOPE.depth, help="0: until no new state")
    ap.add_argument("--variant", choices=RULES, help="check the model with this rule off")
    ap.add_argument("--keep-going", action="store_true", help="every invariant's trace")
    ap.add_argument("--no-reduce", action="store_true", help="no symmetry reduction")
    ap.add_argument("--vllm-scope", action="store_true",
                    help="the scope settings that state vLLM's BlockPool (duplicates, "
                         "blank_to_front, trusts_caller: docs/verification/vllm-block-pool.md)")
    args = ap.parse_args(argv)
    flags = dict.fromkeys(("duplicates", "blank_to_front", "trusts_caller"), args.vllm_scope)
    scope = Scope(pages=args.pages, holders=args.holders, page_size=args.page_size,
                  alphabet=args.alphabet, depth=args.depth, **flags)
    cls = variant(args.variant) if args.variant else PagesModel
    rep = check(cls(scope), keep_going=args.keep_going, reduce=not args.no_reduce)
    print(table(rep, scope))
    return 1 if rep.violations else 0


if __name__ == "__main__":
    sys.exit(main())
