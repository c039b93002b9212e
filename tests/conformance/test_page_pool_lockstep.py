"""kvref.core.page_pool and kvref_model.pages in lockstep.

The machine plays an engine with three streams over a pool of five pages
of two tokens: prefill (a prefix hit, then allocate, write and register
the rest), decode (copy-on-write when the last page is shared), fork
(share the full pages, copy the part page), release (tail first), and the
careless calls: a release twice through two paths, a page twice in one
release, a release of a page it does not hold, a write into a shared or
registered page, a register of a part page or under other tokens, a hit
for a stream that is not empty, another salt, a prompt that diverges.

Every pool call is one model action: the results must be equal, and after
it the pool's state (holders, keys, LRU order, free-blank order) must be
the model's, `sanity_check` must pass, every invariant of
kvref_model.pages_invariants must hold, and every stream must read back, from
the pages it holds, the bytes it wrote or was given (the machine keeps its
own copy of what each page holds, written only when the pool allowed it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvref.core.errors import KVRefError
from kvref.core.page_pool import PagePool, PrefixHit, Registered, ResetRefused
from kvref.prefix import keys as prefix_hash
from kvref.stepping.step import AllocationFailed
from kvref_model import pages as M
from kvref_model.pages_invariants import INTERESTING, state_violations, transition_violations

PS = 2
PAGES = 5
OWNERS = ("r0", "r1", "r2")
EXTRAS: tuple[M.Extras, ...] = ((), (("salt", "ab"),), (("lora", "a"), ("salt", "b")))
BASE = (1, 2, 3, 4, 5, 6, 7, 8)

owners = st.sampled_from(OWNERS)
extras = st.sampled_from(EXTRAS)
lengths = st.integers(1, len(BASE))
diverge = st.one_of(st.none(), st.integers(0, len(BASE) - 1))


def prompt(k: int, at: int | None) -> tuple[int, ...]:
    """The first `k` tokens of one shared prompt, one changed at `at`."""
    t = list(BASE[:k])
    if at is not None and at < k:
        t[at] = 9
    return tuple(t)


def as_model(got: Any) -> M.Result:
    if got is None:
        return M.Ok()
    if isinstance(got, list):
        return M.Pages(tuple(got))
    if isinstance(got, AllocationFailed):
        return M.AllocationFailed(got.pages_short)
    if isinstance(got, PrefixHit):
        return M.Hit(got.pages, got.num_tokens)
    if isinstance(got, Registered):
        return M.Registered(got.page)
    if isinstance(got, ResetRefused):
        return M.ResetRefused(got.pages_held)
    assert isinstance(got, int), got
    return M.Count(got)


class PagePoolLockstep(RuleBasedStateMachine):
    # how often each of the model's interesting cases arose, over a whole run
    seen: ClassVar[Counter[str]] = Counter()
    runs: ClassVar[int] = 0  # machines built: the examples run so far

    def __init__(self) -> None:
        super().__init__()
        PagePoolLockstep.runs += 1
        self.pool = PagePool(PAGES + 1, PS)  # + the sink, page 0
        self.model = M.PagesModel(M.Scope(pages=PAGES, holders=len(OWNERS), page_size=PS))
        self.state = self.model.init()
        self.streams: dict[str, tuple[tuple[int, ...], M.Extras]] = {}
        self.memory: dict[int, M.Key] = {}  # what each page's bytes hold
        self._digests: dict[M.Key, bytes] = {}

    # ------------------------------------------------------------ lockstep

    def do(self, action: M.Action, call: Callable[[], Any]) -> M.Result:
        want, after = self.model.step(self.state, action)
        try:
            got = as_model(call())
        except KVRefError as err:
            got = M.Misuse(type(err).__name__)
        assert got == want, f"{action}: kvref {got}, model {want}"
        for name, pred in INTERESTING.items():
            if pred(self.model, self.state, action, want, after):
                self.seen[name] += 1
        broken = transition_violations(self.model, self.state, action, want, after)
        assert not broken, f"{action}: {broken}"
        self.state = after
        self.compare()
        return want

    def digest(self, key: M.Key | None) -> bytes | None:
        if key is None:
            return None
        d = self._digests.get(key)
        if d is None:
            d = self._digests[key] = prefix_hash.page_key(
                self.digest(key.parent), key.tokens, key.extras)
        return d

    def compare(self) -> None:
        self.pool.sanity_check()
        snap, s = self.pool.snapshot(), self.state
        for p in range(1, PAGES + 1):
            pg = s.page(p)
            assert snap.holders[p - 1] == {OWNERS[h] for h in pg.holders}, (
                f"page {p}: kvref holders {set(snap.holders[p - 1])}, model {pg.holders}")
            assert snap.keys[p - 1] == self.digest(pg.key), f"page {p}: keys differ"
        assert snap.lru == s.lru, f"LRU: kvref {snap.lru}, model {s.lru}"
        assert snap.blank == s.blank, f"free-blank: kvref {snap.blank}, model {s.blank}"
        broken = state_violations(self.model, s)
        assert not broken, broken

    @invariant()
    def streams_read_back_their_tokens(self) -> None:
        for owner, (tokens, ex) in self.streams.items():
            table = self.table(owner)
            assert len(table) == -(-len(tokens) // PS), (owner, table, tokens)
            want = self.contents(tokens, ex)
            got = [self.memory.get(p) for p in table]
            assert got == want, f"{owner} reads {got}, wrote {want}"

    # ------------------------------------------------------------ helpers

    def h(self, owner: str) -> int:
        return OWNERS.index(owner)

    def table(self, owner: str) -> tuple[int, ...]:
        return self.state.tables[self.h(owner)]

    @staticmethod
    def contents(tokens: tuple[int, ...], ex: M.Extras) -> list[M.Key]:
        out: list[M.Key] = []
        for i in range(0, len(tokens), PS):
            out.append(M.Key(out[-1] if out else None, tokens[i:i + PS], ex))
        return out

    def write(self, owner: str, page: int, content: M.Key) -> bool:
        r = self.do(M.Write(self.h(owner), page, content),
                    lambda: self.pool.check_writable(owner, page))
        if isinstance(r, M.Ok):
            self.memory[page] = content
        return isinstance(r, M.Ok)

    def register(self, page: int, content: M.Key, tokens: tuple[int, ...] | None = None
                 ) -> M.Result:
        toks = content.tokens if tokens is None else tokens
        return self.do(M.Register(page, content.parent, toks, content.extras),
                       lambda: self.pool.register(page, self.digest(content.parent), toks,
                                                  content.extras))

    def release_all(self, owner: str) -> M.Result:
        pages = self.table(owner)[::-1]  # tail first: the prefix is evicted last
        return self.do(M.Release(self.h(owner), pages),
                       lambda: self.pool.release(owner, pages))

    def allocate(self, owner: str, n: int) -> M.Result:
        return self.do(M.Allocate(self.h(owner), n), lambda: self.pool.allocate(owner, n))

    # ------------------------------------------------------------ the engine

    @precondition(lambda self: len(self.streams) < len(OWNERS))
    @rule(data=st.data(), k=lengths, at=diverge, ex=extras)
    def prefill(self, data: st.DataObject, k: int, at: int | None, ex: M.Extras) -> None:
        owner = data.draw(st.sampled_from([o for o in OWNERS if not self.table(o)]))
        tokens = prompt(k, at)
        hit = self.do(M.Match(self.h(owner), tokens, ex),
                      lambda: self.pool.match(owner, tokens, ex))
        assert isinstance(hit, M.Hit)
        want = self.contents(tokens, ex)
        got = self.allocate(owner, len(want) - len(hit.pages))
        if not isinstance(got, M.Pages):
            self.release_all(owner)
            return
        for page, content in zip(got.pages, want[len(hit.pages):], strict=True):
            assert self.write(owner, page, content)
            if len(content.tokens) == PS:  # committed and full
                self.register(page, content)
        self.streams[owner] = (tokens, ex)

    @precondition(lambda self: self.streams)
    @rule(data=st.data(), token=st.integers(1, 9))
    def decode(self, data: st.DataObject, token: int) -> None:
        owner = data.draw(st.sampled_from(sorted(self.streams)))
        tokens, ex = self.streams[owner]
        new = (*tokens, token)
        content = self.contents(new, ex)[-1]
        last = self.table(owner)[-1]
        if len(tokens) % PS == 0 or not self.write(owner, last, content):
            # a new page, or a private copy of a shared last page (copy-on-write)
            got = self.allocate(owner, 1)
            if not isinstance(got, M.Pages):
                return
            assert self.write(owner, got.pages[0], content)
            if len(tokens) % PS:
                self.do(M.Release(self.h(owner), (last,)),
                        lambda: self.pool.release(owner, [last]))
        self.streams[owner] = (new, ex)
        if len(new) % PS == 0:
            self.register(self.table(owner)[-1], content)

    @precondition(lambda self: self.streams and len(self.streams) < len(OWNERS))
    @rule(data=st.data(), share_part=st.booleans())
    def fork(self, data: st.DataObject, share_part: bool) -> None:
        """Share the full pages; the part page is copied, or shared too and
        copied by whichever stream appends to it first (copy-on-write)."""
        src = data.draw(st.sampled_from(sorted(self.streams)))
        dst = data.draw(st.sampled_from([o for o in OWNERS if not self.table(o)]))
        tokens, ex = self.streams[src]
        table = self.table(src)
        shared = table if share_part else table[:len(tokens) // PS]
        self.do(M.Share(self.h(dst), shared), lambda: self.pool.share(dst, shared))
        if len(shared) < len(table):
            got = self.allocate(dst, 1)
            if not isinstance(got, M.Pages):
                self.release_all(dst)
                return
            assert self.write(dst, got.pages[0], self.memory[table[-1]])
        self.streams[dst] = (tokens, ex)

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(self.streams)))
        self.release_all(owner)
        del self.streams[owner]

    @rule(pick=st.sets(owners, min_size=1))
    def reclaimable(self, pick: set[str]) -> None:
        released = {o: self.table(o)[::-1] for o in sorted(pick)}
        self.do(M.Reclaimable(tuple((self.h(o), ps) for o, ps in released.items())),
                lambda: self.pool.reclaimable(released))

    @rule()
    def reset_prefix_cache(self) -> None:
        self.do(M.ResetPrefixCache(), self.pool.reset_prefix_cache)

    @rule(k=lengths, at=diverge, ex=extras)
    def lookup(self, k: int, at: int | None, ex: M.Extras) -> None:
        tokens = prompt(k, at)
        self.do(M.Lookup(tokens, ex), lambda: self.pool.lookup(tokens, ex))
        self.do(M.NumFree(), lambda: self.pool.num_free)

    # ------------------------------------------------------------ careless calls

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def released_twice_by_two_paths(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(self.streams)))
        pages = self.table(owner)[::-1]
        self.release_all(owner)  # say, remove_request
        del self.streams[owner]
        self.do(M.Release(self.h(owner), pages),  # and then an offload's release
                lambda: self.pool.release(owner, pages))

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def same_page_twice_in_one_release(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(self.streams)))
        last = self.table(owner)[-1]
        self.do(M.Release(self.h(owner), (last, last)),
                lambda: self.pool.release(owner, [last, last]))

    @rule(owner=owners, page=st.integers(0, PAGES + 1))
    def release_a_page_not_held(self, owner: str, page: int) -> None:
        if page not in self.table(owner):
            self.do(M.Release(self.h(owner), (page,)), lambda: self.pool.release(owner, [page]))

    @rule(owner=owners, page=st.integers(1, PAGES))
    def write_without_copy(self, owner: str, page: int) -> None:
        pg = self.state.page(page)
        if pg.holders != {self.h(owner)} or pg.key is not None:  # refused: nothing written
            self.write(owner, page, M.Key(None, (0,) * PS, ()))

    @precondition(lambda self: self.streams)
    @rule(data=st.data(), change=st.booleans())
    def register_badly(self, data: st.DataObject, change: bool) -> None:
        owner = data.draw(st.sampled_from(sorted(self.streams)))
        page = self.table(owner)[0]
        content = self.memory[page]
        if change and self.state.page(page).key is not None:  # other tokens: immutable
            self.register(page, content, tuple(t + 1 for t in content.tokens))
        else:  # a part page
            self.register(page, content, content.tokens[:-1])

    @precondition(lambda self: self.streams)
    @rule(data=st.data(), k=lengths, at=diverge, ex=extras)
    def hit_on_a_stream_that_is_not_empty(self, data: st.DataObject, k: int,
                                          at: int | None, ex: M.Extras) -> None:
        owner = data.draw(st.sampled_from(sorted(self.streams)))
        tokens = prompt(k, at)
        hit = self.do(M.Match(self.h(owner), tokens, ex),
                      lambda: self.pool.match(owner, tokens, ex))
        if isinstance(hit, M.Hit) and hit.pages:  # the engine notices and gives them back
            pages = hit.pages[::-1]
            self.do(M.Release(self.h(owner), pages), lambda: self.pool.release(owner, pages))

    @rule(owner=owners, n=st.sampled_from([-1, PAGES + 1]))
    def allocate_badly(self, owner: str, n: int) -> None:
        self.allocate(owner, n)


def test_page_pool_lockstep() -> None:
    PagePoolLockstep.seen.clear()
    run_state_machine_as_test(PagePoolLockstep, settings=settings())  # the profile's
    missing = [name for name in INTERESTING if not PagePoolLockstep.seen[name]]
    assert not missing, f"never arose: {missing}"
