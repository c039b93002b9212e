"""cache_prefix of a stream that computed a page and then received a peer's
KV (R55, S30; issue 41, findings (i)).

Open: the seam control of `scripts/plant_rates.py` failed under seed 0 on
this (shrunk from 60 calls to these 12). A request computes two tokens (one
full page of its own), then a retrieve appends a peer's KV to 3 tokens, and
`cache_prefix` is called. kvref answers 0: the stream is `received`, never
registered until a reset (R55, W16). The model keys the first page: its S30
rule asks whether each page's tokens are a peer's, not whether the stream
received any. The spec's text is R55's; which one the rule means is the
lead's call, so the test is kept as an expected failure until then.
"""

from __future__ import annotations

import pytest

from kvref.testing.driver import DriverConfig
from kvref.testing.exhaustive import Mismatch, run_trace
from kvref_model import core as m

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


@pytest.mark.xfail(raises=Mismatch, strict=True,
                   reason="open: R55 (kvref: a received stream keys nothing) against "
                          "the model's S30 (pages of its own tokens key); findings (i)")
def test_cache_prefix_after_a_retrieve_onto_computed_tokens() -> None:
    run_trace(m.Model(SCOPE), CALLS, DriverConfig())
