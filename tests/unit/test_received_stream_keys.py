"""cache_prefix of a stream that computed a page and then received a peer's
KV (R55, S30; issue 41, findings (i)).

The seam control of `scripts/plant_rates.py` failed under seed 0 on this
(shrunk from 60 calls to these 12). A request computes two tokens (one full
page of its own), then a retrieve appends a peer's KV to 3 tokens, and
`cache_prefix` is called. kvref answered 0 (the whole stream was `received`),
the model 1 (its S30 rule asks of each page whether its tokens are a
peer's). Settled for the model: R55 now says the pages wholly before a
retrieve's first token are the stream's own and key; kvref keeps where the
peer's tokens begin (`CacheStream.received_at`).
"""

from __future__ import annotations

import pytest

from kvref.testing.driver import DriverConfig
from kvref.testing.exhaustive import run_trace
from kvref_model import core as m
from tests.unit.test_shared_pages import _received

SCOPE = m.Scope(requests=3, labels=3, device_pages=6, host_pages=4, page_size=2, max_span=3,
                depth=6, sharing=True, windows=(None, 2, 2), margins=(0, 1, 1),
                salts=("a", "a", "lora=b"))


def step(rid: int, span: int) -> list[m.Action]:
    s = m.Step((m.Seg(rid, 0, span),), (), (), (rid,), True)
    return [m.Admit(s), m.Plan(), m.Write(), m.Commit()]


CALLS: list[m.Action] = [m.Ingest(2), *step(2, 1), *step(2, 1),
                         m.RetrieveStart(2, 0, 3), m.RetrieveComplete(2, 0, ok=True),
                         m.CachePrefix(2, 0)]


def test_the_model_keys_the_page_computed_before_the_retrieve() -> None:
    model = m.Model(SCOPE)
    s = model.init()
    for a in CALLS[:-1]:
        _, s = model.step(s, a)
    assert s.stream_map()[(2, 0)].stored_len == 3
    assert model.step(s, CALLS[-1])[0] == m.Count(1)


def test_cache_prefix_after_a_retrieve_onto_computed_tokens() -> None:
    # kvref keys the page it computed before the retrieve, as the model does
    run_trace(m.Model(SCOPE), CALLS, DriverConfig())


@pytest.mark.parametrize(("own", "keyed"), [(3, 0), (4, 1), (5, 1), (8, 2), (9, 2)])
def test_only_the_pages_before_the_peers_first_token_key(own: int, keyed: int) -> None:
    """R55: the page the peer's first token is in, and every page after it,
    key nothing; the whole pages before it are the request's own."""
    src, dst, _ = _received(own)
    assert dst.cache_prefix("r", "main", list(range(10))) == keyed
    assert len(dst._streams["r"]["main"].keys) == keyed
    src.cleanup()
    dst.cleanup()


def test_a_truncate_back_to_its_own_tokens_makes_the_stream_its_own() -> None:
    """Cut to the peer's first token, nothing of the peer's is left: the
    pages the request computes next key again (the model's contents)."""
    src, dst, dd = _received(4)
    dst.truncate("r", "main", 5)
    assert dst._streams["r"]["main"].received  # token 4 is still the peer's
    dst.truncate("r", "main", 4)
    assert not dst._streams["r"]["main"].received
    dd.step([("r", "main", 6)])  # its model holds the request's own 4 tokens
    assert dst.cache_prefix("r", "main", list(range(10))) == 2
    src.cleanup()
    dst.cleanup()
