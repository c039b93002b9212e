"""Short traces on a hybrid model (issue 40), replayed on the model and
kvref together (`kvref.testing.exhaustive.run_trace`: results, states,
page holders and keys, the free queues' order, host lengths and bytes after
every call). Each reaches the state one hybrid plant
(tests/support/hybrid_plants.py) breaks; tests/conformance/
test_hybrid_plants.py runs them clean and with each plant."""

from __future__ import annotations

from kvref_model import core as m
from tests.support.seam_traces import run

# one full group and one window group (W = 3, pages of two tokens): a
# window of six tokens holds two full pages, both keyed
HYBRID = m.Scope(requests=2, labels=1, device_pages=6, host_pages=1, page_size=2,
                 max_span=6, sharing=True, groups=(None, 3), window_cache=True)

TRACES: dict[str, tuple[m.Scope, list[m.Action]]] = {
    # r0's six tokens keyed (the window holds slots 1 and 2), then removed:
    # the window's pages reach the LRU head first (H4)
    "a keyed window removed": (HYBRID, [
        m.Ingest(0), *run(0, 0, 6), m.CachePrefix(0, 0), m.Remove(0)]),
    # r0's four tokens keyed; r1's prompt of seven goes past them inside
    # the third page: the hit steps back to four, which both groups serve (H2)
    "a prompt past a cached one": (HYBRID, [
        m.Ingest(0), *run(0, 0, 4), m.CachePrefix(0, 0), m.Ingest(1),
        m.MatchPrefix(1, 0, 7)]),
    # a keyed window page passed by a later commit goes back blank (H3)
    "a window passes a keyed page": (HYBRID, [
        m.Ingest(0), *run(0, 0, 2), m.CachePrefix(0, 0), *run(0, 0, 2), *run(0, 0, 2)]),
    # r0's six tokens keyed in one step (the window passed slot 0 before):
    # a prompt of five finds the full group's pages, not the window's (H2)
    "a hit the window group cannot serve": (HYBRID, [
        m.Ingest(0), *run(0, 0, 6), m.CachePrefix(0, 0), m.Ingest(1),
        m.MatchPrefix(1, 0, 5)]),
    # r1's admit fits the full group's free pages, not both groups' (H1)
    # r0 retrieves four tokens; the window group's copy cannot start once
    # the full group's has: every group latched failed, and the reset after
    # drains the running copy (H1)
    "a retrieve whose window group cannot start": (HYBRID, [
        m.Ingest(0), m.RetrieveStart(0, 0, 4, start_error=True, late=True),
        m.RetrieveStart(0, 0, 4), m.Reset(0, free=True)]),
    "an admit one group cannot take": (HYBRID, [
        m.Ingest(0), *run(0, 0, 4), m.Ingest(1), m.Admit(m.Step((m.Seg(1, 0, 4),),
                                                                padded=(1,)))]),
}
