"""Pages keyed as they fill (S33): the engine hands the manager its own list
of a stream's token ids once (`follow_tokens`), and every commit keys the
pages that filled from it, with no call per page and no ids carried by the
step.

vLLM's request hashes its blocks as tokens are appended to it; an engine
has that list anyway, so the manager reads it only where a page filled,
and a step that fills no page pays one compare per stream
(`CacheStream.key_at`). A commit keys what a `cache_prefix` of the ids
from the stream's chain to its committed length would key, stream by
stream in segment order (the model composes `CachePrefix` into `Commit`
the same way): nothing for a stream an admitted fork will still write
into (S32), which a later commit keys instead. The list holds the tokens
the engine kept: committed tokens past its end (a speculative draft before
its verify) wait until the engine appends them, and ids past the committed
length (the next step's input) are never read (R56).

Each function runs under the stream table's lock, which `KVManager` holds.
"""

from __future__ import annotations

import contextlib
import logging
import struct
from collections.abc import Sequence, Set
from operator import countOf

from kvref.core import page_keys as prefix_hash
from kvref.core.errors import InvalidArgumentError, KVRefError
from kvref.core.page_keys import PageKey
from kvref.core.stream_table import StreamTable
from kvref.core.streams import CacheStream, FollowedTokens
from kvref.prefix import cache as prefix_cache

logger = logging.getLogger(__name__)


def follow_tokens(table: StreamTable, rid: str, label: str, ids: Sequence[int]) -> int:
    """See `KVManager.follow_tokens`: the `cache_prefix` of the committed ids
    now (its checks and refusals), then commits key from ``ids``."""
    try:
        # the engine's own list, read again at every commit: no array
        prefix_hash.check_ids(ids, arrays=False)
    except InvalidArgumentError as err:
        raise InvalidArgumentError(f"follow_tokens: {err}", request_id=rid,
                                   label=label) from None
    stream = table.stream(rid, label)
    n = prefix_cache.cache_prefix(table, rid, label, ids[:stream.stored_len])
    if table.sharing.caches(table.behaviour(label)):
        # a label that registers nothing (W9, or no shared pages at all)
        # would only make every commit look at it for nothing
        space = stream.space
        tail = prefix_hash.encode_extras(prefix_cache.extras_for(table, rid, space or label))
        ps, keyed, stored = table.page_size, len(stream.keys) * table.page_size, stream.stored_len
        # the committed ids past the chain, checked by that cache_prefix: the
        # page they begin is keyed from them as packed here, once (a chain
        # that stops short of the committed full pages, a received stream's,
        # keeps none: its pages are keyed the general way)
        head = b""
        # an id only `token_bytes` packs (a 0-d array, say) leaves none: that
        # page is keyed as any other
        with contextlib.suppress(struct.error, TypeError):
            if 0 < stored - keyed < ps:
                head = prefix_hash.page_packer(stored - keyed)(*ids[keyed:stored])
        stream.follow_with(FollowedTokens(rid, label, ids, space, tail, head, keyed), ps)
    return n


def key_followed(table: StreamTable, due: list[CacheStream],
                 unkeyable: Set[tuple[str, str]]) -> None:
    """A commit's keying of its followed streams ``due`` (segment order, each
    once: R2): each one's full committed pages past its chain, from its ids.
    A decode step's (at most the one page after each chain, ids in a list)
    in one pass and one pool call; anything else stream by stream, as
    `cache_prefix` would key it.

    The pass runs for every page a decode step fills (about 16 at B = 256),
    so its loop reads slots, not properties (`CacheStream.lengths`), calls
    no Python function per page, and looks at the rows of a decode batch
    again by one array store (`CacheStream.extend_followed`)."""
    ps = table.page_size
    pack, count, root_count = prefix_cache.page_fields(ps)
    # the pool's hash (`KVConfig.page_key_hash`): its one-shot digest where
    # it has one, else its constructor's
    h = table.pages.key_hash
    child, new, one_shot, join = prefix_hash.CHILD_FIELD, h.new, h.one_shot, b"".join
    filled: list[CacheStream] = []
    raws: list[bytes] = []
    keys: list[PageKey] = []
    pages: list[int] = []
    # the last page packed: a hybrid request's groups follow one list of ids
    # and fill the same page in the same commit, so each group after the
    # first reuses its bytes (its key still hashes its own label's extras)
    was_ids: object = None
    was_at = -1
    was_head = was_raw = b""
    for stream, n in zip(due, CacheStream.lengths(due), strict=True):
        f = stream.follow
        if f is None or stream.offloaded:
            continue
        if unkeyable and (f.request_id, f.label) in unkeyable:
            continue  # S32: keyed by a commit after the fork ran, not now
        chain = stream.keys
        done = len(chain)
        start = done * ps
        if n < start + ps:
            # the step filled no page (the compare is conservative): looked
            # at again once the page after the chain is full
            stream.look_at(start + ps)
            continue
        ids = f.ids
        slot = done - stream.released // ps  # page_indices starts at the window
        if (n >= start + 2 * ps or type(ids) is not list or f.space is not stream.space
                or stream.received_at is not None or stream.read_future is not None
                or stream.read_error is not None or slot < 0):
            # (the last: a window passed the page; `cache_prefix` keys the chain)
            _key_all(table, due, unkeyable)
            return
        head = f.head
        if head and start != f.head_at:
            head = b""  # this page is not the one the hand-over's ids began
        if ids is was_ids and start == was_at and head == was_head:
            raw = was_raw  # the page the stream before packed, the same way from the same ids
        else:
            if head:
                # the page the hand-over's ids began: only the ids appended
                # since are checked and packed
                have = len(head) // 8
                tokens = ids[start + have:start + ps]
                pk = prefix_hash.page_packer(ps - have)
            else:
                tokens, pk = ids[start:start + ps], pack
            try:
                raw = pk(*tokens)
            except struct.error:
                _key_all(table, due, unkeyable)  # too few ids, or not 64-bit ints: said there
                return
            # a bool packs as 0 or 1: only where an id's low byte is 0 or 1
            # are the types counted, by a C-level pass (as `cache_prefix`'s
            # one-pass path; about one page in five of random ids)
            # (``0 in low``: a bytes operand of ``in`` is first tried as an
            # int, raising and catching a formatted TypeError)
            low = raw[::8]
            if (0 in low or 1 in low) and (
                    countOf(map(type, tokens), int) != len(tokens)):
                _key_all(table, due, unkeyable)
                return
            if head:
                raw = head + raw
            was_ids, was_at, was_head, was_raw = ids, start, head, raw
        filled.append(stream)
        raws.append(raw)
        msg = (join((child, chain[-1], count, raw, f.tail)) if done
               else join((root_count, raw, f.tail)))
        keys.append(one_shot(msg) if one_shot is not None else new(msg).digest())
        pages.append(stream.page_indices[slot])
    if filled:
        # one pool call; each stream whose page took its key extends its
        # chain and is looked at again once the next page is full (a stream
        # past a failure is looked at by the next commit)
        took, err = table.pages.register_filled(pages, keys)
        CacheStream.extend_followed(filled, keys, raws, len(took), ps)
        if err is not None:
            raise err


def _key_all(table: StreamTable, due: list[CacheStream],
             unkeyable: Set[tuple[str, str]]) -> None:
    """A commit's keying that one pass cannot do (more than a page a
    stream, ids not in a list, a fork's label, received KV, a window past
    the page, ids that do not pack): every followed stream of ``due`` keyed
    stream by stream, as `cache_prefix` would, nothing of the pass kept."""
    looked = [s for s in due if s.follow is not None and not s.offloaded and not (
        unkeyable and (s.follow.request_id, s.follow.label) in unkeyable)]
    _key_each(table, looked)
    CacheStream.looked(looked, table.page_size)


def _key_each(table: StreamTable, streams: list[CacheStream]) -> None:
    """`cache_prefix` of each stream's ids from its chain to its committed
    full pages, in order; a refusal keys nothing of that stream."""
    ps = table.page_size
    for stream in streams:
        f = stream.follow
        assert f is not None
        done, full = len(stream.keys), stream.stored_len // ps
        if full <= done:
            continue
        try:
            # a list shorter than the committed tokens keys the pages it
            # covers: the rest hold drafts not yet verified (the engine
            # appends only the tokens it kept), keyed once it appends them
            ids = f.ids[done * ps:full * ps]
            prefix_cache.cache_prefix(table, f.request_id, f.label, ids, done * ps)
        except (KVRefError, TypeError, ValueError, IndexError) as err:
            # the step is committed whatever its ids say: the pages stay
            # unkeyed (a later commit, or a `cache_prefix`, may key them)
            # and the engine hears why here, as the cache_prefix it did not
            # call would have said
            logger.warning("commit could not key pages of request %r label %r from the "
                           "ids it follows: %s", f.request_id, f.label, err)
