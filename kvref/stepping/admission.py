"""Admission: from the stream table and a step to a grant or a refusal.

Pure computation under the manager's lock: nothing here changes a stream,
so a refusal leaves nothing to unwind (R1). `Stepping.admit` applies a
grant. A step with forks (or a preplan) goes through `reserve`; a plain step
(every decode step) through `plain_grant`, the same rules specialised to a
step with no forks, in one pass that holds the stream objects. Both hand
back the same `Grant`, and any rare decision (a misuse, a refusal's kind)
the plain pass only detects and leaves to the general rule that states it.

Order of answers, as `kvref_model.core.Model.do_Admit` states it: misuse first
(`validate.step_streams`), then a latched retrieve failure (terminal), a retrieve
still copying, an offloaded stream, and last the page count.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import NoReturn

from kvref import validate
from kvref.core.labels import LabelBehaviour
from kvref.core.sharing import NO_SHARING, PageSharing
from kvref.core.streams import CacheStream
from kvref.stepping.step import (
    AdmitFailedReason,
    AdmitRuntimeError,
    AllocationFailed,
    KVStep,
    PublishLeased,
    RequestOffloading,
    RetrieveInProgress,
    StepContext,
)

Key = tuple[str, str]  # (request id, label)
Table = Mapping[str, MutableMapping[str, CacheStream]]
# label -> its attention type (`StreamTable.behaviour`)
Behaviours = Callable[[str], LabelBehaviour]

IDLE, PENDING, FAILED = "idle", "pending", "failed"


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def retrieve_state(stream: CacheStream) -> str:
    """idle / pending / failed. A finished transfer's outcome is read off its
    future once and latched on the stream (I11), as readiness checks do."""
    return stream.settle_retrieve().value  # the enum's values are these names


def engaged(stream: CacheStream) -> bool:
    """Whether the stream may refuse an admit: offloaded, or touched by a
    retrieve (running, or a latched failure). `refusal` says which refusal."""
    return stream.offloaded or stream.read_future is not None or stream.read_error is not None


def named_keys(step: KVStep, padded: tuple[str, ...]) -> dict[Key, None]:
    """Every stream a step names (R2): its segments, and both ends of every
    fork for every padded request; in that order."""
    keys: dict[Key, None] = {(g.request_id, g.label): None for g in step.segments}
    for from_label, to_label in (*step.pre_forks, *step.post_forks):
        for rid in padded:
            keys[(rid, from_label)] = None
            keys[(rid, to_label)] = None
    return keys


def refusal(table: Table, keys: Mapping[Key, None]) -> AdmitFailedReason | None:
    """The first refusal the named streams call for, by kind, or None."""
    failed = pending = offloading = None
    for rid, label in keys:
        stream = table[rid].get(label)
        if stream is None or not engaged(stream):
            continue
        state = retrieve_state(stream) if (stream.read_future is not None
                                           or stream.read_error is not None) else IDLE
        if state == FAILED and failed is None:
            err = stream.read_error
            failed = AdmitRuntimeError(
                f"KV retrieve failed: {type(err).__name__}: {err}; reset or remove the request",
                request_id=rid, label=label)
        elif state == PENDING and pending is None:
            pending = retrieve_in_progress(rid, label)
        if stream.offloaded and offloading is None:
            offloading = request_offloading(rid, label)
    return failed or pending or offloading


def leased_fork_target(step: KVStep, padded: tuple[str, ...],
                       leased: Callable[[str], bool]) -> PublishLeased | None:
    """R50: a fork applied to a leased request may overwrite, in place, pages a
    peer is copying (or, failing, empty them); across processes nothing else
    tells the peer, so the step waits for the lease to end. Any fork over it,
    not only one onto a published label: a target the step creates is then
    written in place too, and the rule stays one an engine can predict."""
    if not (step.pre_forks or step.post_forks):
        return None
    for rid in padded:
        if leased(rid):
            return PublishLeased(
                message=f"a fork over {rid!r}, whose publication a peer still holds: "
                        "retry after release_published or the lease's end", request_id=rid)
    return None


def releases_published(step: KVStep, table: Table, settled: Mapping[Key, int],
                       behaviour: Behaviours, page_size: int, rid: str) -> bool:
    """R70: whether ``step``'s commit would release a page of a stream of
    ``rid`` that holds committed tokens (a page a publish names), from the
    lengths ``settled`` (a preplan's, R41) or the stream's own."""
    if not step.commit:
        return False  # it keeps no tokens, so its commit releases nothing
    for seg in step.segments:
        if seg.request_id != rid or not seg.span:
            continue
        stream = table.get(rid, {}).get(seg.label)
        if stream is None:
            continue
        n = settled.get((rid, seg.label), stream.stored_len)
        label = behaviour(seg.label)
        released = label.released_after(stream.released, n, page_size)
        after = label.released_after(released, n + seg.span, page_size)
        if min(after, pages_for(n, page_size) * page_size) > released:
            return True
    return False


def leased_release(step: KVStep, table: Table, settled: Mapping[Key, int],
                   behaviour: Behaviours, page_size: int,
                   leased: Callable[[str], bool]) -> PublishLeased | None:
    """R70: the step's commit would release window pages (W2) of a leased
    request, pages a peer may still be copying; across processes nothing
    else tells the peer, so the step waits for the lease to end, as a fork
    over it does (R50)."""
    for rid in dict.fromkeys(seg.request_id for seg in step.segments if seg.span):
        if leased(rid) and releases_published(step, table, settled, behaviour, page_size, rid):
            return PublishLeased(
                message=f"the step's commit would release window pages of {rid!r}, whose "
                        "publication a peer still holds: retry after release_published "
                        "or the lease's end", request_id=rid)
    return None


def leased_cow(step: KVStep, table: Table, sharing: PageSharing,
               leased: Callable[[str], bool]) -> PublishLeased | None:
    """R71: a segment of a leased request that writes after a partial last
    page it shares (a truncate into a shared or keyed page, then publish)
    would copy that page first (R52) and give back the one the lease names:
    free-cached, the next allocation may evict it while a peer copies it.
    Across processes nothing else tells the peer, so the step waits for the
    lease to end, as one whose commit releases a window page does (R70)."""
    for seg in step.segments:
        rid = seg.request_id
        if not seg.span or not leased(rid):
            continue
        stream = table.get(rid, {}).get(seg.label)
        if stream is not None and sharing.cow_needed((rid, seg.label), stream):
            return PublishLeased(
                message=f"{rid!r}/{seg.label!r} writes into a shared page its publication "
                        "names, which the write would copy and give back: retry after "
                        "release_published or the lease's end",
                request_id=rid, label=seg.label)
    return None


# what admission asks of shared pages; the name `kvref.admission` exported
Sharing = PageSharing


# One named stream and what its admit takes: the request id, the request's
# streams, the label, the stream (None: the admit creates it, R16) and the
# pages it is short (none when <= 0)
Claim = tuple[str, MutableMapping[str, CacheStream], str, CacheStream | None, int]


@dataclass
class Grant:
    """What an admit will do, computed before it does any of it (R1): every
    stream the step names, in reservation order, so applying the grant
    creates and marks them all (R16). ``cow``: streams whose partial last
    page is shared or registered, copied into a private page before the
    step writes into it (R52); each is one of ``new_pages``."""

    claims: list[Claim]
    new_pages: int
    cow: list[Key] = field(default_factory=list)
    # fork targets of a preplanned step: every page they share or that is
    # cached is copied into one of their own at admit, so the copying forks
    # its promotion runs write only into private pages (R57)
    privatise: list[tuple[Key, int]] = field(default_factory=list)
    # a plain step's (`plain_grant`): each claim's stream, and the claims
    # that create their stream or take pages, in order. Applying it touches
    # only those rows one by one; the others are marked all at once
    streams: list[CacheStream | None] | None = None
    work: list[int] = field(default_factory=list)


def settle(claims: list[Claim], new_pages: int, first_short: Key | None,
           free: int, cow: list[Key] | None = None,
           privatise: list[tuple[Key, int]] | None = None) -> Grant | AllocationFailed:
    """The page count decides last: a grant, or the pages it is short."""
    if new_pages > free:
        return allocation_failed(new_pages, free, first_short)
    return Grant(claims, new_pages, cow or [], privatise or [])


def plain_grant(table: Table, step: KVStep, page_size: int, free: int, max_seq_len: int,
                *, padded: tuple[str, ...] = (), sharing: PageSharing | None = None
                ) -> Grant | AdmitFailedReason:
    """`validate.step_lengths`, `validate.step_streams`, `refusal` and `reserve` of a
    step with no forks and no combined labels: each segment's stream grows by
    its span. ``padded``: the step's ``ctx.padded_request_ids``, which a
    plain step only has to name known requests (R40). ``sharing``: None
    where no stream's tail may be shared (`StreamTable.tails_maybe_shared`
    False), so no segment asks for a copy-on-write.

    One pass over the segments holding each request's streams: at batch 256
    the general path's tuple-keyed lookups were most of an admit. A misuse
    or a stream that may refuse is only detected here; the general rules
    decide it (`misuse`, `refusal`), so each rule is stated once.
    """
    claims: list[Claim] = []
    new_pages = 0
    first_short: Key | None = None
    refusing = at_limit = False
    found: list[CacheStream | None] = []
    keep = found.append
    work: list[int] = []
    new_keys: list[Key] = []  # the claims whose stream the admit creates
    cow: list[Key] = []
    # bound once: a lookup each per segment is a few % of a B=256 admit
    lookup, claim = table.get, claims.append
    for seg in step.segments:
        rid, label, span = seg.request_id, seg.label, seg.span
        streams = lookup(rid)
        if streams is None or span < 0:
            misuse(table, step, padded, max_seq_len)
        stream = streams.get(label)
        # `pages_for` and `engaged` inlined: a call each per segment cost
        # ~45 µs at batch 256 (tests/unit/test_admission_paths.py holds this
        # pass to the general one)
        if stream is None:
            end = span
            short = -(-span // page_size)
            new_keys.append((rid, label))
            if short <= 0:
                work.append(len(claims))  # created, no pages
        else:
            if stream.offloaded or stream.read_future is not None or (
                    stream.read_error is not None):
                refusing = True
            end = stream.stored_len + span
            # slots, not pages: a windowed stream's released slots hold none
            short = (-(-end // page_size) - stream.released // page_size
                     - len(stream.page_indices))
            if sharing is not None and span and stream.tail_maybe_shared and (
                    sharing.cow_needed((rid, label), stream)):
                cow.append((rid, label))
                new_pages += 1
                if first_short is None:
                    first_short = (rid, label)
        if end >= max_seq_len:
            at_limit = True  # at or past it: `validate.step_lengths` decides
        if short > 0:
            new_pages += short
            if first_short is None:
                first_short = (rid, label)
            work.append(len(claims))
        claim((rid, streams, label, stream, short))
        keep(stream)
    if at_limit:
        validate.step_lengths(step, StepContext(), table, max_seq_len)
    # streams named once: distinct objects, and distinct keys among those the
    # admit creates (all None in ``found``)
    distinct = len(set(found)) + (len(set(new_keys)) - 1 if new_keys else 0)
    if distinct != len(claims) or not all(map(table.__contains__, padded)):
        misuse(table, step, padded, max_seq_len)  # a stream named twice, an unknown padded id
    if refusing:
        refused = refusal(table, named_keys(step, ()))
        if refused is not None:
            return refused
    grant = settle(claims, new_pages, first_short, free, cow)
    if isinstance(grant, Grant):
        grant.streams, grant.work = found, work
    return grant


def misuse(table: Table, step: KVStep, padded: tuple[str, ...], max_seq_len: int) -> NoReturn:
    """Raise the misuse of a plain step `plain_grant` found, as the general
    path ranks them: a stream past ``max_seq_len`` first, then the rest."""
    validate.step_lengths(step, StepContext(), table, max_seq_len)
    validate.step_streams(table, step, padded)
    raise AssertionError(f"plain_grant found a misuse the general rules pass: {step!r}")


def reserve(table: Table, step: KVStep, padded: tuple[str, ...], keys: Mapping[Key, None],
            page_size: int, free: int, settled: Mapping[Key, int] | None = None,
            sharing: PageSharing = NO_SHARING, copy_forks: bool = False,
            behaviour: Behaviours | None = None
            ) -> Grant | AllocationFailed:
    """Pages per stream: the most its length reaches while the step runs, the
    forks applied in list order (a chain a->b, b->c copies a's tokens onward;
    a segment on a pre-fork target grows from the source's length, R9).
    ``settled``: a preplan over the running step starts from the lengths
    that step leaves once committed (R41).

    With shared pages (``sharing``), a fork target shares its source's full
    pages and writes only into pages private to it (R51): it needs the rest of its
    length in private pages, less those it holds privately now. Where that
    count may shrink before its fork runs (a fork in this step shares its
    pages first: a cycle, a second fork onto it) it reserves its whole
    length, as a copying fork. A segment whose partial
    last page is shared or registered needs a private copy (R52).
    ``copy_forks`` (a preplan, whose views are built before its forks run):
    its forks copy, as without sharing, into targets whose every page is
    made private at admit (R57).

    Pages, not slots: a windowed stream's released slots hold none (W1), so
    each length is counted past the released prefix the stream has when it
    reaches it: its own, or a fork target's from its source (W5), which a
    copy or a share fills and no more. ``behaviour`` (`StreamTable.behaviour`)
    says what a commit's release leaves a source before its post-forks run
    (W2); without it (no label releases) the count is from before any
    release. A fork target's own released slots are no pages it holds, in
    either sharing setting (issue 27: a fork of a W=7 stream at 400 tokens
    reserved 101 pages, and a post-fork onto a target that had released
    more than its source held reserved none)."""
    # made by this admit, and not yet written by a fork
    unfilled = {k for k in keys if k[1] not in table[k[0]]}
    length: dict[Key, int] = dict(settled or {})

    def length_of(key: Key) -> int:
        if key in length:
            return length[key]
        stream = table[key[0]].get(key[1])
        return stream.stored_len if stream is not None else 0

    # released slots per stream as the step runs: a fork target's become its
    # source's, a windowed writer's grow at the commit
    off: dict[Key, int] = {}

    def off_of(key: Key) -> int:
        if key in off:
            return off[key]
        stream = table[key[0]].get(key[1])
        return stream.released // page_size if stream is not None else 0

    want: dict[Key, int] = {}

    def ask(key: Key, tokens: int) -> None:
        n = pages_for(tokens, page_size) - off_of(key)
        if n > want.get(key, -1):
            want[key] = n

    # a fork target's full pages, shared from its source when the fork runs
    shared_full: dict[Key, int] = {}

    def fork(forks: tuple[tuple[str, str], ...]) -> None:
        for from_label, to_label in forks:
            for rid in padded:
                src = (rid, from_label)
                n = length_of(src)
                if src in unfilled and n == 0:
                    continue  # R20: no source to copy (a padded request without it)
                unfilled.discard((rid, to_label))
                length[(rid, to_label)] = n
                off[(rid, to_label)] = off_of(src)
                shared_full[(rid, to_label)] = n // page_size - off_of(src)
                ask((rid, to_label), n)

    fork(tuple(step.pre_forks))
    for seg in step.segments:
        key = (seg.request_id, seg.label)
        ask(key, length_of(key) + seg.span)
    if step.commit:
        grown = {(g.request_id, g.label): length_of((g.request_id, g.label)) + g.span
                 for g in step.segments}
        length.update(grown)
        for g in step.segments:
            if behaviour is not None and g.span:
                # the commit's release (W2), before post-forks copy
                key = (g.request_id, g.label)
                off[key] = behaviour(g.label).released_after(
                    off_of(key) * page_size, length[key], page_size) // page_size
    fork(tuple(step.post_forks))
    for key in keys:
        want.setdefault(key, 0)
    # the targets sharing their source's full pages (none where forks copy),
    # and those whose private pages may be fewer when their fork runs than
    # now: shared onward before (a fork from it ran first, a cycle) or a
    # target twice
    targets, unsure = sharing.fork_targets((*step.pre_forks, *step.post_forks), padded)
    pre_targets = {(rid, to) for _, to in step.pre_forks for rid in padded}
    writes = {(g.request_id, g.label) for g in step.segments if g.span}
    claims: list[Claim] = []
    cow: list[Key] = []
    privatise: list[tuple[Key, int]] = []
    new_pages = 0
    first_short: Key | None = None
    for (rid, label), n in want.items():
        streams = table[rid]
        stream = streams.get(label)
        key = (rid, label)
        if key not in targets or copy_forks:
            # its own pages, each reused (a copying fork writes into them). A
            # preplan's count is the running commit's too: its release takes
            # as many pages as it adds released slots (R67)
            held = 0 if stream is None else len(stream.page_indices)
        elif key in unsure or key in (settled or {}) or key in writes:
            # its private pages may be fewer when its fork runs (or changed by
            # the running step first, a preplan); or a segment also grows it
            # before a post-fork: every page of its length, as a copying fork
            held = 0 if stream is None or key in unsure or key in (settled or {}) else (
                sharing.private_count(key, stream))
        else:
            # the fork shares the source's full pages: only the rest is private
            held = shared_full.get(key, 0) + (
                sharing.private_count(key, stream) if stream is not None else 0)
        short = n - held
        if (stream is not None and key in writes
                and key not in pre_targets and key not in (settled or {})
                and sharing.cow_needed(key, stream)):
            # the partial page it writes into first is shared or registered
            cow.append(key)
            new_pages += 1
            if first_short is None:
                first_short = key
        if copy_forks and stream is not None and key in targets:
            shared = len(stream.page_indices) - sharing.private_count(key, stream)
            if shared:
                privatise.append((key, shared))
                new_pages += shared
                if first_short is None:
                    first_short = key
        if short > 0:
            new_pages += short
            if first_short is None:
                first_short = key
        claims.append((rid, streams, label, stream, short))
    return settle(claims, new_pages, first_short, free, cow, privatise)


def allocation_failed(new_pages: int, free: int, first_short: Key | None) -> AllocationFailed:
    rid, label = first_short or ("", "")
    return AllocationFailed(
        pages_short=new_pages - free, request_id=rid, label=label,
        message=(f"not enough free pages: step needs {new_pages} new, {free} free "
                 f"(first short: request {rid!r} label {label!r})"),
    )


def request_offloading(rid: str, label: str) -> RequestOffloading:
    return RequestOffloading(
        message=f"request {rid!r} label {label!r} is offloaded or being offloaded; "
        "retry once it is reloaded",
        request_id=rid, label=label,
    )


def retrieve_in_progress(rid: str, label: str) -> RetrieveInProgress:
    return RetrieveInProgress(
        message=f"request {rid!r} label {label!r} is still receiving retrieved KV; "
        "retry once admit_retrieve reports it ready",
        request_id=rid, label=label,
    )
