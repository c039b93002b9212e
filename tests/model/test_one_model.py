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

DROP = {"table", "pool"}  # the one model's page ids: projected away


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
