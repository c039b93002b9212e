"""Traces for people: one line per step, and as a pytest test against kvref.

The generated test names kvref's public API only as text: this module, like
the rest of `model`, imports neither kvref nor torch.
"""

from __future__ import annotations

from kvref_model.core import (
    LABEL_NAMES,
    Action,
    Admit,
    Claimed,
    ClearPreplan,
    Commit,
    Count,
    Fault,
    Flag,
    Freed,
    Ingest,
    Latched,
    LeaseTimeout,
    Misuse,
    NotReady,
    OffloadAbandon,
    OffloadClaim,
    OffloadCommit,
    OffloadCopy,
    Ok,
    Plan,
    Publish,
    Published,
    Refused,
    ReleasePublished,
    Reload,
    Remove,
    Reset,
    Result,
    RetrieveComplete,
    RetrieveStart,
    Scope,
    Truncate,
    Write,
)

Trace = tuple[tuple[Action, Result], ...]



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
    fault = " (a fork copy fails)" if isinstance(a, (Plan, Commit)) and a.fork_error else ""
    if isinstance(a, Plan):
        return ("plan(preplan)" if a.preplan else "plan") + fault
    if isinstance(a, (Write, Commit, ClearPreplan)):
        return {Write: "write_kv", Commit: "commit", ClearPreplan: "clear_preplan"}[type(a)] + fault
    parts = []
    for k, v in vars(a).items():
        parts.append(rname(v) if k == "rid" else lname(v) if k == "label" else f"{k}={v}")
    return f"{type(a).__name__}({', '.join(parts)})"


def show(r: Result) -> str:
    if isinstance(r, Refused):
        return f"refused {r.kind}" + (f" (pages_short={r.pages_short})" if r.pages_short else "")
    if isinstance(r, (Misuse, Fault)):
        return f"raises {r.kind}"
    if isinstance(r, Latched):
        return f"refused {r.kind}, latched"
    if isinstance(r, Claimed):
        return f"claimed {[lname(x) for x in r.labels]}" if r.labels else "claim refused (None)"
    if isinstance(r, Count):
        return repr(r.n)
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
        "AdmitRuntimeError, KVRefError, StepInFlightError)",
        "from kvref.core.errors import *  # noqa: F403 (every misuse kind a trace may name)", "",
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
                w("    from kvref.core.errors import OffloadCopyError")
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
        elif isinstance(a, Truncate):
            call = f"mgr.truncate({q(rname(a.rid))}, {q(lname(a.label))}, {a.new_len})"
            w(f"{pre}{call}" if raises else
              f"{pre}assert {call} == {r.pages if isinstance(r, Freed) else 0}")
        elif isinstance(a, ReleasePublished):
            w(f"    mgr.release_published({q(rname(a.rid))})")
        elif isinstance(a, LeaseTimeout):
            w("    pytest.skip('needs a runtime whose clock the test moves (ManualRuntime)')")
        else:  # the prefix cache's calls: ids from token identities are the lockstep's
            w(f"    pytest.skip('{describe(a)}: the prefix cache is the conformance layer's')")
    return "\n".join(L) + "\n"
