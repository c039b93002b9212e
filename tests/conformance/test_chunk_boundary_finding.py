"""Finding (j) of specs/findings.md, settled: a chunked group at its chunk's
start holds no page (H7).

Found by driving kvref against the model on a chunked hybrid scope for the
first time (the driver had built every numbered group as a window). Two
calls met that state: a retrieve to a chunk's start copies nothing into
the chunked group, which kvref left idle and the model made pending (W16
now says: nothing copied, nothing pending); and an offload claims only
the groups holding pages, so a copy of the label copies its claimed
groups (the model's group layer and the driver asked every group, and the
unclaimed one refused). The exhaustive replay of a small chunked scope
holds both sides to each other in every reachable state.
"""

from __future__ import annotations

import pytest

from kvref.testing.driver import DriverConfig
from kvref.testing.exhaustive import check_scope, run_trace, summary
from kvref_model import core as m

CHUNKED = m.Scope(requests=2, labels=1, device_pages=3, host_pages=1, page_size=1,
                  max_span=2, sharing=True, groups=(None, 2), chunked=(1,),
                  window_cache=True)


def test_a_retrieve_to_a_chunk_start_copies_nothing_into_the_chunk() -> None:
    # a peer's 2 tokens into an empty request: the chunked group (C = 2)
    # reads from token 2, so its copy range [2, 2) is empty
    model = m.Model(CHUNKED)
    run_trace(model, [m.Ingest(0), m.RetrieveStart(0, 0, 2), m.RetrieveComplete(0, 0, ok=True)],
              DriverConfig())
    _, s = model.step(model.step(model.init(), m.Ingest(0))[1], m.RetrieveStart(0, 0, 2))
    st = s.stream_map()
    assert (st[(0, 0)].retrieve, st[(0, 1)].retrieve) == (m.PENDING, m.IDLE)


def test_an_offload_copies_the_groups_it_claimed() -> None:
    # the chunk at 2 holds no page: the claim takes the full group, and the
    # label's copy copies it (it refused before, over the chunked group)
    run_trace(m.Model(CHUNKED), [
        m.Ingest(0), m.RetrieveStart(0, 0, 2), m.OffloadClaim(0), m.OffloadCopy(0, 0),
        m.OffloadCommit(0), m.Reload(0)], DriverConfig())


def test_every_reachable_state_of_a_chunked_scope() -> None:
    out = check_scope(m.Scope(**{**CHUNKED.__dict__, "depth": 3}), DriverConfig())
    print(summary(out))
    assert not out.failures, "\n".join(out.failures)
    assert out.states >= 64 and out.transitions >= 3700  # 64 and 3,771 measured


@pytest.mark.nightly
def test_every_reachable_state_of_a_chunked_scope_nightly() -> None:
    out = check_scope(m.Scope(**{**CHUNKED.__dict__, "depth": 4}), DriverConfig())
    print(summary(out))
    assert not out.failures, "\n".join(out.failures)
    assert out.states >= 219  # measured
