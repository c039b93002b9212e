"""Symmetry reduction: the canonical byte encoding of a state.

Request ids are interchangeable, and so are the labels other than "main"
(ingest creates main and forks start from it; nothing tells the others
apart).  `Canonicaliser.key` encodes a state under every such renaming and
keeps the least encoding: equal exactly for the states of one orbit, so the
visited set stores one fingerprint per symmetry class.

This module is the only part of the checker that knows `State`'s fields.
If the model gains a field it does not know, renaming that field would be
guesswork (it may hold a request id), so the canonicaliser falls back to
no reduction and says so: sound, only larger.
"""

from __future__ import annotations

import itertools
import marshal
import sys
from dataclasses import fields, is_dataclass, replace
from typing import Any

from kvref_model.core import (
    UNWRITTEN,
    Offload,
    Pending,
    Scope,
    Seg,
    State,
    Step,
    Stream,
    project,
)

Perm = tuple[int, ...]
Symmetry = tuple[Perm, Perm]  # (request permutation, label permutation)

# the fields the renaming below handles, per class
KNOWN_FIELDS: dict[type, tuple[str, ...]] = {
    State: ("free", "streams", "host", "current", "staged", "offloads", "leases", "pool"),
    Stream: ("pages", "stored_len", "contents", "in_flight", "offload", "retrieve", "table",
             "keyed", "chain", "followed"),
    Pending: ("step", "phase", "marks", "undo", "fresh", "forked", "basis", "preplanned"),
    Step: ("segments", "pre_forks", "post_forks", "padded", "commit"),
    Seg: ("rid", "label", "span"),
    Offload: ("claimed", "copied", "touched", "hosted"),
}


def unknown_fields() -> list[str]:
    """Fields of the model's state classes that the renaming does not know."""
    out = []
    for cls, known in KNOWN_FIELDS.items():
        have = tuple(f.name for f in fields(cls))
        out += [f"{cls.__name__}.{n}" for n in have if n not in known]
    return out


def symmetries(scope: Scope) -> list[Symmetry]:
    """Every renaming; the identity first."""
    rps = list(itertools.permutations(range(scope.requests)))
    if len(set(scope.salts)) > 1:  # a salt tells requests apart (S25)
        rps = rps[:1]
    # "main" (label 0) is special; the rest are not, unless the prefix cache
    # (keys name token identities, which name labels) or a window tells them apart
    # with groups, the labels inside the model (one per label and group)
    lps = [(0, *p) for p in itertools.permutations(
        range(1, scope.labels * scope.group_count))]
    if scope.sharing or scope.windowed or scope.groups:
        lps = lps[:1]
    return [(rp, lp) for rp in rps for lp in lps]


def _key(k: Any) -> Any:
    """A pool key (kvref_model.pages.Key, a chain) as nested tuples; no key
    is (), not None: encodings are compared (`min`), and a page or parent with
    no key can stand where another renaming has a key, which None and a tuple
    cannot (a TypeError)."""
    got = _KEYS.get(k)
    if got is None:
        if len(_KEYS) > 1 << 14:
            _KEYS.clear()
        got = _KEYS[k] = (() if k is None else (_key(k.parent), k.tokens, k.extras))
    return got


_KEYS: dict[Any, Any] = {}


def _pages(s: State, order: list[tuple[int, int]], rp: Perm, n_labels: int
           ) -> tuple[dict[int, int], tuple[Any, ...]]:
    """Pages renamed by first appearance: in the streams' tables (in the
    renamed stream order ``order``, the original keys), then the LRU, then the
    blank queue; and the pool under that renaming."""
    pool = s.pool
    assert pool is not None
    st = s.stream_map()
    names: dict[int, int] = {0: 0}
    for k in order:
        for p in st[k].table:
            if p not in names:
                names[p] = len(names)
    for p in pool.lru + pool.blank:
        if p not in names:
            names[p] = len(names)
    by_name = sorted((n, p) for p, n in names.items() if p)
    enc = tuple([(tuple(sorted([rp[h // n_labels] * n_labels + h % n_labels
                                for h in pool.pages[p - 1].holders])),
                  _key(pool.pages[p - 1].key)) for _, p in by_name])
    return names, (enc, tuple([names[p] for p in pool.lru]),
                   tuple([names[p] for p in pool.blank]))


def token_map(lp: Perm, n_labels: int) -> Perm:
    # a token identity names the label that wrote it: t < L is label t's own
    # write, L + t a published (retrieved) copy of label t's tokens; the last
    # entry is what index UNWRITTEN (-1) reads: a position nobody wrote
    # belongs to no label and stays itself
    assert UNWRITTEN == -1
    return (*(lp[t] if t < n_labels else n_labels + lp[t - n_labels]
              for t in range(2 * n_labels)), UNWRITTEN)


def _pending(p: Pending | None, rp: Perm, lp: Perm, tm: Perm) -> tuple[Any, ...]:
    if p is None:
        return ()
    st = p.step
    step = (tuple(sorted([(rp[g.rid], lp[g.label], g.span) for g in st.segments])),
            tuple([(lp[f], lp[t]) for f, t in st.pre_forks]),
            tuple([(lp[f], lp[t]) for f, t in st.post_forks]),
            tuple(sorted([rp[r] for r in st.padded])), st.commit)
    undo = tuple(sorted([((rp[k[0]], lp[k[1]]),
                          (0,) if c is None else (1, tuple([tm[t] for t in c])))
                         for k, c in p.undo]))
    return (1, step, p.phase, tuple(sorted([(rp[r], lp[lb]) for r, lb in p.marks])), undo,
            tuple(sorted([(rp[r], lp[lb]) for r, lb in p.fresh])), p.forked,
            tuple(sorted([((rp[r], lp[lb]), n) for (r, lb), n in p.basis])))


def _ids_matter(s: State) -> bool:
    """Whether page ids say more than the counts: a shared or keyed page, or
    a released slot."""
    pool = s.pool
    assert pool is not None
    return bool(pool.lru) or any(len(pg.holders) > 1 or pg.key is not None
                                 for pg in pool.pages) or any(
        0 in v.table for _, v in s.streams)


def _encode(s: State, rp: Perm, lp: Perm, tm: Perm, cur: tuple[Any, ...],
            staged: tuple[Any, ...], same_labels: bool = False,
            n_labels: int = 0) -> tuple[Any, ...]:
    """`s` renamed, as nested tuples of ints, bools and strs (comparable and
    with a deterministic serialisation).  Steps' segments and padded ids are
    sets to the manager, so they are sorted, as are all keyed collections.
    The pending steps come encoded already (`_pending`, cached).  With
    `same_labels` (`lp` the identity, so `tm` is too) the labels and tokens
    are taken as they are: the same values, without mapping each one.  With
    page ids (a pool that is not all private pages of no key: sharing or
    windows on) the tables and the pool are encoded too, pages renamed by
    first appearance; without, they are a function of the page counts up to
    renaming, and left out."""
    if s.pool is not None and n_labels and _ids_matter(s):
        assert same_labels  # symmetries() keeps the labels with sharing or windows
        order = sorted(s.stream_map(), key=lambda k: (rp[k[0]], k[1]))
        names, pool = _pages(s, order, rp, n_labels)
        streams: tuple[Any, ...] = tuple(sorted([
            ((rp[r], lb), v.stored_len, v.contents, v.in_flight, v.offload, v.retrieve,
             tuple([names[p] for p in v.table]), v.keyed, v.chain, v.followed)
            for (r, lb), v in s.streams]))
        offloads: tuple[Any, ...] = tuple(sorted([
            (rp[r], tuple(sorted(o.claimed)), tuple(sorted(o.copied)), o.touched, o.hosted)
            for r, o in s.offloads]))
        return (s.free, streams, tuple(sorted([((rp[r], lb), c) for (r, lb), c in s.host])),
                cur, staged, offloads, tuple(sorted([rp[r] for r in s.leases])), pool)
    if same_labels:
        streams = tuple(sorted([
            ((rp[r], lb), v.pages, v.stored_len, v.contents, v.in_flight, v.offload,
             v.retrieve, v.keyed, v.chain, v.followed) for (r, lb), v in s.streams]))
        offloads = tuple(sorted([
            (rp[r], tuple(sorted(o.claimed)), tuple(sorted(o.copied)), o.touched, o.hosted)
            for r, o in s.offloads]))
        return (s.free, streams, tuple(sorted([((rp[r], lb), c) for (r, lb), c in s.host])),
                cur, staged, offloads, tuple(sorted([rp[r] for r in s.leases])))
    streams = tuple(sorted([
        ((rp[r], lp[lb]), v.pages, v.stored_len, tuple([tm[t] for t in v.contents]),
         v.in_flight, v.offload, v.retrieve, v.keyed, v.chain, v.followed)
        for (r, lb), v in s.streams]))
    host = tuple(sorted([((rp[r], lp[lb]), tuple([tm[t] for t in c]))
                         for (r, lb), c in s.host]))
    offloads = tuple(sorted([
        (rp[r], tuple(sorted([(lp[lb], n) for lb, n in o.claimed])),
         tuple(sorted([lp[lb] for lb in o.copied])), o.touched,
         tuple(sorted([(lp[lb], n) for lb, n in o.hosted]))) for r, o in s.offloads]))
    return (s.free, streams, host, cur, staged, offloads, tuple(sorted([rp[r] for r in s.leases])))


def plain(obj: object) -> object:
    """Any model value as nested tuples, with no renaming: the fallback
    encoding (sets sorted by repr so that equal values encode equally)."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj).__name__, *(plain(getattr(obj, f.name)) for f in fields(obj)))
    if isinstance(obj, (tuple, list)):
        return tuple(plain(x) for x in obj)
    if isinstance(obj, (frozenset, set)):
        return ("set", *sorted((plain(x) for x in obj), key=repr))
    return obj


class Canonicaliser:
    """`key(state)`: bytes equal for exactly the states of one symmetry class."""

    def __init__(self, scope: Scope, reduce: bool = True) -> None:
        self.unknown = unknown_fields()
        if reduce and self.unknown:
            print(f"kvref_model.symmetry: no symmetry reduction: the renaming does not know "
                  f"{', '.join(self.unknown)}", file=sys.stderr)
        self.reduce = reduce and not self.unknown
        nlab = scope.labels * scope.group_count
        self.n_labels = nlab
        # with sharing or windows, page ids are part of the encoding (0: never)
        self.ids = nlab if (scope.sharing or scope.windowed) else 0
        syms = symmetries(scope) if self.reduce else []
        self._renamings = [(rp, lp, token_map(lp, nlab)) for rp, lp in syms]
        self._same_labels = [lp == tuple(range(len(lp))) for _, lp in syms]
        # per request: the renamings that make it request 0
        self._leading = [[j for j, (rp, _) in enumerate(syms) if rp[r] == 0]
                         for r in range(scope.requests)]
        # a pending step is shared by a state and most of its successors:
        # its encodings are cached by identity (the entry keeps it alive, so
        # the id is not reused) and the cache is dropped when it grows
        self._pending: dict[int, tuple[Pending | None, list[tuple[Any, ...]]]] = {}
        self._pending_values: dict[Pending | None, list[tuple[Any, ...]]] = {}

    def _pendings(self, p: Pending | None) -> list[tuple[Any, ...]]:
        got = self._pending.get(id(p))
        if got is None:
            if len(self._pending) > 4096:
                self._pending.clear()
            # then by value: each admit makes a new Pending, equal to the one
            # the same admit made in many another state
            enc = self._pending_values.get(p)
            if enc is None:
                if len(self._pending_values) > 1 << 13:
                    self._pending_values.clear()
                enc = self._pending_values[p] = [_pending(p, rp, lp, tm)
                                                 for rp, lp, tm in self._renamings]
            got = self._pending[id(p)] = (p, enc)
        return got[1]

    def encodings(self, s: State) -> list[tuple[Any, ...]]:
        """`s` under every renaming, in `symmetries` order."""
        cur, staged = self._pendings(s.current), self._pendings(s.staged)
        return [_encode(s, rp, lp, tm, c, st, same, self.ids)
                for (rp, lp, tm), same, c, st in zip(self._renamings, self._same_labels, cur,
                                                      staged, strict=True)]

    def key(self, s: State) -> bytes:
        if not self._renamings:
            # page ids are a function of the counts up to renaming unless
            # sharing or windows are on: without, they are left out (core.project)
            return repr(plain(s if self.ids else project(s))).encode()
        # marshal's format 0 is a function of the value alone (no references
        # or interned strings, which the later formats share by identity),
        # and writes nested tuples of ints, bools and strs 2-3x faster than repr
        return marshal.dumps(min(self._candidates(s)), 0)

    def _candidates(self, s: State) -> list[tuple[Any, ...]]:
        """The encodings among which the least is: all of them, but where
        every stream is one request's, only those renaming that request 0.
        An encoding is (free, streams, ...) with the streams sorted by their
        renamed key, free is the same in all, so one that makes the request
        any other id sorts after one that makes it 0, whatever follows."""
        rids = {k[0] for k, _ in s.streams}
        if len(rids) != 1:
            return self.encodings(s)
        (rid,) = rids
        cur, staged = self._pendings(s.current), self._pendings(s.staged)
        return [_encode(s, rp, lp, tm, cur[j], staged[j], self._same_labels[j], self.ids)
                for j in self._leading[rid]
                for rp, lp, tm in (self._renamings[j],)]

    def canonical(self, s: State) -> State:
        """The orbit member whose encoding is `key(s)` (for tests and display)."""
        if not self._renamings:
            return s
        _, j = min((e, j) for j, e in enumerate(self.encodings(s)))
        rp, lp, _ = self._renamings[j]
        return rename(s, rp, lp, self.n_labels)


def rename(s: State, rp: Perm, lp: Perm, n_labels: int) -> State:
    """`s` with request r called rp[r] and label l called lp[l]."""
    tm = token_map(lp, n_labels)

    def key(k: tuple[int, int]) -> tuple[int, int]:
        return (rp[k[0]], lp[k[1]])

    def toks(c: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(tm[t] for t in c)

    def step(p: Pending | None) -> Pending | None:
        if p is None:
            return None
        st = p.step
        new = Step(tuple(sorted((Seg(rp[g.rid], lp[g.label], g.span) for g in st.segments),
                                key=lambda g: (g.rid, g.label, g.span))),
                   tuple((lp[f], lp[t]) for f, t in st.pre_forks),
                   tuple((lp[f], lp[t]) for f, t in st.post_forks),
                   tuple(sorted(rp[r] for r in st.padded)), st.commit)
        undo = tuple(sorted(((key(k), None if c is None else toks(c)) for k, c in p.undo),
                            key=lambda u: (u[0], u[1] is not None, u[1] or ())))
        return Pending(new, p.phase, frozenset(map(key, p.marks)), undo,
                       frozenset(map(key, p.fresh)), p.forked,
                       tuple(sorted((key(k), n) for k, n in p.basis)), p.preplanned)

    return State(
        free=s.free,
        streams=tuple(sorted((key(k), replace(v, contents=toks(v.contents)))
                             for k, v in s.streams)),
        host=tuple(sorted((key(k), toks(c)) for k, c in s.host)),
        current=step(s.current), staged=step(s.staged),
        offloads=tuple(sorted(
            (rp[r], Offload(tuple(sorted((lp[lb], n) for lb, n in o.claimed)),
                            frozenset(lp[lb] for lb in o.copied), o.touched,
                            tuple(sorted((lp[lb], n) for lb, n in o.hosted))))
            for r, o in s.offloads)),
        leases=tuple(sorted(rp[r] for r in s.leases)),
    )
