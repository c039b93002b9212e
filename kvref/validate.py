"""Is this input well-formed? Checks on what an engine hands the manager.

Each function raises a `KVRefError` subclass naming the request and label it
can, and changes nothing: the manager calls them before it touches any state,
so a misuse found here leaves the manager exactly as it was. They check types
and ranges only; whether a call is allowed in the current lifecycle state is
the manager's business. ``step_lengths`` and ``padded_known`` read the
stream table (read-only), and must run under the manager's lock;
``cache_fits`` asks the device and the host how much memory they have.
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from kvref.core.cache import KVCache
from kvref.core.config import KVConfig, KVReqConfig
from kvref.core.errors import (
    InvalidArgumentError,
    InvalidConfigError,
    InvalidStepError,
    KVDeviceError,
    KVShapeError,
    PublishedInfoError,
    UnknownRequestError,
)
from kvref.core.steps import (
    BucketKey,
    KVStep,
    Segment,
    SlotLease,
    StepContext,
    group_by_plan_label,
)
from kvref.transfer.published import KVSequenceInfo, PublishedKVInfo, PublishRefused


class _HasLength(Protocol):
    @property
    def stored_len(self) -> int: ...


def _what(value: object) -> str:
    return f"{type(value).__name__} {value!r}"


def _is_int(value: object) -> bool:
    # bool is an int subclass; True as a span or layer is a bug, not a 1
    return isinstance(value, int) and not isinstance(value, bool)


# these checks run three times a step (admit, plan, commit): the common case
# is decided by exact types, and only anything else takes the general route
_LIST_TYPES = frozenset({list, tuple})
_STR = frozenset({str})


def _is_sequence(value: object) -> bool:
    # a bare str is a Sequence too, and would be iterated per character
    return type(value) in _LIST_TYPES or (
        isinstance(value, Sequence) and not isinstance(value, str))


def _all_str(items: Sequence[object]) -> bool:
    return set(map(type, items)) <= _STR or all(isinstance(item, str) for item in items)


def _is_str_sequence(value: object) -> bool:
    return _is_sequence(value) and _all_str(value)  # type: ignore[arg-type]


# -- call arguments -------------------------------------------------------------


def request_id(rid: object, call: str) -> None:
    """``rid`` names a request: a ``str``."""
    if not isinstance(rid, str):
        raise InvalidArgumentError(f"{call}: request id must be a str, got {_what(rid)}")


def label(value: object, call: str, rid: str | None = None, what: str = "label") -> None:
    """``value`` names a label (or a node, a graph walk): a ``str``."""
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{call}: {what} must be a str, got {_what(value)}",
                                   request_id=rid)


def req_config(overrides: object, rid: str) -> None:
    if overrides is not None and not isinstance(overrides, KVReqConfig):
        raise InvalidArgumentError(
            f"ingest_request: overrides must be a KVReqConfig or None, got "
            f"{type(overrides).__name__}", request_id=rid,
        )


def new_length(value: object, call: str, rid: str, name: str) -> None:
    """A length to cut a stream back to: an ``int >= 0`` (whether the stream
    holds that many tokens is the manager's business)."""
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        raise InvalidArgumentError(f"{call}: new_len must be an int >= 0, got {_what(value)}",
                                   request_id=rid, label=name)


def optional_label(value: object, call: str) -> None:
    """A plan label argument that defaults to the cursor when None."""
    if value is not None:
        label(value, call)


def layer_idx(idx: object, num_layers: int, call: str) -> None:
    """``idx`` (after the cursor default) addresses a layer: an int in ``[0, num_layers)``.

    A negative index would silently address a layer from the end.
    """
    if idx is None:
        raise InvalidArgumentError(f"{call}: no layer_idx given and the layer cursor is unset")
    if not _is_int(idx):
        raise InvalidArgumentError(f"{call}: layer_idx must be an int, got {_what(idx)}")
    assert isinstance(idx, int)
    if not 0 <= idx < num_layers:
        raise InvalidArgumentError(f"{call}: layer_idx {idx} outside [0, {num_layers})")


def optional_layer_idx(idx: object, num_layers: int, call: str) -> None:
    """A cursor setting: None clears it, anything else must address a layer."""
    if idx is not None:
        layer_idx(idx, num_layers, call)


def kv_pair(k: object, v: object, device: torch.device, plan_label: str) -> None:
    """K and V are tensors on the cache's device (shape and dtype: the plan's business)."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise KVShapeError(f"write_kv {name} must be a torch.Tensor, got {type(t).__name__}",
                               label=plan_label)
        if t.device != device:
            raise KVDeviceError(
                f"write_kv {name} is on {t.device}; the cache is on {device}", label=plan_label
            )


def published(pub: object, rid: str, rank: int) -> None:
    """What `admit_retrieve` is handed: None, or `PublishedKVInfo` whose entries
    for this rank are well-formed (lengths and page lists; whether they fit
    this cache is checked against the cache)."""
    if pub is None:
        return
    if isinstance(pub, PublishRefused):  # not a publication: there is nothing to retrieve
        raise PublishedInfoError(
            f"publish was refused ({type(pub.reason).__name__}: {pub.reason.message}); "
            "retrieve once the publisher publishes", request_id=rid)
    if not isinstance(pub, PublishedKVInfo):
        raise PublishedInfoError(
            f"published must be a PublishedKVInfo or None, got {type(pub).__name__}",
            request_id=rid,
        )
    if not _is_int(pub.world_size) or pub.world_size < 1:
        raise PublishedInfoError(f"published world_size {pub.world_size!r}", request_id=rid)
    if not isinstance(pub.info, Mapping):
        raise PublishedInfoError(f"published info is a {type(pub.info).__name__}",
                                 request_id=rid)
    entries = pub.info.get(rank, {})
    if not isinstance(entries, Mapping):
        raise PublishedInfoError(f"published info for rank {rank} is a "
                                 f"{type(entries).__name__}", request_id=rid)
    for name, info in entries.items():
        if not isinstance(name, str):
            raise PublishedInfoError(f"published label {_what(name)} is not a str",
                                     request_id=rid)
        if not isinstance(info, KVSequenceInfo):
            raise PublishedInfoError(f"published entry is a {type(info).__name__}",
                                     request_id=rid, label=name)
        if not _is_int(info.seq_len) or info.seq_len < 0:
            raise PublishedInfoError(f"published seq_len {info.seq_len!r}",
                                     request_id=rid, label=name)
        pages = info.page_indices
        if isinstance(pages, str) or not isinstance(pages, Sequence) or not all(
            _is_int(p) for p in pages
        ):
            raise PublishedInfoError(f"published page_indices {pages!r}",
                                     request_id=rid, label=name)


# -- the cache's size ---------------------------------------------------------------

# what a page costs in a free list (`PageAllocator`: a deque slot, an int, a
# flag byte), measured with tracemalloc on CPython 3.11
FREE_LIST_BYTES_PER_PAGE = 41


def host_memory_bytes() -> int | None:
    """This host's physical memory, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def device_memory_bytes(device: torch.device) -> int | None:
    """What ``device`` holds in all: a CUDA device's total memory, None where
    it cannot be asked (no CUDA here, another kind). The host's for ``cpu``."""
    if device.type == "cpu":
        return host_memory_bytes()
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(device)[1])
    return None


def cache_fits(cfg: KVConfig, device: torch.device, dtype: torch.dtype) -> None:
    """The cache ``cfg`` sizes, and its host pool, fit where they will live.

    Raises `InvalidConfigError` with the byte figures before anything is
    allocated, where the allocator would raise an untyped error (or the
    kernel kill the process) past them. An impossible size, not a tight one:
    the bound is everything the device (its total memory, not what is free
    now) or the host (physical memory) has. On ``cpu`` the device cache, the
    host pool and the page free lists share the host; on CUDA the cache is
    held to the device's memory and the rest to the host's. A device whose
    memory cannot be asked is not checked.
    """
    def cache_bytes(pages: int) -> int:
        return math.prod(KVCache.shape_for(cfg, pages)) * dtype.itemsize

    pages, host_pages = cfg.max_num_pages, cfg.cpu_offload_pages
    device_need = cache_bytes(pages)
    pool_need = cache_bytes(host_pages) if host_pages > 0 else 0
    lists_need = (pages + host_pages) * FREE_LIST_BYTES_PER_PAGE
    cache = (f"the device cache: {device_need:,} bytes (max_num_pages {pages} x "
             f"{cache_bytes(1):,} bytes a page in {dtype})")
    pool = (f"the host pool: {pool_need:,} bytes (cpu_offload_pages {host_pages})"
            if host_pages > 0 else "")
    lists = f"page free lists: {lists_need:,} bytes"
    host = host_memory_bytes()
    if device.type == "cpu":
        parts, need = [cache, pool, lists], device_need + pool_need + lists_need
    else:
        capacity = device_memory_bytes(device)
        if capacity is not None and device_need > capacity:
            raise InvalidConfigError(
                f"KVConfig does not fit {device}: {cache}, more than its "
                f"{capacity:,} bytes of memory")
        parts, need = [pool, lists], pool_need + lists_need
    if host is not None and need > host:
        raise InvalidConfigError(
            f"KVConfig does not fit this host: {need:,} bytes ("
            + "; ".join(p for p in parts if p)
            + f"), more than its {host:,} bytes of physical memory")


# -- steps ------------------------------------------------------------------------


def step(step: object, ctx: object) -> None:
    """A `KVStep` and `StepContext` whose every field has the type it promises."""
    _step_from(step, ctx, 0)


def _step_from(step: object, ctx: object, first: int) -> None:
    """`step`, its segments checked from ``first`` on (those before were
    checked already: `StepValidator`)."""
    if not isinstance(step, KVStep):
        raise InvalidStepError(f"step must be a KVStep, got {type(step).__name__}")
    if not isinstance(ctx, StepContext):
        raise InvalidStepError(f"ctx must be a StepContext, got {type(ctx).__name__}")
    segments(step.segments, first)
    if step.commit is not True and step.commit is not False:
        raise InvalidStepError(f"KVStep.commit must be a bool, got {_what(step.commit)}")
    if step.pre_forks:
        forks("pre_forks", step.pre_forks)
    if step.post_forks:
        forks("post_forks", step.post_forks)
    combined = step.combined_labels
    # an empty list or tuple (most steps) passes without a generator
    if not (type(combined) in _LIST_TYPES and not combined) and (
            not _is_sequence(combined)
            or not all(_is_str_sequence(group) for group in combined)):
        raise InvalidStepError(
            f"KVStep.combined_labels must be a sequence of sequences of str labels, "
            f"got {combined!r}"
        )
    padded = ctx.padded_request_ids
    if not (type(padded) in _LIST_TYPES and not padded) and not _is_str_sequence(padded):
        raise InvalidStepError(
            f"StepContext.padded_request_ids must be a sequence of str request ids, "
            f"got {padded!r}"
        )
    if (step.pre_forks or step.post_forks) and not padded:
        # a fork applies to each padded request; with none it would do
        # nothing, silently (R25, R40). Malformed input, so checked before
        # any lifecycle state, at admit, plan and commit alike
        raise InvalidStepError("a step with forks names no padded_request_ids to apply "
                               "them to")
    if ctx.is_preplan is not True and ctx.is_preplan is not False:
        raise InvalidStepError(f"StepContext.is_preplan must be a bool, got "
                               f"{_what(ctx.is_preplan)}")
    if ctx.slot_lease is not None and not isinstance(ctx.slot_lease, SlotLease):
        raise InvalidStepError(f"StepContext.slot_lease must be a SlotLease or None, got "
                               f"{type(ctx.slot_lease).__name__}")


class StepValidator:
    """`step`, walked once per step object: admit, plan and commit each check
    the step, and three walks cost about a fifth of a decode step.

    It remembers the last (step, ctx) it passed and what they held: every
    field's object, by identity, and copies of the segment and padded-id
    lists. A call with the same objects holding the same things passes at
    once; anything else is walked again, so a step whose segments were
    changed in place between admit and commit is checked as it is now.
    Only what cannot change unseen is remembered: an exact `KVStep` and
    `StepContext` (frozen: a field can only be swapped, which identity
    sees), segments and padded ids in a list or a tuple (compared by ==,
    element identity first: a segment replaced by an equal one counts as
    the same, as `same_step` counts it), forks and combined labels as tuples
    of tuples (of str, immutable all the way down); other steps are walked
    every time. A new step whose segments begin with the remembered step's
    own objects (by identity) walks only the segments after those. Called
    outside the manager's lock: the memo is replaced whole.
    """

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: _Seen | None = None

    def __call__(self, step_: object, ctx: object) -> None:
        seen = self._seen
        if seen is not None and step_ is seen.step and ctx is seen.ctx:
            st, cx = seen.step, seen.ctx  # the very objects, typed
            if (st.segments is seen.segments and st.commit is seen.commit
                    and st.pre_forks is seen.pre_forks and st.post_forks is seen.post_forks
                    and st.combined_labels is seen.combined_labels
                    and cx.padded_request_ids is seen.padded
                    and cx.is_preplan is seen.is_preplan and cx.slot_lease is seen.slot_lease
                    and st.segments == seen.segments_copy
                    and cx.padded_request_ids == seen.padded_copy):
                return
        known = 0
        if seen is not None and type(step_) is KVStep and (
                type(step_.segments) in _LIST_TYPES):
            # a new step whose first segments are the last one's objects (a
            # decode batch with a prefill chunk beside it, issue 42): those
            # passed, and a `Segment` is frozen, so only the rest is walked
            segs, prev = step_.segments, seen.segments_copy
            if all(map(operator.is_, segs, prev)):  # the usual case: no list
                known = min(len(segs), len(prev))
            else:
                known = list(map(operator.is_, segs, prev)).index(False)
            if ctx is seen.ctx and seen.same_fields(step_):
                # and every other field the very objects the last step held
                # and passed (a new step of each engine step, the same
                # context): only its segments can fail, and the memo is the
                # last one's with them (issue 42: the full walk and memo
                # of a mixed step's new object were about 4 µs)
                segments(segs, known)
                self._seen = seen.with_segments(step_)
                return
        if known:
            _step_from(step_, ctx, known)
        else:
            step(step_, ctx)
        assert isinstance(step_, KVStep) and isinstance(ctx, StepContext)
        self._seen = _Seen.of(step_, ctx)


class _Seen:
    """A (step, ctx) `step` passed, and what each held then."""

    __slots__ = ("combined_labels", "commit", "ctx", "is_preplan", "padded", "padded_copy",
                 "post_forks", "pre_forks", "segments", "segments_copy", "slot_lease", "step")

    def __init__(self, step_: KVStep, ctx: StepContext) -> None:
        self.step, self.ctx = step_, ctx
        self.segments, self.commit = step_.segments, step_.commit
        self.pre_forks, self.post_forks = step_.pre_forks, step_.post_forks
        self.combined_labels = step_.combined_labels
        self.padded, self.is_preplan = ctx.padded_request_ids, ctx.is_preplan
        self.slot_lease = ctx.slot_lease
        # a slice is a copy of a list, and a tuple itself
        self.segments_copy = step_.segments[:]
        self.padded_copy = ctx.padded_request_ids[:]

    def same_fields(self, step_: KVStep) -> bool:
        """``step_`` (an exact `KVStep`) holds this memo's objects in every
        field but its segments, and this memo's context still holds what it
        did: what `_step_from` checks of them passed for those objects."""
        cx = self.ctx
        return (step_.commit is self.commit and step_.pre_forks is self.pre_forks
                and step_.post_forks is self.post_forks
                and step_.combined_labels is self.combined_labels
                and cx.padded_request_ids is self.padded and cx.is_preplan is self.is_preplan
                and cx.slot_lease is self.slot_lease
                and cx.padded_request_ids == self.padded_copy)

    def with_segments(self, step_: KVStep) -> _Seen:
        """This memo moved to ``step_``, which `same_fields` holds to it and
        whose segments (a list or a tuple) passed."""
        new = _Seen.__new__(_Seen)
        new.step, new.ctx = step_, self.ctx
        new.segments, new.commit = step_.segments, self.commit
        new.pre_forks, new.post_forks = self.pre_forks, self.post_forks
        new.combined_labels = self.combined_labels
        new.padded, new.is_preplan = self.padded, self.is_preplan
        new.slot_lease = self.slot_lease
        new.segments_copy = step_.segments[:]
        new.padded_copy = self.padded_copy
        return new

    @classmethod
    def of(cls, step_: KVStep, ctx: StepContext) -> _Seen | None:
        """The memo of a step `step` passed, or None if it could change unseen."""
        if type(step_) is not KVStep or type(ctx) is not StepContext:
            return None
        if (type(step_.segments) not in _LIST_TYPES
                or type(ctx.padded_request_ids) not in _LIST_TYPES):
            return None
        for nested in (step_.pre_forks, step_.post_forks, step_.combined_labels):
            # empty (most steps): no generator
            if type(nested) is not tuple or (nested and not all(
                    type(x) is tuple for x in nested)):
                return None
        return cls(step_, ctx)


def segments(segs: object, first: int = 0) -> None:
    """Every segment a `Segment` of str ids and a non-negative int span;
    ``first``: the segments before it are known to be."""
    if not _is_sequence(segs):
        raise InvalidStepError(
            f"KVStep.segments must be a sequence of Segment, got {type(segs).__name__}"
        )
    assert isinstance(segs, Sequence)
    for seg in segs[first:] if first else segs:
        # one expression per segment (a plain loop measured faster here than
        # C-level map/set passes); only a bad segment takes the slow path
        if not (isinstance(seg, Segment) and type(seg.span) is int and seg.span >= 0
                and isinstance(seg.request_id, str) and isinstance(seg.label, str)):
            _bad_segment(seg)


def _bad_segment(seg: object) -> None:
    """Which part of ``seg`` is wrong, as an error naming the stream."""
    if not isinstance(seg, Segment):
        raise InvalidStepError(f"KVStep.segments holds a {type(seg).__name__}, not a Segment")
    rid, name, span = seg.request_id, seg.label, seg.span
    if not isinstance(rid, str):
        raise InvalidStepError(f"segment request id must be a str, got {_what(rid)}")
    if not isinstance(name, str):
        raise InvalidStepError(f"segment label must be a str, got {_what(name)}",
                               request_id=rid)
    if not _is_int(span):
        raise InvalidStepError(f"span must be an int, got {_what(span)}",
                               request_id=rid, label=name)
    if span < 0:
        raise InvalidStepError(f"negative span {span}", request_id=rid, label=name)


def forks(field: str, pairs: object) -> None:
    if isinstance(pairs, str) or not isinstance(pairs, Sequence):
        raise InvalidStepError(f"KVStep.{field} must be a sequence of (from, to) label pairs, "
                               f"got {pairs!r}")
    for pair in pairs:
        if not (_is_str_sequence(pair) and len(pair) == 2):
            raise InvalidStepError(f"KVStep.{field} holds {pair!r}, not a (from, to) pair "
                                   "of str labels")
        if pair[0] == pair[1]:
            raise InvalidStepError(f"fork of label {pair[0]!r} onto itself", label=pair[0])


def step_lengths(
    step: KVStep,
    ctx: StepContext,
    streams: Mapping[str, Mapping[str, _HasLength]],
    max_seq_len: int,
) -> None:
    """No stream the step grows ends past ``max_seq_len``. Under the manager's lock.

    A pre-fork target starts the step at its source's length (applied in
    order, so a chain a->b, b->c carries a's length to c); a post-fork target
    ends at its source's, which its own segment already bounds. Unknown
    requests pass here: the admit itself names them.
    """
    pre = _pre_fork_lengths(step, ctx, streams) if step.pre_forks else None
    for seg in step.segments:
        if pre and (seg.request_id, seg.label) in pre:
            base = pre[(seg.request_id, seg.label)]
        else:
            labels = streams.get(seg.request_id)
            stream = labels.get(seg.label) if labels is not None else None
            base = stream.stored_len if stream is not None else 0
        if base + seg.span > max_seq_len:
            _too_long(seg, base, max_seq_len)


def padded_known(padded: Sequence[str], streams: Mapping[str, object]) -> None:
    """Every request ``ctx.padded_request_ids`` names is ingested (and not
    removed). Under the manager's lock; raises `UnknownRequestError` naming
    the first that is not, and changes nothing.

    The padded requests are what a step's forks apply to, and a padded id
    the manager does not know is the engine's bookkeeping gone wrong with or
    without forks (R40): `admit` (plain, forked or preplanned) and
    `pages_needed` check it with the step's own requests, `plan` and
    `commit` once they know the step is the admitted one and before they
    change anything. One C-level pass: a decode step at batch 256 pays for it
    three times.
    """
    if all(map(streams.__contains__, padded)):
        return
    for rid in padded:
        if rid not in streams:
            raise UnknownRequestError("padded request is unknown (never ingested, or removed)",
                                      request_id=rid)


def step_streams(streams: Mapping[str, object], step: KVStep, padded: Sequence[str]) -> None:
    """A step's misuse against the stream table that does not depend on what
    the streams hold: an unknown request, a negative span, a stream named
    twice, a padded id not ingested, forks with nothing to apply to or onto
    their own label, bad combined labels. Under the manager's lock (admit and
    `pages_needed`); raises, changes nothing."""
    seen: set[tuple[str, str]] = set()
    for seg in step.segments:
        rid, label = seg.request_id, seg.label
        if rid not in streams:
            raise UnknownRequestError("unknown request (never ingested, or removed)",
                                      request_id=rid, label=label)
        if seg.span < 0:
            raise InvalidStepError(f"negative span {seg.span}", request_id=rid, label=label)
        if (rid, label) in seen:
            # both would be planned from one length and write the same slots
            raise InvalidStepError("stream appears twice in one step", request_id=rid,
                                   label=label)
        seen.add((rid, label))
    # with or without forks: a padded id the manager does not know (R40)
    padded_known(padded, streams)
    forks = (*step.pre_forks, *step.post_forks)
    if forks:
        if not padded:
            # a fork applies to each padded request; with none it would do
            # nothing, silently (R25)
            raise InvalidStepError("a step with forks names no padded_request_ids to apply "
                                   "them to")
        for from_label, to_label in forks:
            if from_label == to_label:
                raise InvalidStepError(f"fork of label {from_label!r} onto itself")
    if step.combined_labels:
        try:
            group_by_plan_label((), step.combined_labels)
        except ValueError as err:
            raise InvalidStepError(str(err)) from None


def _pre_fork_lengths(
    step: KVStep, ctx: StepContext, streams: Mapping[str, Mapping[str, _HasLength]]
) -> dict[tuple[str, str], int]:
    """Each pre-fork target's length at plan: its source's, chains followed in order."""
    pre: dict[tuple[str, str], int] = {}
    for src, dst in step.pre_forks:
        for rid in ctx.padded_request_ids:
            labels = streams.get(rid)
            if labels is None:
                continue
            if (rid, src) in pre:
                pre[(rid, dst)] = pre[(rid, src)]
            elif src in labels:
                pre[(rid, dst)] = labels[src].stored_len
    return pre


def _too_long(seg: Segment, base: int, max_seq_len: int) -> None:
    raise InvalidStepError(
        f"stream would reach {base + seg.span} tokens ({base} stored + span "
        f"{seg.span}), past KVConfig.max_seq_len {max_seq_len}",
        request_id=seg.request_id, label=seg.label,
    )


def slot_lease(step: KVStep, ctx: StepContext, buffer_len: int) -> None:
    """A step planned under a slot lease fits the graph's static buffers.

    Checked before plan changes anything (a pre-fork copies at plan): found
    inside, it left the fork applied or one label's buffer restaged.
    """
    lease = ctx.slot_lease
    if lease is None:
        return
    bucket = lease.bucket
    if not (_is_int(lease.slot) and isinstance(bucket, BucketKey)
            and _is_int(bucket.num_tokens) and bucket.num_tokens >= 0):
        raise InvalidStepError(f"slot lease {lease!r}: slot must be an int and bucket a "
                               "BucketKey of a non-negative token count")
    if buffer_len == 0:
        raise InvalidStepError(
            "a step planned under a slot lease before build_cuda_graph_buffers"
        )
    if bucket.num_tokens > buffer_len:
        raise InvalidStepError(
            f"bucket of {bucket.num_tokens} tokens is larger than the graph buffers "
            f"({buffer_len}); build_cuda_graph_buffers with a larger max_seq_len"
        )
    try:
        groups = group_by_plan_label(step.segments, step.combined_labels)
    except ValueError as err:
        raise InvalidStepError(str(err)) from None
    for plan_label, segs in groups.items():
        n = sum(seg.span for seg in segs)
        if n > bucket.num_tokens:
            raise InvalidStepError(
                f"{n} tokens do not fit a bucket of {bucket.num_tokens}", label=plan_label
            )


def capture_len(max_seq_len: object) -> None:
    """`build_cuda_graph_buffers`'s token count: a positive int."""
    if not _is_int(max_seq_len) or max_seq_len < 1:  # type: ignore[operator]
        raise InvalidArgumentError(
            f"build_cuda_graph_buffers: max_seq_len must be a positive int, got "
            f"{_what(max_seq_len)}"
        )
