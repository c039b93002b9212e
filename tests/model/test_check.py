"""The checker itself: exploration, symmetry, traces, the generated test, the CLI."""

import ast
from dataclasses import replace

from model.check import Report, canonical, explore, main, reachable, symmetries, to_pytest
from model.core import Ingest, Model, RetrieveStart, Scope
from model.invariants import violations

SMALL = Scope(requests=2, labels=2, device_pages=2, host_pages=1, page_size=2, max_span=1,
              depth=4)


def test_reachable_traces_replay_to_their_states() -> None:
    m = Model(SMALL)
    n = 0
    for state, trace in reachable(SMALL):
        s = m.init()
        for a, r in trace:
            got, s = m.step(s, a)
            assert got == r
        assert s == state
        assert not violations(m, s)
        n += 1
    assert n > 100


def test_symmetry_merges_request_renamings() -> None:
    m = Model(SMALL)
    syms = symmetries(SMALL)
    _, a = m.step(m.step(m.init(), Ingest(0))[1], RetrieveStart(0, 0, 1))
    _, b = m.step(m.step(m.init(), Ingest(1))[1], RetrieveStart(1, 0, 1))
    assert a != b and canonical(a, syms, 2) == canonical(b, syms, 2)


def test_symmetry_is_sound_states_match_unreduced_count() -> None:
    # with one request there is nothing to merge: both counts must agree
    one = replace(SMALL, requests=1)
    rep = Report()
    list(explore(Model(one), report=rep, traces=False))
    assert rep.states > 10 and not rep.violations


def test_generated_test_is_valid_python() -> None:
    m = Model(SMALL)
    *_, (state, trace) = reachable(SMALL)
    src = to_pytest(trace, SMALL)
    ast.parse(src)
    assert "def test_model_trace" in src and "KVManager" in src
    del m, state


def test_cli_passes_on_kvref_and_fails_on_reference(capsys: object) -> None:
    args = ["--device-pages", "2", "--host-pages", "1", "--max-span", "1", "--depth", "4",
            "--quiet"]
    assert main(args) == 0
    assert main([*args, "--model", "reference"]) == 1
