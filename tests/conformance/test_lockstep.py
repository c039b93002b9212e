"""kvref and the model, driven together by Hypothesis.

Each rule is one critical section of the manager, issued the way an engine
issues it: the model's protocol (`model.protocol.enabled`) says which calls
are legal now, the rule draws one, runs it on both, and the checks after it
compare the results, the states (kvref's read back abstractly), every model
invariant, page ownership by id (I1, I2, I6) and the bytes of every stream
(I7). Writes are checked for isolation (I8) against the pages the step planned.
"""

from __future__ import annotations

import collections
import os
from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from model import core as m
from model.invariants import violations
from model.protocol import enabled
from tests.conformance.driver import Driver, DriverConfig

SCOPE = m.Scope(requests=3, labels=3, device_pages=6, host_pages=4, page_size=2, max_span=3)
NIGHTLY_SCOPE = m.Scope(requests=4, labels=4, device_pages=12, host_pages=8, page_size=3,
                        max_span=5)

# rule -> times it ran; outcome kind -> count (the end-of-run coverage report)
RULES: collections.Counter[str] = collections.Counter()
OUTCOMES: collections.Counter[str] = collections.Counter()
LARGEST: dict[str, int] = collections.defaultdict(int)


def steps(model: m.Model, s: m.State, ready: list[int]) -> st.SearchStrategy[m.Step]:
    """A step over some of the ready requests: several segments, at most one fork."""
    sc = model.scope
    seg = st.builds(
        m.Seg, st.sampled_from(ready), st.integers(0, sc.labels - 1), st.integers(0, sc.max_span)
    )
    fork = st.tuples(st.just(0), st.integers(1, sc.labels - 1))

    @st.composite
    def build(draw: Any) -> m.Step:
        segs = draw(st.lists(seg, min_size=1, max_size=3,
                             unique_by=lambda g: (g.rid, g.label)))
        kind = draw(st.sampled_from(["none", "pre", "post"]))
        forks = (draw(fork),) if kind != "none" else ()
        rids = sorted({g.rid for g in segs})
        padded = tuple(draw(st.sampled_from([rids, ready]))) if forks else tuple(rids)
        return m.Step(tuple(segs), forks if kind == "pre" else (),
                      forks if kind == "post" else (), padded, draw(st.booleans()))

    return build()


class Lockstep(RuleBasedStateMachine):
    scope = SCOPE
    config = DriverConfig()

    def __init__(self) -> None:
        super().__init__()
        self.model = m.Model(self.scope)
        self.state = self.model.init()
        self.driver = Driver(self.scope, self.config)
        self._enabled: tuple[m.State | None, list[m.Action]] = (None, [])

    # -- the one way an action runs ------------------------------------------

    def run(self, action: m.Action) -> None:
        RULES[type(action).__name__] += 1
        if isinstance(action, m.OffloadCopy) and action.copy_error:
            RULES["OffloadCopy (fault)"] += 1
        if isinstance(action, m.RetrieveComplete) and not action.ok:
            RULES["RetrieveComplete (failed)"] += 1
        want, nxt = self.model.step(self.state, action)
        before = self.driver.kv.kv_cache.tensor.clone() if isinstance(action, m.Write) else None
        generations = self.driver.generations()
        got = self.driver.apply(action)
        self.driver.check_generations(generations, self.driver.generations())
        OUTCOMES[f"{type(action).__name__} -> {type(got).__name__}"
                 + (f"({got.kind})" if isinstance(got, (m.Refused, m.Misuse)) else "")] += 1
        assert got == want, f"{action}: kvref answered {got}, the model {want}"
        broken = violations(self.model, nxt, action, want, self.state)
        assert not broken, f"model invariant after {action}: {broken}"
        prev, self.state = self.state, nxt
        if before is not None:
            self.check_isolation(before)
        del prev

    def check_isolation(self, before: torch.Tensor) -> None:
        """I8: a write changed only pages of the streams its plan named, or the sink."""
        after = self.driver.kv.kv_cache.tensor
        changed = (after != before).flatten(2).any(dim=2).any(dim=0).nonzero().flatten()
        allowed = self.driver.pages_of_step()
        stray = set(changed.tolist()) - allowed
        assert not stray, f"I8: write touched pages {sorted(stray)} outside {sorted(allowed)}"

    def enabled_of(self, kind: type) -> list[m.Action]:
        # every rule's precondition asks; enumerate the protocol once per state
        if self._enabled[0] is not self.state:
            self._enabled = (self.state, list(enabled(self.model, self.state)))
        return [a for a in self._enabled[1] if isinstance(a, kind)]

    def draw_enabled(self, data: st.DataObject, kind: type) -> m.Action:
        return data.draw(st.sampled_from(self.enabled_of(kind)), label=kind.__name__)

    def has(self, kind: type) -> bool:
        return bool(self.enabled_of(kind))

    def ready(self) -> list[int]:
        busy = {k[0] for k, v in self.state.streams if v.retrieve != m.IDLE}
        return sorted(self.state.requests() - busy)

    # -- rules: one per critical section ---------------------------------------

    @rule(data=st.data())
    def ingest(self, data: st.DataObject) -> None:
        self.run(m.Ingest(data.draw(st.integers(0, self.scope.requests - 1))))

    @precondition(lambda self: self.state.staged is None and self.state.current is None
                  and bool(self.ready()))
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        self.driver.combine = data.draw(st.booleans(), label="combined labels")
        self.run(m.Admit(data.draw(steps(self.model, self.state, self.ready()))))

    @precondition(lambda self: self.state.staged is None and self.state.current is None
                  and bool(self.ready()))
    @rule(data=st.data())
    def whole_step(self, data: st.DataObject) -> None:
        """admit, plan, write, commit back to back, as an engine runs most steps.

        The fine-grained rules interleave other calls between these; this one
        keeps full steps (and so committed, checkable bytes) frequent.
        """
        self.driver.combine = data.draw(st.booleans(), label="combined labels")
        self.run(m.Admit(data.draw(steps(self.model, self.state, self.ready()))))
        for action in (m.Plan(), m.Write(), m.Commit()):
            if self.state.current is None or not any(
                type(a) is type(action) for a in enabled(self.model, self.state)
            ):
                continue
            self.run(action)
            self.agrees_with_model()

    @precondition(lambda self: self.state.staged is None and bool(self.ready()))
    @rule(data=st.data())
    def admit_preplan(self, data: st.DataObject) -> None:
        # mostly over requests the running step leaves alone: a preplan over
        # its streams is always the same R10 misuse, and would crowd out the rest
        ready = self.ready()
        cur = self.state.current
        if cur is not None and data.draw(st.integers(0, 3), label="free requests") > 0:
            busy = {k[0] for k in m.named(cur.step)}
            ready = [r for r in ready if r not in busy] or ready
        self.driver.combine = data.draw(st.booleans(), label="combined labels")
        self.run(m.Admit(data.draw(steps(self.model, self.state, ready)), preplan=True))

    @precondition(lambda self: self.state.current is None and self.state.staged is not None
                  and self.state.staged.phase == m.PLANNED)
    @rule()
    def admit_staged(self) -> None:
        assert self.state.staged is not None
        self.run(m.Admit(self.state.staged.step))

    @precondition(lambda self: self.has(m.Plan))
    @rule(data=st.data())
    def plan(self, data: st.DataObject) -> None:
        self.run(self.draw_enabled(data, m.Plan))

    @precondition(lambda self: self.has(m.Write))
    @rule()
    def write_kv(self) -> None:
        self.run(m.Write())

    @precondition(lambda self: self.has(m.Commit))
    @rule()
    def commit(self) -> None:
        self.run(m.Commit())

    @precondition(lambda self: self.state.staged is not None)
    @rule()
    def clear_preplan(self) -> None:
        self.run(m.ClearPreplan())

    @precondition(lambda self: self.has(m.OffloadClaim))
    @rule(data=st.data())
    def offload_claim(self, data: st.DataObject) -> None:
        self.run(self.draw_enabled(data, m.OffloadClaim))

    @precondition(lambda self: self.has(m.OffloadClaim))
    @rule(data=st.data())
    def whole_offload(self, data: st.DataObject) -> None:
        """`KVManager.offload`: claim, copy each claimed stream, commit, back to back."""
        claim = self.draw_enabled(data, m.OffloadClaim)
        assert isinstance(claim, m.OffloadClaim)
        self.run(claim)
        off = self.state.offload_of(claim.rid)
        if off is None:
            return
        for label, _ in off.claimed:
            if any(isinstance(a, m.OffloadCopy) and (a.rid, a.label) == (claim.rid, label)
                   and not a.copy_error
                   for a in self.enabled_of(m.OffloadCopy)):
                self.run(m.OffloadCopy(claim.rid, label))
        self.run(m.OffloadCommit(claim.rid))
        self.agrees_with_model()

    @precondition(lambda self: any(not a.copy_error for a in self.enabled_of(m.OffloadCopy)))
    @rule(data=st.data())
    def offload_copy(self, data: st.DataObject) -> None:
        ok = [a for a in self.enabled_of(m.OffloadCopy) if not a.copy_error]
        self.run(data.draw(st.sampled_from(ok)))

    @precondition(lambda self: any(a.copy_error for a in self.enabled_of(m.OffloadCopy)))
    @rule(data=st.data())
    def offload_copy_raises(self, data: st.DataObject) -> None:
        faults = [a for a in self.enabled_of(m.OffloadCopy) if a.copy_error]
        self.run(data.draw(st.sampled_from(faults)))

    @precondition(lambda self: self.has(m.OffloadCommit))
    @rule(data=st.data())
    def offload_commit(self, data: st.DataObject) -> None:
        self.run(self.draw_enabled(data, m.OffloadCommit))

    @precondition(lambda self: self.has(m.OffloadAbandon))
    @rule(data=st.data())
    def offload_abandon(self, data: st.DataObject) -> None:
        self.run(self.draw_enabled(data, m.OffloadAbandon))

    @precondition(lambda self: self.has(m.Reload))
    @rule(data=st.data())
    def reload(self, data: st.DataObject) -> None:
        self.run(self.draw_enabled(data, m.Reload))

    @precondition(lambda self: self.has(m.Publish))
    @rule(data=st.data())
    def publish(self, data: st.DataObject) -> None:
        self.run(self.draw_enabled(data, m.Publish))

    @precondition(lambda self: self.has(m.RetrieveStart))
    @rule(data=st.data())
    def admit_retrieve(self, data: st.DataObject) -> None:
        self.run(self.draw_enabled(data, m.RetrieveStart))

    @precondition(lambda self: any(a.ok for a in self.enabled_of(m.RetrieveComplete)))
    @rule(data=st.data())
    def retrieve_completes(self, data: st.DataObject) -> None:
        done = [a for a in self.enabled_of(m.RetrieveComplete) if a.ok]
        self.run(data.draw(st.sampled_from(done)))

    @precondition(lambda self: any(not a.ok for a in self.enabled_of(m.RetrieveComplete)))
    @rule(data=st.data())
    def retrieve_fails(self, data: st.DataObject) -> None:
        failed = [a for a in self.enabled_of(m.RetrieveComplete) if not a.ok]
        self.run(data.draw(st.sampled_from(failed)))

    @precondition(lambda self: self.has(m.Reset))
    @rule(data=st.data())
    def reset_request(self, data: st.DataObject) -> None:
        self.run(self.draw_enabled(data, m.Reset))

    @precondition(lambda self: self.has(m.Remove))
    @rule(data=st.data())
    def remove_request(self, data: st.DataObject) -> None:
        self.run(self.draw_enabled(data, m.Remove))

    # -- after every rule --------------------------------------------------------

    @invariant()
    def agrees_with_model(self) -> None:
        got = self.driver.abstract(self.state)
        assert got == self.state, f"kvref state\n  {got}\nmodel state\n  {self.state}"
        self.driver.check_pages()
        self.driver.check_host_lengths(self.state)
        self.driver.check_bytes(self.state)
        LARGEST["streams"] = max(LARGEST["streams"], len(self.state.streams))
        LARGEST["pages held"] = max(LARGEST["pages held"],
                                    self.scope.device_pages - self.state.free)
        LARGEST["host copies"] = max(LARGEST["host copies"], len(self.state.host))

    def teardown(self) -> None:
        """Drain the run the way an engine shuts down, checked as any other
        action, then I12: with every request gone, every page but the sink
        is free and the host pool is empty."""
        for rid in sorted(rid for rid, _ in self.state.offloads):
            self.run(m.OffloadAbandon(rid))
        while self.state.current is not None:
            phase = self.state.current.phase
            self.run(m.Plan() if phase == m.ADMITTED else m.Commit())
        if self.state.staged is not None:
            self.run(m.ClearPreplan())
        for k, v in self.state.streams:
            if v.retrieve == m.PENDING:
                self.run(m.RetrieveComplete(k[0], k[1], ok=True))
        for rid in sorted(self.state.requests()):
            self.run(m.Remove(rid))
        self.agrees_with_model()
        kv = self.driver.kv
        assert kv.num_free_pages == self.scope.device_pages, "I12: device pages leaked"
        pool = kv._cpu_pool
        assert pool is not None and pool.num_free == pool.capacity, "I12: host pages leaked"


def report() -> str:
    lines = ["lockstep coverage: rule runs"]
    lines += [f"  {name:<18} {n}" for name, n in sorted(RULES.items())]
    lines.append("outcomes")
    lines += [f"  {name:<40} {n}" for name, n in sorted(OUTCOMES.items())]
    lines.append("largest: " + ", ".join(f"{k} {v}" for k, v in LARGEST.items()))
    return "\n".join(lines)


def test_lockstep(driver_config: DriverConfig, capsys: pytest.CaptureFixture[str]) -> None:
    Lockstep.config = driver_config
    Lockstep.scope = SCOPE
    RULES.clear()
    OUTCOMES.clear()
    run_state_machine_as_test(Lockstep)
    with capsys.disabled():
        print("\n" + report())
    if settings().database is None:  # the ci profile: a rule that never ran is a hole
        faults = {"OffloadCopy (fault)", "RetrieveComplete (failed)"}
        never = ({t.__name__ for t in m.ACTIONS} | faults) - set(RULES)
        assert not never, f"actions never exercised: {sorted(never)}"


@pytest.mark.nightly
def test_lockstep_nightly(driver_config: DriverConfig) -> None:
    Lockstep.config = driver_config
    Lockstep.scope = NIGHTLY_SCOPE
    run_state_machine_as_test(
        Lockstep, settings=settings(max_examples=int(os.environ.get("KVREF_NIGHTLY_EXAMPLES",
                                                                      "20000")))
    )
    print(report())
