"""S31 in the one model: `Model.cache_prefixes` is `CachePrefix` of each
stream in order, or the first misuse and the very state given."""

from __future__ import annotations

from kvref_model import core
from tests.model.test_one_model import PS2, run, step


def _two_streams() -> tuple[core.Model, core.State]:
    m = core.Model(core.Scope(**PS2, sharing=True))
    _, s = run(m, core.Ingest(0), *step(0, 0, 4), *step(0, 1, 3))
    return m, s


def test_the_batch_is_each_cache_prefix_in_order() -> None:
    m, s = _two_streams()
    got, after = m.cache_prefixes(s, ((0, 0), (0, 1)))
    r0, t = m.step(s, core.CachePrefix(0, 0))
    r1, t = m.step(t, core.CachePrefix(0, 1))
    assert got == (r0, r1) == (core.Count(2), core.Count(1))
    assert after == t and after != s
    assert m.cache_prefixes(s, ()) == ((), s)


def test_a_misuse_anywhere_is_that_misuse_and_changes_nothing() -> None:
    m, s = _two_streams()
    for keys in (((0, 0), (1, 0)),  # r1 was never ingested: UnknownRequestError
                 ((0, 0), (0, 0))):  # a stream named twice
        got, after = m.cache_prefixes(s, keys)
        assert isinstance(got, core.Misuse) and after is s, (keys, got)
    assert m.cache_prefixes(s, ((0, 0), (1, 0)))[0] == core.Misuse("UnknownRequestError")
    assert m.cache_prefixes(s, ((0, 0), (0, 0)))[0] == core.Misuse("InvalidArgumentError")
