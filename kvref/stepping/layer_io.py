"""What attention layers call between plan and commit: this step's K/V reads and
writes, addressed by the plan state the stepping mechanism holds (R27).

Layers pass neither label nor layer on every call; they use the cursors of
`AttentionResource`, which `plan` resets.
"""

from __future__ import annotations

import torch

from kvref import validate
from kvref.core.cache import KVCache
from kvref.core.config import KVConfig
from kvref.core.errors import KVShapeError, StepNotAdmittedError
from kvref.core.resource import AttentionResource
from kvref.hybrid.layout import GroupLayout
from kvref.stepping.admit_plan_commit import Stepping
from kvref.stepping.plan import KVPlanState


class LayerIO(AttentionResource):
    """Per-layer access to the KV cache for the planned step; `KVManager` is one."""

    # set by the subclass's constructor
    config: KVConfig
    kv_cache: KVCache
    _stepping: Stepping
    # a hybrid model's groups (None: every page holds every layer): a layer
    # reads and writes its group's streams, at its slot in the group's pages
    _groups: GroupLayout | None

    def set_default_layer_idx(self, layer_idx: int | None) -> None:
        """The layer `write_kv`, `read_kv` and `layer_view` use when given none."""
        validate.optional_layer_idx(layer_idx, self.config.num_layers, "set_layer_idx")
        super().set_default_layer_idx(layer_idx)

    # the reference's name for the layer cursor
    set_layer_idx = set_default_layer_idx

    def reset_default_cursors(self) -> None:
        """Back to layer 0 and the default label."""
        super().reset_default_cursors()
        # unlike attention's, every read here needs a usable index
        self._default_layer_idx = 0

    def layer_view(self, layer_idx: int | None = None) -> torch.Tensor:
        """One layer's pages in the shape FlashInfer's paged attention takes."""
        validate.layer_idx(self._default_layer_idx if layer_idx is None else layer_idx,
                           self.config.num_layers, "layer_view")
        if layer_idx is None:
            layer_idx = self._default_layer_idx
        assert layer_idx is not None
        return self.kv_cache.layer_view(self._slot(layer_idx))

    def read_kv(self, layer_idx: int | None = None, plan_label: str | None = None) -> torch.Tensor:
        """The slots this step's plan writes: ``[num_tokens, 2, H, D]`` (K, then V)."""
        validate.optional_label(plan_label, "read_kv")
        validate.layer_idx(self._default_layer_idx if layer_idx is None else layer_idx,
                           self.config.num_layers, "read_kv")
        layer = self._default_layer_idx if layer_idx is None else layer_idx
        assert layer is not None
        state, _ = self._plan_state_for(self._group_label(plan_label, layer))
        n = state.write_len
        return self.kv_cache.read_tokens(self._slot(layer), state.token_to_page[:n],
                                         state.token_to_cache[:n])

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_idx: int | None = None,
        label: str | None = None,
        return_tensor: bool = False,
    ) -> torch.Tensor | None:
        """Write K, V ``[num_tokens, num_kv_heads, head_dim]`` into this step's slots.

        Under a slot lease ``num_tokens`` is the bucket's: the padding rows
        land on the sink page.
        """
        validate.optional_label(label, "write_kv")
        validate.layer_idx(self._default_layer_idx if layer_idx is None else layer_idx,
                           self.config.num_layers, "write_kv")
        validate.kv_pair(k, v, self.kv_cache.tensor.device,
                         self._default_label if label is None else label)
        layer = self._default_layer_idx if layer_idx is None else layer_idx
        assert layer is not None
        state, plan_label = self._plan_state_for(self._group_label(label, layer))
        n = state.write_len
        want = (n, *self.kv_cache.token_shape)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != want or t.dtype != self.kv_cache.dtype:
                raise KVShapeError(
                    f"write_kv {name} is {tuple(t.shape)} {t.dtype}; this step's plan "
                    f"wants {want} {self.kv_cache.dtype}",
                    label=plan_label,
                )
        return self.kv_cache.write_tokens(
            self._slot(layer), k, v, state.token_to_page[:n], state.token_to_cache[:n],
            return_tensor
        )

    def _slot(self, layer: int) -> int:
        """The layer's index in the cache tensor: its slot in its group's pages."""
        return layer if self._groups is None else self._groups.layer(layer)[1]

    def _group_label(self, label: str | None, layer: int) -> str | None:
        """The plan label a layer's call addresses: with groups, its group's
        stream of ``label`` (the cursor's label where none is given)."""
        if self._groups is None:
            return label
        return self._groups.plan_label(self._default_label if label is None else label, layer)

    def _plan_state_for(self, label: str | None) -> tuple[KVPlanState, str]:
        plan_label = self._default_label if label is None else label
        states = self._stepping.current_plan_states
        state = states.get(plan_label)
        if state is None:
            raise StepNotAdmittedError(
                f"no step is planned for plan label {plan_label!r} "
                f"(planned: {sorted(states)})",
                label=plan_label,
            )
        return state, plan_label
