"""Disagreements between kvref and the one model at the seams that the
composed layers found on the clean tree and that are still open (issue 27),
each as the shortest trace that shows it, replayed on both
(`kvref.testing.exhaustive.run_trace`). Strict xfails: once one is settled
its test passes, fails as XPASS, and moves to the composed regressions;
the plants waiting on it (tests/conformance/test_interaction_plants.py,
`BLOCKED`) are then found."""

from __future__ import annotations

import pytest

from kvref_model import core as m
from tests.support.plant_layers import traces
from tests.support.seam_traces import SHARED, TRACES, run

_PREPLANNED_FORK = m.Step((m.Seg(0, 0, 0),), pre_forks=((0, 1),), padded=(0,), commit=False)

OPEN: dict[str, tuple[m.Scope, list[m.Action], str]] = {
    "copy-on-write admit after a truncate into a shared page": (
        *TRACES["write after a truncate into a shared page"],
        "the admit's reserved copy: pages 3 in the model's table, 2 in kvref's stream"),
    "preplanned copy-on-write fork": (
        SHARED, [m.Ingest(0), *run(0, 0, 3), m.Admit(_PREPLANNED_FORK, preplan=True),
                 m.Plan(preplan=True), m.Admit(_PREPLANNED_FORK), m.Plan(), m.Commit()],
        "after the promoted plan: free 4 in kvref, 5 in the model"),
}


@pytest.mark.xfail(strict=True, reason="open disagreement on the clean tree (issue 27)")
@pytest.mark.parametrize("name", sorted(OPEN))
def test_open_disagreement(name: str) -> None:
    scope, trace, seen = OPEN[name]
    found = traces(None, scope, [trace])
    assert found.at is None, f"{seen}: at call {found.at}: {found.message}"
