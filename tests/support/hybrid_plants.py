"""Hybrid-model defects (issue 40) planted in kvref as monkeypatches, each
the class of a KV-cache bug another engine shipped: found by the model
layers run on a hybrid scope (tests/conformance/test_hybrid_plants.py),
while the clean tree passes the same runs. H1-H4 of specs/retention.md
state what each breaks. `SCHEDULED_PLANTS` are defects only an
interleaving shows, found by the controlled scheduler's hybrid programs
(tests/concurrency/test_shared_programs.py)."""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType

import pytest

from kvref import AdmitOutcome, KVStep, StepContext
from kvref.core.groups import GROUP_SEP
from kvref.core.refusals import AllocationFailed
from kvref.core.stream_table import Key, StreamTable
from kvref.core.streams import ClaimedStream
from kvref.manager import KVManager
from kvref.offload import phases
from kvref.offload.handle import Offload
from kvref.offload.outcomes import OffloadOutcome
from kvref.offload.phases import HostOffload
from kvref.prefix import cache as prefix_cache
from kvref.transfer import retrieval

Plant = Callable[[pytest.MonkeyPatch], None]


def _mutant(mp: pytest.MonkeyPatch, module: ModuleType, name: str, old: str, new: str,
            owner: type | None = None) -> None:
    """``module.name`` (or ``owner.name``, a method of a class of the module)
    rebuilt from its own source with ``old`` replaced by ``new`` (one spot):
    a one-line defect inside a function too long to wrap. Its globals are
    the module's, so it calls what the original does."""
    where: object = module if owner is None else owner
    src = textwrap.dedent(inspect.getsource(getattr(where, name)))
    assert src.count(old) == 1, f"{name}: the plant's spot is gone"
    scope = dict(vars(module))
    exec(compile(src.replace(old, new), f"<plant {module.__name__}.{name}>", "exec"), scope)
    mp.setattr(where, name, scope[name])


def window_frees_tail_first(mp: pytest.MonkeyPatch) -> None:
    """vLLM #48435 (H4 off): a cached window lets go of its pages tail
    first, as a full stream does, so the tail a window hit at its end reads
    is evicted first; sessions re-sending a growing prefix in turn lost
    every hit at about 25 % pool occupancy."""
    def bad(self: StreamTable, key: Key, pages: list[int]) -> int:
        return self.pages.release_table(key, list(pages)[::-1]) if pages else 0

    mp.setattr(StreamTable, "give_back", bad)


def window_hit_only_at_the_longest_point(mp: pytest.MonkeyPatch) -> None:
    """vLLM #57610: the lookup tries the longest hit the ids allow and
    stops there: a prompt that goes past a cached one inside its last page
    (its ids diverge there) finds nothing, where a shorter hit every group
    serves stood."""
    _mutant(mp, prefix_cache, "match_prefix_groups",
            "    while pages and not serves(pages * ps):\n        pages -= 1\n",
            "    if not serves(pages * ps):\n        pages = 0\n")


def window_passes_keyed_pages_to_the_lru(mp: pytest.MonkeyPatch) -> None:
    """vLLM #42948 (H3 off): the pages a cached window passes at a commit
    go back keyed, onto the LRU, so they push other requests' cached
    prefixes toward eviction (and an allocation for a request evicts the
    prefix its own lookup was to hit)."""
    def bad(self: StreamTable, key: Key, stream: object) -> int:
        ps = self.page_size
        released = self.behaviour(key[1]).released_after(
            stream.released, stream.stored_len, ps)  # type: ignore[attr-defined]
        if released == stream.released:  # type: ignore[attr-defined]
            return 0
        gone = stream.release_window_to(released, ps)  # type: ignore[attr-defined]
        return self.pages.release_table(key, list(gone)[::-1]) if gone else 0

    def bad_each(self: StreamTable, keys: list[Key], streams: list[object]) -> None:
        for key, stream in zip(keys, streams, strict=True):
            bad(self, key, stream)

    mp.setattr(StreamTable, "retire", bad)
    # a decode step's commit retires its windows in one call
    mp.setattr(StreamTable, "retire_each", bad_each)


def hit_decided_by_the_first_group(mp: pytest.MonkeyPatch) -> None:
    """vLLM PR 50457 / vllm-ascend PR 12394: the hit length is one group's
    (the full group's), taken for every group: the window group attaches
    what it has of the pages its window reads, a table with holes, and the
    label's groups disagree (H2)."""
    _mutant(mp, prefix_cache, "match_prefix_groups",
            "for i, got in enumerate(cached)\n",
            "for i, got in enumerate(cached[:1])\n")


def refused_admit_keeps_the_first_group(mp: pytest.MonkeyPatch) -> None:
    """H1 off: admission reserves group by group and returns the first
    refusal without unwinding, so an admit the window group cannot take
    leaves the full group's pages reserved and its streams in flight."""
    orig = KVManager.admit

    def bad(self: KVManager, step: KVStep, ctx: StepContext) -> AdmitOutcome:
        out = orig(self, step, ctx)
        if out.ok or self._groups is None or not isinstance(out.reason, AllocationFailed):
            return out
        # the first group's streams are the labels' own names
        first = KVStep(segments=list(step.segments), commit=step.commit)
        with self._lock:
            self._stepping.admit(first, ctx)
        return out

    mp.setattr(KVManager, "admit", bad)


def late_start_fault_keeps_the_started_group(mp: pytest.MonkeyPatch) -> None:
    """H1 off (kvref before this fix): a retrieve whose window group's copy
    cannot start answers the plain refusal of R26, while the full group's
    copy, started first, keeps running: the groups disagree (one pending
    with the peer's length, one as it was) and the call says nothing moved."""
    spot = "if not any(lb.split(GROUP_SEP, 1)[0] == user for lb in started):"
    src = textwrap.dedent(inspect.getsource(retrieval.Retrieval.admit_retrieve))
    assert src.count(spot) == 1, "admit_retrieve: the plant's spot is gone"
    scope = dict(vars(retrieval))
    exec(compile(src.replace(spot, "if True:"), "<plant admit_retrieve>", "exec"), scope)
    mp.setattr(retrieval.Retrieval, "admit_retrieve", scope["admit_retrieve"])


def later_group_copy_trusts_the_first(mp: pytest.MonkeyPatch) -> None:
    """R19 per group broken: a label's copy checks the claim once, at its
    first group's copy, and the later groups' copies trust that check. A
    reset between two groups' copies (kvref copies each group's stream in
    its own critical sections) then has a later group copy the reset
    stream and answer True, where a copy of a changed claim copies nothing
    (the commit's guard still throws it away: the answer and the host
    pages it held meanwhile are wrong). Only a schedule that runs the reset
    between the groups' copies shows it: the controlled scheduler's hybrid
    offload program (tests/concurrency/test_shared_programs.py)."""
    _mutant(mp, phases, "copy_to_host", "if self._stale(offload):",
            "if self._stale(offload) and (offload.cancelled"
            f" or {GROUP_SEP!r} not in claim.label):",  # the first group's stream only
            owner=phases.HostOffload)


def commit_releases_group_by_group(mp: pytest.MonkeyPatch) -> None:
    """H1's commit split: an offload commit that moves the first group's
    streams in one critical section and each later group's in another, as
    a coordinator looping over per-group managers would. Between the two,
    any thread sees a half-offloaded request: the offload closed, the first
    group on the host, the window group still claimed and holding its
    device pages."""
    orig = HostOffload.commit

    def bad(self: HostOffload, offload: Offload, claims: Mapping[str, ClaimedStream],
            copied: Sequence[str]) -> OffloadOutcome:
        later = [lb for lb in copied if GROUP_SEP in lb]
        first = {lb: c for lb, c in claims.items() if lb not in later}
        out = orig(self, offload, first, [lb for lb in copied if lb not in later])
        rid, freed = offload.request_id, out.pages_freed
        with self.table.lock:  # the second section: the later groups
            streams = self.table.streams.get(rid, {})
            for lb in later:
                s = streams.get(lb)
                if s is None:
                    continue
                if not out.moved:  # the guard failed on the first group
                    self._give_back_claim(rid, streams, lb)
                    continue
                freed += self.table.give_back((rid, lb), s.page_indices)
                s.commit_offload()
        moved = out.moved + (tuple(later) if out.moved else ())
        return OffloadOutcome(freed, moved, out.kept, out.reason)

    mp.setattr(HostOffload, "commit", bad)


PLANTS: dict[str, Plant] = {
    "window_frees_tail_first": window_frees_tail_first,
    "window_hit_only_at_the_longest_point": window_hit_only_at_the_longest_point,
    "window_passes_keyed_pages_to_the_lru": window_passes_keyed_pages_to_the_lru,
    "hit_decided_by_the_first_group": hit_decided_by_the_first_group,
    "refused_admit_keeps_the_first_group": refused_admit_keeps_the_first_group,
    "late_start_fault_keeps_the_started_group": late_start_fault_keeps_the_started_group,
}

# found by the controlled scheduler's hybrid programs, not by a sequential
# trace: plant -> (the HYBRID_CASES program, the DFS schedule, one
# preemption, at which it is found)
SCHEDULED_PLANTS: dict[str, tuple[Plant, str, int]] = {
    "later_group_copy_trusts_the_first": (
        later_group_copy_trusts_the_first, "hybrid: an offload against a reset of its request",
        18),  # of the clean tree's 40
    "commit_releases_group_by_group": (
        commit_releases_group_by_group,
        "hybrid: an offload and its reload against another request's step", 1),
}
