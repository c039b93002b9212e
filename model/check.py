"""Exhaustive bounded model checking: `python -m model.check --help`.

Breadth-first over every state the engine protocol (model.protocol) can
reach in a bounded scope.  States are canonicalised by symmetry (request
ids, and the non-main labels, which nothing tells apart) before hashing.
Every invariant is checked on every state and transition; the first
violation prints its shortest trace, readable and as a pytest test against
kvref's public API, and exits 1.  At the end a table shows the state
count, the per-action fire counts (an action that never fired is a
coverage hole) and, per invariant, whether its interesting case arose.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from model import invariants as inv
from model.core import (
    ACTIONS,
    LABEL_NAMES,
    Action,
    Admit,
    Claimed,
    ClearPreplan,
    Commit,
    Flag,
    Freed,
    Ingest,
    Misuse,
    Model,
    NotReady,
    Offload,
    OffloadAbandon,
    OffloadClaim,
    OffloadCommit,
    OffloadCopy,
    Ok,
    Pending,
    Plan,
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
)
from model.protocol import calls as enabled

Trace = tuple[tuple[Action, Result], ...]


# ------------------------------------------------------------ symmetry


def _rename(s: State, rp: tuple[int, ...], lp: tuple[int, ...], n_labels: int) -> State:
    def key(k: tuple[int, int]) -> tuple[int, int]:
        return (rp[k[0]], lp[k[1]])

    def toks(c: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(lp[t] if t < n_labels else n_labels + lp[t - n_labels] for t in c)

    def step(p: Pending | None) -> Pending | None:
        if p is None:
            return None
        st = p.step
        new = Step(
            tuple(sorted((Seg(rp[g.rid], lp[g.label], g.span) for g in st.segments),
                         key=repr)),
            tuple((lp[f], lp[t]) for f, t in st.pre_forks),
            tuple((lp[f], lp[t]) for f, t in st.post_forks),
            tuple(sorted(rp[r] for r in st.padded)), st.commit)
        undo = tuple(sorted(((key(k), None if c is None else toks(c)) for k, c in p.undo),
                            key=repr))
        return Pending(new, p.phase, frozenset(map(key, p.marks)), undo,
                       frozenset(map(key, p.fresh)))

    return State(
        free=s.free,
        streams=tuple(sorted((key(k), replace(v, contents=toks(v.contents)))
                             for k, v in s.streams)),
        host=tuple(sorted((key(k), toks(c)) for k, c in s.host)),
        current=step(s.current), staged=step(s.staged),
        offloads=tuple(sorted(
            (rp[r], Offload(tuple(sorted((lp[lb], n) for lb, n in o.claimed)),
                            frozenset(lp[lb] for lb in o.copied), o.touched))
            for r, o in s.offloads)),
    )


def symmetries(scope: Scope) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    rps = list(itertools.permutations(range(scope.requests)))
    # "main" is special (ingest creates it, forks start from it); the rest are not
    lps = [(0, *p) for p in itertools.permutations(range(1, scope.labels))]
    return [(rp, lp) for rp in rps for lp in lps]


def canonical(s: State, syms: list[tuple[tuple[int, ...], tuple[int, ...]]],
              n_labels: int) -> State:
    # the orbit member with the least hash: orbit-invariant, and far cheaper
    # than a total order (a tie between distinct members only costs a merge)
    best, best_h = s, hash(s)
    for rp, lp in syms[1:]:
        t = _rename(s, rp, lp, n_labels)
        if hash(t) < best_h:
            best, best_h = t, hash(t)
    return best


# ------------------------------------------------------------- the search


@dataclass
class Report:
    states: int = 0
    transitions: int = 0
    depth: int = 0
    seconds: float = 0.0
    fired: Counter[str] = field(default_factory=Counter)
    interesting: Counter[str] = field(default_factory=Counter)
    # first (shortest) violation per invariant ID
    violations: dict[str, tuple[str, Trace]] = field(default_factory=dict)


def explore(model: Model, *, keep_going: bool = False, progress: bool = False,
            report: Report | None = None, traces: bool = True) -> Iterator[tuple[State, Trace]]:
    """BFS; yields each reachable (representative) state with its shortest
    trace.  Violations land in `report`; without keep_going the search
    stops at the first one."""
    rep = report if report is not None else Report()
    sc = model.scope
    syms = symmetries(sc)
    t0 = last = time.monotonic()
    init = model.init()
    # canonical -> (representative concrete state, parent canonical, action, result)
    parent: dict[State, tuple[State, State | None, Action | None, Result | None]] = {}
    c0 = canonical(init, syms, sc.labels)
    parent[c0] = (init, None, None, None)
    frontier: deque[tuple[State, int]] = deque([(c0, 0)])
    canon: dict[State, State] = {}  # concrete -> canonical, a cache

    def trace_of(c: State) -> Trace:
        out: list[tuple[Action, Result]] = []
        while True:
            _, pc, a, r = parent[c]
            if pc is None or a is None or r is None:
                return tuple(reversed(out))
            out.append((a, r))
            c = pc

    for i, msg in inv.violations(model, init):
        rep.violations.setdefault(i, (msg, ()))
    yield init, ()
    while frontier:
        c, d = frontier.popleft()
        rep.depth = max(rep.depth, d)
        if sc.depth and d >= sc.depth:
            continue
        s = parent[c][0]
        for a in enabled(model, s):
            r, n = model.step(s, a)
            rep.transitions += 1
            rep.fired[type(a).__name__] += 1
            for i, (_, pred) in inv.INTERESTING.items():
                if pred(model, s, a, r, n):
                    rep.interesting[i] += 1
            cn = c if n == s else canon.get(n) or canonical(n, syms, sc.labels)
            canon[n] = cn
            new = cn not in parent
            if new:
                parent[cn] = (n, c, a, r)
            # state invariants once per state; transition ones on every step
            bad = inv.violations(model, n, a, r, s, states=new)
            for i, msg in bad:
                if i not in rep.violations:
                    # the transition's own trace: the parent's plus this step
                    rep.violations[i] = (msg, (*trace_of(c), (a, r)))
            if bad and not keep_going:
                rep.seconds = time.monotonic() - t0
                return
            if new:
                rep.states += 1
                frontier.append((cn, d + 1))
                yield n, trace_of(cn) if traces else ()
        if progress and time.monotonic() - last > 2:
            last = time.monotonic()
            print(f"  ... {len(parent)} states, {rep.transitions} transitions, depth {d}, "
                  f"{len(parent) / (last - t0):.0f} states/s", file=sys.stderr, flush=True)
    rep.states = len(parent)
    rep.seconds = time.monotonic() - t0


def reachable(scope: Scope, model: type[Model] = Model) -> Iterator[tuple[State, Trace]]:
    """Every reachable state (one per symmetry class) with its shortest trace:
    what the bounded conformance layer replays on kvref."""
    return explore(model(scope), keep_going=True)


# ------------------------------------------------------------ rendering


def rname(rid: int) -> str:
    return f"r{rid}"


def lname(label: int) -> str:
    return LABEL_NAMES[label] if label < len(LABEL_NAMES) else f"l{label}"


def describe(a: Action) -> str:
    if isinstance(a, Admit):
        st = a.step
        segs = ", ".join(f"{rname(g.rid)}/{lname(g.label)}+{g.span}" for g in st.segments)
        forks = "".join(f", pre {lname(f)}->{lname(t)}" for f, t in st.pre_forks)
        forks += "".join(f", post {lname(f)}->{lname(t)}" for f, t in st.post_forks)
        pad = ",".join(map(rname, st.padded))
        return (f"{'preplan ' if a.preplan else ''}admit([{segs}]{forks}, padded [{pad}]"
                f"{'' if st.commit else ', commit=False'})")
    if isinstance(a, Plan):
        return "plan(preplan)" if a.preplan else "plan"
    if isinstance(a, (Write, Commit, ClearPreplan)):
        return {Write: "write_kv", Commit: "commit", ClearPreplan: "clear_preplan"}[type(a)]
    parts = []
    for k, v in vars(a).items():
        parts.append(rname(v) if k == "rid" else lname(v) if k == "label" else f"{k}={v}")
    return f"{type(a).__name__}({', '.join(parts)})"


def show(r: Result) -> str:
    if isinstance(r, Refused):
        return f"refused {r.kind}" + (f" (pages_short={r.pages_short})" if r.pages_short else "")
    if isinstance(r, Misuse):
        return f"raises {r.kind}"
    if isinstance(r, Claimed):
        return f"claimed {[lname(x) for x in r.labels]}" if r.labels else "claim refused (None)"
    if isinstance(r, (Freed, Flag)):
        return repr(r.pages if isinstance(r, Freed) else r.value)
    if isinstance(r, Published):
        return "published " + ", ".join(f"{lname(lb)}={n}" for lb, n in r.lengths)
    return "ready=False" if isinstance(r, NotReady) else "ok"


def render(trace: Trace) -> str:
    return "\n".join(f"  {i + 1:2}. {describe(a):60} -> {show(r)}"
                     for i, (a, r) in enumerate(trace))


def to_pytest(trace: Trace, scope: Scope, name: str = "test_model_trace") -> str:
    """The trace as a test against kvref's public API."""
    q = repr
    L = [
        "import pytest", "import torch", "from kvref import (KVManager, KVConfig, KVStep, Segment, "
        "StepContext, TransferEngineInfo,", "    AllocationFailed, RequestOffloading, "
        "AdmitRuntimeError, KVRefError, StepInFlightError)", "",
        "",
        "def _mgr():",
        "    cfg = KVConfig(num_layers=1, num_kv_heads=1, head_dim=4, max_seq_len=64,",
        f"                   max_num_pages={scope.device_pages + 1}, page_size={scope.page_size}, "
        f"num_qo_heads=1, cpu_offload_pages={scope.host_pages})",
        "    return KVManager(cfg, 'kv', None, TransferEngineInfo(), torch.device('cpu'), "
        "dtype=torch.float32)", "",
        "",
        "def _kv(token, n):  # token identity t -> every element t, so reads show it",
        "    return torch.full((n, 1, 4), float(token)), torch.full((n, 1, 4), float(token))", "",
        "",
        "def _published(rid, label, n):",
        "    src = _mgr()  # a second manager (the prefill side) holding n tokens",
        "    src.ingest_request(rid)",
        "    st = KVStep(segments=[Segment(request_id=rid, label=label, span=n)], commit=True,",
        "                pre_forks=[], post_forks=[], combined_labels=[])",
        "    ctx = StepContext(padded_request_ids=[rid], is_preplan=False)",
        "    assert src.admit(st, ctx).ok",
        "    src.plan(st, ctx)",
        f"    src.write_kv(*_kv({scope.labels} + LABELS.index(label), n), layer_idx=0,",
        "                 label=label)",
        "    src.commit(st, ctx)",
        "    return src.publish(rid)", "",
        "",
        f"LABELS = {[lname(i) for i in range(scope.labels)]!r}", "",
        "",
        "def _finish_retrieve(mgr, rid, label, ok):",
        "    pytest.skip('needs the transfer-engine hook of the conformance layer')", "",
        "",
        "def _inject_copy_fault(mgr):",
        "    pytest.skip('needs the copy-fault hook of the conformance layer')", "",
        "",
        f"def {name}():",
        "    mgr = _mgr()",
        "    off = {}",
        "    cur = cur_ctx = pp = pp_ctx = None",
    ]
    refusal = {"AllocationFailed": "AllocationFailed", "RequestOffloading": "RequestOffloading",
               "AdmitRuntimeError": "AdmitRuntimeError"}
    w = L.append
    for i, (a, r) in enumerate(trace):
        w(f"    # {i + 1}. {describe(a)} -> {show(r)}")
        raises = isinstance(r, Misuse) and r.kind != "OffloadCopyError"
        pre = "    "
        if raises:
            w(f"    with pytest.raises({r.kind if isinstance(r, Misuse) else 'KVRefError'}):")
            pre = "        "
        if isinstance(a, Ingest):
            w(f"{pre}mgr.ingest_request({q(rname(a.rid))})")
        elif isinstance(a, Admit):
            st = a.step
            segs = ", ".join(f"Segment(request_id={q(rname(g.rid))}, label={q(lname(g.label))}, "
                             f"span={g.span})" for g in st.segments)
            pf = [(lname(f), lname(t)) for f, t in st.pre_forks]
            po = [(lname(f), lname(t)) for f, t in st.post_forks]
            var = "pp" if a.preplan else "cur"
            w(f"{pre}{var} = KVStep(segments=[{segs}], commit={st.commit}, pre_forks={pf!r}, "
              f"post_forks={po!r}, combined_labels=[])")
            w(f"{pre}{var}_ctx = StepContext(padded_request_ids={[rname(x) for x in st.padded]!r}, "
              f"is_preplan={a.preplan})")
            w(f"{pre}out = mgr.admit({var}, {var}_ctx)")
            if isinstance(r, Ok):
                w(f"{pre}assert out.ok")
            elif isinstance(r, Refused):
                w(f"{pre}assert not out.ok and isinstance(out.reason, {refusal[r.kind]})")
                if r.pages_short:
                    w(f"{pre}assert out.reason.pages_short == {r.pages_short}")
        elif isinstance(a, Plan):
            if a.preplan:
                w("    mgr.plan(pp, pp_ctx)")
            else:
                w("    if cur is None:  # promotion of the staged preplan")
                w("        cur, cur_ctx = pp, StepContext("
                  "padded_request_ids=pp_ctx.padded_request_ids, is_preplan=False)")
                w("    mgr.plan(cur, cur_ctx)")
        elif isinstance(a, Write):
            w("    for seg in cur.segments:")
            w("        if seg.span:")
            w("            mgr.write_kv(*_kv(LABELS.index(seg.label), seg.span), layer_idx=0, "
              "label=seg.label)")
        elif isinstance(a, Commit):
            w("    mgr.commit(cur, cur_ctx)")
            w("    cur = None")
        elif isinstance(a, ClearPreplan):
            w("    mgr.clear_preplan()")
        elif isinstance(a, OffloadClaim):
            w(f"    off[{q(rname(a.rid))}] = mgr.begin_offload({q(rname(a.rid))})")
            if isinstance(r, Claimed) and r.labels:
                w(f"    assert sorted(off[{q(rname(a.rid))}].labels) == "
                  f"{sorted(lname(x) for x in r.labels)!r}")
            else:
                w(f"    assert off.pop({q(rname(a.rid))}) is None")
        elif isinstance(a, OffloadCopy):
            h = f"off[{q(rname(a.rid))}]"
            if a.copy_error:
                w("    from kvref.errors import OffloadCopyError")
                w("    # the conformance layer supplies the fault hook")
                w("    with pytest.raises(OffloadCopyError):")
                w(f"        _inject_copy_fault(mgr); {h}.copy({q(lname(a.label))})")
            else:
                w(f"    assert {h}.copy({q(lname(a.label))}) is {isinstance(r, Flag) and r.value}")
        elif isinstance(a, OffloadCommit):
            freed = r.pages if isinstance(r, Freed) else 0
            w(f"    assert off.pop({q(rname(a.rid))}).commit() == {freed}")
        elif isinstance(a, OffloadAbandon):
            w(f"    off.pop({q(rname(a.rid))}).abandon()")
        elif isinstance(a, Reload):
            w(f"    assert mgr.reload({q(rname(a.rid))}) is {isinstance(r, Flag) and r.value}")
        elif isinstance(a, Publish):
            w(f"    info = mgr.publish({q(rname(a.rid))})  # model: {show(r)}")
        elif isinstance(a, RetrieveStart):
            w(f"    out = mgr.admit_retrieve({q(rname(a.rid))}, 'node', 'walk', "
              f"_published({q(rname(a.rid))}, {q(lname(a.label))}, {a.length}))")
            if isinstance(r, Refused):
                w(f"    assert not out.ok and isinstance(out.reason, {refusal[r.kind]})")
            else:
                w(f"    assert out.ok and out.ready is {isinstance(r, Ok)}")
        elif isinstance(a, RetrieveComplete):
            w(f"    _finish_retrieve(mgr, {q(rname(a.rid))}, {q(lname(a.label))}, ok={a.ok})"
              "  # the conformance layer's transfer-engine hook")
        elif isinstance(a, Reset):
            w(f"{pre}mgr.reset_request({q(rname(a.rid))}, free={a.free})")
        elif isinstance(a, Remove):
            w(f"{pre}mgr.remove_request({q(rname(a.rid))})")
    return "\n".join(L) + "\n"


# ------------------------------------------------------------------ main


def table(rep: Report, scope: Scope) -> str:
    rows = [
        f"scope: {scope}",
        f"states {rep.states}   transitions {rep.transitions}   depth {rep.depth}   "
        f"{rep.seconds:.1f}s   {rep.states / max(rep.seconds, 1e-9):.0f} states/s",
        "", "action             fired",
    ]
    for cls in ACTIONS:
        n = rep.fired[cls.__name__]
        hole = "" if n else "   <-- COVERAGE HOLE: never fired"
        rows.append(f"  {cls.__name__:18} {n:>9}{hole}")
    rows += ["", "invariant  violated  interesting case (count)"]
    for i in inv.INVARIANT_IDS:
        if i in inv.NOT_IN_MODEL:
            rows.append(f"  {i:8} {'n/a':8}  {inv.NOT_IN_MODEL[i]}")
            continue
        what, _ = inv.INTERESTING[i]
        n = rep.interesting[i]
        rows.append(f"  {i:8} {'YES' if i in rep.violations else 'no':8}  {what} ({n})"
                    + ("   <-- VACUOUS" if not n else ""))
    return "\n".join(rows)


def model_class(name: str, without: str) -> type[Model]:
    from model.reference import ReferenceModel
    from model.reference import without as ablate
    if without:
        return ablate(*without.split(","))
    return ReferenceModel if name == "reference" else Model


def main(argv: list[str] | None = None) -> int:
    d = Scope()
    ap = argparse.ArgumentParser(prog="python -m model.check", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=d.requests)
    ap.add_argument("--labels", type=int, default=d.labels)
    ap.add_argument("--device-pages", type=int, default=d.device_pages)
    ap.add_argument("--host-pages", type=int, default=d.host_pages)
    ap.add_argument("--page-size", type=int, default=d.page_size)
    ap.add_argument("--max-span", type=int, default=d.max_span)
    ap.add_argument("--depth", type=int, default=d.depth, help="0: until no new state")
    ap.add_argument("--model", choices=("kvref", "reference"), default="kvref")
    ap.add_argument("--without", default="", help="kvref's model minus these rules, e.g. R2,R5")
    ap.add_argument("--keep-going", action="store_true",
                    help="report the shortest violation of every invariant, not just the first")
    ap.add_argument("--emit-traces", metavar="FILE", help="one JSON line per reachable state")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--conformance", action="store_true",
                    help="also replay every reachable state and enabled action on kvref "
                    "(needs kvref and the repository's tests/ importable)")
    o = ap.parse_args(argv)
    scope = Scope(o.requests, o.labels, o.device_pages, o.host_pages, o.page_size, o.max_span,
                  o.depth)
    if o.conformance:
        # imported by name: the model itself never depends on kvref
        exhaustive = importlib.import_module("tests.conformance.exhaustive")
        result = exhaustive.check_scope(scope, progress=not o.quiet)
        print(exhaustive.summary(result))
        for failure in result.failures:
            print("MISMATCH", failure)
        return 1 if result.failures else 0
    model = model_class(o.model, o.without)(scope)
    rep = Report()
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(o.emit_traces, "w")) if o.emit_traces else None
        for _, trace in explore(model, keep_going=o.keep_going, progress=not o.quiet,
                                report=rep, traces=out is not None):
            if out:
                out.write(json.dumps([[describe(a), show(r)] for a, r in trace]) + "\n")
    print(table(rep, scope))
    for i, (msg, trace) in sorted(rep.violations.items(), key=lambda x: int(x[0][1:])):
        print(f"\nVIOLATION {i}: {msg}\nshortest trace ({len(trace)} steps):\n{render(trace)}")
        if not o.keep_going:
            print("\nas a test against kvref:\n")
            print(to_pytest(trace, scope, f"test_{i.lower()}_counterexample"))
    return 1 if rep.violations else 0


if __name__ == "__main__":
    sys.exit(main())


_ = (Stream,)
