"""Each action of the model, and each invariant flagging a bad state."""

from dataclasses import replace

import pytest

from kvref_model import invariants as inv
from kvref_model.core import (
    CLAIMED,
    FAILED,
    OFFLOADED,
    PENDING,
    PLANNED,
    Action,
    Admit,
    Claimed,
    ClearPreplan,
    Commit,
    Fault,
    Flag,
    Freed,
    Ingest,
    Misuse,
    Model,
    NotReady,
    OffloadAbandon,
    OffloadClaim,
    OffloadCommit,
    OffloadCopy,
    Ok,
    Plan,
    ProtocolError,
    Publish,
    Published,
    Refused,
    Reload,
    Remove,
    Reset,
    Result,
    RetrieveComplete,
    RetrieveStart,
    Scope,
    Seg,
    State,
    Step,
    Stream,
    Write,
    project,
)

SC = Scope(requests=2, labels=2, device_pages=3, host_pages=2, page_size=2, max_span=2)
MAIN, CFG = 0, 1


def run(*actions: Action, m: Model | None = None) -> tuple[list[Result], State]:
    m = m or Model(SC)
    s, out = m.init(), []
    for a in actions:
        r, n = m.step(s, a)
        assert not inv.violations(m, n, a, r, s), (a, inv.violations(m, n, a, r, s))
        out.append(r)
        s = n
    return out, s


def seg(span: int, label: int = MAIN, rid: int = 0, commit: bool = True, **kw: object) -> Step:
    return Step((Seg(rid, label, span),), padded=(rid,), commit=commit, **kw)  # type: ignore[arg-type]


def decode(span: int = 1, label: int = MAIN, rid: int = 0) -> list[Action]:
    return [Admit(seg(span, label, rid)), Plan(), Write(), Commit()]


def stream(s: State, rid: int = 0, label: int = MAIN) -> Stream:
    # as the counting model states it: its page ids left out (core.project)
    return replace(s.stream_map()[(rid, label)], table=())


def test_ingest_is_idempotent() -> None:
    _, s = run(Ingest(0), *decode(), Ingest(0))
    assert stream(s).stored_len == 1


def test_step_lifecycle_counts_pages_by_ceil() -> None:
    rs, s = run(Ingest(0), *decode(3))
    assert rs == [Ok()] * 5
    assert stream(s) == Stream(pages=2, stored_len=3, contents=(MAIN,) * 3)
    assert s.free == 1


def test_commit_false_keeps_pages_not_tokens() -> None:
    _, s = run(Ingest(0), Admit(seg(2, commit=False)), Plan(), Write(), Commit())
    assert stream(s).pages == 1 and stream(s).stored_len == 0 and not stream(s).in_flight


def test_admit_refusal_is_atomic_with_pages_short() -> None:
    # post-fork target needs 2 pages, the segment 2 more: 4 > 3 free
    step = seg(3, post_forks=((MAIN, CFG),))
    rs, s = run(Ingest(0), Admit(step))
    assert rs[-1] == Refused("AllocationFailed", pages_short=1)
    assert s.stream_map() == {(0, MAIN): Stream()}


def test_admit_marks_every_named_stream() -> None:
    _, s = run(Ingest(0), Ingest(1), *decode(1, rid=1),
               Admit(Step((Seg(0, MAIN, 1),), pre_forks=((MAIN, CFG),), padded=(0, 1))))
    assert stream(s, 1).in_flight and stream(s, 1, CFG).in_flight  # no segment of r1
    rs, _ = run(Ingest(0), Ingest(1), *decode(1, rid=1),
                Admit(Step((Seg(0, MAIN, 1),), pre_forks=((MAIN, CFG),), padded=(0, 1))),
                OffloadClaim(1))
    assert rs[-1] == Claimed(())


def test_pre_fork_copies_at_plan_post_fork_at_commit() -> None:
    _, s = run(Ingest(0), *decode(2), Admit(seg(1, pre_forks=((MAIN, CFG),))), Plan())
    assert stream(s, 0, CFG).contents == (MAIN, MAIN)
    _, s = run(Ingest(0), Admit(seg(1, post_forks=((MAIN, CFG),))), Plan(), Write(), Commit())
    assert stream(s, 0, CFG).contents == (MAIN,)


def test_fork_then_grow_reserves_from_the_source() -> None:  # R9
    _, s = run(Ingest(0), *decode(2), Admit(seg(1, CFG, pre_forks=((MAIN, CFG),))))
    assert stream(s, 0, CFG).pages == 2


def test_preplan_promote_and_clear() -> None:
    pre = [Ingest(0), *decode(1), Admit(seg(1, CFG), preplan=True), Plan(preplan=True)]
    _, s = run(*pre)
    assert s.staged is not None and s.staged.phase == PLANNED
    rs, s2 = run(*pre, Admit(seg(1, CFG)), Plan(), Write(), Commit())
    assert rs[-4] == Ok() and stream(s2, 0, CFG).stored_len == 1
    _, s3 = run(*pre, ClearPreplan())
    assert (0, CFG) not in s3.stream_map() and s3.free == 2  # invented label removed


def test_preplan_over_running_step_reserves_what_it_leaves() -> None:  # R41 (R10 retired)
    rs, s = run(Ingest(0), Admit(seg(2)), Admit(seg(1), preplan=True))
    assert rs[-1] == Ok() and stream(s).pages == 2  # 2 + 1 tokens at page size 2, not 0 + 1
    assert s.staged is not None and s.staged.basis == (((0, MAIN), 2),)


def test_offload_phases() -> None:
    base = [Ingest(0), *decode(3)]
    rs, s = run(*base, OffloadClaim(0), OffloadCopy(0, MAIN), OffloadCommit(0))
    assert rs[-3:] == [Claimed((MAIN,)), Flag(True), Freed(2)]
    assert stream(s).offload == OFFLOADED and s.host == (((0, MAIN), (MAIN,) * 3),)
    rs, s = run(*base, OffloadClaim(0), OffloadCopy(0, MAIN), OffloadCommit(0), Reload(0))
    assert rs[-1] == Flag(True) and stream(s) == Stream(2, 3, (MAIN,) * 3)
    rs, s = run(*base, OffloadClaim(0), OffloadCopy(0, MAIN), OffloadAbandon(0))
    assert s.host == () and stream(s).offload == ""


def test_claim_refused_in_flight_and_admit_refused_while_claimed() -> None:
    rs, _ = run(Ingest(0), Admit(seg(1)), OffloadClaim(0))
    assert rs[-1] == Claimed(())
    rs, s = run(Ingest(0), *decode(1), OffloadClaim(0), Admit(seg(0)))
    assert rs[-1] == Refused("RequestOffloading") and stream(s).offload == CLAIMED


def test_copy_host_full_and_copy_error() -> None:
    m = Model(Scope(device_pages=3, host_pages=1, page_size=2))
    rs, _ = run(Ingest(0), *decode(2), *decode(1), OffloadClaim(0), OffloadCopy(0, MAIN), m=m)
    assert rs[-1] == Flag(False)
    rs, s = run(Ingest(0), *decode(1), OffloadClaim(0), OffloadCopy(0, MAIN, copy_error=True))
    assert rs[-1] == Fault("OffloadCopyError") and s.offloads == () and s.host == ()


def test_reset_during_offload_fails_the_guard() -> None:
    rs, s = run(Ingest(0), *decode(1), OffloadClaim(0), OffloadCopy(0, MAIN), Reset(0, False),
                OffloadCommit(0))
    assert rs[-1] == Freed(0) and stream(s).offload == "" and s.host == ()


def test_reload_refused_mid_offload() -> None:  # R6
    rs, _ = run(Ingest(0), *decode(1), OffloadClaim(0), OffloadCopy(0, MAIN), Reload(0))
    assert rs[-1] == Flag(False)


def test_reset_and_remove() -> None:
    rs, _ = run(Ingest(0), Admit(seg(1)), Reset(0, True))
    assert rs[-1] == Misuse("StepInFlightError")  # R5
    _, s = run(Ingest(0), *decode(3), Reset(0, False))
    assert stream(s) == Stream(pages=2)
    _, s = run(Ingest(0), *decode(3), Reset(0, True))
    assert stream(s) == Stream() and s.free == 3
    _, s = run(Ingest(0), *decode(3), Remove(0))
    assert project(s) == project(Model(SC).init())  # the blank queue: another order


def test_publish() -> None:
    rs, _ = run(Ingest(0), *decode(2), Publish(0))
    assert rs[-1] == Published(((MAIN, 2),))


def test_retrieve_latch_until_reset() -> None:
    rs, s = run(Ingest(0), RetrieveStart(0, MAIN, 2), RetrieveStart(0, MAIN, 2),
                RetrieveComplete(0, MAIN, ok=False), RetrieveStart(0, MAIN, 2),
                RetrieveStart(0, CFG, 1))
    assert rs[1:] == [NotReady(), NotReady(), Ok(), Refused("AdmitRuntimeError"), NotReady()]
    assert stream(s).retrieve == FAILED and stream(s, 0, CFG).retrieve == PENDING
    _, s = run(Ingest(0), RetrieveStart(0, MAIN, 2), RetrieveComplete(0, MAIN, ok=False),
               Reset(0, False))
    assert stream(s).retrieve == ""  # R7


def test_retrieve_into_a_named_stream_raises() -> None:  # R14
    rs, _ = run(Ingest(0), Admit(seg(0, CFG), preplan=True), RetrieveStart(0, CFG, 1))
    assert rs[-1] == Misuse("StepInFlightError")


def test_calls_out_of_order_are_misuse_and_change_nothing() -> None:
    m = Model(SC)
    s = m.init()
    assert m.step(s, Plan()) == (Misuse("StepNotAdmittedError"), s)
    assert m.step(s, OffloadCommit(0)) == (Misuse("OffloadStateError"), s)
    # only the environment's events have preconditions
    with pytest.raises(ProtocolError):
        m.step(s, RetrieveComplete(0, MAIN, ok=True))


# --- each invariant flags a bad state or transition

def test_state_invariants_flag_bad_states() -> None:
    m = Model(SC)
    _, good = run(Ingest(0), *decode(3))
    v = stream(good)
    bad = {
        "I1": replace(good, free=2),
        "I2": replace(good, free=4, streams=()),
        "I3": replace(good, streams=(((0, MAIN), replace(v, pages=1)),), free=2),
        "I5": replace(good, streams=(((0, MAIN), replace(v, offload=OFFLOADED)),)),
        "I6": replace(good, host=(((0, MAIN), (0,)),)),
        "I7": replace(good, streams=(((0, MAIN), replace(v, stored_len=2)),)),
        "I12": replace(good, streams=(), free=3, host=(((0, MAIN), ()),)),
        "I13": replace(good, streams=(((0, MAIN), replace(v, in_flight=True)),)),
    }
    assert not inv.violations(m, good)
    for i, s in bad.items():
        assert i in {x for x, _ in inv.violations(m, s)}, i
    _, s = run(Ingest(0), Admit(seg(1)))
    claimed = replace(s, streams=(((0, MAIN), replace(stream(s), offload=CLAIMED)),))
    assert "I4" in {x for x, _ in inv.violations(m, claimed)}
    _, s = run(Ingest(0), Admit(seg(1)), Plan())
    assert "I8" in {x for x, _ in inv.violations(m, replace(s, streams=(), free=3))}
    # the planned step's branch of I3 (its stream map is read only there)
    short = replace(s, streams=(((0, MAIN), replace(stream(s), pages=0, table=())),))
    assert any(x == "I3" and "planned step" in msg for x, msg in inv.violations(m, short))
    # I7's token check: a token id no label's write or retrieve makes
    odd = replace(good, streams=(((0, MAIN), replace(v, contents=(*v.contents[:-1], 2 * m.nlab))),))
    assert any(x == "I7" and "no write" in msg for x, msg in inv.violations(m, odd))


def test_transition_invariants_flag_bad_steps() -> None:
    m = Model(SC)
    _, s = run(Ingest(0), Admit(seg(1)), Plan(), Write())
    r, n = m.step(s, Commit())
    dropped = replace(n, streams=(((0, MAIN), replace(stream(n), stored_len=0, contents=())),))
    assert "I15" in {x for x, _ in inv.violations(m, dropped, Commit(), r, s)}
    assert "I10" in {x for x, _ in inv.violations(m, n, Commit(), Refused("X"), s)}
    _, s = run(Ingest(0), RetrieveStart(0, MAIN, 1), RetrieveComplete(0, MAIN, ok=False))
    r, n = m.step(s, Publish(0))
    lost = replace(n, streams=(((0, MAIN), replace(stream(n), retrieve="")),))
    assert "I11" in {x for x, _ in inv.violations(m, lost, Publish(0), r, s)}
    _, s = run(Ingest(0), Admit(seg(1, CFG), preplan=True))
    r, n = m.step(s, ClearPreplan())
    assert "I9" in {x for x, _ in inv.violations(m, s, ClearPreplan(), r, s)}
    _, s = run(Ingest(0), *decode(1), OffloadClaim(0), OffloadCopy(0, MAIN))
    r, n = m.step(s, OffloadCommit(0))
    stale = replace(n, host=(((0, MAIN), ()),))
    assert "I14" in {x for x, _ in inv.violations(m, stale, OffloadCommit(0), r, s)}
    _, s = run(Ingest(0), Ingest(1), *decode(1, rid=1), Admit(seg(1)), Plan(), Write())
    r, n = m.step(s, Commit())
    leak = replace(n, streams=tuple((k, replace(v, contents=(), stored_len=0)) if k[0] == 1
                                    else (k, v) for k, v in n.streams))
    assert "I8" in {x for x, _ in inv.violations(m, leak, Commit(), r, s)}


def test_clear_preplan_keeps_what_the_running_step_committed_into_its_fork_target() -> None:
    """R11: a preplan runs no fork, so clear_preplan rewinds none. Under R41 the
    running step may commit into the preplan's pre-fork target in between
    (found by the lockstep suite: the rewind wiped that commit)."""
    m = Model(Scope(requests=1, labels=2, device_pages=4, host_pages=1, page_size=2,
                    max_span=2))
    rs, s = run(Ingest(0), Admit(seg(2)), Admit(seg(0, CFG, pre_forks=((CFG, MAIN),)),
                                                 preplan=True),
                Plan(), Write(), Commit(), ClearPreplan(), m=m)
    assert rs[-1] == Ok() and stream(s).stored_len == 2
