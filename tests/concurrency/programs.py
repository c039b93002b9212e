"""Hypothesis strategies for thread programs and schedules.

Roles, as an engine has them: one engine thread runs steps and starts
retrieves (the only thread that admits, plans, writes and commits: the model
has one step pipeline; and it admits only requests whose retrieves landed,
which it can know only if no other thread starts them); a worker offloads
and reloads; lifecycle threads reset, remove and re-ingest. Retrieves
complete on their own task actors. A test picks the engine and one to three
of the others, each one to three calls long.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from kvref_model import core as m
from tests.support.sched_harness import SCOPE, Op, Program, StepOp

RIDS = st.integers(0, SCOPE.requests - 1)


@st.composite
def step_ops(draw: Any, sharing: bool = False) -> StepOp:
    rid = draw(RIDS)
    label = draw(st.integers(0, SCOPE.labels - 1))
    span = draw(st.integers(0, SCOPE.max_span))
    fork = draw(st.sampled_from(["none", "none", "pre", "post"]))
    forks = ((0, 1),) if fork != "none" else ()
    step = m.Step((m.Seg(rid, label, span),), forks if fork == "pre" else (),
                  forks if fork == "post" else (), (rid,), draw(st.booleans()))
    return StepOp(step, draw(st.sampled_from(["run", "run", "preplan", "clear"])))


def worker_ops() -> st.SearchStrategy[Op]:
    return st.builds(Op, st.sampled_from(["offload", "offload", "reload"]), RIDS)


def lifecycle_ops(rids: st.SearchStrategy[int] = RIDS,
                  sharing: bool = False) -> st.SearchStrategy[Op]:
    """Reset, remove, re-ingest, truncate; with the prefix cache on, a prefix
    hit (match_prefix of up to three pages of the label's tokens),
    reset_prefix_cache, reclaimable and cache_prefixes too."""
    ops = [
        st.builds(Op, st.just("reset"), rids, st.just(0), st.integers(0, 1)),
        st.builds(Op, st.just("remove"), rids),
        st.builds(Op, st.just("ingest"), rids),
        # a verify step's rollback, racing the engine's steps and the worker
        st.builds(Op, st.just("truncate"), rids, st.integers(0, SCOPE.labels - 1),
                  st.integers(0, 4)),
    ]
    if sharing:
        ops += [st.builds(Op, st.just("match"), rids, st.integers(0, SCOPE.labels - 1),
                          st.integers(2, 3 * SCOPE.page_size + 1)),
                st.just(Op("resetcache", 0)),
                # an engine's victim filter, reading the pool and the streams
                st.builds(Op, st.just("reclaimable"), rids),
                # keying a batch, racing what shortens or removes the stream
                st.builds(Op, st.just("cacheprefixes"), rids)]
    return st.one_of(*ops)


def transfer_ops(rids: st.SearchStrategy[int] = RIDS) -> st.SearchStrategy[Op]:
    return st.builds(Op, st.just("retrieve"), rids, st.integers(0, SCOPE.labels - 1),
                     st.integers(1, 5), st.booleans())


@st.composite
def programs(draw: Any, avoid_known_races: bool = False, sharing: bool = True
             ) -> list[Program]:
    """Two to four threads (``sharing``: for a scope with the prefix cache
    on, whose calls the lifecycle threads make too). ``avoid_known_races`` steers clear of the races
    test_known_races.py pins down (all fixed now; kept to bisect a regression
    there from one elsewhere): no reset/remove of a request the engine
    retrieves into or the worker offloads."""
    others = draw(st.lists(st.sampled_from(["worker", "life", "life2"]), min_size=1,
                           max_size=3, unique=True))
    ops = st.lists
    engine = draw(ops(st.one_of(step_ops(sharing), step_ops(sharing), transfer_ops()),
                      min_size=1, max_size=4))
    progs = [Program("engine", engine)]
    xfer_rids = {op.rid for op in engine if isinstance(op, Op)}
    # cache_prefixes names the ids a stream held after the set-up
    # (`CachePrefixIds`): only for one no engine step or retrieve grows
    grown = xfer_rids | {g.rid for op in engine if isinstance(op, StepOp)
                         for g in op.step.segments}
    offloaded: set[int] = set()
    if "worker" in others:
        work = draw(ops(worker_ops(), min_size=1, max_size=3))
        offloaded = {op.rid for op in work if op.kind == "offload"}
        progs.append(Program("worker", work))
    every = list(range(SCOPE.requests))
    free = [r for r in every if r not in xfer_rids | offloaded] if avoid_known_races \
        else every
    for name in ("life", "life2"):
        if name in others:
            life = draw(ops(lifecycle_ops(st.sampled_from(every), sharing), min_size=1,
                            max_size=3))
            # a reset/remove of a request the known races involve becomes an ingest
            life = [op if op.kind in ("ingest", "match", "resetcache", "reclaimable")
                    or op.rid in free
                    else Op("ingest", op.rid) for op in life]
            life = [Op("reclaimable", op.rid) if op.kind == "cacheprefixes" and op.rid in grown
                    else op for op in life]
            progs.append(Program(name, life))
    return progs


def choices(max_size: int = 60) -> st.SearchStrategy[list[int]]:
    """A schedule: one choice per switch point (then no preemption).

    Mostly zeros, so a drawn schedule preempts a few times rather than at
    every point (which would rarely let a critical section finish)."""
    return st.lists(st.one_of(st.just(0), st.just(0), st.integers(0, 4)), max_size=max_size)
