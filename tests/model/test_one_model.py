"""Features off reproduce today: the one model (kvref_model.core) with
sharing and windows off reaches exactly the states and transitions of the
page-counting lifecycle model it grew from (tests/model/frozen/core_v0.py, a
frozen copy of kvref_model/core.py at c4e7395, explored with its own
protocol), state for state under the projection page ids -> page counts."""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any

import pytest

from kvref_model import core
from kvref_model.protocol import calls
from kvref_model.reference import ReferenceModel
from tests.model.frozen import core_v0 as v0
from tests.model.frozen import protocol_v0
from tests.model.frozen.reference_v0 import ReferenceModel as ReferenceV0

# the one model's page ids, the keyed slots a host copy remembers (S29;
# always () with sharing off), and whether a step's forks copy as a
# preplan's (R57; always False with sharing off): projected away
DROP = {"table", "pool", "keyed", "preplanned"}


def norm(x: Any) -> Any:
    """A value of either model as plain nested tuples (class names kept)."""
    if is_dataclass(x) and not isinstance(x, type):
        return (type(x).__name__,
                *(norm(getattr(x, f.name)) for f in fields(x) if f.name not in DROP))
    if isinstance(x, tuple):
        return tuple(norm(y) for y in x)
    if isinstance(x, frozenset):
        return ("set", *sorted((norm(y) for y in x), key=repr))
    return x


def explore(model: Any, issue: Any, depth: int) -> tuple[set[Any], set[Any]]:
    """Every state within `depth` calls and every transition, normalised."""
    memo: dict[Any, Any] = {}

    def norm_state(s: Any) -> Any:
        got = memo.get(s)
        if got is None:
            got = memo[s] = norm(s)
        return got

    states, trans = {norm(model.init())}, set()
    seen = {model.init()}
    level = [model.init()]
    for _ in range(depth):
        nxt = []
        for s in level:
            ns = norm_state(s)
            for a in issue(model, s):
                r, n = model.step(s, a)
                nn = norm_state(n)
                trans.add((ns, norm(a), norm(r), nn))
                states.add(nn)
                if n not in seen:
                    seen.add(n)
                    nxt.append(n)
        level = nxt
    return states, trans


SCOPES = [
    (dict(), 4),
    (dict(page_size=2, max_span=2, device_pages=3), 3),
    (dict(requests=1, labels=3, device_pages=4, host_pages=2), 3),
]


@pytest.mark.parametrize(("kw", "depth"), SCOPES)
@pytest.mark.parametrize("variant", ["kvref", "reference"])
def test_features_off_is_todays_model(kw: dict[str, int], depth: int, variant: str) -> None:
    new_cls, old_cls = ((core.Model, v0.Model) if variant == "kvref"
                        else (ReferenceModel, ReferenceV0))
    new = new_cls(core.Scope(**kw, depth=depth))
    old = old_cls(v0.Scope(**kw, depth=depth))
    got_states, got_trans = explore(new, calls, depth)
    want_states, want_trans = explore(old, protocol_v0.calls, depth)
    assert len(want_states) > 100
    assert got_states == want_states
    assert got_trans == want_trans


def test_projection_is_what_the_read_back_compares() -> None:
    m = core.Model(core.Scope())
    s = m.init()
    for a in (core.Ingest(0), core.Admit(core.Step((core.Seg(0, 0, 1),), padded=(0,)))):
        _, s = m.step(s, a)
    p = core.project(s)
    assert p.pool is None and all(v.table == () for _, v in p.streams)
    assert dict(p.streams)[(0, 0)].pages == 1 and p.free == 2


# --- the mechanisms together: scenarios of the one model (issue 27, part 1)

PS2 = dict(requests=2, labels=3, device_pages=6, host_pages=4, page_size=2, max_span=4)


def run(m: core.Model, *actions: core.Action) -> tuple[list[core.Result], core.State]:
    from kvref_model.invariants import violations
    s, out = m.init(), []
    for a in actions:
        r, n = m.step(s, a)
        bad = violations(m, n, a, r, s)
        assert not bad, (a, bad)
        out.append(r)
        s = n
    return out, s


def step(rid: int, label: int, span: int, **kw: Any) -> list[core.Action]:
    st = core.Step((core.Seg(rid, label, span),), padded=(rid,), **kw)
    return [core.Admit(st), core.Plan(), core.Write(), core.Commit()]


def test_a_fork_shares_full_pages_and_a_write_after_truncate_copies() -> None:
    m = core.Model(core.Scope(**PS2, sharing=True))
    _, s = run(m, core.Ingest(0), *step(0, 0, 4, post_forks=((0, 1),)))
    st = s.stream_map()
    assert st[(0, 1)].table[:2] == st[(0, 0)].table[:2]  # shared by reference (S19)
    # R52: cut the target into a shared full page, then write into it
    _rs, s2 = run(m, core.Ingest(0), *step(0, 0, 4, post_forks=((0, 1),)),
                 core.Truncate(0, 1, 3), *step(0, 1, 1))
    st2 = s2.stream_map()
    assert st2[(0, 1)].table[1] != st2[(0, 0)].table[1]  # the copy (S18)
    assert st2[(0, 0)].contents == (0,) * 4 and st2[(0, 1)].contents == (0, 0, 0, 1)


def test_a_hit_attaches_cached_pages_and_an_offload_frees_only_the_last_holder() -> None:
    m = core.Model(core.Scope(**PS2, sharing=True))
    rs, _ = run(m, core.Ingest(0), *step(0, 0, 4), core.CachePrefix(0, 0), core.Ingest(1),
                core.MatchPrefix(1, 0, 5))
    assert rs[-3] == core.Count(2) and rs[-1] == core.Count(4)
    rs, _s = run(m, core.Ingest(0), *step(0, 0, 4), core.CachePrefix(0, 0), core.Ingest(1),
                core.MatchPrefix(1, 0, 5), core.OffloadClaim(1), core.OffloadCopy(1, 0),
                core.OffloadCommit(1))
    assert rs[-1] == core.Freed(0)  # r0 still holds both pages (R53)


def test_reset_prefix_cache_is_refused_while_a_host_copy_exists() -> None:
    m = core.Model(core.Scope(**PS2, sharing=True))
    rs, _s = run(m, core.Ingest(0), *step(0, 0, 4), core.OffloadClaim(0),
                core.OffloadCopy(0, 0), core.OffloadCommit(0), core.ResetPrefixCache())
    assert rs[-1] == core.Refused("RequestOffloading")
    rs, _ = run(m, core.Ingest(0), *step(0, 0, 4), core.OffloadClaim(0), core.ResetPrefixCache())
    assert rs[-1] == core.Refused("RequestOffloading")  # claimed: the copy is on its way


def test_received_kv_is_never_cached_nor_is_a_fork_of_it() -> None:
    m = core.Model(core.Scope(**PS2, sharing=True))
    rs, _s = run(m, core.Ingest(0), core.RetrieveStart(0, 0, 4),
                core.RetrieveComplete(0, 0, ok=True), *step(0, 0, 0, post_forks=((0, 1),)),
                core.CachePrefix(0, 0), core.CachePrefix(0, 1))
    assert rs[-2:] == [core.Count(0), core.Count(0)]


WIN = dict(requests=1, labels=3, device_pages=5, host_pages=4, page_size=2, max_span=4,
           windows=(None, 2, 2), margins=(0, 1, 1))


def test_a_fork_of_a_windowed_stream_reserves_its_window_not_its_length() -> None:
    # issue 27, defect 1: the target takes the source's released prefix
    m = core.Model(core.Scope(**WIN, sharing=True))
    acts = [core.Ingest(0)] + [a for _ in range(4) for a in step(0, 1, 4)]
    _rs, s = run(m, *acts, *step(0, 2, 0, pre_forks=((1, 2),)))
    st = s.stream_map()
    assert st[(0, 1)].stored_len == 16 and st[(0, 1)].pages <= 3
    assert st[(0, 2)].stored_len == 16 and st[(0, 2)].table[:6] == (0,) * 6


def test_a_post_fork_onto_a_windowed_target_is_not_lost() -> None:
    # issue 27, defect 2: reserved from the source's retained slots
    m = core.Model(core.Scope(**{**WIN, "device_pages": 8}))
    rs, s = run(m, core.Ingest(0), *step(0, 2, 8), *step(0, 1, 9),
                *step(0, 1, 1, post_forks=((1, 2),)))
    assert rs[-1] == core.Ok()
    assert s.stream_map()[(0, 2)].stored_len == 10


def test_a_window_released_under_an_offload_and_reloaded_retained_only() -> None:
    m = core.Model(core.Scope(**WIN, sharing=True))
    rs, s = run(m, core.Ingest(0), *step(0, 1, 4), *step(0, 1, 4), core.OffloadClaim(0),
                core.OffloadCopy(0, 1), core.OffloadCommit(0), core.Reload(0))
    v = s.stream_map()[(0, 1)]
    assert rs[-1] == core.Flag(True) and v.table[:2] == (0, 0) and v.pages == 2


def test_a_windowed_truncate_into_the_released_prefix_is_refused() -> None:
    m = core.Model(core.Scope(**WIN))
    rs, _ = run(m, core.Ingest(0), *step(0, 1, 4), *step(0, 1, 4), core.Truncate(0, 1, 3))
    assert rs[-1] == core.Misuse("ReleasedPrefixError")  # W6
    rs, _ = run(m, core.Ingest(0), *step(0, 1, 4), *step(0, 1, 4), core.Truncate(0, 1, 7))
    assert rs[-1] == core.Freed(0)  # within the margin: legal (W15)
