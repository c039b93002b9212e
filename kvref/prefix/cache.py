"""The prefix cache over a manager's streams: find cached pages for a new
prompt (`match_prefix`), keep a stream's committed full pages findable
(`cache_prefix`), and forget them all (`reset_prefix_cache`).

The engine names token ids; the manager never sees them otherwise. So the
engine says which tokens are committed and final (`cache_prefix` after a
commit, a speculative draft only once its verify step kept it), and the
manager refuses what it can check: ids for tokens the stream has not
committed, and ids that disagree with those it named before for a page it
keyed. KV computed from other tokens than the ones named cannot be
detected here; the engine owns that contract (specs/shared-pages.md, R56).

Each function runs under the stream table's lock, which `KVManager` holds.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence, Set
from operator import countOf

from kvref import validate
from kvref.core import page_keys as prefix_hash
from kvref.core.errors import InvalidArgumentError, StepInFlightError, StreamUnavailableError
from kvref.core.page_keys import ExtraKeys, PageKey, Tokens
from kvref.core.page_pool import ResetRefused
from kvref.core.stream_table import StreamTable
from kvref.core.streams import CacheStream
from kvref.stepping.admission import IDLE, retrieve_state


def extras_for(table: StreamTable, rid: str, space: str) -> ExtraKeys:
    """The extra keys every page of a stream is hashed with: its request's
    cache salt, its engine's tagged extra keys, and the label whose KV it
    holds (its own, or for a fork target its source's). Two labels may hold
    different KV for the same token ids (a draft model's stream beside the
    target's), so a hit never crosses them; a forked sample holds its
    source's KV and keys like it."""
    cfg = table.overrides.get(rid)
    salt = cfg.cache_salt if cfg is not None else None
    # the engine's tagged keys (`KVReqConfig.extra_keys`), between the salt
    # and the label; their tags are never "salt" or "label"
    extra = cfg.extra_keys if cfg is not None else ()
    return _extras(salt, extra, space)


def _extras(salt: str | None, extra: tuple[tuple[str, str | bytes | int], ...],
            space: str) -> ExtraKeys:
    # one tuple per (salt, extras, label), so the keys' encoding of it is
    # found by identity (`prefix_hash.encode_extras`): encoded once, not per call
    got = _EXTRAS.get((salt, extra, space))
    if got is None:
        if len(_EXTRAS) >= 4096:
            _EXTRAS.clear()  # bounded: many salts rebuild, not grow
        got = _EXTRAS[(salt, extra, space)] = (
            ((("salt", salt),) if salt is not None else ()) + extra + (("label", space),))
    return got


_EXTRAS: dict[tuple[str | None, tuple[tuple[str, str | bytes | int], ...], str],
              ExtraKeys] = {}


def _settled(stream: CacheStream, rid: str, label: str, call: str) -> None:
    """Raise unless the stream's pages are resident and no copy writes them."""
    if stream.offloaded:
        raise StreamUnavailableError(f"{call} of a stream an offload claims or holds; "
                                     "reload it first", request_id=rid, label=label)
    # a copy that has landed leaves the stream settled: its outcome is read
    # off the future here, as a readiness check would (observe() reports
    # such a stream idle, and so must these calls)
    if retrieve_state(stream) != IDLE:
        raise StreamUnavailableError(f"{call} of a stream a retrieve copies into (or failed "
                                     "to)", request_id=rid, label=label)


def encoded_ids(tokens: Tokens, rid: str, label: str, call: str) -> bytes:
    """`prefix_hash.token_bytes` of a call's ids, a misuse of them raised
    naming the call, the request and the label."""
    try:
        return prefix_hash.token_bytes(tokens)
    except InvalidArgumentError as err:
        raise InvalidArgumentError(f"{call}: {err}", request_id=rid, label=label) from None


def match_prefix(table: StreamTable, rid: str, label: str, tokens: Tokens) -> int:
    """See `KVManager.match_prefix`."""
    # encoded once: the check of every id, the hashes and the stream's
    # record; ids that are not ids are refused first, as the API table says
    raw = encoded_ids(tokens, rid, label, "match_prefix")
    streams = table.request(rid)
    stream = _matchable(table, streams, rid, label)
    table.leases.refuse(rid, "match_prefix")
    if stream is None:
        # as an admit naming it would (R16): the engine's next call names it
        stream = streams[label] = CacheStream()
    if len(tokens) < 2 or not table.sharing.caches(table.behaviour(label)):
        # W10: a windowed label never hits (its stream computes its prompt);
        # nothing does without shared pages
        return 0
    key = (rid, label)
    hit = table.pages.match(key, tokens, extras_for(table, rid, stream.space or label),
                            encoded=raw)
    n = hit.num_tokens
    if not n:
        return 0
    # an empty stream's pages are spare and private to it: they follow the hit
    stream.attach_prefix(list(hit.pages), n, list(hit.keys), raw[:n * 8])
    return n


def match_prefix_groups(table: StreamTable, rid: str, labels: Sequence[str],
                        tokens: Tokens) -> int:
    """`KVManager.match_prefix` of a hybrid label whose group streams are
    ``labels``: the longest hit every group serves (H2 of specs/retention.md),
    whole pages in each, at most ``len(tokens) - 1`` tokens, the same tokens
    attached in each. A full-attention group serves ``h`` tokens if every
    page before ``h`` is cached; a window group if the pages its window reads
    at ``h`` are, and its slots before them hold no page. The lookup goes
    past a gap: a later hit point stands where an earlier page was evicted.
    Every check of every group passes before any page is attached."""
    raw = encoded_ids(tokens, rid, labels[0], "match_prefix")
    streams = table.request(rid)
    found = [_matchable(table, streams, rid, lb) for lb in labels]
    table.leases.refuse(rid, "match_prefix")
    for lb, stream in zip(labels, found, strict=True):
        if stream is None:
            streams[lb] = CacheStream()  # R16, in every group (H1)
    behaviours = [table.behaviour(lb) for lb in labels]
    ps = table.page_size
    most = (len(raw) // 8 - 1) // ps  # S8: the last token is always computed
    if most <= 0 or not all(table.sharing.caches(b) for b in behaviours):
        return 0
    chains: list[list[PageKey]] = []
    cached: list[list[int | None]] = []
    for lb in labels:
        extras = extras_for(table, rid, streams[lb].space or lb)
        keys = prefix_hash.page_keys(tokens, ps, extras, pages=most, encoded=raw,
                                     key_hash=table.pages.key_hash)
        chains.append(keys)
        cached.append([table.pages.cached_page(k) for k in keys])

    def first_read(i: int, n: int) -> int:
        # the first slot group i's window reads at n tokens (0: full attention)
        return min(n // ps, behaviours[i].released_after(0, n, ps) // ps)

    def serves(n: int) -> bool:
        return all(p is not None for i, got in enumerate(cached)
                   for p in got[first_read(i, n):n // ps])

    pages = most
    while pages and not serves(pages * ps):
        pages -= 1
    if not pages:
        return 0
    n = pages * ps
    for i, lb in enumerate(labels):
        lo = first_read(i, n)
        got = [p for p in cached[i][lo:pages] if p is not None]
        table.pages.attach((rid, lb), got)
        streams[lb].attach_prefix(got, n, chains[i][:pages], raw[:n * 8], released=lo * ps)
    return n


def _matchable(table: StreamTable, streams: dict[str, CacheStream], rid: str, label: str
               ) -> CacheStream | None:
    """`match_prefix`'s refusals of one stream, changing nothing; the stream
    (None: the request lacks it, and the hit makes it)."""
    stream = streams.get(label)
    if stream is not None:
        if stream.step_in_flight:
            # the admitted step writes from the stream's length, 0, and would
            # overwrite what the hit attached
            raise StepInFlightError("match_prefix onto a stream a step names; commit it "
                                    "first", request_id=rid, label=label)
        _settled(stream, rid, label, "match_prefix")
        if stream.stored_len:
            raise InvalidArgumentError(
                f"match_prefix onto a stream that holds {stream.stored_len} tokens: a hit "
                "attaches a prompt's first pages, so only to an empty stream",
                request_id=rid, label=label)
    return stream


def cache_prefix(table: StreamTable, rid: str, label: str, tokens: Tokens,
                 start: int = 0) -> int:
    """See `KVManager.cache_prefix`."""
    if type(tokens) is list and len(tokens) == table.page_size:
        # the page after the chain, as an engine keying pages as they fill
        # names it: the one-pass path costs a third less per call (issue 28);
        # anything it does not take, a misuse included, the general path
        # decides. The caller has refused a fork target already.
        fast = one_page_each(table, [(rid, label, tokens, start)], frozenset())
        if fast is not None:
            return fast[0]
    todo = _checked(table, rid, label, tokens, start)
    return 0 if todo is None else _register(table, todo)


def cache_prefixes(table: StreamTable, calls: Sequence[tuple[str, str, Tokens, int]],
                   fork_targets: Set[tuple[str, str]]) -> list[int]:
    """See `KVManager.cache_prefixes`: every call checked before any pages are
    keyed (S31), so a misuse in one changes nothing. ``fork_targets``: the
    streams an admitted fork will still write into (R57, S32, as `cache_prefix`)."""
    fast = one_page_each(table, calls, fork_targets) if type(calls) is list else None
    if fast is not None:
        return fast
    if isinstance(calls, str | bytes) or not isinstance(calls, Sequence):
        raise InvalidArgumentError(
            f"cache_prefixes takes a sequence of (request_id, label, token_ids, start), "
            f"got {type(calls).__name__}")
    todo: list[_Todo | None] = []
    named: set[tuple[str, str]] = set()
    for i, call in enumerate(calls):
        if not isinstance(call, tuple) or len(call) != 4:
            raise InvalidArgumentError(
                f"cache_prefixes entry {i}: a (request_id, label, token_ids, start) tuple, "
                f"got {call!r:.80}")
        rid, label, tokens, start = call
        validate.request_id(rid, "cache_prefixes")
        validate.label(label, "cache_prefixes", rid)
        if (rid, label) in named:
            # the second would check against the state the first leaves
            raise InvalidArgumentError(f"cache_prefixes entry {i} names the stream a "
                                       "previous entry names", request_id=rid, label=label)
        named.add((rid, label))
        if (rid, label) in fork_targets:
            raise StepInFlightError(
                f"cache_prefixes entry {i}: a stream an admitted fork will still write "
                "into; commit that step first (R57, S32)", request_id=rid, label=label)
        todo.append(_checked(table, rid, label, tokens, start))
    filled = _pages_that_filled(table, todo)
    if filled is not None:
        return filled
    return [0 if t is None else _register(table, t) for t in todo]


def _pages_that_filled(table: StreamTable, todo: list[_Todo | None]) -> list[int] | None:
    """`_register` of each, when each names just the page after its stream's
    chain (a decode step's batch): their keys registered by one pool call,
    not one per stream. None, doing nothing, when any names more."""
    ps = table.page_size
    keyed: list[tuple[CacheStream, bytes, PageKey]] = []
    for t in todo:
        if t is None:
            continue
        stream, rid, label, _, raw, start = t
        if len(raw) != 8 * ps or start != len(stream.keys) * ps:
            return None
        if len(stream.keys) < stream.released // ps:
            return None  # a window passed the page: the general path keys the chain only
        parent = stream.keys[-1] if stream.keys else None
        keyed.append((stream, raw, prefix_hash.next_page_key(
            parent, raw, extras_for(table, rid, stream.space or label),
            key_hash=table.pages.key_hash)))
    made = key_filled(table, [st for st, _, _ in keyed], [raw for _, raw, _ in keyed],
                       [key for _, _, key in keyed],
                       [st.page_indices[len(st.keys) - st.released // ps]
                        for st, _, _ in keyed])
    counts = iter(made)
    return [0 if t is None else next(counts) for t in todo]


def key_filled(table: StreamTable, streams: list[CacheStream], raws: list[bytes],
                keys: list[PageKey], pages: list[int]) -> list[int]:
    """Register each stream's page that just filled (``pages[i]``, ids
    ``raws[i]``) under its key, in one pool call; returns per entry 1 if
    the page became findable here, else 0. S23 counts a page only if this
    call made it findable: not one keyed before (a hit), nor one passed
    over because another page has its key; a fork's two streams naming one
    shared page count it once (the second finds the key the first gave it)."""
    took, err = table.pages.register_filled(pages, keys)
    # as `_register` entry by entry: the ones before a failure keep their
    # key (one transition over them all: a call per page was a tenth of its cost)
    done = len(took)
    CacheStream.extend_chains(streams[:done], keys[:done], raws[:done])
    if err is not None:
        raise err
    return took


def one_page_each(table: StreamTable, calls: Sequence[object],
                   fork_targets: Set[tuple[str, str]]) -> list[int] | None:
    """`cache_prefixes` of a decode step's batch, each entry naming, as a list
    of ints, just the page after its stream's chain, every check of
    `_checked` passed: one pass that hashes each page and one pool call that
    registers them all, no record per entry. None, changing nothing, when
    any entry is otherwise (the general path then decides, and raises what
    it finds).

    What entries of one label share (its behaviour; its extra keys' encoding
    where the request has none of its own) is looked up when the label
    changes, not per entry: the per-entry work, not the hash, was most of a
    page's cost (issue 28)."""
    ps = table.page_size
    if not calls or not table.sharing.shares:
        return None  # without shared pages no label keys: the general path says 0
    pack, count, root_count = page_fields(ps)
    child = prefix_hash.CHILD_FIELD
    streams_of = table.streams
    overrides = table.overrides
    behaviour = table.behaviour
    caches = table.sharing.caches
    filled: list[CacheStream] = []
    raws: list[bytes] = []
    keys: list[PageKey] = []
    pages: list[int] = []
    # the pool's hash (`KVConfig.page_key_hash`), its constructor called per page
    new, join = table.pages.key_hash.new, b"".join
    # the label of the entry before, found cacheable (a batch names one
    # label, the same object, throughout), and the encoding of its extra
    # keys for a request with none of its own
    last_label: object = None
    label_tail = b""
    # nothing is changed before every entry passed: a check that raises
    # (an entry of other than four, an unknown request or label, an id a page
    # does not pack) hands the batch to the general path, which decides
    try:
        for call in calls:
            if type(call) is not tuple:
                return None
            rid, label, tokens, start = call
            if type(rid) is not str or type(start) is not int or type(tokens) is not list:
                return None
            stream = streams_of[rid][label]
            if stream.offloaded or stream.received or (
                    stream.read_future is not None or stream.read_error is not None):
                return None
            chain = stream.keys
            done = len(chain)
            if start != done * ps or start + ps > stream.stored_len:
                return None
            if label is not last_label:
                if type(label) is not str or not caches(behaviour(label)):
                    return None
                last_label = label
                label_tail = _LABEL_TAILS.get(label) or _label_tail(label)
            if fork_targets and (rid, label) in fork_targets:
                return None
            raw = pack(*tokens)  # struct.error: not a page of 64-bit ints
            # a bool packs as 0 or 1 (a Python, numpy or torch one), which the
            # general path refuses: only where an id's low byte is 0 or 1 are
            # the types counted (a slice and a translate of the packed bytes
            # cost less than a type per id)
            if len(raw[::8].translate(None, b"\x00\x01")) != ps and (
                    countOf(map(type, tokens), int) != ps):
                return None
            cfg = overrides.get(rid)  # every request has one (`ingest_request`)
            if stream.space is None and (
                    cfg is None or (cfg.cache_salt is None and not cfg.extra_keys)):
                tail = label_tail
            else:
                tail = prefix_hash.encode_extras(extras_for(table, rid, stream.space or label))
            filled.append(stream)
            raws.append(raw)
            slot = done - stream.released // ps  # page_indices starts at the window
            if slot < 0:
                return None  # a window passed the page: the general path keys the chain
            keys.append(new(join((child, chain[-1], count, raw, tail)) if done
                            else join((root_count, raw, tail))).digest())
            pages.append(stream.page_indices[slot])
    except (KeyError, TypeError, ValueError, struct.error):
        return None
    if len(set(filled)) != len(filled):
        return None  # a stream named twice: the general path refuses it
    return key_filled(table, filled, raws, keys, pages)


def page_fields(ps: int) -> tuple[Callable[..., bytes], bytes, bytes]:
    """The packer of a page of ``ps`` ids, the count field, and the root
    parent field followed by it: what hashing one page as it fills needs."""
    fields = _PAGE_FIELDS.get(ps)
    if fields is None:
        count = prefix_hash.page_count_field(ps)
        fields = _PAGE_FIELDS[ps] = (prefix_hash.page_packer(ps), count,
                                     prefix_hash.ROOT_FIELD + count)
    return fields


def _label_tail(label: str) -> bytes:
    """The encoded extra keys of a stream of ``label`` (not a fork target
    keyed by its source's label) whose request has no salt and no extras:
    kept once per label."""
    if len(_LABEL_TAILS) >= 4096:
        _LABEL_TAILS.clear()  # bounded, as `_EXTRAS`
    tail = _LABEL_TAILS[label] = prefix_hash.encode_extras(_extras(None, (), label))
    return tail


# page size -> (`prefix_hash.page_packer`, the count field, the root parent
# field followed by the count field)
_PAGE_FIELDS: dict[int, tuple[Callable[..., bytes], bytes, bytes]] = {}
# label -> the encoded extra keys of a stream of it with no salt and no extras
_LABEL_TAILS: dict[str, bytes] = {}


# what `_checked` found to key: the stream, its key, the ids, where they start
_Todo = tuple[CacheStream, str, str, Tokens, bytes, int]


def _checked(table: StreamTable, rid: str, label: str, tokens: Tokens, start: int
             ) -> _Todo | None:
    """`cache_prefix`'s checks, changing nothing: None if it keys nothing."""
    stream = table.stream(rid, label)
    ps = table.page_size
    if isinstance(start, bool) or not isinstance(start, int) or start < 0 or start % ps:
        raise InvalidArgumentError(f"cache_prefix start={start!r}: a whole number of pages "
                                   f"(a multiple of {ps}) at or after 0",
                                   request_id=rid, label=label)
    raw = encoded_ids(tokens, rid, label, "cache_prefix")
    end = start + len(raw) // 8
    _settled(stream, rid, label, "cache_prefix")
    if end > stream.stored_len:
        # a draft not yet verified, or a step not yet committed: its KV may
        # still change (vLLM PRs 18668, 19006 cached draft tokens)
        raise InvalidArgumentError(
            f"cache_prefix names tokens up to {end}; the stream has committed "
            f"{stream.stored_len}", request_id=rid, label=label)
    keyed = len(stream.keys) * ps
    if start > keyed:
        raise InvalidArgumentError(
            f"cache_prefix from token {start}: the stream's cached pages end at {keyed}, "
            "and a page's key chains from the one before it", request_id=rid, label=label)
    if not table.sharing.caches(table.behaviour(label)):
        # W9: a windowed label registers nothing, so its window's release
        # frees pages blank and never pushes cached prefixes out (vLLM 42948);
        # nothing does without shared pages
        return None
    # the ids of pages already keyed must be the ones they were keyed with
    overlap = min(end, keyed)
    if raw[: (overlap - start) * 8] != stream.key_tokens[start * 8: overlap * 8]:
        raise InvalidArgumentError(
            f"cache_prefix names tokens {start}..{overlap - 1} otherwise than the stream's "
            "cached pages hold them (a hit or an earlier cache_prefix)",
            request_id=rid, label=label)
    own = stream.received_at
    if own is not None and end > own:
        # R55: the page a retrieve's first token is in, and every page after
        # it, hold a peer's KV; the pages before it are this stream's own
        end = max(start, own - own % ps)
        raw = raw[:(end - start) * 8]
    if end // ps <= len(stream.keys):
        return None
    return stream, rid, label, tokens, raw, start


def _register(table: StreamTable, todo: _Todo) -> int:
    """Key the full pages `_checked` found past the stream's chain."""
    stream, rid, label, _, raw, start = todo
    ps = table.page_size
    keyed = len(stream.keys) * ps
    full = (start + len(raw) // 8) // ps
    extras = extras_for(table, rid, stream.space or label)
    # page_indices holds slot `off` onward: a window's released slots hold
    # no page, and their keys only carry the chain (H3)
    off = stream.released // ps
    if len(stream.keys) < off:
        return _register_past_window(table, todo, extras, off)
    if full * ps - keyed == ps and start == keyed and len(raw) == 8 * ps:
        # the page that just filled, named alone (a decode step's): one hash
        # of the bytes as given, no slicing of the ids
        key = prefix_hash.next_page_key(stream.keys[-1] if stream.keys else None, raw,
                                        extras, key_hash=table.pages.key_hash)
        done, keyed_now, err = table.pages.register_chain(
            stream.page_indices[len(stream.keys) - off:full - off], [key])
        # on a failure the key it gave stays, and no token ids are added
        stream.extend_chain([key] if done else [], raw if err is None else b"")
        if err is not None:
            raise err
        return keyed_now
    fresh_raw = raw[(keyed - start) * 8:(full * ps - start) * 8]
    parent = stream.keys[-1] if stream.keys else None
    # hashed from the bytes already checked above: not encoded again, and
    # no slice of the ids made only to be checked again
    new_keys = prefix_hash.packed_page_keys(fresh_raw, ps, extras, parent=parent,
                                            key_hash=table.pages.key_hash)
    # one pass under the pool's lock for the whole run of pages
    done, keyed_now, err = table.pages.register_chain(
        stream.page_indices[len(stream.keys) - off:full - off], new_keys)
    # deduplicated or not, the key names these tokens: the chain goes on
    stream.extend_chain(new_keys[:done], fresh_raw if err is None else b"")
    if err is not None:
        raise err
    # the pages findable because of this call (S23): a page passed over
    # under another page's key makes nothing new findable
    return keyed_now


def _register_past_window(table: StreamTable, todo: _Todo, extras: ExtraKeys,
                          off: int) -> int:
    """`_register` of a window's stream whose chain stops before its
    released slots: the keys of those carry the chain only (their pages
    went back blank, H3), then the live pages are keyed from the chain."""
    stream, rid, label, tokens, raw, start = todo
    ps = table.page_size
    keyed = len(stream.keys)
    upto = min(off, (start + len(raw) // 8) // ps)
    ids = raw[(keyed * ps - start) * 8:(upto * ps - start) * 8]
    parent = stream.keys[-1] if stream.keys else None
    stream.extend_chain(_chain_of(table, ids, extras, parent), ids)
    if (start + len(raw) // 8) // ps <= off:
        return 0
    return _register(table, (stream, rid, label, tokens, raw, start))


def _chain_of(table: StreamTable, ids: bytes, extras: ExtraKeys, parent: PageKey | None
              ) -> list[PageKey]:
    """The chained keys of the whole pages whose ids ``ids`` holds, packed."""
    return prefix_hash.packed_page_keys(ids, table.page_size, extras, parent=parent,
                                        key_hash=table.pages.key_hash)


def reset_prefix_cache(table: StreamTable) -> int | ResetRefused:
    """See `KVManager.reset_prefix_cache`. Refused while a stream is offloaded
    or claimed for offload (S30): its host copy holds KV computed before the
    reset, which a reload brings back and `cache_prefix` would key again,
    so a later match would find it. An offload claim marks its streams
    ``offloaded``, so one flag covers both."""
    away = sum(s.offloaded for streams in table.streams.values() for s in streams.values())
    if away:
        held = table.pages.capacity - table.pages.num_free
        return ResetRefused(held, f"{away} streams are offloaded or being offloaded; "
                                  "reload or remove them first", streams_offloaded=away)
    return table.pages.reset_prefix_cache()
