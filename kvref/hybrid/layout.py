"""How a hybrid config's labels, steps and layers map onto group streams (H1).

A label ``L`` names one stream per attention group: the first group's is
``L``, group ``name``'s is ``L@name`` (`kvref.core.groups`). `GroupLayout`
is the one place that turns what an engine names into what the mechanisms
act on: a step on ``L`` into the same step on every group's stream (so one
admission reserves in every group or none, R1), a model layer into its
group and its slot in a page, and a group label back into its label.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvref.core.errors import InvalidArgumentError
from kvref.core.groups import GROUP_SEP, AttentionGroup
from kvref.core.steps import KVStep, Segment


class GroupLayout:
    """The groups of one `KVConfig` (non-empty), as the manager applies them."""

    def __init__(self, groups: Sequence[AttentionGroup]) -> None:
        self.groups = tuple(groups)
        self._suffixes = ("", *(GROUP_SEP + g.name for g in self.groups[1:]))
        # model layer -> (group, its slot in a page of that group)
        self._layer = {layer: (gi, slot) for gi, g in enumerate(self.groups)
                       for slot, layer in enumerate(g.layers)}
        self._labels: dict[str, tuple[str, ...]] = {}
        # steps expanded, by identity: admit, plan and commit of one step
        # object must hand the mechanisms one expanded object (they compare
        # the running step by identity); the entry keeps the step alive
        self._steps: dict[int, tuple[KVStep, KVStep]] = {}

    def labels(self, label: str) -> tuple[str, ...]:
        """Each group's stream label of ``label``, the first group's first."""
        got = self._labels.get(label)
        if got is None:
            if GROUP_SEP in label:
                raise InvalidArgumentError(
                    f"label {label!r}: a hybrid config's labels do not hold {GROUP_SEP!r} "
                    "(it joins a label and its group's name)", label=label)
            if len(self._labels) > 4096:
                self._labels.clear()
            got = self._labels[label] = tuple(label + s for s in self._suffixes)
        return got

    def label_of(self, group_label: str) -> str:
        """The label a group's stream belongs to."""
        return group_label.split(GROUP_SEP, 1)[0]

    def is_first(self, group_label: str) -> bool:
        return GROUP_SEP not in group_label

    def layer(self, layer_idx: int) -> tuple[int, int]:
        """(group, slot in the group's pages) of model layer ``layer_idx``."""
        return self._layer[layer_idx]

    def plan_label(self, label: str, layer_idx: int) -> str:
        """The plan label whose tables a layer of ``label``'s plan reads."""
        return self.labels(label)[self._layer[layer_idx][0]]

    def expand(self, step: KVStep) -> KVStep:
        """The step on every group: each segment and fork once per group, and
        each combined-label group once per group (so a group's plan label is
        its first label's group label)."""
        got = self._steps.get(id(step))
        if got is not None and got[0] is step:
            return got[1]
        n = len(self.groups)
        out = KVStep(
            segments=[Segment(s.request_id, lb, s.span) for s in step.segments
                      for lb in self._labels_of(s.label)],
            commit=step.commit,
            pre_forks=[(f, t) for a, b in step.pre_forks
                       for f, t in zip(self._labels_of(a), self._labels_of(b), strict=True)],
            post_forks=[(f, t) for a, b in step.post_forks
                        for f, t in zip(self._labels_of(a), self._labels_of(b), strict=True)],
            combined_labels=[[self._labels_of(lb)[g] for lb in combined]
                             for combined in step.combined_labels for g in range(n)])
        if len(self._steps) > 64:
            self._steps.clear()  # an engine holds a step or two at a time
        self._steps[id(step)] = (step, out)
        return out

    def _labels_of(self, label: object) -> tuple[str, ...]:
        # a label of the wrong type is the step validator's to name; it ran first
        return self.labels(label) if isinstance(label, str) else (label,) * len(self.groups)  # type: ignore[return-value]
