"""The search engine: workers, resume, fingerprints, progress."""

import os
from dataclasses import replace

import pytest

from kvref_model.check import Report, explore, make_spec
from kvref_model.core import Model, Scope
from kvref_model.fingerprint import FingerprintSet, collision_odds, fingerprint
from kvref_model.reference import ReferenceModel
from kvref_model.search import CheckpointMismatch, Search

SCOPE = Scope(requests=2, labels=2, device_pages=2, host_pages=1, page_size=1, max_span=1,
              depth=4)
# the reference variant's state space grows much faster
REF = Scope(requests=2, labels=2, device_pages=2, host_pages=1, page_size=1, max_span=1, depth=3)


def summary(rep: Report) -> tuple[object, ...]:
    return (rep.states, rep.transitions, rep.depth, dict(rep.fired), dict(rep.interesting),
            {i: (msg, trace) for i, (msg, trace) in rep.violations.items()}, rep.complete)


def run(model: Model, **kw: object) -> tuple[Report, list[object]]:
    rep = Report()
    states = [s for s, _ in explore(model, report=rep, traces=False, **kw)]  # type: ignore[arg-type]
    return rep, states


def test_one_and_three_workers_agree_exactly() -> None:
    one, s1 = run(Model(SCOPE), workers=1)
    three, s3 = run(Model(SCOPE), workers=3)
    assert one.states > 500 and one.complete
    assert summary(one) == summary(three)
    assert s1 == s3  # the same representatives, in the same order


def test_workers_agree_on_violations_and_their_traces() -> None:
    # the reference variant breaks several invariants; every shortest trace
    # must be the same whichever process found it
    one, _ = run(ReferenceModel(REF), workers=1, keep_going=True)
    two, _ = run(ReferenceModel(REF), workers=2, keep_going=True)
    assert len(one.violations) >= 2
    assert summary(one) == summary(two)


def test_stops_at_the_first_violation_without_keep_going() -> None:
    rep, _ = run(ReferenceModel(REF), workers=2)
    assert rep.violations and not rep.complete
    full, _ = run(ReferenceModel(REF), workers=1, keep_going=True)
    assert rep.states < full.states
    # what it found is as short as the shortest anywhere
    shortest = min(len(t) for _, t in full.violations.values())
    assert min(len(t) for _, t in rep.violations.values()) == shortest


@pytest.mark.parametrize("workers", [1, 2])
def test_resume_from_a_checkpoint_gives_the_uninterrupted_result(tmp_path, workers) -> None:  # type: ignore[no-untyped-def]
    ck = str(tmp_path / "ck")
    whole, all_states = run(Model(SCOPE), workers=1)
    part, first = run(Model(SCOPE), workers=workers, checkpoint=ck, stop_after_chunks=3)
    assert not part.complete and 0 < part.states < whole.states and os.path.exists(ck)
    rest, then = run(Model(SCOPE), workers=3 - workers, resume=ck)
    assert summary(rest) == summary(whole)
    assert first + then == all_states


def test_resume_refuses_another_search(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ck = str(tmp_path / "ck")
    run(Model(SCOPE), checkpoint=ck, stop_after_chunks=2)
    with pytest.raises(CheckpointMismatch):
        run(Model(replace(SCOPE, depth=6)), resume=ck)
    with pytest.raises(CheckpointMismatch):
        run(ReferenceModel(REF), resume=ck)


def test_violation_traces_replay_from_parent_pointers() -> None:
    rep, _ = run(ReferenceModel(REF), keep_going=True)
    m = ReferenceModel(REF)
    for i, (_, trace) in rep.violations.items():
        s = m.init()
        for a, r in trace:
            got, s = m.step(s, a)
            assert got == r, i


def test_visited_set_costs_fingerprints_only() -> None:
    rep, _ = run(Model(SCOPE))
    # the flat table (8-byte slots at most 3/4 full, after doubling at most
    # 3/8 full) plus 6 bytes of parent pointer a state
    assert rep.visited_bytes / rep.states <= 8 * 8 / 3 + 6


def test_progress_reports_states_rate_depth_queue_memory(capsys) -> None:  # type: ignore[no-untyped-def]
    s = Search(make_spec(Model(SCOPE)), workers=2, progress=True, progress_every=0)
    for _ in s.run():
        pass
    err = capsys.readouterr().err
    line = err.splitlines()[-1]
    for word in ("states,", "transitions", "depth", "states/s", "queue", "memory", "MiB"):
        assert word in line, line


def test_fingerprint_set_is_a_set() -> None:
    fs = FingerprintSet(capacity=4)  # grows many times below
    keys = [fingerprint(str(i).encode()) for i in range(20_000)]
    assert all(fs.add(k) for k in keys)
    assert not any(fs.add(k) for k in keys[::7])
    assert len(fs) == len(keys) and keys[123] in fs and fingerprint(b"x") not in fs
    back = FingerprintSet.from_bytes(fs.to_bytes())
    assert len(back) == len(keys) and all(k in back for k in keys[:500])
    assert fs.nbytes / len(fs) <= 8 * 8 / 3


def test_fingerprints_are_stable_and_collision_odds_follow_the_birthday_bound() -> None:
    # stable across processes and runs (resume depends on it): a fixed value
    assert fingerprint(b"kvref") == int.from_bytes(
        __import__("hashlib").blake2b(b"kvref", digest_size=8).digest(), "little")
    assert collision_odds(1) == 0
    assert 0.4 < collision_odds(2**32) < 0.6
    assert collision_odds(10**6) < 1e-7
