"""Small thread programs over shared pages and windows for the controlled
scheduler (issue 27, build 3), in kvref's default configuration (the prefix
cache on, a windowed label with a rollback margin), explored depth first.

Each run is checked as every scheduled run is (`tests.support.sched_harness`):
each call's result is the model's for the order the critical sections ran
in, and at every quiescent point kvref's state, page holders and keys
(`check_page_map`), free list and host lengths agree with the model's; the
bytes at the end. Then every request is removed and no page may be left
held (`Harness.drain`). Each program also states its own postcondition
over the outcomes its interleavings can give (`Case.post`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from kvref_model import core as m
from tests.support.sched_harness import SHIPPED_SCOPE, Harness, Op, Program, Setup, StepOp
from tests.support.scheduler import Prefix, next_dfs_prefix


@dataclass(frozen=True)
class Case:
    programs: tuple[Program, ...]
    setup: Setup
    scope: m.Scope
    # the program's own postcondition over the log of one run: the results
    # its calls got, by action (raises AssertionError)
    post: Callable[[dict[m.Action, list[m.Result]]], None]


def results(h: Harness) -> dict[m.Action, list[m.Result]]:
    out: dict[m.Action, list[m.Result]] = {}
    for e in h.lin.log:
        if e.actor != "setup" and e.result is not None:
            out.setdefault(e.action, []).append(e.result)
    return out


def step(rid: int, label: int, span: int) -> StepOp:
    return StepOp(m.Step((m.Seg(rid, label, span),), padded=(rid,)))


def _hit_always(got: dict[m.Action, list[m.Result]]) -> None:
    # the pages r0 keyed are held, claimed, or free-cached after its offload
    # committed: a hit finds them in every order
    assert got[m.MatchPrefix(1, 0, 5)] == [m.Count(4)], got


def _hit_or_evicted(got: dict[m.Action, list[m.Result]]) -> None:
    # the hit first: both cached pages held again, the admit is a page short;
    # the admit first: it evicts the prefix's last page, the hit finds one
    hit = got[m.MatchPrefix(1, 0, 5)]
    admit = got[m.Admit(step(2, 0, 6).step)]
    assert (hit, admit) in (([m.Count(4)], [m.Refused("AllocationFailed", 1)]),
                            ([m.Count(2)], [m.Ok()])), (hit, admit)


def _reset_only_when_nothing_held(got: dict[m.Action, list[m.Result]]) -> None:
    # a reset is whole or refused (S14): it clears the cache only once both
    # sharers are gone, and then the copy-on-write step did not run after it
    reset = got[m.ResetPrefixCache()]
    assert len(reset) == 1 and isinstance(reset[0], (m.Count, m.Refused)), reset


def _retrieve_lands(got: dict[m.Action, list[m.Result]]) -> None:
    assert got[m.RetrieveStart(2, 2, 5)] in ([m.Ok()], [m.NotReady()]), got


def _window_offloaded(got: dict[m.Action, list[m.Result]]) -> None:
    # the window's retained pages go to the host in any order (the other
    # request's commit takes no page the offload needs)
    assert got[m.OffloadCommit(0)] == [m.Freed(2)], got


def steps(rid: int, label: int, *spans: int) -> tuple[m.Action, ...]:
    """Whole steps as set-up calls: admit, plan, write, commit each."""
    out: list[m.Action] = []
    for span in spans:
        out += [m.Admit(step(rid, label, span).step), m.Plan(), m.Write(), m.Commit()]
    return tuple(out)


# a request's first four tokens in two full pages, keyed
CACHED = ((0, 4), (1, 0), (2, 0))
SMALL = replace(SHIPPED_SCOPE, device_pages=4, host_pages=2)

# a hybrid model (issue 40): one full group and one window group (W = 3)
# over one pool, the window group keying and hitting (H2-H4)
HYBRID = m.Scope(requests=3, labels=1, device_pages=6, host_pages=2, page_size=2,
                 max_span=6, sharing=True, groups=(None, 3), window_cache=True)


def _hybrid_hit_or_evicted(got: dict[m.Action, list[m.Result]]) -> None:
    # the hit first: every group's pages held again, the admit two pages
    # short; the admit first: it evicts the full group's cached pages (they
    # reached the LRU first), and no hit stands in every group (H2)
    hit = got[m.MatchPrefix(1, 0, 5)]
    admit = got[m.Admit(step(2, 0, 4).step)]
    assert (hit, admit) in (([m.Count(4)], [m.Refused("AllocationFailed", 2)]),
                            ([m.Count(0)], [m.Ok()])), (hit, admit)


def _hybrid_hit_or_passed(got: dict[m.Action, list[m.Result]]) -> None:
    # the hit first: it shares the window's first page, which the commit
    # then passes (still held by the hit); the commit first: that page went
    # back blank (H3), so the window group cannot serve the hit
    assert got[m.MatchPrefix(1, 0, 5)] in ([m.Count(4)], [m.Count(0)]), got


CASES = {
    # a prefix hit racing an offload claim of the request whose pages it finds
    "hit against offload": Case(
        (Program("life", [Op("match", 1, 0, 5)]), Program("worker", [Op("offload", 0)])),
        Setup(CACHED, (), (m.CachePrefix(0, 0),)), SHIPPED_SCOPE, _hit_always),
    # an allocation that evicts a free-cached page racing a match of it
    "eviction against match": Case(
        (Program("engine", [step(2, 0, 6)]), Program("life", [Op("match", 1, 0, 5)])),
        Setup(CACHED, (), (m.CachePrefix(0, 0), m.Remove(0))), SMALL, _hit_or_evicted),
    # a copy-on-write admit (r1 shares r0's pages and was truncated into the
    # second) racing the removals and a reset_prefix_cache
    "copy-on-write against reset": Case(
        (Program("engine", [step(1, 0, 1)]),
         Program("life", [Op("remove", 0), Op("remove", 1), Op("resetcache", 0)])),
        Setup(CACHED, (), (m.CachePrefix(0, 0), m.MatchPrefix(1, 0, 5), m.Truncate(1, 0, 3))),
        SHIPPED_SCOPE, _reset_only_when_nothing_held),
    # the windowed label's commits release pages while a retrieve's copy
    # writes into another request's windowed stream
    "window release against a retrieve's copy": Case(
        (Program("engine", [Op("retrieve", 2, 2, 5), step(0, 2, 3), step(0, 2, 3)]),),
        Setup(((0, 0), (1, 0), (2, 0)), ()), SHIPPED_SCOPE, _retrieve_lands),
    # an offload copy of a windowed stream that released a page, while
    # another request's windowed commit releases one
    "window release against an offload copy": Case(
        (Program("worker", [Op("offload", 0)]), Program("engine", [step(1, 2, 3)])),
        Setup(((0, 0), (1, 0), (2, 0)), (), steps(0, 2, 3, 3) + steps(1, 2, 3)),
        SHIPPED_SCOPE, _window_offloaded),
}

# hybrid offloads: each request's label one page in each group, two pages
# free, room on the host for two group copies
TWO_EACH = ((0, 2), (1, 2), (2, 0))


def _hybrid_offload_or_step(got: dict[m.Action, list[m.Result]]) -> None:
    # r0's offload always moves both groups (the step takes no host room);
    # the pages its commit frees go to r1's step or back to r0's reload,
    # never to both (the reload needs two, the step four of the six)
    assert got[m.OffloadCommit(0)] == [m.Freed(2)], got
    admit, reload = got[m.Admit(step(1, 0, 4).step)], got[m.Reload(0)]
    assert (admit, reload) in (([m.Refused("AllocationFailed", 2)], [m.Flag(True)]),
                               ([m.Ok()], [m.Flag(False)])), (admit, reload)


def _group_copies(got: dict[m.Action, list[m.Result]], rid: int) -> list[bool]:
    out = []
    for g in range(2):
        [flag] = got[m.OffloadCopy(rid, 0, group=g)]
        assert isinstance(flag, m.Flag), flag
        out.append(flag.value)
    return out


def _hybrid_offloads_share_the_host(got: dict[m.Action, list[m.Result]]) -> None:
    # each group's copy takes one host page of two, in its own critical
    # sections: the first offload to copy both groups fills the host, or the
    # two take one group each and each label's groups end apart, one on the
    # host and one on the device (H1): what a label-level copy could not
    # give (specs/findings.md, issue 40)
    freed = (got[m.OffloadCommit(0)], got[m.OffloadCommit(1)])
    assert freed in (([m.Freed(2)], [m.Freed(0)]), ([m.Freed(0)], [m.Freed(2)]),
                     ([m.Freed(1)], [m.Freed(1)])), freed
    for rid in (0, 1):
        assert [m.Freed(sum(_group_copies(got, rid)))] == got[m.OffloadCommit(rid)], got


def _hybrid_offload_or_reset(got: dict[m.Action, list[m.Result]]) -> None:
    # the commit moves both groups or, the reset inside the offload, none;
    # a group's copy after the reset copies nothing, and neither does any
    # later group's (R19, per group's copy)
    assert got[m.OffloadCommit(0)] in ([m.Freed(2)], [m.Freed(0)]), got
    copies = _group_copies(got, 0)
    assert copies in ([True, True], [True, False], [False, False]), copies


# hybrid models (issue 40): CI explores them with one preemption (a few
# seconds each), the nightly run with two
HYBRID_CASES = {
    # an allocation that evicts cached pages of both groups racing a hit
    # every group must serve
    "hybrid: eviction against a hit every group serves": Case(
        (Program("engine", [step(2, 0, 4)]), Program("life", [Op("match", 1, 0, 5)])),
        Setup(((0, 4), (1, 0), (2, 0)), (), (m.CachePrefix(0, 0), m.Remove(0))), HYBRID,
        _hybrid_hit_or_evicted),
    # a commit whose window passes a keyed page racing a hit that
    # needs that page
    "hybrid: a window passes a page against a hit": Case(
        (Program("engine", [step(0, 0, 2)]), Program("life", [Op("match", 1, 0, 5)])),
        Setup(((0, 4), (1, 0), (2, 0)), (), (m.CachePrefix(0, 0),)), HYBRID,
        _hybrid_hit_or_passed),
    # an offload, claim, a copy per group, commit, then its reload, racing
    # another request's step for the pages the commit frees
    "hybrid: an offload and its reload against another request's step": Case(
        (Program("worker", [Op("offload", 0), Op("reload", 0)]),
         Program("engine", [step(1, 0, 4)])),
        Setup(TWO_EACH, ()), HYBRID, _hybrid_offload_or_step),
    # two offloads whose group copies race for the host pool
    "hybrid: two offloads against each other for the host pool": Case(
        (Program("worker", [Op("offload", 0)]), Program("worker2", [Op("offload", 1)])),
        Setup(TWO_EACH, ()), HYBRID, _hybrid_offloads_share_the_host),
    # a reset of the request between its claim, its groups' copies and its commit
    "hybrid: an offload against a reset of its request": Case(
        (Program("worker", [Op("offload", 0)]), Program("life", [Op("reset", 0)])),
        Setup(TWO_EACH, ()), HYBRID, _hybrid_offload_or_reset),
}


class Failed(AssertionError):
    """A schedule of a program failed: ``at`` is its 1-based number in DFS order."""

    def __init__(self, at: int, message: str) -> None:
        super().__init__(f"schedule {at}: {message}")
        self.at = at


def explore(case: Case, bound: int = 2, budget: int = 3000) -> int:
    """Every schedule of ``case`` with at most ``bound`` preemptions, depth
    first; raises `Failed` at the first that fails. Returns how many ran."""
    prefix: list[int] | None = []
    n = 0
    while prefix is not None and n < budget:
        n += 1
        h = Harness(Prefix(prefix), scope=case.scope)
        try:
            h.run(case.programs, case.setup, drain=True)
            case.post(results(h))
        except AssertionError as err:  # ScheduleFailure is one
            raise Failed(n, str(err)) from None
        prefix = next_dfs_prefix(h.sched.trace, bound)
    assert prefix is None, f"more than {budget} schedules"
    return n


