"""The names a hybrid scope's streams go by on each side (issue 40).

Inside the model, group ``g`` of label ``L`` is the stream of internal label
``L * G + g`` (`kvref_model.groups`); inside kvref it is the stream of group
label ``L`` (group 0) or ``L@g<g>`` (`kvref.hybrid.GroupLayout`). The driver
names every stream, token and page holder through a `GroupMap`, so one code
path serves a scope with groups and one without (G = 1: every map is the
identity on today's names).
"""

from __future__ import annotations

from kvref import KVStep, RetentionPolicy, Segment
from kvref.core.groups import GROUP_SEP, AttentionGroup, ChunkedAttention
from kvref_model import core as m


class GroupMap:
    """Model internal labels and token identities against kvref's stream labels."""

    def __init__(self, scope: m.Scope) -> None:
        self.scope = scope
        self.g = scope.group_count
        self.labels = scope.labels
        self.nlab = scope.labels * self.g  # the model's internal labels
        self._kv = tuple(m.LABEL_NAMES[i // self.g] + self.suffix(i % self.g)
                         for i in range(self.nlab))
        self._internal = {name: i for i, name in enumerate(self._kv)}

    @staticmethod
    def suffix(group: int) -> str:
        return "" if group == 0 else f"{GROUP_SEP}g{group}"

    # -- the config ------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        """Two layers a group, interleaved (group g: layers g and G + g), so a
        write to a layer lands in its group's pages only if kvref maps it."""
        return 2 * self.g

    def attention_groups(self) -> tuple[AttentionGroup, ...]:
        """`KVConfig.groups` of the scope: () without groups. A chunked
        group's number is its chunk (H7; built as a window before, so a
        chunked scope drove kvref through a window the model did not have)."""
        sc = self.scope
        return tuple(
            AttentionGroup(f"g{i}", (i, self.g + i),
                           None if w is None else ChunkedAttention(w) if i in sc.chunked
                           else RetentionPolicy(w, sc.margin(i)))
            for i, w in enumerate(sc.groups))

    def layers(self, group: int) -> tuple[int, ...]:
        """The model layers whose pages a group's streams hold."""
        return tuple(range(self.num_layers)) if self.g == 1 else (group, self.g + group)

    # -- labels ------------------------------------------------------------------

    def kv_label(self, internal: int) -> str:
        """kvref's stream label of model internal label ``internal``."""
        return self._kv[internal]

    def internal(self, kv_label: str) -> int:
        """The model internal label of kvref's stream label ``kv_label``."""
        return self._internal[kv_label]

    def user(self, kv_label: str) -> str:
        """The label an engine names: a group label's label."""
        return kv_label.split(GROUP_SEP, 1)[0]

    def group(self, kv_label: str) -> int:
        return self._internal[kv_label] % self.g

    def streams(self, label: int) -> tuple[str, ...]:
        """kvref's stream labels of the engine's label ``label``, group order."""
        return self._kv[label * self.g:(label + 1) * self.g]

    def is_first(self, kv_label: str) -> bool:
        return GROUP_SEP not in kv_label

    def holder(self, h: int) -> tuple[int, str]:
        """(model request, kvref stream label) of a model pool holder."""
        return h // self.nlab, self._kv[h % self.nlab]

    # -- token identities -----------------------------------------------------

    def user_token(self, token: int) -> int:
        """The identity an engine's id names for the model's ``token``: the
        engine hands one list of ids for every group of a label, and the
        model gives each group its own identity (its internal label; a
        peer's: nlab + internal label), so the group is dropped here."""
        if token < 0:
            return token
        if token < self.nlab:
            return token // self.g
        return self.labels + (token - self.nlab) // self.g

    def token_of_view(self, kv_label: str) -> int:
        """The identity of a token a view of ``kv_label`` computes."""
        return self._internal[kv_label]

    # -- steps ---------------------------------------------------------------------

    def expand(self, step: KVStep) -> KVStep:
        """The step on every group's streams, as the plan's tables name them
        (the oracle builds them from scratch from this; written here, not
        taken from kvref's `GroupLayout`, which is under test)."""
        if self.g == 1:
            return step

        def each(label: str) -> tuple[str, ...]:
            return self.streams(m.LABEL_NAMES.index(label))

        return KVStep(
            segments=[Segment(s.request_id, lb, s.span) for s in step.segments
                      for lb in each(s.label)],
            commit=step.commit,
            pre_forks=[p for a, b in step.pre_forks for p in zip(each(a), each(b), strict=True)],
            post_forks=[p for a, b in step.post_forks
                        for p in zip(each(a), each(b), strict=True)],
            combined_labels=[[each(lb)[g] for lb in combined]
                             for combined in step.combined_labels for g in range(self.g)])
