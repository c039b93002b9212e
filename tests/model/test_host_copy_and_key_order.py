"""Two properties of the one model, each at the scope and trace where its own
checker once found it broken: an offload copy holds the host pages it took
when it ran (I6), and page keys encode comparably with "no key"."""

from __future__ import annotations

from kvref_model import core as m
from kvref_model.invariants import i6, i17
from kvref_model.pages import Key
from kvref_model.symmetry import _key

ALL_WINDOWED = m.Scope(requests=1, labels=1, device_pages=3, host_pages=1, page_size=2,
                       max_span=2, depth=8, windows=(1,), margins=(1,))
TWO = m.Step((m.Seg(0, 0, 2),), padded=(0,))
# a windowed stream of 4 tokens holds 1 page (slot 0 released); its copy takes
# 1 host page; a keep-pages reset then makes the stream whole-table again
OFFLOAD_THEN_RESET = [m.Ingest(0), m.Admit(TWO), m.Commit(), m.Admit(TWO), m.Commit(),
                      m.OffloadClaim(0), m.OffloadCopy(0, 0), m.Reset(0, free=False)]


def test_a_copy_holds_the_host_pages_it_took_when_it_ran() -> None:
    """I6: the host use of an open offload's copy was worked out from the
    stream as it is now; after a reset of the claimed stream (its released
    slots forgotten) the 1-page copy counted 2 of the 1 host page."""
    model = m.Model(ALL_WINDOWED)
    s = model.init()
    for a in OFFLOAD_THEN_RESET:
        _, s = model.step(s, a)
        assert i6(model, s) is None, (a, i6(model, s))
    assert model.host_used(s) == 1
    r, s = model.step(s, m.OffloadCommit(0))  # touched: the guard abandons
    assert r == m.Freed(0) and not s.host and model.host_used(s) == 0


def test_keys_encode_comparably_with_no_key() -> None:
    """symmetry.key took the least of the renamings' encodings; a page with
    no key (None) against one with a key (a tuple) in the same place raised
    TypeError (--requests 2 --labels 1 --page-size 1 --max-span 1 --windows ""
    --margins "" --depth 0, about 21,000 states in)."""
    k = Key(None, (0,), ())
    encs = [((0,), _key(None)), ((0,), _key(k)), ((0,), _key(Key(k, (1,), ())))]
    assert min(encs) == ((0,), _key(None))
    assert len({_key(None), _key(k)}) == 2



def test_a_fork_fault_may_leave_its_target_without_a_key_chain() -> None:
    """I17 (the checker's, not a rule): a preplanned fork from a stream that a
    CachePrefix keyed in between gives its target the source's chain (S23);
    the same promotion with the copy failing leaves the target empty and
    without a chain, which I17 reported as more than emptying the target
    (--requests 1 --labels 2 --device-pages 3 --host-pages 3 --page-size 1
    --windows "" --margins "" --depth 8). kvref agrees with the model here
    (tests/conformance/test_composed_regressions.py)."""
    scope = m.Scope(requests=1, labels=2, device_pages=3, host_pages=3, page_size=1,
                    max_span=2, depth=8, sharing=True, windows=(), margins=())
    model = m.Model(scope)
    one = m.Step((m.Seg(0, 0, 1),), padded=(0,))
    pp = m.Step((m.Seg(0, 0, 0),), pre_forks=((0, 1),), padded=(0,))
    s = model.init()
    for a in [m.Ingest(0), m.Admit(one), m.Plan(), m.Write(), m.Commit(),
              m.Admit(pp, preplan=True), m.CachePrefix(0, 0)]:
        _, s = model.step(s, a)
    r, n = model.step(s, m.Plan(fork_error=True))
    assert r == m.Fault("ForkCopyError")
    assert n.stream_map()[(0, 1)].chain == 0 and model.step(s, m.Plan())[1].stream_map()[
        (0, 1)].chain == 1
    assert i17(model, s, m.Plan(fork_error=True), r, n) is None
