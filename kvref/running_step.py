"""The admitted step and the staged preplan: what the stepping mechanism
remembers between admit, plan and commit (R23: one running, one staged)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvref.plan import KVPlanOutputs, KVPlanState
from kvref.step import KVStep, StepContext
from kvref.stream_table import Key


@dataclass
class RunningStep:
    """The admitted step, from admit (or a preplan's promotion) to commit (R23)."""

    step: KVStep
    padded: tuple[str, ...]  # the admit's padded_request_ids: what its forks reserved
    # streams its admit created and no fork has written since: a fork from
    # one of them that is still empty copies nothing (R20)
    created: set[Key]
    planned: bool = False
    # its pre-forks ran (perhaps at a plan that failed): never twice
    forked: bool = False


@dataclass
class StagedPreplan:
    """A step admitted (and maybe planned) one ahead, not yet promoted."""

    step: KVStep
    ctx: StepContext
    # labels this step's admit created; an abandon removes them with their pages
    created: list[Key]
    marked: list[Key]
    outputs: KVPlanOutputs | None = None
    states: dict[str, KVPlanState] = field(default_factory=dict)


def same_step(step: KVStep, ctx: StepContext, other: KVStep, padded: tuple[str, ...]) -> bool:
    """The same step admitted again: equal, and padded to the same requests
    (its forks reserved for those)."""
    return (step is other or step == other) and tuple(ctx.padded_request_ids) == padded


def where(step: KVStep, admitted: KVStep | None = None) -> dict[str, str]:
    """The request and label an error about ``step`` names: its first segment
    that the ``admitted`` step does not have, else its first."""
    segments = list(step.segments) if isinstance(step, KVStep) else []
    known = {(g.request_id, g.label) for g in admitted.segments} if admitted else set()
    stray = [g for g in segments if (g.request_id, g.label) not in known] or segments
    if not stray:
        return {}
    return {"request_id": stray[0].request_id, "label": stray[0].label}
