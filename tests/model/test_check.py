"""The checker on kvref's model: traces, the generated test, the CLI's verdicts."""

import ast

from kvref_model.check import Report, explore, main, reachable, to_pytest
from kvref_model.core import Model, Scope
from kvref_model.invariants import violations

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


def test_traces_are_shortest() -> None:
    # BFS: a state's trace is never longer than the depth it was found at,
    # and the depths come in order
    lengths = [len(t) for _, t in reachable(SMALL)]
    assert lengths == sorted(lengths) and lengths[-1] == SMALL.depth


def test_one_request_has_nothing_to_merge() -> None:
    one = Scope(requests=1, labels=1, device_pages=2, host_pages=1, page_size=2, max_span=1,
                depth=4)
    reduced, full = Report(), Report()
    list(explore(Model(one), report=reduced, traces=False))
    list(explore(Model(one), report=full, traces=False, reduce=False))
    assert reduced.states == full.states > 10 and not reduced.violations


def test_generated_test_is_valid_python() -> None:
    *_, (_, trace) = reachable(SMALL)
    src = to_pytest(trace, SMALL)
    ast.parse(src)
    assert "def test_model_trace" in src and "KVManager" in src


def test_cli_passes_on_kvref_and_fails_on_reference() -> None:
    args = ["--device-pages", "2", "--host-pages", "1", "--max-span", "1", "--depth", "4",
            "--quiet", "--workers", "1"]
    assert main(args) == 0
    assert main([*args, "--model", "reference"]) == 1


def test_coverage_table_names_holes_and_vacuous_invariants(capsys) -> None:  # type: ignore[no-untyped-def]
    # depth 1: only ingest fires, so every other action is a hole
    assert main(["--depth", "1", "--quiet", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "Ingest" in out and "COVERAGE HOLE" in out and "VACUOUS" in out
    assert "collided" in out  # the fingerprint collision odds
