"""Truncation: a stream cut back to a prefix of its tokens.

What a speculative verify step needs: the step commits every drafted token
it verified, then the engine cuts each stream back to the accepted prefix.
The pages past the new end go back to the allocator and the generation is
bumped, so anything holding the old pages or length (a plan's views, a host
copy, a peer's retrieve) can tell they changed. Runs under the stream
table's lock, which `KVManager.truncate` holds.
"""

from __future__ import annotations

from kvref.core.errors import (
    InvalidArgumentError,
    ReleasedPrefixError,
    StepInFlightError,
    StreamUnavailableError,
)
from kvref.core.stream_table import StreamTable, pages_for
from kvref.core.streams import CacheStream
from kvref.stepping.admission import FAILED, PENDING, retrieve_state


def truncate(table: StreamTable, rid: str, label: str, new_len: int) -> int:
    """See `KVManager.truncate`. Every refusal raises before anything changes."""
    stream = check(table, rid, label, new_len)
    if new_len == stream.stored_len:
        # nothing to cut: the spare pages stay for the next step (R39)
        return 0
    return _cut(table, rid, label, stream, new_len)


def check(table: StreamTable, rid: str, label: str, new_len: int) -> CacheStream:
    """Every refusal of `truncate`, changing nothing; the stream it would cut.
    A hybrid label checks each group's stream before any is cut (H1)."""
    stream = table.stream(rid, label)
    if stream.step_in_flight:
        # the step (or a staged preplan) addresses slots past the new end
        # and would commit its span onto the shorter stream
        raise StepInFlightError("truncate while a step names the stream; commit it first",
                                request_id=rid, label=label)
    if stream.offloaded:
        # its pages are leaving or on the host: the copy's length is the old one
        raise StreamUnavailableError("truncate of a stream an offload claims or holds; "
                                     "reload it first", request_id=rid, label=label)
    state = retrieve_state(stream) if (stream.read_future is not None
                                       or stream.read_error is not None) else None
    if state == PENDING:
        # the transfer is still writing the pages this would free
        raise StreamUnavailableError("truncate while a retrieve is copying into the stream",
                                     request_id=rid, label=label)
    if state == FAILED:
        raise StreamUnavailableError("truncate of a stream whose retrieve failed; reset or "
                                     "remove the request", request_id=rid, label=label)
    # a peer may still be copying the pages this would free (R33)
    table.leases.refuse(rid, "truncate")
    if new_len > stream.stored_len:
        raise InvalidArgumentError(f"truncate to {new_len} tokens; the stream holds "
                                   f"{stream.stored_len}", request_id=rid, label=label)
    behaviour = table.behaviour(label)
    first = behaviour.first_read(new_len)
    if first < stream.released:
        # W6: at the new length attention would read released tokens
        raise ReleasedPrefixError(
            f"truncate to {new_len} tokens: its window ({behaviour}) would start at "
            f"{first}, before the {stream.released} tokens already released",
            request_id=rid, label=label)
    return stream


def _cut(table: StreamTable, rid: str, label: str, stream: CacheStream, new_len: int) -> int:
    # in slots: page_indices holds slot released // ps onward
    keep = pages_for(new_len, table.page_size) - stream.released // table.page_size
    cut = stream.truncate_to(new_len, keep, table.page_size)
    # only pages whose last holder this was go free: a shared one stays
    # with its other holders (R54)
    freed = table.give_back((rid, label), cut)
    table.tails_maybe_shared |= stream.tail_maybe_shared
    return freed
