"""Finding (j) of specs/findings.md, open: a chunked group whose chunk
starts at a retrieve's new length copies nothing, and kvref and the model
disagree on whether it is pending.

Found by driving kvref against the model on a chunked hybrid scope for the
first time (the driver had built every numbered group as a window, so no
layer ever did): `python -m kvref.testing.exhaustive --requests 2 --labels 1
--device-pages 3 --host-pages 1 --page-size 1 --max-span 2 --depth 2
--sharing --groups None,2 --chunked 1 --window-cache` reports 5 mismatches,
each this one. A strict expected failure until it is settled: a fix on
either side makes it pass, and the strict mark says so.
"""

from __future__ import annotations

import pytest

from kvref.testing.driver import DriverConfig
from kvref.testing.exhaustive import run_trace
from kvref_model import core as m

CHUNKED = m.Scope(requests=2, labels=1, device_pages=3, host_pages=1, page_size=1,
                  max_span=2, sharing=True, groups=(None, 2), chunked=(1,),
                  window_cache=True)


@pytest.mark.xfail(strict=True, reason="finding (j), open: a chunk starting at a "
                   "retrieve's length is pending in the model, idle in kvref")
def test_a_retrieve_to_a_chunk_start() -> None:
    # a peer's 2 tokens into an empty request: the chunked group (C = 2)
    # reads from token 2, so its copy range [2, 2) is empty
    run_trace(m.Model(CHUNKED), [m.Ingest(0), m.RetrieveStart(0, 0, 2)], DriverConfig())
