"""Chained keys of full pages of tokens, for the prefix cache.

A page's key is ``H(message)``, where ``H`` is the manager's page-key hash
(`KVConfig.page_key_hash`): SHA-256 (32 bytes) by default, or xxHash's
XXH3-128 (16 bytes, `KeyHash`), and the message is, in order (integers are
unsigned 64-bit little-endian unless said otherwise):

1. the parent: ``b"\\x00"`` for a stream's first page, else ``b"\\x01"``
   followed by the previous page's key;
2. the page's token count, then each token id as a *signed* 64-bit
   little-endian integer (the bytes of ``array("q")``, or of a numpy integer
   array cast to ``"<i8"``): no pickling, no ``repr``;
3. the extra keys (a LoRA name, a tenant's ``cache_salt``, a multimodal
   hash: anything else the page's KV depends on or must be kept apart by):
   their count, then for each a tag and a value, each length-prefixed, the
   value after a type byte (``s`` a UTF-8 string, ``b`` bytes, ``i`` a decimal
   integer).

Every field is fixed-size or length-prefixed, so the message is parsed back
uniquely: two different (parent, tokens, extras) never give one message,
and ``(("lora", "a"), ("salt", "bc"))`` never encodes like
``(("lora", "ab"), ("salt", "c"))`` (vLLM 44701 joined untagged extra keys
into one tuple). A collision of two keys is then a collision of ``H``:
for SHA-256 one nobody can construct; XXH3-128 is not built to resist one
crafted on purpose (docs/concepts/shared-pages.md, "Choosing the page-key hash").
Because each key covers its parent's, a key names the whole prefix: a page
hits only under the same tokens before it, and the same extra keys. Only
``H`` differs between the hashes: the message is the same bytes.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvref.core.errors import InvalidArgumentError, InvalidConfigError

DIGEST_SIZE = 32  # SHA-256's, the default hash's; `KeyHash.digest_size` per hash
PageKey = bytes
ExtraValue = str | bytes | int
ExtraKeys = Sequence[tuple[str, ExtraValue]]
Tokens = Sequence[int] | np.ndarray[Any, Any]

_ROOT = b"\x00"
_CHILD = b"\x01"
# the parent field's prefixes, for a caller that builds a page's message itself
ROOT_FIELD, CHILD_FIELD = _ROOT, _CHILD


class _Digest(Protocol):
    def digest(self) -> bytes: ...


@dataclass(frozen=True)
class KeyHash:
    """A page-key hash: ``new(message).digest()`` is a page's key.

    The hashlib-style constructor, not a one-shot function, because SHA-256
    has none: a wrapper would cost the default a Python call per page, and
    the loops that key pages call ``new`` directly."""

    name: str
    new: Callable[[bytes], _Digest]
    digest_size: int
    # ``new(message).digest()`` in one call, where the package has one: what
    # keying a page as it fills calls (xxHash's costs half its constructor's)
    one_shot: Callable[[bytes], bytes] | None = None


SHA256 = KeyHash("sha256", hashlib.sha256, 32)
# name -> (module, constructor, its one-shot digest, digest size, the extra
# that installs the module)
_OPTIONAL = {"xxh3_128": ("xxhash", "xxh3_128", "xxh3_128_digest", 16, "fast-hash")}
# the names `KVConfig.page_key_hash` takes, the default first
PAGE_KEY_HASHES = ("sha256", *_OPTIONAL)
_LOADED: dict[str, KeyHash] = {"sha256": SHA256}


def key_hash_named(name: str) -> KeyHash:
    """The page-key hash named ``name`` (one of `PAGE_KEY_HASHES`).

    `InvalidConfigError` for another name, naming the choices, and for a
    hash whose package is not installed, naming the extra that installs it."""
    got = _LOADED.get(name) if isinstance(name, str) else None
    if got is not None:
        return got
    if not isinstance(name, str) or name not in _OPTIONAL:
        raise InvalidConfigError(
            f"KVConfig.page_key_hash must be one of {list(PAGE_KEY_HASHES)}, got {name!r}")
    module, attr, one_shot, size, extra = _OPTIONAL[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as err:
        raise InvalidConfigError(
            f"KVConfig.page_key_hash={name!r} needs the {module!r} package: "
            f"pip install 'kvref[{extra}]' (or pip install {module})") from err
    got = _LOADED[name] = KeyHash(name, getattr(mod, attr), size, getattr(mod, one_shot))
    return got


def _u64(n: int) -> bytes:
    return n.to_bytes(8, "little")


def encode_extras(extras: ExtraKeys) -> bytes:
    """The tagged, length-prefixed encoding of the extra keys (field 3)."""
    # the very tuple encoded before (a stream's, `extras_for` keeps one per
    # salt and label): found by identity, no check of its items
    seen = _BY_ID.get(id(extras))
    if seen is not None and seen[0] is extras:
        return seen[1]
    # a stream's extras are the same on every call: encoded once. Only exact
    # types are cached, since True == 1 and "a" == a str subclass would share
    # an entry while one of them encodes otherwise (or is refused)
    if type(extras) is tuple and all(
            type(item) is tuple and len(item) == 2 and type(item[0]) is str
            and type(item[1]) in _PLAIN for item in extras):
        got = _encoded_extras(extras)
        if len(_BY_ID) >= 4096:
            _BY_ID.clear()  # bounded: a workload of many salts re-encodes, not grows
        # the entry holds the tuple, so its id is not reused while it is here
        _BY_ID[id(extras)] = (extras, got)
        return got
    return _encode_extras(extras)


_PLAIN = (str, bytes, int)
_BY_ID: dict[int, tuple[object, bytes]] = {}


@functools.lru_cache(maxsize=4096)
def _encoded_extras(extras: tuple[tuple[str, ExtraValue], ...]) -> bytes:
    return _encode_extras(extras)


def _encode_extras(extras: ExtraKeys) -> bytes:
    out = [_u64(len(extras))]
    for item in extras:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise InvalidArgumentError(f"an extra key is a (tag: str, value) pair, got {item!r}")
        tag, value = item
        if isinstance(value, str):
            kind, raw = b"s", value.encode()
        elif isinstance(value, bytes):
            kind, raw = b"b", value
        elif isinstance(value, int) and not isinstance(value, bool):
            kind, raw = b"i", str(value).encode()
        else:
            raise InvalidArgumentError(
                f"extra key {tag!r}: the value must be str, bytes or int, got "
                f"{type(value).__name__}")
        t = tag.encode()
        out += [_u64(len(t)), t, kind, _u64(len(raw)), raw]
    return b"".join(out)


# the usual ids, passed by one type check (`check_ids` runs on every
# `cache_prefix` of a decode step)
_ID_LISTS = frozenset({list, tuple})


def check_ids(tokens: object, *, arrays: bool = True) -> None:
    """Raise `InvalidArgumentError` naming what ``tokens`` is unless it is a
    sequence of ids that can be read more than once and has a length: a
    list, a tuple, any other `Sequence` but a ``str`` or ``bytes``, and
    where ``arrays``, a 1-D numpy array or torch tensor. Whether the items
    are 64-bit integers is `token_bytes`' business. Every call that takes
    token ids checks them here, so None, an iterator or a bare int is a
    typed misuse, not a ``TypeError`` from ``len``, and is found before
    anything is touched."""
    if type(tokens) in _ID_LISTS:
        return
    if arrays and isinstance(tokens, np.ndarray):
        return  # its dtype and shape: `token_bytes`
    if arrays and _is_tensor(tokens):
        ndim = getattr(tokens, "ndim", None)
        if ndim != 1:
            raise InvalidArgumentError(f"token_ids must be a 1-D tensor of ids, got a tensor "
                                       f"of {ndim} dimensions")
        return
    if isinstance(tokens, str | bytes | bytearray) or not isinstance(tokens, Sequence):
        what = "None" if tokens is None else type(tokens).__name__
        if isinstance(tokens, Iterator):
            # a generator would be read once by the length and again by the hash
            what += " (an iterator: pass the ids as a list)"
        kinds = ("a list, a tuple, a 1-D integer array or tensor" if arrays
                 else "a list (or another sequence) the engine extends")
        raise InvalidArgumentError(f"token_ids must be a sequence of ids ({kinds}), got "
                                   f"{what}")


def _is_tensor(tokens: object) -> bool:
    # by its module, so this module needs no torch; a Parameter is one too
    return type(tokens).__module__.split(".", 1)[0] == "torch"


def token_bytes(tokens: Tokens) -> bytes:
    """Token ids as signed 64-bit little-endian integers, back to back;
    `InvalidArgumentError` for anything else (`check_ids`)."""
    check_ids(tokens)
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise InvalidArgumentError(
                f"token_ids must be a 1-D integer array, got {tokens.dtype} of shape "
                f"{tokens.shape}")
        if tokens.dtype == np.uint64 and tokens.size and int(tokens.max()) >= 1 << 63:
            raise InvalidArgumentError("a token id does not fit in a signed 64-bit integer")
        return np.ascontiguousarray(tokens, dtype="<i8").tobytes()
    if str(getattr(tokens, "dtype", "")) == "torch.bool":
        raise InvalidArgumentError("token_ids must be integer ids, got a torch bool tensor "
                                   "(a mask passed as ids?)")
    n = len(tokens)
    if n < _LONG or type(tokens) not in (list, tuple):
        _refuse_bools(tokens)
    try:  # struct packs a list twice as fast as array("q") does, here
        # a page's worth (every cache_prefix of a decode step) by a kept Struct
        raw = (_PAGE_PACK.get(n) or struct.Struct(f"<{n}q")).pack(*tokens)
    except (struct.error, TypeError) as err:
        _refuse_bools(tokens)
        raise InvalidArgumentError(f"token ids must be 64-bit integers: {err}") from None
    if n >= _LONG and type(tokens) in (list, tuple):
        # a prompt: a bool packs as 0 or 1, so only the items packed as 0 or
        # 1 are looked at, not the type of every id (a set of 2,048 types
        # cost as much as hashing the prompt)
        # read unsigned, a negative id is past 1: an id below 2 is 0 or 1.
        # The minimum first: a prompt with no such id (most) pays one pass
        words = np.frombuffer(raw, dtype="<u8")
        if words.min() < 2 and any(type(tokens[i]) is not int
                                   for i in np.flatnonzero(words < 2).tolist()):
            _refuse_bools(tokens)
    return raw


# from this many ids a list is checked for bools after packing (`token_bytes`)
_LONG = 64


def _refuse_bools(tokens: Tokens) -> None:
    """Raise if `tokens` holds a bool. A bool is an int subclass that struct
    packs as 0 and 1: refused, as every other call refuses a bool where it
    takes an int (one C-level pass)."""
    kinds = set(map(type, tokens))
    if kinds == _INTS:  # plain ints, the usual ids: one comparison
        return
    if bool in kinds or np.bool_ in kinds or (
            # torch scalars in a list (a tensor's own dtype was checked): a
            # 0-d bool tensor, as ``list(mask)`` gives, packs as 0 or 1
            getattr(tokens, "dtype", None) is None
            and any(k.__module__.startswith("torch") for k in kinds)
            and any(str(getattr(t, "dtype", "")) == "torch.bool" for t in tokens)):
        raise InvalidArgumentError("token_ids must be integer ids, got a bool among them "
                                   "(a mask passed as ids?)")


_INTS = {int}


# the page sizes engines use, each packed by a Struct built once
_PAGE_PACK = {n: struct.Struct(f"<{n}q") for n in (1, 8, 16, 32, 64, 128, 256)}


def page_packer(page_size: int) -> Callable[..., bytes]:
    """``pack(*ids)``: ``page_size`` ids as `token_bytes` encodes them, for
    ints already checked to be plain ints (raises struct.error past 64 bits
    or for another count of ids)."""
    got = _PAGE_PACK.get(page_size)
    if got is None:
        if len(_PAGE_PACK) >= 4096:
            _PAGE_PACK.clear()  # bounded: sizes are a page's or less, a handful
        got = _PAGE_PACK[page_size] = struct.Struct(f"<{page_size}q")
    return got.pack


def page_count_field(page_size: int) -> bytes:
    """The token-count field of a full page's message (field 2)."""
    return _u64(page_size)


def _parent_field(parent: PageKey | None, h: KeyHash = SHA256) -> bytes:
    if parent is None:
        return _ROOT
    if not isinstance(parent, bytes) or len(parent) != h.digest_size:
        raise InvalidArgumentError(
            f"a parent key is the {h.digest_size}-byte {h.name} key of the previous page, "
            f"got {parent!r:.80}")
    return _CHILD + parent


def page_key(parent: PageKey | None, tokens: Tokens, extras: ExtraKeys = (), *,
             key_hash: KeyHash = SHA256) -> PageKey:
    """The key of one page holding `tokens`, after the page keyed `parent`."""
    tb = token_bytes(tokens)
    return key_hash.new(b"".join((_parent_field(parent, key_hash), _u64(len(tb) // 8), tb,
                                  encode_extras(extras)))).digest()


def _chain_setup(tokens: Tokens, page_size: int, extras: ExtraKeys,
                 parent: PageKey | None, pages: int | None, encoded: bytes | None,
                 h: KeyHash) -> tuple[int, bytes, bytes, bytes, int, bytes, bytes]:
    """What hashing a chain needs: the number of pages, the ids encoded once
    (only what is hashed), the count and extras fields, the page's byte
    length, and the first page's parent field split in two: its prefix byte
    and the parent key (empty for a root). The loops hash each page's
    message as one join of five parts, the parent key among them, so no
    parent field is built per page."""
    if page_size <= 0:
        raise InvalidArgumentError(f"page_size must be positive, got {page_size}")
    check_ids(tokens)  # before its length is read
    n = len(tokens) // page_size
    if pages is not None:
        n = min(n, max(pages, 0))
    if n == 0:
        return 0, b"", b"", b"", 8 * page_size, b"", b""  # nothing to hash
    # bytes, not a memoryview: a page's slice copies 8 * page_size bytes,
    # which costs less than making a view object per page (a view of what
    # was given first, so an int is refused as before, not made zero bytes)
    tb = (token_bytes(tokens[:n * page_size]) if encoded is None
          else encoded if type(encoded) is bytes else bytes(memoryview(encoded)))
    field = _parent_field(parent, h)
    return n, tb, _u64(page_size), encode_extras(extras), 8 * page_size, field[:1], field[1:]


def iter_page_keys(tokens: Tokens, page_size: int, extras: ExtraKeys = (), *,
                   parent: PageKey | None = None, pages: int | None = None,
                   encoded: bytes | None = None, key_hash: KeyHash = SHA256
                   ) -> Iterator[PageKey]:
    """The chained keys of the whole pages of `tokens` (at most `pages` of
    them), lazily: a caller that stops at the first miss hashes no further.
    The tokens and the extra keys are encoded once for the whole chain;
    ``encoded``: `token_bytes` of `tokens`, where the caller has it already."""
    n, tb, count, tail, step, kind, prev = _chain_setup(tokens, page_size, extras, parent,
                                                        pages, encoded, key_hash)
    new, join = key_hash.new, b"".join
    for i in range(0, n * step, step):
        key = new(join((kind, prev, count, tb[i:i + step], tail))).digest()
        yield key
        kind, prev = _CHILD, key


def page_keys(tokens: Tokens, page_size: int, extras: ExtraKeys = (), *,
              parent: PageKey | None = None, pages: int | None = None,
              encoded: bytes | None = None, key_hash: KeyHash = SHA256) -> list[PageKey]:
    """`iter_page_keys` as a list: what an engine computes once per prompt
    (one loop, no generator to resume per page: a fifth less per prompt)."""
    n, tb, count, tail, step, kind, prev = _chain_setup(tokens, page_size, extras, parent,
                                                        pages, encoded, key_hash)
    return _chain(tb, n, step, count, tail, kind, prev, key_hash)


def packed_page_keys(encoded: bytes, page_size: int, extras: ExtraKeys = (), *,
                     parent: PageKey | None = None, key_hash: KeyHash = SHA256
                     ) -> list[PageKey]:
    """`page_keys` of ids already packed (``encoded``, `token_bytes` of
    them, checked by whoever packed them): the keys of the whole pages it
    holds, with no list of ids to check or slice."""
    step = 8 * page_size
    field = _parent_field(parent, key_hash)
    return _chain(encoded, len(encoded) // step, step, _u64(page_size), encode_extras(extras),
                  field[:1], field[1:], key_hash)


def _chain(tb: bytes, n: int, step: int, count: bytes, tail: bytes, kind: bytes, prev: bytes,
           key_hash: KeyHash) -> list[PageKey]:
    """The chained keys of the ``n`` pages of ``step`` bytes each at the head
    of ``tb``, the first after the parent field ``kind + prev``."""
    if n <= 0:
        return []
    new, join = key_hash.new, b"".join
    # the first page apart: every later one's parent field is the child byte
    # and the key before it, so the loop keeps no parent field of its own
    key = new(join((kind, prev, count, tb[:step], tail))).digest()
    out: list[PageKey] = [key]
    add, child = out.append, _CHILD
    for i in range(step, n * step, step):
        key = new(join((child, key, count, tb[i:i + step], tail))).digest()
        add(key)
    return out


def cached_head(index: Mapping[PageKey, int], tokens: Tokens, page_size: int,
                extras: ExtraKeys = (), *, pages: int | None = None,
                encoded: bytes | None = None, key_hash: KeyHash = SHA256
                ) -> tuple[list[int], list[PageKey]]:
    """The longest run of `tokens`' first pages (at most `pages`) whose keys
    ``index`` maps: the pages it maps them to, and the keys. Hashed page by
    page, stopping at the first miss, as a walk of `iter_page_keys` would."""
    n, tb, count, tail, step, kind, prev = _chain_setup(tokens, page_size, extras, None,
                                                        pages, encoded, key_hash)
    found: list[int] = []
    keys: list[PageKey] = []
    if not n:
        return found, keys
    new, join, find = key_hash.new, b"".join, index.get
    # the first page apart, as `_chain`: the loop's parent field is the
    # child byte and the key before it
    key = new(join((kind, prev, count, tb[:step], tail))).digest()
    p = find(key)
    if p is None:
        return found, keys
    found.append(p)
    keys.append(key)
    add_page, add_key, child = found.append, keys.append, _CHILD
    for i in range(step, n * step, step):
        key = new(join((child, key, count, tb[i:i + step], tail))).digest()
        p = find(key)
        if p is None:
            break
        add_page(p)
        add_key(key)
    return found, keys


def next_page_key(parent: PageKey | None, encoded: bytes, extras: ExtraKeys = (), *,
                  key_hash: KeyHash = SHA256) -> PageKey:
    """The key of the one page whose ids `encoded` holds (`token_bytes`),
    after the page keyed `parent`: `page_key` without encoding the ids again,
    for a page that just filled (`KVManager.cache_prefixes`)."""
    return key_hash.new(b"".join((_parent_field(parent, key_hash), _u64(len(encoded) // 8),
                                  encoded, encode_extras(extras)))).digest()
