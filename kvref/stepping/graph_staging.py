"""CUDA-graph staging: a captured graph reads its write addressing from static
buffers, so a step planned under a slot lease copies its slots into them.

One buffer per (slot, plan label), made on the first plan under that key and
sized for the largest capture bucket any runner declared.
"""

from __future__ import annotations

import torch

from kvref.core.errors import KVRefError
from kvref.stepping.plan import SINK_PAGE, KVPlanState
from kvref.stepping.step import SlotLease


class GraphStaging:
    """The static plan-state buffers CUDA graphs were captured against."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        # (slot, label) -> static addressing, sized for the largest capture bucket
        self.static_plan_states: dict[tuple[int, str], KVPlanState] = {}
        self.max_seq_len = 0

    def leased(self, state: KVPlanState, lease: SlotLease | None, label: str) -> KVPlanState:
        """Under a slot lease, the step's slots staged into the graph's static buffer."""
        if lease is None:
            return state
        static = self._static_plan_state(lease.slot, label)
        static.copy_(state, lease.bucket.num_tokens)
        static.write_len = lease.bucket.num_tokens
        return static

    def _static_plan_state(self, slot: int, label: str) -> KVPlanState:
        state = self.static_plan_states.get((slot, label))
        if state is None:
            if self.max_seq_len == 0:
                raise KVRefError(
                    "a step planned under a slot lease before build_cuda_graph_buffers",
                    label=label,
                )
            n = self.max_seq_len
            state = KVPlanState(
                token_to_page=torch.full((n,), SINK_PAGE, dtype=torch.long, device=self._device),
                token_to_cache=torch.zeros(n, dtype=torch.long, device=self._device),
                total_tokens=0,
            )
            self.static_plan_states[(slot, label)] = state
        return state

    def build_buffers(self, max_seq_len: int) -> None:
        # the (slot, label) buffers are made on the first plan under that key
        # (the step declares its labels), all at one length so they outlive
        # any bucket; every runner capturing against this cache calls in, so
        # keep the largest
        if self.static_plan_states and max_seq_len > self.max_seq_len:
            raise KVRefError(
                f"graph buffers already built for {self.max_seq_len} tokens; "
                f"a later capture of {max_seq_len} would outgrow addresses a graph recorded"
            )
        self.max_seq_len = max(self.max_seq_len, max_seq_len)
