"""Mismatches the composed harness (kvref in its shipped configuration:
the prefix cache on, windowed labels) found between kvref and the one model,
each kept as the shortest trace that showed it, replayed on both."""

from __future__ import annotations

import pytest

from kvref.testing.driver import Driver, DriverConfig
from kvref.testing.exhaustive import run_trace
from kvref.testing.lockstep import SHIPPED_SCOPE
from kvref_model import core as m
from tests.support.seam_traces import SHARED, SHARED_PREFIX, TRACES, run

SHARING = m.Scope(requests=2, labels=3, device_pages=2, host_pages=1, page_size=1,
                  max_span=2, sharing=True, windows=(None, 1, 1), margins=(0, 1, 1))


def on_the_model(trace: list[m.Action], scope: m.Scope) -> tuple[m.Result, m.State]:
    """The trace on the model alone: its last result and the state after it."""
    model = m.Model(scope)
    s, got = model.init(), None
    for a in trace:
        got, s = model.step(s, a)
    assert got is not None
    return got, s


def replay(trace: list[m.Action], scope: m.Scope = SHARING) -> m.Result:
    """The trace on the model and on kvref, every call compared; the last result."""
    run_trace(m.Model(scope), trace, DriverConfig())
    return on_the_model(trace, scope)[0]


@pytest.mark.parametrize("label", [0, 1])
def test_a_match_that_misses_makes_the_stream(label: int) -> None:
    """Model hole (S24 says the stream is created, hit or not): the model made
    it only on a hit; kvref made it on a miss and on a windowed label (W10)."""
    assert replay([m.Ingest(0), m.MatchPrefix(0, label, 4)]) == m.Count(0)


@pytest.mark.parametrize("call", [m.CachePrefix(0, 0), m.MatchPrefix(0, 0, 4)])
def test_prefix_calls_after_a_retrieve_landed(call: m.Action) -> None:
    """kvref bug: with the copy landed (observe() already said idle), the
    prefix calls still raised StreamUnavailableError until a readiness
    check collected the future. The model's CachePrefix had the converse
    hole: a stream a retrieve copies into was not refused at all."""
    got = replay([m.Ingest(0), m.RetrieveStart(0, 0, 2), m.RetrieveComplete(0, 0, ok=True),
                  call])
    assert got == (m.Count(0) if isinstance(call, m.CachePrefix)
                   else m.Misuse("InvalidArgumentError"))


def test_prefix_call_while_a_retrieve_copies() -> None:
    assert replay([m.Ingest(0), m.RetrieveStart(0, 0, 2), m.CachePrefix(0, 0)]) == m.Misuse(
        "StreamUnavailableError")


def test_a_preplan_forking_windowed_labels_is_refused() -> None:
    """Model hole (R67): kvref refuses a preplan whose forks name a windowed
    label (PreplanRefused); the model admitted it."""
    step = m.Step((m.Seg(0, 0, 0),), pre_forks=((1, 2),), padded=(0,))
    assert replay([m.Ingest(0), m.Admit(step, preplan=True)]) == m.Refused("PreplanRefused")


def test_a_post_fork_with_sharing_reserves_only_what_it_does_not_share() -> None:
    """Model/kvref disagreement, settled as kvref ships it (S19): the model
    reserved a copy-on-write post-fork target its source's whole length
    (admit left free=0); kvref reserves only what the fork does not share
    (free=1), here nothing: page size 1, so no partial page to copy."""
    step = m.Step((m.Seg(0, 1, 1),), post_forks=((1, 2),), padded=(0,))
    assert replay([m.Ingest(0), m.Admit(step)]) == m.Ok()


def test_a_shared_fork_copies_nothing_so_cannot_fault() -> None:
    """Model bug: a fork that shares every page copies no byte, yet the model
    raised ForkCopyError for an injected copy fault; kvref runs no copy."""
    step = m.Step((m.Seg(0, 1, 1),), post_forks=((1, 2),), padded=(0,))
    assert replay([m.Ingest(0), m.Admit(step), m.Commit(fork_error=True)]) == m.Ok()


def test_a_reset_keeps_no_page_two_of_its_streams_share() -> None:
    """Model bug (S21): a reset that keeps pages judged each page private after
    the streams before it had let go, so the last of two sharers kept it;
    kvref judges as the call found them and frees it."""
    step = m.Step((m.Seg(0, 1, 1),), post_forks=((1, 2),), padded=(0,))
    trace = [m.Ingest(0), m.Admit(step), m.Commit(), m.Reset(0, free=False)]
    assert replay(trace) == m.Ok()
    s = m.Model(SHARING).init()
    for a in trace:
        _, s = m.Model(SHARING).step(s, a)
    assert s.free == SHARING.device_pages


def test_the_offload_priority_counts_shared_pages_once() -> None:
    """Driver bug: R45's check summed the pages of each stream; a claim frees
    a page two of the request's streams share once (kvref's priority)."""
    step = m.Step((m.Seg(0, 1, 1),), post_forks=((1, 2),), padded=(0,))
    replay([m.Ingest(0), m.Admit(step), m.Commit()])  # check_queries runs after each


def test_reclaimable_of_an_unknown_request_is_a_misuse() -> None:
    """kvref bug (S28): reclaimable of a request never ingested answered 0;
    the model (and S28) say UnknownRequestError, as every call naming one."""
    assert replay([m.Reclaimable(0)]) == m.Misuse("UnknownRequestError")


def test_a_preplan_of_an_unknown_request_is_a_misuse_before_a_refusal() -> None:
    """kvref bug: a preplan forking windowed labels for a request never
    ingested was refused (PreplanRefused) before the unknown request was
    named; a misuse is reported first."""
    step = m.Step((m.Seg(0, 0, 0),), pre_forks=((1, 2),), padded=(0,), commit=False)
    assert replay([m.Admit(step, preplan=True)]) == m.Misuse("UnknownRequestError")


def test_a_retrieve_that_cannot_start_leaves_the_prefix_cache() -> None:
    """kvref bug: a retrieve took its pages (evicting a free-cached one, its
    key dropped) before starting the copy, and a start that raised gave them
    back blank: the cache lost a page the model still held. Pages are now
    named to the copy first and taken once it started."""
    step = m.Step((m.Seg(0, 0, 1),), padded=(0,))
    trace = [m.Ingest(0), m.Admit(step), m.Plan(), m.Write(), m.Commit(),
             m.CachePrefix(0, 0), m.Truncate(0, 0, 0), m.Ingest(1),
             m.RetrieveStart(1, 0, 2, start_error=True), m.MatchPrefix(1, 0, 2)]
    assert replay(trace) == m.Count(1)  # the page cached before the failed start


def test_a_post_fork_after_a_window_release_reserves_the_window() -> None:
    """Model bug (W2, S19): the commit retires a windowed stream's old pages
    before its post-forks run, so a post-fork target inherits the larger
    released prefix; the model counted the prefix from before the commit and
    refused (AllocationFailed) what kvref admitted. Found by the lockstep in
    the shipped scope (page size 2, W=2 with margin 1)."""
    def whole(step: m.Step) -> list[m.Action]:
        return [m.Admit(step), m.Plan(), m.Write(), m.Commit()]
    trace = [m.Ingest(0), *whole(m.Step((m.Seg(0, 2, 3),), padded=(0,))),
             *whole(m.Step((m.Seg(0, 2, 1), m.Seg(0, 1, 1)), padded=(0,)))]
    step = m.Step((m.Seg(0, 2, 2),), pre_forks=((2, 1),), post_forks=((2, 1),), padded=(0,))
    assert replay([*trace, m.Admit(step)], SHIPPED_SCOPE) == m.Ok()


def test_a_page_passed_over_stays_passed_over() -> None:
    """Model hole (S23): a cache_prefix goes on from where its stream's chain
    ends; a page passed over because another page had its key is not keyed
    later, when that page is evicted (kvref, as vLLM's cached-block count).
    The model walked every call from the first page and keyed it then. Found
    by the shipped-configuration lockstep; the model now keeps each stream's
    chain (`Stream.chain`), which the driver reads back as `keyed_pages`."""
    trace = [m.Ingest(rid=2),
             m.Admit(m.Step((m.Seg(rid=2, label=0, span=3),), padded=(2,))),
             m.Plan(),
             m.Write(),
             m.Commit(),
             m.CachePrefix(rid=2, label=0),
             m.Ingest(rid=1),
             m.Admit(m.Step((m.Seg(rid=1, label=0, span=1),), padded=(1,))),
             m.Commit(),
             m.Admit(m.Step((m.Seg(rid=2, label=0, span=2), m.Seg(rid=1, label=1, span=2)),
                            pre_forks=((2, 1), (1, 2)), padded=(1, 2), commit=False)),
             m.Commit(),
             m.Admit(m.Step((m.Seg(rid=1, label=1, span=3),), padded=(1,)), preplan=True),
             m.ClearPreplan(),
             m.Reset(rid=2, free=True),
             m.Admit(m.Step((m.Seg(rid=2, label=0, span=2),), padded=(2,))),
             m.Plan(),
             m.Write(),
             m.Commit(),
             m.CachePrefix(rid=2, label=0),
             m.Admit(m.Step((m.Seg(rid=2, label=0, span=1),), padded=(2,))),
             m.Commit(),
             m.Admit(m.Step((m.Seg(rid=2, label=0, span=2),), padded=(2,))),
             m.CachePrefix(rid=2, label=0)]
    assert replay(trace[:-1], SHIPPED_SCOPE) == m.Ok()
    assert replay(trace, SHIPPED_SCOPE) == m.Count(0)


def test_a_windowed_copy_keeps_its_host_pages_through_a_reset() -> None:
    """Model and harness hole (issue 27, I6): a copy of a windowed stream
    takes its retained slots only (W8); the model recounted it from the
    stream after a keep-pages reset (2 host pages of 1) and the harness
    counted every token's page (R46). kvref was right: used 1."""
    scope = m.Scope(requests=1, labels=1, device_pages=3, host_pages=1, page_size=2,
                    max_span=2, windows=(1,), margins=(1,))
    two = m.Step((m.Seg(0, 0, 2),), padded=(0,))
    got = replay([m.Ingest(0), m.Admit(two), m.Commit(), m.Admit(two), m.Commit(),
                  m.OffloadClaim(0), m.OffloadCopy(0, 0), m.Reset(0, free=False),
                  m.OffloadCommit(0)], scope)
    assert got == m.Freed(0)


def test_a_windowed_fork_targets_view_counts_from_its_first_retained_page() -> None:
    """Harness bug: the lockstep's check of plan's views compared a view's
    length with the stream's whole length; a windowed stream's view counts
    from its first retained page (W1), ``offset`` tokens in. Found by the
    shipped-configuration lockstep: a pre-fork target inheriting a released
    prefix (W5), view length 4 at offset 2 of 6 tokens."""
    trace = [m.Ingest(2), m.RetrieveStart(2, 2, 3), m.RetrieveComplete(2, 2, ok=True),
             m.Admit(m.Step((m.Seg(2, 2, 3), m.Seg(2, 0, 3)), padded=(2,))), m.Commit(),
             m.Admit(m.Step((m.Seg(2, 1, 0),), pre_forks=((2, 1),), padded=(2,))), m.Plan()]
    model, d = m.Model(SHIPPED_SCOPE), Driver(SHIPPED_SCOPE, DriverConfig())
    s = model.init()
    for a in trace:
        want, nxt = model.step(s, a)
        assert d.apply(a, s) == want, a
        s = nxt
    views = [v for out in (d.outputs or {}).values() for v in out.views]
    assert [(v.offset, v.length) for v in views] == [(2, 4)]
    d.check_views()


def test_no_key_under_a_pending_fork() -> None:
    """Model and kvref defect (S32): between an admit whose pre-fork targets a
    stream and its plan, cache_prefix keyed the target's private page that
    the admit counted on; at plan the fork gave it to the cache and the
    write found no page (kvref raised a plain KVRefError, the model broke I3).
    Found by the one model's checker at one request, two labels, page size 1."""
    scope = m.Scope(requests=1, labels=2, device_pages=3, host_pages=3, page_size=1,
                    max_span=2, sharing=True)
    first = m.Step((m.Seg(0, 0, 1),), pre_forks=((0, 1),), padded=(0,))
    then = m.Step((m.Seg(0, 0, 1),), pre_forks=((1, 0),), padded=(0,))
    trace = [m.Ingest(0), m.Admit(first), m.Plan(), m.Write(), m.Commit(), m.Admit(then),
             m.CachePrefix(0, 0)]
    assert replay(trace, scope) == m.Misuse("StepInFlightError")
    assert replay([*trace, m.Plan(), m.Write(), m.Commit(), m.CachePrefix(0, 0)],
                  scope) == m.Count(1)


def test_a_write_after_a_fork_between_windows() -> None:
    """Harness bug in kvref/testing/driver.py: a windowed view's written
    positions ignored its offset (the first retained page), so a window
    written past a release read back another position's bytes (I7: the
    source's token 6 read position 4's). Found by the controlled
    scheduler's programs."""
    scope = TRACES["fork of a window"][0]
    trace = [m.Ingest(0), *run(0, 1, 3), *run(0, 1, 3), *run(0, 1, 1, pre=((1, 2),))]
    assert replay(trace, scope) == m.Ok()


def test_a_window_written_in_steps_of_1_2_2_1_tokens() -> None:
    """Harness bug in kvref/testing/driver.py: a windowed view's written
    positions ignored its offset, so token 5 of a W=2 (margin 1) stream read
    position 3's bytes (I7), with the prefix cache on or off. Found by the
    controlled scheduler's programs (its drawn steps of 1, 2, 2, 1 tokens)."""
    trace = [m.Ingest(0), *run(0, 2, 1), *run(0, 2, 2), *run(0, 2, 2), *run(0, 2, 1)]
    assert replay(trace, SHARED) == m.Ok()


def test_offload_of_a_window_that_released_a_page() -> None:
    """Harness bug in kvref/testing/driver.py: the R46 host-use check
    counted a windowed stream's released slots, where a host copy holds its
    retained pages only (W8). Found by the controlled scheduler's programs
    (a window release against an offload)."""
    scope, trace = TRACES["offload of a window"]
    assert replay(trace, scope) == m.Ok()


def test_a_copy_on_write_admit_after_a_truncate_into_a_shared_page() -> None:
    """Model/kvref disagreement, settled as kvref ships it (S18, R52: the
    admit of a step that writes into a shared partial page "reserves a page
    and copies it first"): kvref copies at admit, in place in the stream's
    table, so a copy that raises changes nothing and the stream never holds
    the reserved page beside the shared one (as R57's privatising admit).
    The model reserved the page at the table's tail and swapped it in at
    plan: between admit and plan its stream held 3 pages and still shared
    the partial one, kvref's 2 and private. Free pages agreed (5), so the
    difference was only where the reserved page was recorded; the model
    now makes the copy at admit, and the plants that wait on it
    (`preplan_skips_copy_on_write`, `truncate_forgets_the_shared_tail`)
    are found by their traces."""
    scope, trace = TRACES["write after a truncate into a shared page"]
    admit = trace.index(m.Truncate(1, 0, 3)) + 1
    assert replay(trace[:admit + 1], scope) == m.Ok()  # the admit: both sides agree
    s = m.Model(scope).init()
    for a in trace[:admit + 1]:
        _, s = m.Model(scope).step(s, a)
    writer, reader = s.stream_map()[(1, 0)], s.stream_map()[(0, 0)]
    assert writer.pages == 2 and writer.table[1] != reader.table[1]  # copied at admit
    assert s.free == scope.device_pages - 3
    assert replay(trace, scope) == m.Ok()


def test_a_preplanned_copy_on_write_fork_copies() -> None:
    """Model bug (R57: a preplan's forks copy, as without sharing, into
    targets whose every page is made private at admit): the model's
    promoted preplan shared the source's full page with the target, so the
    plan left 5 pages free, kvref 4 (the target's two pages its own). The
    model now keeps `Pending.preplanned` through promotion, copies its
    forks, and makes a fork target's shared pages private at the preplan's
    admit (counted in its reservation), as kvref's `Forks.privatise`."""
    fork = m.Step((m.Seg(0, 0, 0),), pre_forks=((0, 1),), padded=(0,), commit=False)
    trace = [m.Ingest(0), *run(0, 0, 3), m.Admit(fork, preplan=True), m.Plan(preplan=True),
             m.Admit(fork), m.Plan(), m.Commit()]
    assert replay(trace, SHARED) == m.Ok()
    s = m.Model(SHARED).init()
    for a in trace:
        _, s = m.Model(SHARED).step(s, a)
    assert s.free == SHARED.device_pages - 4


def test_a_preplanned_fork_onto_a_target_that_shares_privatises_it() -> None:
    """R57 at admit: a preplanned fork onto a target that shares its
    source's full page (an earlier copy-on-write fork) copies that page
    into a fresh one at the preplan's admit; the model kept it shared (and
    its copying fork would then have let it go)."""
    fork = m.Step((m.Seg(0, 0, 1),), post_forks=((0, 1),), padded=(0,))
    trace = [m.Ingest(0), *run(0, 0, 3), *run(0, 0, 0, pre=((0, 1),)),
             m.Admit(fork, preplan=True), m.Plan(preplan=True), m.Admit(fork), m.Plan(),
             m.Write(), m.Commit(), *run(0, 1, 2)]
    assert replay(trace, SHARED) == m.Ok()


def test_a_copy_on_write_admit_letting_go_of_the_last_reference_frees_it() -> None:
    """Model bug in the copy at admit (found by the controlled scheduler's
    copy-on-write-against-reset program, schedule 57): with the other
    sharer removed, the writer held the keyed partial page last; the copy
    let it go, free-cached, yet the admit counted free as before the copy
    (I1, I23: free 5, the pool 6). kvref frees it; the model's free is now
    the pool's count."""
    scope, trace = TRACES["write after a truncate into a shared page"]
    at = trace.index(m.Truncate(1, 0, 3)) + 1
    assert replay([*trace[:at], m.Remove(0), *trace[at:]], scope) == m.Ok()


# every label windowed (W=1, margin 1, ps=2): a commit past W + k releases
# the window's first page (W2)
ALL_WINDOWED = m.Scope(requests=1, labels=1, device_pages=3, host_pages=1, page_size=2,
                       max_span=2, depth=8, windows=(1,), margins=(1,))
# r0 at 3 tokens, a step of one more admitted: its commit releases slot 0
TO_THREE = [m.Ingest(0), m.Admit(m.Step((m.Seg(0, 0, 1),), padded=(0,))), m.Commit(),
            m.Admit(m.Step((m.Seg(0, 0, 2),), padded=(0,))), m.Commit()]
ONE_MORE = m.Step((m.Seg(0, 0, 1),), padded=(0,))


def test_a_publish_waits_for_a_commit_that_releases_window_pages() -> None:
    """Model and kvref bug (I18, R70): publish between the admit and the
    commit of a step whose commit releases the window's first page leased
    that page, then the commit gave it back to the pool while the peer
    could still be copying it. The publish is refused until it committed."""
    assert replay([*TO_THREE, m.Admit(ONE_MORE), m.Publish(0)],
                  ALL_WINDOWED) == m.Refused("WindowPending")
    assert replay([*TO_THREE, m.Admit(ONE_MORE), m.Commit(), m.Publish(0)],
                  ALL_WINDOWED) == m.Published(((0, 4),))


def test_a_step_that_releases_leased_window_pages_waits_for_the_lease() -> None:
    """R70 from the other side: once published, an admit whose commit would
    release a published window page is refused (PublishLeased), as a fork
    over the request is (R50); once the lease ends it is admitted."""
    leased = [*TO_THREE, m.Publish(0), m.Admit(ONE_MORE)]
    assert replay(leased, ALL_WINDOWED) == m.Refused("PublishLeased")
    assert replay([*leased, m.ReleasePublished(0), m.Admit(ONE_MORE), m.Commit()],
                  ALL_WINDOWED) == m.Ok()
    assert replay([*leased, m.LeaseTimeout(), m.Admit(ONE_MORE)], ALL_WINDOWED) == m.Ok()


@pytest.mark.parametrize("half", ["admit", "publish"])
def test_kvref_without_r70_is_found_by_these_traces(half: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The plant: either half of R70 switched off in kvref (the admit's
    refusal, or publish's) and the traces above mismatch the model."""
    import kvref.stepping.admission as admission
    from kvref.stepping.admit_plan_commit import Stepping
    from kvref.testing.exhaustive import Mismatch
    if half == "admit":
        monkeypatch.setattr(admission, "leased_release", lambda *args: None)
        trace = [*TO_THREE, m.Publish(0), m.Admit(ONE_MORE), m.Commit()]
    else:
        monkeypatch.setattr(Stepping, "release_pending", lambda self, rid: False)
        trace = [*TO_THREE, m.Admit(ONE_MORE), m.Publish(0), m.Commit()]
    with pytest.raises(Mismatch, match="PublishLeased" if half == "admit" else "WindowPending"):
        replay(trace, ALL_WINDOWED)


def test_r70_over_a_staged_preplan() -> None:
    """A preplan over a running step (R41) whose commit, from the length the
    running step leaves, releases the window's first page: publish waits for
    it, and a leased request's preplan is refused."""
    zero = m.Step((m.Seg(0, 0, 0),), padded=(0,))
    staged = [*TO_THREE, m.Admit(zero), m.Admit(ONE_MORE, preplan=True)]
    assert replay([*staged, m.Publish(0)], ALL_WINDOWED) == m.Refused("WindowPending")
    assert replay([*staged, m.Plan(), m.Commit(), m.Publish(0)],
                  ALL_WINDOWED) == m.Refused("WindowPending")
    assert replay([*TO_THREE, m.Publish(0), m.Admit(zero), m.Admit(ONE_MORE, preplan=True)],
                  ALL_WINDOWED) == m.Refused("PublishLeased")


# one request, two full-attention labels, page size 1: the scope where a
# replay driven by the checker disagreed after a preplan (issue 27)
TWO_FULL = m.Scope(requests=1, labels=2, device_pages=3, host_pages=3, page_size=1,
                   max_span=2, depth=8, sharing=True, windows=(), margins=())
POST_FORKED = m.Step((m.Seg(0, 0, 1),), post_forks=((0, 1),), padded=(0,))


@pytest.mark.parametrize("fault", [False, True])
def test_a_preplan_promoted_unplanned_copies_its_forks(fault: bool) -> None:
    """kvref bug (R57): a preplan promoted by the real plan without having been
    planned ahead ran its forks as sharing forks (the copy-on-write target
    shared main's page and gave back the page its admit had made private for
    the copy; an injected copy fault never fired). Its admit privatised and
    reserved as for a copying fork, so its forks copy, planned ahead or not,
    as the model says."""
    trace = [m.Ingest(0), m.Admit(POST_FORKED, preplan=True), m.Plan(), m.Commit(fault)]
    assert replay(trace, TWO_FULL) == (m.Fault("ForkCopyError") if fault else m.Ok())


def test_a_failed_preplanned_fork_from_a_keyed_source() -> None:
    """The trace that broke the checker's I17 (its own defect: an emptied
    target's key chain): kvref agrees with the model call for call."""
    one = m.Step((m.Seg(0, 0, 1),), padded=(0,))
    pp = m.Step((m.Seg(0, 0, 0),), pre_forks=((0, 1),), padded=(0,))
    assert replay([m.Ingest(0), m.Admit(one), m.Plan(), m.Write(), m.Commit(),
                   m.Admit(pp, preplan=True), m.CachePrefix(0, 0), m.Plan(fork_error=True)],
                  TWO_FULL) == m.Fault("ForkCopyError")


# a stream of label 1 holding nothing yet (a step that names it with no span)
_EMPTY_LABEL_1 = [m.Admit(m.Step((m.Seg(0, 1, 0),), padded=(0,))), m.Plan(), m.Write(),
                  m.Commit()]


@pytest.mark.parametrize("how", ["fork from an empty source", "truncate to 0"])
def test_an_emptied_fork_target_keys_its_own_tokens_as_its_own(how: str) -> None:
    """kvref defect (S25), found by the nightly lockstep (2026-12-05): a fork
    target keys its pages under its source's label, since it holds the
    source's KV; it kept that label once it held nothing of the source's
    (forked from an empty source, or truncated to 0), and keyed the tokens
    it computed next under the source's label. The model keys them as its
    own label's: another page of the same tokens under its own label holds
    the key, so this one is passed over (S11). kvref keyed it afresh."""
    own = [m.Ingest(1), *run(1, 0, 2), m.CachePrefix(1, 0)]  # (0, 0)'s tokens, keyed
    if how == "truncate to 0":
        head = [m.Ingest(0), *run(0, 1, 2), *run(0, 0, 0, pre=((1, 0),)), m.Truncate(0, 0, 0)]
    else:
        head = [m.Ingest(0), *run(0, 0, 2), *_EMPTY_LABEL_1, *run(0, 0, 0, pre=((1, 0),))]
    trace = [*own, *head, *run(0, 0, 2), m.CachePrefix(0, 0)]
    assert replay(trace, SHARED) == m.Count(0)


@pytest.mark.parametrize("starts", [False, True])
def test_a_retrieve_into_a_shared_partial_page_that_cannot_start(starts: bool) -> None:
    """kvref defect (R26 at R52), found by the nightly lockstep (2026-12-05):
    a retrieve into a stream whose partial last page it shares (a truncate
    into a shared page) made that page private before starting its copy,
    and a start that raised left it made: a refused call had moved a page.
    The private page is now named to the copy and taken once it started."""
    trace = [*SHARED_PREFIX, m.Truncate(1, 0, 3),
             m.RetrieveStart(1, 0, 6, start_error=not starts)]
    if starts:
        trace += [m.RetrieveComplete(1, 0, True), *run(1, 0, 1), *run(0, 0, 1)]
    replay(trace, SHARED)


def test_a_failed_reload_gives_back_a_cached_page_it_took_blank() -> None:
    """Model hole (R26 with S29), found by the packaged harness at 300 runs
    (2026-12-05; shrunk from 71 calls to 19 and rewritten here): the model
    said a reload whose copy failed moved nothing, yet a fresh page it took
    may be a free-cached one, evicted as it was taken and perhaps written by
    the copy before it failed. kvref gave it back blank; the model kept it
    cached. The model now gives back the pages taken, in the order taken."""
    keyed = [m.Ingest(1), *run(1, 0, 2), m.CachePrefix(1, 0), m.Remove(1)]  # 1 cached
    offloaded = [m.Ingest(0), *run(0, 0, 3), m.OffloadClaim(0), m.OffloadCopy(0, 0),
                 m.OffloadCommit(0)]  # its 2 pages on the host
    fill = [m.Ingest(2), *run(2, 0, 3), *run(2, 0, 3), *run(2, 0, 2)]  # 1 blank left
    trace = [*keyed, *offloaded, *fill, m.Reload(0, copy_error=True)]
    assert replay(trace, SHIPPED_SCOPE) == m.Fault("ReloadCopyError")
    _, s = on_the_model(trace, SHIPPED_SCOPE)
    assert s.pool is not None and s.pool.lru == () and s.free == 2  # both back, blank
    assert replay([*trace, m.Reload(0)], SHIPPED_SCOPE) == m.Flag(True)


# issue 44, item 1 (R71): a retrieve into a request whose own publication is
# leased. A windowed label (W=1, no margin, one token a page): a retrieve to 2
# tokens releases slot 0 (W16), which publish named
LEASED_WINDOW = m.Scope(requests=1, labels=2, device_pages=3, host_pages=1, page_size=1,
                        max_span=2, sharing=True, windows=(None, 1), margins=(0, 0))
WINDOW_PUBLISHED = [m.Ingest(0), m.Admit(m.Step((m.Seg(0, 1, 1),), padded=(0,))), m.Plan(),
                    m.Write(), m.Commit(), m.Publish(0)]
# full attention: r0's keyed page truncated into, then published; the next
# write after its token (a retrieve's copy, or a step's) copies that page
# first (R52), which gave the published page back free-cached
KEYED = m.Scope(requests=1, labels=1, device_pages=3, host_pages=1, page_size=2, max_span=2,
                sharing=True)
KEYED_PUBLISHED = [m.Ingest(0), m.Admit(m.Step((m.Seg(0, 0, 2),), padded=(0,))), m.Plan(),
                   m.Write(), m.Commit(), m.CachePrefix(0, 0), m.Truncate(0, 0, 1),
                   m.Publish(0)]


def test_a_retrieve_into_a_leased_window_waits_for_the_lease() -> None:
    """Model and kvref bug (I18, R71): the retrieve's window release gave the
    published page back to the pool, BLANK, under the lease."""
    assert replay([*WINDOW_PUBLISHED, m.RetrieveStart(0, 1, 2)],
                  LEASED_WINDOW) == m.Refused("PublishLeased")
    assert replay([*WINDOW_PUBLISHED, m.RetrieveStart(0, 1, 2), m.ReleasePublished(0),
                   m.RetrieveStart(0, 1, 2)], LEASED_WINDOW) == m.NotReady()
    # full attention beside it releases nothing: the same retrieve goes ahead
    assert replay([*WINDOW_PUBLISHED, m.RetrieveStart(0, 0, 2)], LEASED_WINDOW) == m.NotReady()


@pytest.mark.parametrize("write", ["retrieve", "admit"])
def test_a_write_after_a_truncate_into_a_keyed_page_waits_for_the_lease(write: str) -> None:
    """Model and kvref bug (I18, R71): the copy-on-write of the published
    partial page gave it back free-cached, the next allocation's to evict.
    The admit's copy-on-write did the same: the checker found it once I18
    followed pages through every call."""
    call: m.Action = (m.RetrieveStart(0, 0, 2) if write == "retrieve"
                      else m.Admit(m.Step((m.Seg(0, 0, 1),), padded=(0,))))
    assert replay([*KEYED_PUBLISHED, call], KEYED) == m.Refused("PublishLeased")
    after = m.NotReady() if write == "retrieve" else m.Ok()
    assert replay([*KEYED_PUBLISHED, call, m.LeaseTimeout(), call], KEYED) == after
