"""Each seam plant of tests/support/seam_plants.py breaks kvref where it is
planted: a reproduction against the public API, which the clean manager
passes. Which composed layer (lockstep, exhaustive replay, controlled
scheduler in kvref's default configuration) finds each, and at which example,
is measured once those layers pass their CI budget clean (issue 27 part 5)."""

from __future__ import annotations

import pytest

from tests.support import seam_plants
from tests.unit.test_shared_pages import _retrieved


@pytest.mark.parametrize("planted", [False, True], ids=["clean", "planted"])
def test_received_kv_cached(planted: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if planted:
        seam_plants.received_kv_cached(monkeypatch)
    src, dst = _retrieved()
    try:
        keyed = dst.cache_prefix("r", "main", list(range(10)))
        dst.remove_request("r")
        dst.ingest_request("q")
        hit = dst.match_prefix("q", "main", [*range(10), 1])
    finally:
        src.cleanup()
        dst.cleanup()
    # R55: a peer's KV is never keyed, so never found by another request
    assert (keyed, hit) == ((2, 8) if planted else (0, 0))
