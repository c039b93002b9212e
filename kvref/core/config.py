"""Static shape of a KV cache and per-request label routing."""

from __future__ import annotations

import copy as _copy
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvref.core.errors import InvalidConfigError
from kvref.core.page_keys import PAGE_KEY_HASHES, key_hash_named

if TYPE_CHECKING:
    from kvref.core.groups import AttentionGroup


class KVLayout(enum.Enum):
    """Order of the (page_size, heads) axes inside a page.

    NHD: ``[layers, pages, 2, page_size, heads, head_dim]``
    HND: ``[layers, pages, 2, heads, page_size, head_dim]``
    FlashInfer takes either, per layer, as ``kv_layout="NHD" | "HND"``.
    """

    NHD = "NHD"
    HND = "HND"


def _is_int(value: object) -> bool:
    # bool is an int subclass, and True pages or heads is a typo, not a count
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(name: str, value: object) -> None:
    _int_at_least(name, value, 1, "")


def _int_at_least(name: str, value: object, low: int, why: str) -> None:
    if not _is_int(value):
        raise InvalidConfigError(
            f"KVConfig.{name} must be an int, got {type(value).__name__} {value!r}"
        )
    assert isinstance(value, int)
    if value < low:
        raise InvalidConfigError(
            f"KVConfig.{name} must be >= {low}, got {value}" + (f" ({why})" if why else "")
        )


def _labels(name: str, labels: object) -> tuple[str, ...]:
    if isinstance(labels, str) or not isinstance(labels, Sequence) or not all(
        isinstance(label, str) for label in labels
    ):
        raise InvalidConfigError(
            f"KVReqConfig.{name} must be a sequence of str labels, got {labels!r}"
        )
    return tuple(labels)


# the most pages a cache may have: page ids travel as int32 in FlashInfer's page
# tables (and kvref's plans), so a cache of more could not be addressed
MAX_NUM_PAGES = 2**31

# what `KVConfig.publish_lease_s` is unless given: vLLM's P/D connector frees a
# producer's blocks the same 480 s after its consumer went quiet
# (VLLM_NIXL_ABORT_REQUEST_TIMEOUT); finite, so a consumer that dies does not
# pin the publisher's pages until the process ends (R49)
DEFAULT_PUBLISH_LEASE_S = 480.0


@dataclass(frozen=True)
class RetentionPolicy:
    """FIFO retention of ``context_budget`` tokens: a sliding window (issue 19).

    A label `KVConfig.retention` maps to a policy keeps only its last
    ``context_budget`` committed tokens resident: after each commit, every
    page lying wholly before the window's first token ``max(0, n - W)`` is
    released (W2 of specs/retention.md). A model whose attention layer has
    ``sliding_window = S`` (a query sees itself and ``S - 1`` tokens before
    it) configures ``context_budget = S``; its attention masks with
    `window_left` ``= S - 1``.

    ``rollback_margin`` k keeps k tokens more than the window before
    releasing (pages wholly before ``max(0, n - W - k)`` go), so a
    speculative step may commit up to k draft tokens and truncate the
    rejected ones: a truncate is checked against W alone (W6, W15). Raising W
    instead would not do: the truncate check would grow with it.
    """

    context_budget: int
    rollback_margin: int = 0

    def __post_init__(self) -> None:
        if not _is_int(self.context_budget) or self.context_budget < 1:
            raise InvalidConfigError(
                f"RetentionPolicy.context_budget must be an int >= 1, got "
                f"{self.context_budget!r}")
        if not _is_int(self.rollback_margin) or self.rollback_margin < 0:
            raise InvalidConfigError(
                f"RetentionPolicy.rollback_margin must be an int >= 0, got "
                f"{self.rollback_margin!r}")

    @property
    def window_left(self) -> int:
        """Tokens before a query's own position that attention may read:
        ``context_budget - 1`` (FlashInfer's ``window_left``)."""
        return self.context_budget - 1


@dataclass
class KVConfig:
    """The static shape of one KV cache, and its lease timeout.

    Validated at construction (`validate`); a field of the wrong type or
    range raises `InvalidConfigError`, so does ``max_num_pages`` above
    `MAX_NUM_PAGES`. Whether the cache fits the device and the host is
    checked where the device is known, by `KVManager`'s constructor, before
    anything is allocated.

    A `KVManager` keeps a private, validated copy (`copy`, or `sharded` under
    tensor parallelism): changing this object after the manager was built
    changes nothing in that manager; ``manager.config`` is the copy it runs on.

    ``publish_lease_s``: seconds a `publish` lease pins the request's pages
    before it expires on its own (R34); `DEFAULT_PUBLISH_LEASE_S` (480 s)
    unless given, None for no deadline (until `release_published`; R49).

    ``page_key_hash``: the hash of the prefix cache's page keys, one of
    `PAGE_KEY_HASHES`: ``"sha256"`` (the default; cryptographic: nobody can
    craft a prompt whose page key is another prompt's) or ``"xxh3_128"``
    (xxHash, several times faster per page, not built to resist such a
    crafted prompt; ``pip install 'kvref[fast-hash]'``). The chain and the
    message hashed are the same; only the digest differs. Keys never cross
    managers, so engines exchanging KV need not agree
    (docs/concepts/shared-pages.md).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_seq_len: int
    # includes the sink page: a cache of N pages hands out N - 1
    max_num_pages: int
    page_size: int
    num_qo_heads: int
    layout: KVLayout = KVLayout.NHD
    cpu_offload_pages: int = 0
    # seconds a `publish` lease pins the request before it expires on its own
    # (R34); None: until `release_published`. A finite default (R49): a
    # consumer that dies must not pin the publisher's pages forever
    publish_lease_s: float | None = DEFAULT_PUBLISH_LEASE_S
    # shared pages: forks share their source's full pages (copy on write),
    # and `cache_prefix` / `match_prefix` keep and find full pages of
    # committed tokens. On by default, as vLLM's enable_prefix_caching; off,
    # every page has one holder and forks copy every page
    enable_prefix_caching: bool = True
    # label -> its sliding window (issue 19, specs/retention.md); a label
    # absent is full attention. Empty: nothing is windowed
    retention: Mapping[str, RetentionPolicy] = field(default_factory=dict)
    # a hybrid model's attention groups (`kvref.core.groups`, issue 40): each
    # a set of layers of one type whose pages hold only those layers. Empty:
    # one full-attention group of every layer, each page all of them
    groups: Sequence[AttentionGroup] = ()
    # the prefix cache's page-key hash (`PAGE_KEY_HASHES`): SHA-256 unless an
    # engine that needs no cryptographic keys asks for the fast one
    page_key_hash: str = "sha256"
    # the tensor-parallel degree the head counts were divided by; 1 = unsharded
    sharded_by: int = field(default=1, init=False)

    def __post_init__(self) -> None:
        # the enum's name as a string is what a YAML or JSON config holds
        if isinstance(self.layout, str) and not isinstance(self.layout, KVLayout):
            try:
                self.layout = KVLayout(self.layout)
            except ValueError:
                raise InvalidConfigError(
                    f"KVConfig.layout must be one of {[m.value for m in KVLayout]}, "
                    f"got {self.layout!r}"
                ) from None
        self.validate()

    def validate(self) -> None:
        """Raise `InvalidConfigError` unless every field is usable.

        Run at construction and again by `copy`: a dataclass field can be
        reassigned between the two, and a manager must not be built from a
        config that stopped being valid.
        """
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size", "num_qo_heads",
                     "max_seq_len"):
            _positive_int(name, getattr(self, name))
        _int_at_least("max_num_pages", self.max_num_pages, 2,
                      "page 0 is the sink, so one page leaves nothing to allocate")
        if self.max_num_pages > MAX_NUM_PAGES:
            raise InvalidConfigError(
                f"KVConfig.max_num_pages must be <= {MAX_NUM_PAGES} (2**31: page ids are "
                f"int32 in the page tables), got {self.max_num_pages}")
        _int_at_least("cpu_offload_pages", self.cpu_offload_pages, 0, "")
        if not isinstance(self.enable_prefix_caching, bool):
            raise InvalidConfigError(
                f"KVConfig.enable_prefix_caching must be a bool, got "
                f"{type(self.enable_prefix_caching).__name__} {self.enable_prefix_caching!r}")
        _positive_int("sharded_by", self.sharded_by)
        if not isinstance(self.retention, Mapping) or not all(
                isinstance(k, str) and isinstance(v, RetentionPolicy)
                for k, v in self.retention.items()):
            raise InvalidConfigError(
                f"KVConfig.retention must map str labels to RetentionPolicy, got "
                f"{self.retention!r}")
        from kvref.core.groups import check_groups  # it builds on this module
        if isinstance(self.groups, (str, bytes)) or not isinstance(self.groups, Sequence):
            raise InvalidConfigError(f"KVConfig.groups must be a sequence, got {self.groups!r}")
        check_groups(self.groups, self.num_layers, self.page_size)
        if self.groups and self.retention:
            # a group's window is its layers'; a label's would cut every group
            raise InvalidConfigError(
                "KVConfig.retention names label windows; with groups, give each group its "
                "retention (AttentionGroup.retention) instead")
        if not isinstance(self.page_key_hash, str) or self.page_key_hash not in PAGE_KEY_HASHES:
            raise InvalidConfigError(
                f"KVConfig.page_key_hash must be one of {list(PAGE_KEY_HASHES)}, got "
                f"{self.page_key_hash!r}")
        key_hash_named(self.page_key_hash)  # its package missing: the extra to install
        lease = self.publish_lease_s
        if lease is not None and (isinstance(lease, bool) or not isinstance(lease, (int, float))
                                  or not lease > 0):
            raise InvalidConfigError(
                f"KVConfig.publish_lease_s must be None or seconds > 0, got {lease!r}")
        if not isinstance(self.layout, KVLayout):
            raise InvalidConfigError(
                f"KVConfig.layout must be a KVLayout, got {type(self.layout).__name__} "
                f"{self.layout!r}"
            )
        if self.num_qo_heads % self.num_kv_heads:
            raise InvalidConfigError(
                f"num_qo_heads {self.num_qo_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}"
            )

    def copy(self) -> KVConfig:
        """An independent, validated copy (sharding included) a resource can own."""
        # copy.copy keeps `sharded_by`, which dataclasses.replace would reset
        # (it is not an __init__ field); every field is an immutable value
        dup = _copy.copy(self)
        dup.validate()
        # the mapping is the one mutable field: the copy owns its own
        dup.retention = dict(self.retention)
        dup.groups = tuple(self.groups)
        return dup

    def sharded(self, n: int) -> KVConfig:
        """A copy with the head counts divided across ``n`` tensor-parallel ranks.

        Leaves this config as it is: the caller's config stays the whole
        model's, and the copy is the one resource's private view.
        """
        return self.copy().shard(n)

    def shard(self, n: int) -> KVConfig:
        """Divide the head counts across ``n`` tensor-parallel ranks, once, in place.

        Idempotent: every resource built from one config calls this, and a
        second division would size the cache for heads this rank does not own.
        """
        _positive_int("shard", n)
        if n == self.sharded_by:
            return self
        if self.sharded_by != 1:
            raise InvalidConfigError(
                f"KVConfig already sharded by {self.sharded_by}; cannot reshard by {n}"
            )
        if self.num_kv_heads % n or self.num_qo_heads % n:
            raise InvalidConfigError(
                f"cannot shard {self.num_kv_heads} kv heads / {self.num_qo_heads} "
                f"qo heads across {n} ranks"
            )
        self.num_kv_heads //= n
        self.num_qo_heads //= n
        self.sharded_by = n
        return self

    def window(self, label: str) -> int | None:
        """The label's retention window W in tokens, or None (full attention)."""
        policy = self.retention.get(label)
        return None if policy is None else policy.context_budget

    @property
    def layers_per_page(self) -> int:
        """The layers one page holds: a group's (every group has as many), or
        every layer without groups."""
        return len(self.groups[0].layers) if self.groups else self.num_layers

    @property
    def usable_pages(self) -> int:
        return self.max_num_pages - 1


# tags kvref keys every page with itself: an engine's extra key cannot pose as one
RESERVED_TAGS = frozenset({"salt", "label"})


def _extra_keys(value: object) -> tuple[tuple[str, str | bytes | int], ...]:
    if isinstance(value, str | bytes) or not isinstance(value, tuple | list):
        raise InvalidConfigError(f"KVReqConfig.extra_keys must be a tuple of (tag, value) "
                                 f"pairs, got {type(value).__name__}")
    out: list[tuple[str, str | bytes | int]] = []
    for item in value:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise InvalidConfigError(f"KVReqConfig.extra_keys: each is a (tag, value) pair, "
                                     f"got {item!r:.80}")
        tag, v = item
        if not isinstance(tag, str) or not tag or tag in RESERVED_TAGS:
            raise InvalidConfigError(
                f"KVReqConfig.extra_keys: a tag is a non-empty str other than "
                f"{sorted(RESERVED_TAGS)} (kvref's own), got {tag!r:.80}")
        if isinstance(v, bool) or type(v) not in (str, bytes, int):
            raise InvalidConfigError(
                f"KVReqConfig.extra_keys[{tag!r}]: a value is a str, bytes or int, got "
                f"{type(v).__name__}")
        out.append((tag, v))
    return tuple(out)


@dataclass(frozen=True)
class KVReqConfig:
    """Which labels of a request a (node, graph walk) reads, and the keys its
    pages are cached under.

    ``labels`` maps ``(node, walk)`` to its labels; ``(node, "*")`` matches any
    walk of that node. Anything unmapped reads ``default_labels``.

    ``cache_salt``: the tenant; only requests with the same salt share
    cached pages. ``extra_keys``: ``(tag, value)`` pairs for whatever else
    the KV depends on (``("lora", "adapter-7")``, ``("mm", image_hash)``,
    ``("mm_offset", 12)``), a value a ``str``, ``bytes`` or ``int``; tagged
    in every page key, so two kinds never collide. The tags ``salt`` and
    ``label`` are kvref's own: `InvalidConfigError`, as for any other
    malformed pair.
    """

    labels: Mapping[tuple[str, str], tuple[str, ...]] = field(default_factory=dict)
    default_labels: tuple[str, ...] = ("main",)
    # the tenant's key into the prefix cache: its pages are found only by
    # requests with the same salt, so one tenant cannot learn another's
    # prompts from how fast its own are admitted (an extra key of every
    # page hash, kvref.prefix.keys)
    cache_salt: str | None = None
    # what else this request's KV depends on, each tagged with its kind: a
    # LoRA adapter (("lora", "adapter-7")), each multimodal input's hash and
    # offset (("mm", b"<hash>"), ("mm_offset", 12)). Hashed into every page
    # key with its tag, so two kinds never collide whatever their values
    # (vLLM 44701 joined untagged extras); encoded once per request
    extra_keys: tuple[tuple[str, str | bytes | int], ...] = ()

    def __post_init__(self) -> None:
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise InvalidConfigError(
                f"KVReqConfig.cache_salt must be a str or None, got "
                f"{type(self.cache_salt).__name__}")
        object.__setattr__(self, "extra_keys", _extra_keys(self.extra_keys))
        # a bare str is a sequence too, and would route the labels "m", "a", ...
        object.__setattr__(self, "default_labels", _labels("default_labels", self.default_labels))
        if not isinstance(self.labels, Mapping):
            raise InvalidConfigError(
                f"KVReqConfig.labels must be a mapping, got {type(self.labels).__name__}"
            )
        routed: dict[tuple[str, str], tuple[str, ...]] = {}
        for key, labels in self.labels.items():
            if not (isinstance(key, tuple) and len(key) == 2
                    and all(isinstance(k, str) for k in key)):
                raise InvalidConfigError(
                    f"KVReqConfig.labels keys are (node, walk) pairs of str, got {key!r}"
                )
            routed[key] = _labels(f"labels[{key!r}]", labels)
        object.__setattr__(self, "labels", routed)

    def get_labels(self, node: str, walk: str) -> tuple[str, ...]:
        found = self.labels.get((node, walk))
        if found is None:
            found = self.labels.get((node, "*"), self.default_labels)
        return found


@dataclass
class KVSpec:
    """What an engine's resource registry hands `KVManager.build`."""

    config: KVConfig
    resource_key: str = "kv"
