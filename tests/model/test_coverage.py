"""kvref_model.coverage: a rule fires where switching it off alone changes the
transition; the layers' hook records what they step; the checker's --rules."""

from __future__ import annotations

import json
from pathlib import Path

from kvref.testing.driver import DriverConfig
from kvref.testing.exhaustive import run_trace
from kvref_model import core as m
from kvref_model import coverage
from kvref_model.check import main
from kvref_model.reference import ReferenceModel

SCOPE = m.Scope(requests=1, labels=2, device_pages=2, host_pages=1, page_size=1, max_span=1)
STEP = m.Step((m.Seg(0, 0, 1),), padded=(0,))


def _walk(model: m.Model, actions: list[m.Action]) -> m.State:
    s = model.init()
    for a in actions:
        s = model.step(s, a)[1]
    return s


def test_a_rule_fires_only_where_it_changes_the_transition() -> None:
    model, tracer = m.Model(SCOPE), coverage.RuleTracer(m.Model, SCOPE)
    busy = _walk(model, [m.Ingest(0), m.Admit(STEP)])
    r, n = model.step(busy, m.Reset(0, True))
    assert "R5_no_reset_in_flight" in tracer.fired(busy, m.Reset(0, True), r, n)
    # idle: R5 is consulted, but the model without it resets the same way
    idle = _walk(model, [m.Ingest(0)])
    r, n = model.step(idle, m.Reset(0, True))
    assert "R5_no_reset_in_flight" not in tracer.fired(idle, m.Reset(0, True), r, n)
    assert "R5_no_reset_in_flight" in tracer.reads


def test_r1_fires_on_a_refused_admit_the_sequential_one_would_leave_half_done() -> None:
    scope = m.Scope(requests=1, labels=2, device_pages=1, host_pages=0, page_size=1, max_span=1)
    model, tracer = m.Model(scope), coverage.RuleTracer(m.Model, scope)
    s = _walk(model, [m.Ingest(0)])
    two = m.Admit(m.Step((m.Seg(0, 0, 1), m.Seg(0, 1, 1)), padded=(0,)))
    r, n = model.step(s, two)
    assert isinstance(r, m.Refused) and "R1_atomic_admit" in tracer.fired(s, two, r, n)
    one = m.Admit(STEP)
    r, n = model.step(s, one)
    assert "R1_atomic_admit" not in tracer.fired(s, one, r, n)  # admitted: nothing to undo


def test_a_rule_already_off_cannot_fire() -> None:
    assert "R5_no_reset_in_flight" not in coverage.flags(ReferenceModel)
    assert "R5_no_reset_in_flight" in coverage.flags(m.Model)


def test_the_layers_hook_records_what_it_steps() -> None:
    trace = [m.Ingest(0), m.Admit(STEP), m.Reset(0, True), m.Plan(), m.Write(), m.Commit()]
    coverage.note(m.Model(SCOPE), m.Model(SCOPE).init(), m.Ingest(0), m.Ok(),
                  m.Model(SCOPE).init())  # no recording on: nothing happens
    with coverage.recording("trace") as cov:
        run_trace(m.Model(SCOPE), trace, DriverConfig())
    assert cov.transitions == len(trace) and cov.actions["Admit"] == 1
    assert cov.rules["R5"] == 1 and cov.invariants["I15"] == 1  # a commit of a span
    table = cov.table()
    assert "R5" in table and "<-- never fired" in table and "I15" in table
    doc = cov.to_json()
    assert doc["rules"]["R5"] == 1 and "R5" not in doc["never_fired"]
    with coverage.recording("tail") as tail:  # a replayed prefix is not counted again
        run_trace(m.Model(SCOPE), trace, DriverConfig(), note_from=5)
    assert tail.transitions == 1 and dict(tail.actions) == {"Commit": 1}


def test_the_checker_counts_the_rules_that_fired(tmp_path: Path) -> None:
    out = tmp_path / "rep.json"
    args = ["--requests", "1", "--labels", "2", "--device-pages", "1", "--host-pages", "0",
            "--page-size", "1", "--max-span", "1", "--depth", "3", "--no-sharing",
            "--windows", "", "--margins", "", "--quiet", "--workers", "1"]
    assert main([*args, "--rules", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["rules"]["R1"] > 0 and rep["rules"]["R5"] > 0  # a refused two-page admit
    assert "R71" in rep["never_fired"]  # no lease in three calls
    # the counts are the workers' merged: the same with two
    assert main([*args[:-1], "2", "--rules", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rules"] == rep["rules"]
    assert main([*args, "--json", str(out)]) == 0
    assert "rules" not in json.loads(out.read_text())
