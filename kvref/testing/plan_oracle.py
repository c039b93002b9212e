"""A plan's page tables against the same tables built from scratch.

The manager keeps a decode batch's page table across steps and updates only
the rows a step changed (`kvref.stepping.decode_table`). A row it failed to
update (a copy-on-write swap, a window release, a truncate it missed) is a
table naming pages the stream no longer holds. This builds the tables the
plan should have handed out from the manager's observed state alone (its
streams' pages, lengths, released counts and generations, read through
`KVManager.observe` right after the plan), with the from-scratch builder
(`plan_tables` over fresh `SequenceView`s), and compares them.
"""

from __future__ import annotations

from typing import Any

import torch

from kvref.stepping.plan import KVPlanOutputs, SequenceView, group_by_plan_label, plan_tables
from kvref.stepping.step import KVStep


def scratch_views(kv: Any, step: KVStep, obs: Any = None) -> dict[str, list[SequenceView]]:
    """The views a plan of ``step`` makes over ``kv``'s state now (after its
    pre-forks ran; ``obs``: `KVManager.observe` of it, if taken): per plan
    label, each segment's stream sliced to its length, from its first
    retained page; a zero-length one has none."""
    obs = kv.observe() if obs is None else obs
    ps = obs.page_size
    out: dict[str, list[SequenceView]] = {}
    for plan_label, segments in group_by_plan_label(step.segments,
                                                    step.combined_labels).items():
        views = out[plan_label] = []
        for seg in segments:
            s = obs.requests[seg.request_id][seg.label]
            length = s.stored_len + seg.span - s.released
            if s.stored_len + seg.span == 0:
                continue
            views.append(SequenceView(seg.request_id, seg.label,
                                      list(s.pages[:-(-length // ps)]), length, seg.span,
                                      s.generation, s.released))
    return out


def mismatch(kv: Any, step: KVStep, outputs: KVPlanOutputs) -> str | None:
    """What in ``outputs`` (the plan of ``step``, just made, not a promoted
    preplan) differs from the tables built from scratch; None when nothing."""
    obs = kv.observe()
    expected = scratch_views(kv, step, obs)
    if list(expected) != list(outputs):
        return f"plan labels {list(outputs)}, expected {list(expected)}"
    ps = obs.page_size
    for plan_label, views in expected.items():
        got = outputs[plan_label]
        want, _, _ = plan_tables(views, ps, torch.device("cpu"))
        for field in ("qo_indptr", "paged_kv_indptr", "paged_kv_indices",
                      "paged_kv_last_page_len"):
            a, b = getattr(got.cpu_indptrs, field), getattr(want, field)
            if a.dtype != b.dtype or not torch.equal(a, b):
                return f"{plan_label}: {field} {a.tolist()}, from scratch {b.tolist()}"
        rows = [(v.request_id, v.label, v.page_idxs, v.length, v.to_compute, v.generation,
                 v.offset) for v in got.views]
        rows_want = [(v.request_id, v.label, v.page_idxs, v.length, v.to_compute,
                      v.generation, v.offset) for v in views]
        if rows != rows_want:
            return f"{plan_label}: views {rows}, from scratch {rows_want}"
    return None
