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
  kvref left it idle while the label's other group copied, the model made
  it pending with it. Settled on the model's reading (H1): kvref's chunked
  group waits on its label's copy, and the model completes a label's
  retrieve in every group when an offload's copy waits it out.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvref.testing.driver import DriverConfig
from kvref.testing.exhaustive import check_scope, run_trace, summary
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


def test_a_retrieve_to_a_chunk_start_is_pending_in_every_group() -> None:
    # a peer's 2 tokens into an empty request: the chunked group reads from
    # token 2, so its copy range [2, 2) is empty; it is pending with the
    # full group's copy (H1), so a second retrieve waits for both (idle, it
    # grew the chunked group alone), and an offload's wait completes both
    run_trace(m.Model(CHUNKED), [
        m.Ingest(0), m.RetrieveStart(0, 0, 2), m.RetrieveStart(0, 0, 3),
        m.RetrieveComplete(0, 0, ok=True), m.Ingest(1), m.RetrieveStart(1, 0, 2),
        m.OffloadClaim(1), m.OffloadCopy(1, 0)], DriverConfig())


def test_every_reachable_state_of_a_chunked_scope() -> None:
    out = check_scope(replace(CHUNKED, depth=3), DriverConfig())
    print(summary(out))
    assert not out.failures, "\n".join(out.failures)
    assert out.states >= 63 and out.transitions >= 3700  # 63 and 3,712 measured


@pytest.mark.nightly
def test_every_reachable_state_of_a_chunked_scope_nightly() -> None:
    out = check_scope(replace(CHUNKED, depth=4, device_pages=4), DriverConfig())
    print(summary(out))
    assert not out.failures, "\n".join(out.failures)
    assert out.states >= 353  # measured
