"""Finding (j) of specs/findings.md: a chunked group at its chunk's start
holds no page (H7), a state no window reaches.

Found by driving kvref against the model on a chunked hybrid scope for the
first time (the driver had built every numbered group as a window). Two
calls meet that state:

- an offload claims only the streams holding pages, so the chunked group
  is not claimed, and a copy of the label asked every group (the model's
  group layer and the driver, as an engine naming a label), the unclaimed
  one refusing with `OffloadStateError`. Settled: a label's copy copies
  its claimed groups (kvref's handle names the claimed streams; it was
  right);
- a retrieve to a chunk's start copies nothing into the chunked group:
  kvref leaves it idle while the label's other group copies, the model
  makes it pending with it. Open: a strict expected failure below.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvref.testing.driver import DriverConfig
from kvref.testing.exhaustive import run_trace
from kvref_model import core as m
from tests.support.seam_traces import run

CHUNKED = m.Scope(requests=2, labels=1, device_pages=3, host_pages=1, page_size=1,
                  max_span=2, sharing=True, groups=(None, 2), chunked=(1,),
                  window_cache=True)


def test_an_offload_copies_the_groups_it_claimed() -> None:
    # two tokens computed: the chunk (C = 2) starts at 2 and holds no page,
    # so the claim takes the full group, and the label's copy copies it (it
    # refused before, over the unclaimed chunked group); reloaded after
    # (four pages: the step reserves both groups' before the chunk lets go)
    scope = replace(CHUNKED, device_pages=4, host_pages=2)
    calls = [m.Ingest(0), *run(0, 0, 2), m.OffloadClaim(0), m.OffloadCopy(0, 0),
             m.OffloadCommit(0), m.Reload(0), *run(0, 0, 1)]
    model = m.Model(scope)
    s = model.init()
    said = []
    for call in calls:
        r, s = model.step(s, call)
        said.append(r)
    assert said[5:8] == [m.Claimed((0,)), m.Flag(True), m.Freed(2)], said
    run_trace(model, calls, DriverConfig())  # and kvref answers alike, call by call


@pytest.mark.xfail(strict=True, reason="finding (j), open: a retrieve to a chunk's start "
                   "leaves the chunked group idle in kvref, pending in the model")
def test_a_retrieve_to_a_chunk_start() -> None:
    # a peer's 2 tokens into an empty request: the chunked group reads from
    # token 2, so its copy range [2, 2) is empty
    run_trace(m.Model(CHUNKED), [m.Ingest(0), m.RetrieveStart(0, 0, 2)], DriverConfig())
