"""The abstract stream-lifecycle model: state, actions, results and `step`.

Porcupine style: `Model(scope).init()` gives the first state and
`Model.step(state, action)` is a pure function to `(result, next_state)`.
Nothing else.  It is the one model of kvref: a stream holds page identities
from the pool model (`kvref_model.pages`: holders, free-cached LRU,
free-blank FIFO, chained keys), a length and a tuple of token identities.
Copy-on-write forks and the prefix cache (`Scope.sharing`) and per-label
windows with a rollback margin (`Scope.windows`, `Scope.margins`) are
settings of the scope; with them off the model is the page-counting
lifecycle model it was (tests/model/test_one_model.py checks that, state for
state).  Generations, locks and tensors are left out on purpose.  Each
action is one critical section of the manager, and its result is what the
manager must return.

The rules kvref departs from the reference by (specs/rules.md)
are class attributes, so `kvref_model.reference` can switch them off and the
checker can show what each one prevents.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from kvref_model import pages as pool_model

_T = TypeVar("_T")
# per class: its field names (in order, and as a set), or None where
# `replace` must not copy them itself
_FIELD_NAMES: dict[type, tuple[tuple[str, ...], frozenset[str]] | None] = {}


def replace(obj: _T, /, **changes: Any) -> _T:
    """`dataclasses.replace`, for the model's frozen dataclasses at a third of
    its cost (the checker calls it about once a transition): a new object
    with the same fields, `changes` applied.  Only the fields are copied, so
    nothing an object caches in its __dict__ (State's hash) carries over.  A
    class with more than plain init fields (InitVar, init=False, a
    __post_init__, slots) goes through `dataclasses.replace`."""
    cls: Any = type(obj)
    if cls in _FIELD_NAMES:
        names = _FIELD_NAMES[cls]
    else:
        plain = (dataclasses.is_dataclass(cls) and not hasattr(cls, "__post_init__")
                 and not hasattr(cls, "__slots__") and hasattr(obj, "__dict__")
                 and all(f.init for f in dataclasses.fields(cls)))
        order = tuple(f.name for f in dataclasses.fields(cls)) if plain else ()
        names = _FIELD_NAMES[cls] = (order, frozenset(order)) if plain else None
    if names is None or not names[1].issuperset(changes):
        return dataclasses.replace(obj, **changes)  # type: ignore[type-var]
    new = object.__new__(cls)
    d, src = new.__dict__, obj.__dict__
    if len(src) == len(names[0]):
        d.update(src)  # nothing cached beside the fields: one C-level copy
    else:
        for name in names[0]:
            d[name] = src[name]
    d.update(changes)
    return new  # type: ignore[no-any-return]


Key = tuple[int, int]  # (request, label); label 0 is "main"
Tokens = tuple[int, ...]  # token identities, one per stored position

MAIN = 0
# offload state of one stream
RESIDENT, CLAIMED, OFFLOADED = "", "claimed", "offloaded"
# retrieve state of one stream (the failure is latched)
IDLE, PENDING, FAILED = "", "pending", "failed"
# phase of an admitted step
ADMITTED, PLANNED, WRITTEN = "admitted", "planned", "written"

LABEL_NAMES = ("main", "cfg", "draft", "aux")
# the identity of a position a commit counted that no write filled (a step
# committed before it was planned or written): its bytes are unspecified
UNWRITTEN = -1


class ProtocolError(Exception):
    """An event that cannot happen in this state: only the environment's
    actions have preconditions (a retrieve completing needs one running).
    Every call of the manager's API has a result in every state."""


@dataclass(frozen=True)
class Scope:
    requests: int = 2
    labels: int = 2
    # the default scope: every call in every state (the total protocol), every
    # action fires and every invariant's interesting case arises within depth
    # 6 (a reload of retrieved tokens needs six calls); host_pages=1 so a copy
    # can find the pool full; findings.md uses page_size=2 scopes
    device_pages: int = 3  # usable pages; the sink is extra and never counted
    host_pages: int = 1
    page_size: int = 1
    max_span: int = 1
    depth: int = 6  # 0: explore until no new state
    # the settings of KVConfig the model is checked under (off: today's
    # lockstep configuration). sharing: copy-on-write forks and the prefix
    # cache; windows: each label's retention window W (None: full attention),
    # () for none; margins: each windowed label's rollback margin k; salts:
    # each request's cache_salt (() : one salt for all)
    sharing: bool = False
    windows: tuple[int | None, ...] = ()
    margins: tuple[int, ...] = ()
    salts: tuple[str, ...] = ()
    # hybrid models (H1-H5, specs/retention.md): each attention group's
    # window, None for full attention; () is one full group, every config
    # before groups. With groups a label's stream is one stream per group
    # (internal label `label * len(groups) + group`), `windows` stays () and
    # `margins` are the groups'
    groups: tuple[int | None, ...] = ()
    # a windowed stream keys its pages and hits (H2-H4); off: W9 and W10,
    # kept for comparison
    window_cache: bool = False
    # another engine's pool, stated as the pool model's settings
    # (kvref_model.pages.Scope; docs/verification/vllm-hybrid-coordinator.md):
    # one key names several pages (no dedup), and freed blank pages go to the
    # front of the free queue. Off: kvref's rules
    duplicates: bool = False
    blank_to_front: bool = False
    # chunked local attention (Llama 4; H7 of specs/retention.md): the groups,
    # by index into `groups`, whose number is a chunk C rather than a window
    # W. A chunk is a window whose start moves by whole chunks: the next token
    # of a stream n long reads from n // C * C, not from max(0, n - W)
    chunked: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if any(not 0 <= g < len(self.groups) or self.groups[g] is None for g in self.chunked):
            raise ValueError(f"Scope.chunked {self.chunked}: each names a group with a "
                             f"number (its chunk), of groups {self.groups}")

    @property
    def group_count(self) -> int:
        return max(1, len(self.groups))

    @property
    def windowed(self) -> bool:
        """Whether some stream has a window (a label's, or a group's)."""
        # asked on every admit: no generator (a group's window is None or an int)
        return bool(self.windows) or self.groups.count(None) != len(self.groups)

    def window(self, label: int) -> int | None:
        if self.groups:  # an internal label: its group's window
            return self.groups[label % len(self.groups)]
        return self.windows[label] if label < len(self.windows) else None

    def margin(self, label: int) -> int:
        if self.groups:
            label %= len(self.groups)
        return self.margins[label] if label < len(self.margins) else 0

    def chunk(self, label: int) -> bool:
        """Whether the (internal) label's group is chunked local attention."""
        return bool(self.chunked) and label % len(self.groups) in self.chunked

    def first_read(self, label: int, n: int) -> int:
        """The first token the next token of a stream ``n`` long reads (W1,
        H7): 0 under full attention, max(0, n - W) under a window, the
        chunk's start n // C * C under a chunk."""
        w = self.window(label)
        if w is None:
            return 0
        return n // w * w if self.chunk(label) else max(0, n - w)

    def first_kept(self, label: int, n: int) -> int:
        """The first token a commit to ``n`` tokens keeps (W2, W15, H7): what
        the next token would read ``k`` (the margin) tokens back."""
        return self.first_read(label, max(0, n - self.margin(label)))


# ---------------------------------------------------------------- state


@dataclass(frozen=True)
class Stream:
    pages: int = 0  # device pages held: a high-water count (the non-zero entries of table)
    stored_len: int = 0
    contents: Tokens = ()  # logical tokens, kept while the stream is on host
    in_flight: bool = False
    offload: str = RESIDENT
    retrieve: str = IDLE
    # the page ids it holds in slot order, 0 for a slot the window released
    # (the sink is never a stream's, so 0 names no page); an offloaded stream
    # keeps only its released slots. () in an abstract read-back (`project`)
    table: tuple[int, ...] = ()
    # offloaded (sharing): the full-page slots whose page was keyed when the
    # offload committed. The host copy remembers those keys (each is the
    # chain of its tokens, so the slot says which); a reload re-attaches the
    # ones still cached (S29). () otherwise
    keyed: tuple[int, ...] = ()
    # (sharing) its first full pages whose keys it has worked out: keyed by
    # its CachePrefix, found by a hit, or passed over because another page
    # had the key. A CachePrefix goes on from there and never retries those
    # (S23, as vLLM's cached-block count); a fork target takes its source's;
    # a truncate, a reset or an offload commit cuts it (`Model.step`)
    chain: int = 0
    # (sharing) the engine handed its list of the stream's ids (S33): every
    # commit that grows the stream keys its full pages past the chain, as
    # its CachePrefix would. Kept through truncates, forks into it, resets
    # and offloads, as the engine's list is; gone with the stream
    followed: bool = False


NO_STREAM = Stream()  # a stream not there yet (frozen: one value serves every lookup)


@dataclass(frozen=True)
class Seg:
    rid: int
    label: int
    span: int


@dataclass(frozen=True)
class Step:
    segments: tuple[Seg, ...]
    pre_forks: tuple[tuple[int, int], ...] = ()
    post_forks: tuple[tuple[int, int], ...] = ()
    padded: tuple[int, ...] = ()  # ctx.padded_request_ids
    commit: bool = True


@dataclass(frozen=True)
class Pending:
    """An admitted step (the running one, or the staged preplan)."""

    step: Step
    phase: str
    marks: frozenset[Key]  # the in-flight marks this step owns
    # preplan only: what clear_preplan restores. None: a label the preplan
    # invented (removed with its pages); else a pre-fork target's contents
    undo: tuple[tuple[Key, Tokens | None], ...] = ()
    # the streams this admit created (R16): a fork from one of them that is
    # still empty copies nothing (R20); a cleared preplan removes them (I9)
    fresh: frozenset[Key] = frozenset()
    # the pre-forks ran (at plan, or at a plan that faulted): neither a
    # retried plan nor the commit of an unplanned step runs them again
    forked: bool = False
    # a preplan over the running step (R41): the lengths it was built from for
    # the streams both name, what that step leaves once it commits as admitted;
    # promotion checks them (R42)
    basis: tuple[tuple[Key, int], ...] = ()
    # admitted as a preplan with forks, sharing on (kept at promotion): its
    # views name pages built before its forks ran, so they copy (R57)
    preplanned: bool = False


@dataclass(frozen=True)
class Offload:
    """An offload between claim and commit/abandon."""

    claimed: tuple[tuple[int, int], ...]  # (label, pages held at claim)
    copied: frozenset[int] = frozenset()
    touched: bool = False  # a claimed stream changed: the generation guard fails
    # (label, host pages) of each copy, counted when it ran: the copy holds
    # them until the commit or abandon, whatever a reset or remove of the
    # claimed stream does to its window's released slots meanwhile (I6)
    hosted: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, eq=True, unsafe_hash=False)
class State:
    free: int
    streams: tuple[tuple[Key, Stream], ...] = ()  # sorted by key
    host: tuple[tuple[Key, Tokens], ...] = ()  # host copies, sorted by key
    current: Pending | None = None
    staged: Pending | None = None
    offloads: tuple[tuple[int, Offload], ...] = ()
    # requests whose publication is leased to a peer (R33): pinned until released
    leases: tuple[int, ...] = ()
    # the device pages (kvref_model.pages): holders, keys, LRU and blank queue;
    # `free` is its free count. None in an abstract read-back (`project`)
    pool: pool_model.State | None = None

    def __hash__(self) -> int:
        # cached: the checker hashes each state many times (dict keys)
        h: int | None = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.free, self.streams, self.host, self.current, self.staged,
                      self.offloads, self.leases, self.pool))
            object.__setattr__(self, "_hash", h)
        return h

    def stream_map(self) -> dict[Key, Stream]:
        # a fresh dict every call (callers change theirs), copied from one kept
        # with the state: a step asks several times, and a copy is the cheaper
        got: dict[Key, Stream] | None = self.__dict__.get("_map")
        if got is None:
            got = dict(self.streams)
            object.__setattr__(self, "_map", got)
        return got.copy()

    def requests(self) -> set[int]:
        got: frozenset[int] | None = self.__dict__.get("_requests")  # kept, as `_map`
        if got is None:
            got = frozenset([k[0] for k, _ in self.streams])
            object.__setattr__(self, "_requests", got)
        return set(got)

    def offload_of(self, rid: int) -> Offload | None:
        return dict(self.offloads).get(rid)


def project(s: State) -> State:
    """The state as the page-counting lifecycle model states it: page ids
    and the pool left out (what `kvref.testing`'s abstract read-back of kvref
    gives, and what the features-off equivalence test compares)."""
    return replace(s, pool=None, streams=tuple((k, replace(v, table=(), keyed=()))
                                               for k, v in s.streams))


def _sorted(d: dict[Key, Stream]) -> tuple[tuple[Key, Stream], ...]:
    return tuple(sorted(d.items()))


# -------------------------------------------------------------- actions


@dataclass(frozen=True)
class Ingest:
    rid: int


@dataclass(frozen=True)
class Admit:
    step: Step
    preplan: bool = False


@dataclass(frozen=True)
class Plan:
    preplan: bool = False
    fork_error: bool = False  # the first fork copy that runs raises


@dataclass(frozen=True)
class Write:
    """attention writes K/V for the planned (running) step's segments"""


@dataclass(frozen=True)
class Read:
    """attention reads back the slots the planned (running) step writes"""


@dataclass(frozen=True)
class Commit:
    """commit the running step"""

    fork_error: bool = False  # the first post-fork copy that runs raises


@dataclass(frozen=True)
class ClearPreplan:
    pass


@dataclass(frozen=True)
class OffloadClaim:
    rid: int


@dataclass(frozen=True)
class OffloadCopy:
    rid: int
    label: int
    copy_error: bool = False  # a host copy that raises
    # with groups: the copy of one group's stream of the label (None: every
    # group's in turn, the label's copy). kvref copies each group's stream in
    # its own critical sections, so a concurrent run is checked one group's
    # copy at a time (H1); the label's copy is exactly its groups' in order
    group: int | None = None


@dataclass(frozen=True)
class OffloadCommit:
    rid: int


@dataclass(frozen=True)
class OffloadAbandon:
    rid: int


@dataclass(frozen=True)
class Reload:
    rid: int
    copy_error: bool = False  # a host-to-device copy raises


@dataclass(frozen=True)
class Publish:
    rid: int


@dataclass(frozen=True)
class RetrieveStart:
    """admit_retrieve of info published by another manager: `length` tokens
    (0: nothing published, `None` handed in: a readiness check)"""

    rid: int
    label: int
    length: int
    start_error: bool = False  # the transfer engine raises starting the copy
    # with start_error, on a label of groups: the fault strikes the last
    # group's copy once the groups before it started theirs (H1: every group
    # latched failed); without it, the first copy the call starts (R26)
    late: bool = False
    # the publication handed in is stale: its source stream's generation moved
    # since publish (the peer changed, released or reused those pages; R35)
    stale: bool = False


@dataclass(frozen=True)
class RetrieveComplete:
    rid: int
    label: int
    ok: bool
    # the publisher's stream moved while the copy read it (its lease released
    # or expired, then reset or reused): the copy's second read catches it (R35)
    moved: bool = False


@dataclass(frozen=True)
class Reset:
    rid: int
    free: bool


@dataclass(frozen=True)
class Remove:
    rid: int


@dataclass(frozen=True)
class Truncate:
    """cut a stream back to its first ``new_len`` tokens (a speculative
    verify step keeping its accepted prefix)"""

    rid: int
    label: int
    new_len: int


@dataclass(frozen=True)
class ReleasePublished:
    """the consumer releases the lease `publish` took (R34)"""

    rid: int


@dataclass(frozen=True)
class LeaseTimeout:
    """the clock passes the lease deadline: every lease taken so far expires
    (the clock moves only here, so they share one deadline; R34)"""


# --- the prefix cache (Scope.sharing; specs/shared-pages.md)


@dataclass(frozen=True)
class CachePrefix:
    """cache_prefix(rid, label): register the stream's full pages of committed
    tokens under their chained keys (S23); ``drafts``: ids the engine names
    past the committed length (a speculative draft before its verify), a
    misuse (S23, R56)"""

    rid: int
    label: int
    drafts: int = 0
    # the ids named from this token on (S34): a whole number of pages, at
    # most where the stream's chain ends; what it names before that is
    # checked against the chain, not keyed again
    start: int = 0


@dataclass(frozen=True)
class FollowTokens:
    """follow_tokens(rid, label, ids): the `CachePrefix` of the committed ids
    now (its result and its refusals), and from then on every commit that
    grows the stream keys what it filled (S33)"""

    rid: int
    label: int


@dataclass(frozen=True)
class MatchPrefix:
    """match_prefix(rid, label, ids) onto an empty stream (S24); the ids are
    `length` tokens of the label's own identity (what it would compute)"""

    rid: int
    label: int
    length: int


@dataclass(frozen=True)
class ResetPrefixCache:
    pass


@dataclass(frozen=True)
class NumFree:
    pass


@dataclass(frozen=True)
class Reclaimable:
    """pages that would become free if every stream of `rid` let go (S26)"""

    rid: int


Action = (
    Ingest | Admit | Plan | Write | Read | Commit | ClearPreplan | OffloadClaim
    | OffloadCopy | OffloadCommit | OffloadAbandon | Reload | Publish | RetrieveStart
    | RetrieveComplete | Reset | Remove | Truncate | ReleasePublished | LeaseTimeout
    | CachePrefix | FollowTokens | MatchPrefix | ResetPrefixCache | NumFree | Reclaimable
)
ACTIONS: tuple[type, ...] = (
    Ingest, Admit, Plan, Write, Read, Commit, ClearPreplan, OffloadClaim, OffloadCopy,
    OffloadCommit, OffloadAbandon, Reload, Publish, RetrieveStart, RetrieveComplete,
    Reset, Remove, Truncate, ReleasePublished, LeaseTimeout,
    CachePrefix, FollowTokens, MatchPrefix, ResetPrefixCache, NumFree, Reclaimable,
)
# the actions of the prefix cache: the checker issues them only with sharing on
SHARING_ACTIONS: tuple[type, ...] = (CachePrefix, FollowTokens, MatchPrefix,
                                     ResetPrefixCache, NumFree, Reclaimable)


# -------------------------------------------------------------- results


@dataclass(frozen=True)
class Ok:
    pass


@dataclass(frozen=True)
class NotReady:
    """admitted (ok=True) but not ready: a retrieve is in progress"""


@dataclass(frozen=True)
class Refused:
    # AllocationFailed | RequestOffloading | RetrieveInProgress | AdmitRuntimeError
    # | PreplanStale | UnknownRequest (publish only, R48)
    kind: str
    pages_short: int = 0


@dataclass(frozen=True)
class Misuse:
    kind: str  # the KVRefError subclass kvref raises; the state is unchanged


@dataclass(frozen=True)
class Fault:
    """An injected fault reached the caller as this KVRefError subclass; what
    the call promises (all or nothing, nothing leaked) is its invariant's."""

    kind: str


@dataclass(frozen=True)
class Freed:
    pages: int


@dataclass(frozen=True)
class Flag:
    value: bool  # reload's answer; a copy's (False: host pool full)


@dataclass(frozen=True)
class Claimed:
    labels: tuple[int, ...]  # () : begin_offload returned None


@dataclass(frozen=True)
class Published:
    lengths: tuple[tuple[int, int], ...]  # (label, stored_len) on device


@dataclass(frozen=True)
class Latched:
    """Refused, and the failure latched on the stream (I11): unlike `Refused`,
    the call changed the stream's retrieve state, and every later readiness
    check reports it until reset or removal (R35)."""

    kind: str


@dataclass(frozen=True)
class Count:
    n: int  # keys added, tokens attached, pages free or reclaimable, keys dropped


Result = (Ok | NotReady | Refused | Misuse | Fault | Freed | Flag | Claimed | Published
          | Latched | Count)
RESULTS: tuple[type, ...] = (Ok, NotReady, Refused, Misuse, Fault, Freed, Flag, Claimed,
                             Published, Latched, Count)


# ---------------------------------------------------------------- model


def named(step: Step) -> set[Key]:
    """Every stream a step names: its segments, and both ends of every fork
    for every padded request."""
    # a function of the (frozen) step, asked several times per admit: kept
    # per step object (the entry holds it, so its id is not reused)
    got = _NAMED.get(id(step))
    if got is not None and got[0] is step:
        return set(got[1])
    keys = {(g.rid, g.label) for g in step.segments}
    for f, t in step.pre_forks + step.post_forks:
        for rid in step.padded:
            keys |= {(rid, f), (rid, t)}
    if len(_NAMED) > 4096:
        _NAMED.clear()
    _NAMED[id(step)] = (step, frozenset(keys))
    return keys


_NAMED: dict[int, tuple[Step, frozenset[Key]]] = {}


class _Pool(pool_model.PagesModel):
    """The pool model, without its record of each holder's table: the
    streams' tables are that record here."""

    def _with(self, s: pool_model.State, pages: list[pool_model.Page], *,
              lru: tuple[int, ...] | None = None, blank: tuple[int, ...] | None = None,
              add: tuple[int, tuple[int, ...]] = (0, ())) -> pool_model.State:
        return pool_model.State(tuple(pages), s.lru if lru is None else lru,
                                s.blank if blank is None else blank, s.tables, s.order)


# the Model's names of the pool's rules (kvref_model.pages.PagesModel's attributes)
POOL_RULES = {
    "S4_evict_drops_key": "EVICT_DROPS_KEY", "S5_hit_leaves_lru": "HIT_LEAVES_LRU",
    "S7_tagged_extras": "TAGGED_EXTRAS", "S8_cap_before_last_token": "CAP_BEFORE_LAST_TOKEN",
    "S9_release_refuses_duplicates": "RELEASE_REFUSES_DUPLICATES",
    "S9h_release_checks_holder": "RELEASE_CHECKS_HOLDER",
    "S10_write_needs_private": "WRITE_NEEDS_PRIVATE", "S11_dedup_keeps_page": "DEDUP_KEEPS_PAGE",
    "S13_reclaim_counts_pages_once": "RECLAIM_COUNTS_PAGES_ONCE",
}
_HANDLERS: dict[tuple[type, type], Any] = {}  # Model.step's: (model class, action class)


class Model:
    # kvref's rules (specs/rules.md); kvref_model.reference switches them off
    R1_atomic_admit = True
    R2_mark_everything_named = True
    R3_offloaded_refuses = True
    R5_no_reset_in_flight = True
    R6_no_reload_mid_offload = True
    R7_reset_clears_latch = True
    R9_fork_then_grow = True
    R11_preplan_forks_at_promotion = True
    R12_reset_forgets_host = True
    R13_publish_resident = True
    R14_retrieve_refuses_named = True
    R15_retrieve_refuses_absent_named = True
    R16_admit_makes_named = True
    R20_fork_from_absent_copies_nothing = True
    R21_publish_complete = True
    R22_admit_waits_for_retrieve = True
    R24_commit_runs_pending_forks = True
    R38_truncate_settled_only = True
    R33_publish_leases = True
    R35_stale_retrieve_latched = True
    R50_lease_refuses_in_place_writes = True
    R70_lease_holds_the_window = True
    R71_lease_keeps_its_pages = True
    R41_preplan_over_running_step = True
    R42_promotion_checks_basis = True
    R43_shared_marks = True

    # shared pages (specs/shared-pages.md), acting with Scope.sharing on; the
    # pool's own rules are kvref_model.pages.PagesModel's, named here by ID so
    # that --without and the variants switch them off the same way
    S4_evict_drops_key = True
    S5_hit_leaves_lru = True
    S7_tagged_extras = True
    S8_cap_before_last_token = True
    S9_release_refuses_duplicates = True
    S9h_release_checks_holder = True
    S10_write_needs_private = True
    S11_dedup_keeps_page = True
    S13_reclaim_counts_pages_once = True
    S14o_reset_refuses_offloaded = True  # a host copy holds pre-reset KV (issue 27)
    S18_append_copies_on_write = True
    S19_fork_copies_part_page = True
    # a copy-on-write fork reserves only what it does not share (kvref's
    # choice; off: the target's whole length, as a copying fork)
    S19_fork_shares_full_pages = True
    S21_reset_keeps_only_private = True
    S24_match_needs_empty_stream = True
    S26_reclaim_counts_last_reference = True
    # S29: a reload shares again each page whose remembered key the cache still
    # holds, rather than copying it back private (issue 28, part 4); off: every
    # page is copied back, as before. S29k: the page looked up is the one under
    # the slot's chained key (off: under its own tokens' key alone, the chain
    # dropped: a page of other tokens before it can be attached)
    S29_reload_reattaches = True
    S29k_reattach_by_chained_key = True
    S30_received_never_cached = True  # R55: a peer's KV, or a fork of it
    # S32: cache_prefix refuses a stream an admitted fork will still write into
    S32_no_key_under_a_pending_fork = True
    # retention (specs/retention.md), acting on the labels Scope.windows names
    W2_retire_whole_pages_only = True
    W5_fork_inherits_window = True
    W6_truncate_keeps_window = True
    W8_reload_only_retained = True
    W9_window_never_cached = True
    W10_window_never_hits = True
    W16_retrieve_only_retained = True
    # hybrid models (specs/retention.md H1-H5), acting with Scope.groups or
    # Scope.window_cache on
    H1_groups_move_together = True
    H2_hit_every_group = True
    H3_window_release_blank = True
    H4_window_frees_head_first = True
    H7_chunk_moves_by_chunks = True

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        off = {attr: False for name, attr in POOL_RULES.items() if not getattr(self, name)}
        self.pool = (type("Pool", (_Pool,), off) if off else _Pool)(pool_model.Scope(
            pages=scope.device_pages, holders=scope.requests * scope.labels * scope.group_count,
            page_size=scope.page_size, extras=(), duplicates=scope.duplicates,
            blank_to_front=scope.blank_to_front))
        self._plain = not (scope.sharing or scope.windowed)
        # the streams' labels inside the model: one per (label, group); a
        # token's identity is its internal label (a peer's: nlab + label)
        self.nlab = scope.labels * scope.group_count

    def init(self) -> State:
        return State(free=self.scope.device_pages, pool=self.pool.init())

    def need(self, tokens: int) -> int:
        return -(-tokens // self.scope.page_size)

    # --- pages

    def holder(self, k: Key) -> int:
        return k[0] * self.nlab + k[1]

    def extras(self, rid: int) -> pool_model.Extras:
        # the label is not an extra key: a token's identity names the label
        # whose KV it is, so a hit never crosses labels (S25) by construction
        return (("salt", self.scope.salts[rid] if self.scope.salts else ""),)

    def private(self, pool: pool_model.State, k: Key, p: int) -> bool:
        pg = pool.pages[p - 1]
        return pg.key is None and len(pg.holders) == 1 and self.holder(k) in pg.holders

    @staticmethod
    def released(v: Stream) -> int:
        """The slots the window released (a prefix of the table)."""
        z = 0
        for p in v.table:
            if p:
                break
            z += 1
        return z

    @staticmethod
    def tab(v: Stream, table: tuple[int, ...]) -> Stream:
        return replace(v, table=table, pages=len(table) - table.count(0))

    def _alloc(self, pool: pool_model.State, k: Key, n: int
               ) -> tuple[tuple[int, ...], pool_model.State]:
        if n <= 0:
            return (), pool
        r, pool = self.pool.step(pool, pool_model.Allocate(self.holder(k), n))
        assert isinstance(r, pool_model.Pages), r  # the caller counted the free pages
        return r.pages, pool

    def _release(self, pool: pool_model.State, k: Key, table: tuple[int, ...],
                 blank: bool = False) -> tuple[int, pool_model.State]:
        """k lets go of the pages of ``table`` (given in slot order), tail first
        (S6), one pool call; the pages that became free. A call the pool
        refuses changes nothing (P1 then reports the tables and holders apart)."""
        # H4: a window's cached pages go head first, so the tail a window hit
        # reads is evicted last (vLLM 48435: tail first, round-robin sessions
        # lost every hit)
        head_first = (self.scope.window_cache and self.H4_window_frees_head_first
                      and self.scope.window(k[1]) is not None)
        go = tuple(p for p in (table if head_first else reversed(table)) if p)
        if not go:
            return 0, pool
        r, nxt = self.pool.step(pool, pool_model.Release(self.holder(k), go, blank))
        return (r.n, nxt) if isinstance(r, pool_model.Count) else (0, pool)

    def window_first(self, label: int, n: int) -> int:
        """The first token a commit keeps (W2, W15): max(0, n - W - k), or
        under a chunk its start k tokens back, max(0, n - k) // C * C (H7)."""
        w = self.scope.window(label)
        if w is not None and not self.H7_chunk_moves_by_chunks:
            # a chunk kept as a window of C: pages it no longer reads
            return max(0, n - self.scope.margin(label) - w)
        return self.scope.first_kept(label, n)

    def retired_slots(self, label: int, n: int) -> int:
        """W2: the slots wholly before the window of a stream of ``n`` tokens."""
        first = self.window_first(label, n)
        return first // self.scope.page_size if self.W2_retire_whole_pages_only else \
            self.need(first)

    def _retire(self, k: Key, v: Stream, pool: pool_model.State
                ) -> tuple[Stream, pool_model.State]:
        """W2: the pages wholly before the window go; their slots stay, empty."""
        upto = min(self.retired_slots(k[1], v.stored_len), len(v.table))
        if not upto:
            return v, pool
        if not any(v.table[:upto]):
            return v, pool
        # H3: what the window passes goes back blank, so it never pushes
        # another stream's cached prefix toward eviction (vLLM 42948)
        _, pool = self._release(pool, k, v.table[:upto], blank=self.scope.window_cache
                                and self.H3_window_release_blank)
        return self.tab(v, (0,) * upto + v.table[upto:]), pool

    def _cow(self, st: dict[Key, Stream], pool: pool_model.State, step: Step,
             spans: bool = True) -> pool_model.State:
        """S18/W11: each page a segment writes into that is shared or
        registered is swapped for a private one: a spare page the admit
        reserved for it (the table's tail), else a free one; the old released.
        Run at admit (kvref copies there); plan and an unplanned commit run
        it again, a no-op unless a page the step writes became shared since."""
        if not (self.scope.sharing and self.S18_append_copies_on_write):
            return pool
        targets = {(r, t) for _, t in step.pre_forks for r in step.padded}
        for g in step.segments:
            k = (g.rid, g.label)
            if not g.span or k not in st or k in targets:
                continue
            v = st[k]
            table = list(v.table)
            end = self.need(v.stored_len + g.span)
            for i in range(v.stored_len // self.scope.page_size, min(end, len(table))):
                p = table[i]
                if not p or self.private(pool, k, p):
                    continue
                if len(table) > end and self.private(pool, k, table[-1]):
                    q = table.pop()
                else:
                    got, pool = self._alloc(pool, k, min(1, len(pool.blank) + len(pool.lru)))
                    if not got:
                        continue  # not reserved: S10's check reports the write
                    q = got[0]
                table[i] = q
                _, pool = self._release(pool, k, (p,))
            st[k] = self.tab(v, tuple(table))
        return pool

    def _next(self, s: State, st: dict[Key, Stream], pool: pool_model.State,
              **changes: Any) -> State:
        return replace(s, streams=_sorted(st), pool=pool, free=len(pool.blank) + len(pool.lru),
                       **changes)

    def step(self, s: State, a: Action) -> tuple[Result, State]:
        if self.scope.groups and self.H1_groups_move_together:
            from kvref_model import groups  # it builds on this module
            return groups.step(self, s, a)
        return self.step_one(s, a)

    def step_one(self, s: State, a: Action) -> tuple[Result, State]:
        """One action on the streams it names (internal labels, with groups)."""
        # the class's handler, looked up once per (model class, action class):
        # the checker steps millions of times (an instance's own do_ attribute,
        # which nothing sets, would not be seen)
        handler = _HANDLERS.get((type(self), type(a)))
        if handler is None:
            handler = _HANDLERS[(type(self), type(a))] = getattr(
                type(self), "do_" + type(a).__name__)
        result: Result
        result, nxt = handler(self, s, a)
        if self.scope.sharing and nxt is not s:
            nxt = self._cut_chains(nxt)
        assert isinstance(result, RESULTS)
        assert isinstance(nxt, State)
        return result, nxt

    def _cut_chains(self, s: State) -> State:
        """A chain names full pages of committed tokens: one past its stream's
        length (a truncate, a reset, an emptied fork target) is cut there."""
        ps = self.scope.page_size
        if all(v.chain <= v.stored_len // ps for _, v in s.streams):
            return s
        return replace(s, streams=tuple(
            (k, v if v.chain <= v.stored_len // ps else replace(v, chain=v.stored_len // ps))
            for k, v in s.streams))

    # --- requests

    def do_Ingest(self, s: State, a: Ingest) -> tuple[Result, State]:
        st = s.stream_map()
        if (a.rid, MAIN) in st:
            return Ok(), s  # idempotent, as the reference (the very state: nothing to copy)
        for g in range(self.scope.group_count):  # main's stream in every group (H1)
            st[(a.rid, MAIN + g)] = Stream()
        return Ok(), replace(s, streams=_sorted(st))

    def _in_flight(self, s: State, rid: int) -> bool:
        return any(v.in_flight for k, v in s.streams if k[0] == rid)

    def _drained(self, s: State, rid: int) -> State:
        # reset and remove wait for the request's running retrieves, which
        # land (the transfer completes) before the call goes on
        if not any(v.retrieve == PENDING for k, v in s.streams if k[0] == rid):
            return s
        return replace(s, streams=tuple(
            (k, replace(v, retrieve=IDLE) if k[0] == rid and v.retrieve == PENDING else v)
            for k, v in s.streams))

    def _latch(self, v: Stream) -> str:
        return IDLE if self.R7_reset_clears_latch else v.retrieve  # R7

    def do_Reset(self, s: State, a: Reset) -> tuple[Result, State]:
        if a.rid not in s.requests():
            return Misuse("UnknownRequestError"), s
        if self.R5_no_reset_in_flight and self._in_flight(s, a.rid):
            return Misuse("StepInFlightError"), s
        if a.rid in s.leases:  # R33: the peer may still be copying these pages
            return Misuse("PublishLeasedError"), s
        s = self._drained(s, a.rid)
        st, pool, offloads = s.stream_map(), s.pool, dict(s.offloads)
        assert pool is not None
        # private as the call found them: a page two of its streams share is
        # no stream's to keep, whichever lets go of it first
        before = pool
        for k, v in st.items():
            if k[0] != a.rid:
                continue
            if v.offload == OFFLOADED and not self.R12_reset_forgets_host:
                st[k] = replace(v, retrieve=self._latch(v))  # reload brings it back
                continue
            # S21: a kept (spare) page is private; the released slots are forgotten
            keep = () if a.free else tuple(p for p in v.table if p and (
                not self.S21_reset_keeps_only_private or self.private(before, k, p)))
            _, pool = self._release(pool, k, tuple(p for p in v.table if p not in keep))
            # R12: a committed host copy is forgotten with the tokens
            off = RESIDENT if v.offload == OFFLOADED else v.offload
            st[k] = self.tab(Stream(offload=off, retrieve=self._latch(v),
                                    followed=v.followed), keep)
            if v.offload == CLAIMED:  # the offload's generation guard will fail
                offloads[a.rid] = replace(offloads[a.rid], touched=True)
        host = s.host
        if self.R12_reset_forgets_host:
            host = tuple(h for h in s.host if h[0][0] != a.rid
                         or (h[0] in st and st[h[0]].offload == CLAIMED))
        return Ok(), self._next(s, st, pool, host=host,
                                offloads=tuple(sorted(offloads.items())))

    def do_Remove(self, s: State, a: Remove) -> tuple[Result, State]:
        if a.rid not in s.requests():
            return Ok(), s  # idempotent, as the reference
        if self.R5_no_reset_in_flight and self._in_flight(s, a.rid):
            return Misuse("StepInFlightError"), s
        if a.rid in s.leases:  # R33
            return Misuse("PublishLeasedError"), s
        s = self._drained(s, a.rid)
        st, pool = s.stream_map(), s.pool
        assert pool is not None
        for k, v in sorted(st.items()):
            if k[0] == a.rid:
                _, pool = self._release(pool, k, v.table)
                del st[k]
        return Ok(), self._next(
            s, st, pool, host=tuple(h for h in s.host if h[0][0] != a.rid),
            offloads=tuple(o for o in s.offloads if o[0] != a.rid))

    # --- steps

    def _copies(self, src: Key, length: dict[Key, int], fresh: frozenset[Key]) -> bool:
        """Whether a fork from ``src`` copies anything (R20): a source that did not
        exist before this step's admit (R16 made it empty), that no earlier fork
        of the step wrote and that is still empty is no source at all, e.g. a
        padded request without it."""
        if src not in length:
            return False
        return not (self.R20_fork_from_absent_copies_nothing and src in fresh
                    and length[src] == 0)

    def reservations(self, step: Step, st: dict[Key, Stream],
                     pool: pool_model.State | None = None) -> dict[Key, int]:
        """Pages each stream must hold once the step is admitted: the most its
        length reaches while the step runs, its forks applied in list order
        (a chain a->b, b->c copies a's tokens twice; a cycle ends as the first
        source)."""
        # a function of the step and of which streams it names exist at what
        # length (nothing else of `st` is read), asked by every admit: kept per
        # model and step object (the entry holds the step, so its id is not
        # reused); a copy goes out, callers own it. With sharing or windows the
        # tables matter too: not kept
        if not self._plain:
            return self._reservations(step, st, pool)
        proj = tuple([(k, st[k].stored_len if k in st else -1) for k in sorted(named(step))])
        memo: dict[tuple[int, tuple[tuple[Key, int], ...]],
                   tuple[Step, dict[Key, int]]] = self.__dict__.setdefault(
                       "_reservations_memo", {})
        got = memo.get((id(step), proj))
        if got is not None and got[0] is step:
            return dict(got[1])
        if len(memo) > 1 << 14:
            memo.clear()
        want = self._reservations(step, st)
        memo[(id(step), proj)] = (step, dict(want))
        return want

    def _reservations(self, step: Step, st: dict[Key, Stream],
                      pool: pool_model.State | None = None,
                      shares: dict[Key, int] | None = None) -> dict[Key, int]:
        """`reservations`; ``shares`` (filled if given): each fork target's
        count of its source's full retained pages when its fork runs, the
        pages a copy-on-write fork shares rather than reserves (S19)."""
        want: dict[Key, int] = {}
        # W3: pages for the retained slots only; a fork target takes its
        # source's released prefix (W5), so a fork of a windowed stream
        # reserves its window, not its length (issue 27, defect 1)
        rel = {k: self.released(v) for k, v in st.items()} if self.scope.windowed else {}

        def ask(k: Key, tokens: int) -> None:
            want[k] = max(want.get(k, 0), self.need(tokens) - rel.get(k, 0))

        fresh = set(named(step) - set(st))
        length = {k: v.stored_len for k, v in st.items()} | dict.fromkeys(fresh, 0)

        def fork(forks: tuple[tuple[int, int], ...]) -> None:
            for f, t in forks:
                for rid in step.padded:
                    if self._copies((rid, f), length, frozenset(fresh)):
                        fresh.discard((rid, t))  # written by a fork: a source from here on
                        length[(rid, t)] = length[(rid, f)]
                        if rel and self.W5_fork_inherits_window:
                            rel[(rid, t)] = rel.get((rid, f), 0)
                        ask((rid, t), length[(rid, f)])
                        if shares is not None:
                            shares[(rid, t)] = (length[(rid, f)] // self.scope.page_size
                                                - rel.get((rid, f), 0))

        fork(step.pre_forks)
        for g in step.segments:
            k = (g.rid, g.label)
            base = length[k] if self.R9_fork_then_grow else st.get(k, Stream()).stored_len
            # with S19's sharing count, a segment names its length even with
            # no span: a target whose held count is 0 then reserves it anew
            if g.span > 0 or shares is not None:
                ask(k, base + g.span)
        if step.commit:
            for g in step.segments:
                k = (g.rid, g.label)
                length[k] += g.span
                if rel and g.span:
                    # W2: the commit retires the window's old pages before its
                    # post-forks run, so a post-fork target inherits the
                    # larger released prefix (a W=2 post-fork reserved a page
                    # more than it can ever hold; the shipped lockstep found it)
                    rel[k] = max(rel.get(k, 0), self.retired_slots(g.label, length[k]))
        fork(step.post_forks)
        if self.scope.sharing and self.S18_append_copies_on_write and pool is not None:
            # a page the step writes into that is shared or registered needs a
            # private copy: one page more, swapped in at admit (S18, R52, R57)
            targets = {(r, t) for _, t in step.pre_forks for r in step.padded}
            for g in step.segments:
                k = (g.rid, g.label)
                if not g.span or k not in st or k in targets:
                    continue
                v, ps = st[k], self.scope.page_size
                cow = sum(1 for p in v.table[v.stored_len // ps:self.need(v.stored_len + g.span)]
                          if p and not self.private(pool, k, p))
                if cow:
                    want[k] = want.get(k, 0) + cow
        return want

    def _misused(self, s: State, a: Admit) -> Misuse | None:
        """What makes an admit a misuse, whatever the streams hold."""
        step = a.step
        if (step.pre_forks or step.post_forks) and not step.padded:
            # a fork applied to no request (R25): malformed, so before any
            # lifecycle check, at every step call (R40)
            return Misuse("InvalidStepError")
        if s.staged is not None:
            if a.preplan or step != s.staged.step:
                # one step staged at a time; the next admit is its own (R23)
                return Misuse("PreplanPendingError")
        elif not a.preplan and s.current is not None and step != s.current.step:
            return Misuse("StepInFlightError")  # one running step (R23)
        sc = self.scope
        if sc.windowed and any((sc.window(f), sc.margin(f)) != (sc.window(t), sc.margin(t))
                              for f, t in step.pre_forks + step.post_forks):
            # W5: a fork keeps the retention; a windowed source cannot give a
            # full-attention target the tokens it released
            return Misuse("InvalidArgumentError")
        known = s.requests()  # a fresh set a call: asked once
        if any(r not in known for r in {g.rid for g in step.segments} | set(step.padded)):
            return Misuse("UnknownRequestError")
        return None

    def do_Admit(self, s: State, a: Admit) -> tuple[Result, State]:
        misuse = self._misused(s, a)
        if misuse is not None:
            return misuse, s
        if a.preplan and self._views_would_move(s, a.step):
            return Refused("PreplanRefused"), s
        if not a.preplan and s.current is None and self.stale(s) is not None:
            return Refused("PreplanStale"), s  # R42: clear_preplan and admit afresh
        if not a.preplan and (s.staged is not None or s.current is not None):
            # the staged preplan, or the running step, admitted again: everything
            # is already reserved and marked
            return Ok(), s
        st = s.stream_map()
        keys = named(a.step)
        if self.R22_admit_waits_for_retrieve:
            retrieving = {st[k].retrieve for k in keys if k in st}
            if FAILED in retrieving:
                return Refused("AdmitRuntimeError"), s  # latched: terminal (I11)
            if PENDING in retrieving:
                return Refused("RetrieveInProgress"), s  # its pages are still zeros
        if any(st[k].offload != RESIDENT for k in keys if k in st):
            return Refused("RequestOffloading"), s
        if self.R50_lease_refuses_in_place_writes and (
                a.step.pre_forks or a.step.post_forks) and set(a.step.padded) & set(s.leases):
            # R50: a fork would overwrite a published stream in place; across
            # processes the lease is all that keeps the peer's bytes (R35)
            return Refused("PublishLeased"), s
        base = self._settled(s) if a.preplan else st
        if self.R70_lease_holds_the_window and any(
                self.releases_published(base, a.step, r) for r in s.leases):
            # R70: its commit would release window pages a peer may be copying
            return Refused("PublishLeased"), s
        if self.R71_lease_keeps_its_pages and self.scope.sharing and (
                self.S18_append_copies_on_write) and any(
                g.rid in s.leases and g.span and self.part_shared(s.pool, (g.rid, g.label),
                                                                 st.get((g.rid, g.label)))
                for g in a.step.segments):
            # R71: its copy-on-write (S18) would give back a page the lease names
            return Refused("PublishLeased"), s
        shares: dict[Key, int] | None = (
            {} if self.scope.sharing and not a.preplan and self.S19_fork_shares_full_pages
            else None)
        want = (self._reservations(a.step, base, s.pool, shares) if shares is not None
                else self.reservations(a.step, base, s.pool))
        if self.R16_admit_makes_named:  # every named stream exists, so a mark covers it
            for k in sorted(keys):
                want.setdefault(k, 0)
        # a preplan counts what each stream holds once the running step has
        # committed: its window may release pages then (W2) that the preplan needs
        have = {k: (base[k] if k in base else st[k]).pages for k in want if k in st}
        if shares is not None:
            have.update(self._fork_holds(a.step, st, s.pool, shares))
        new = sum(max(0, n - have.get(k, 0)) for k, n in want.items())
        # R57: a preplan's fork targets are made private at admit: each page
        # another stream holds or the cache names is copied into a fresh one,
        # counted here (its forks then copy into the pages its views name)
        privatise = self._shared_in_targets(a.step, st, s.pool) if a.preplan else {}
        new += sum(len(v) for v in privatise.values())
        if new > s.free:
            return Refused("AllocationFailed", new - s.free), s
        undo: list[tuple[Key, Tokens | None]] = []
        pool = s.pool
        assert pool is not None
        for k, n in want.items():
            if k not in st:
                undo.append((k, None))
            v = st.get(k, NO_STREAM)
            got, pool = self._alloc(pool, k, n - have.get(k, 0))
            st[k] = self.tab(v, v.table + got)
        for k, idx in privatise.items():
            got, pool = self._alloc(pool, k, len(idx))
            table = list(st[k].table)
            old = tuple(table[i] for i in idx)
            for i, q in zip(idx, got, strict=True):
                table[i] = q
            _, pool = self._release(pool, k, old)
            st[k] = self.tab(st[k], tuple(table))
        # S18/R52: the copy-on-write is made at admit, into the page it just
        # reserved (kvref copies there, so a failed copy changes nothing and
        # the stream never holds the reserved page beside the shared one)
        pool = self._cow(st, pool, a.step)
        before = s.stream_map()
        # a pre-fork target to rewind, where a preplan runs its forks (R11 off);
        # under R11 there is none, and a running step may still move it (R41)
        for _, t in a.step.pre_forks if not self.R11_preplan_forks_at_promotion else ():
            for rid in a.step.padded:
                if (rid, t) in before:
                    undo.append(((rid, t), before[(rid, t)].contents))
        marks = frozenset(k for k in keys if k in st)
        fresh = frozenset(k for k in st if k not in before)
        # a copy-on-write or a privatising copy may let go of a keyed page it
        # held last: free-cached then, so free is the pool's count (S18, R57)
        free = len(pool.blank) + len(pool.lru) if self.scope.sharing else s.free - new
        return Ok(), self._admitted(replace(s, pool=pool), st, free, a, marks,
                                    tuple(undo), fresh, asked=s)

    def _shared_in_targets(self, step: Step, st: dict[Key, Stream],
                           pool: pool_model.State | None) -> dict[Key, tuple[int, ...]]:
        """R57: the table slots of a preplan's fork targets whose page is not
        private to the target (another holder, or a key)."""
        if not (self.scope.sharing and self.S18_append_copies_on_write) or pool is None:
            return {}
        out: dict[Key, tuple[int, ...]] = {}
        for _, t in step.pre_forks + step.post_forks:
            for rid in step.padded:
                v = st.get((rid, t))
                if v is None:
                    continue
                idx = tuple(i for i, p in enumerate(v.table)
                            if p and not self.private(pool, (rid, t), p))
                if idx:
                    out[(rid, t)] = idx
        return out

    def _fork_holds(self, step: Step, st: dict[Key, Stream], pool: pool_model.State | None,
                    shares: dict[Key, int]) -> dict[Key, int]:
        """S19 with sharing: what each fork target counts as held at admit. A
        copy-on-write fork shares its source's full pages, so a target needs
        private pages only for the rest of its length, less the private
        pages it holds now. Where that may shrink before its fork runs (a
        target twice, or one a fork of this step shares onward first) it
        holds nothing; one a segment also writes holds its private pages
        (each reserved as a copying fork's)."""
        assert pool is not None
        targets: set[Key] = set()
        sources: set[Key] = set()
        unsure: set[Key] = set()
        for f, t in step.pre_forks + step.post_forks:
            for rid in step.padded:
                if (rid, t) in targets or (rid, t) in sources:
                    unsure.add((rid, t))
                targets.add((rid, t))
                sources.add((rid, f))
        writes = {(g.rid, g.label) for g in step.segments if g.span}
        held: dict[Key, int] = {}
        for k in targets:
            v = st.get(k)
            mine = 0 if v is None else sum(1 for p in v.table if p and self.private(pool, k, p))
            if k in unsure:
                held[k] = 0
            elif k in writes:
                held[k] = mine
            else:
                held[k] = shares.get(k, 0) + mine
        return held

    def _views_would_move(self, s: State, step: Step) -> bool:
        """R67, R57: a preplan's views name pages before it runs; a fork (W5
        moves a window's released prefix, a copy-on-write fork gives its
        target other pages) or a copy-on-write the running step cannot see
        would move them in between, so such a preplan is refused
        (`PreplanRefused`, nothing changed) until the running step committed."""
        sc, p = self.scope, s.current
        forks = step.pre_forks + step.post_forks
        pending = () if p is None else p.step.post_forks + (
            () if p.forked else p.step.pre_forks)
        if sc.windowed:
            if any(sc.window(lb) is not None for fk in forks for lb in fk):
                return True  # R67: its forks name a windowed label
            if p is not None:
                targets = {(r, t) for _, t in pending if sc.window(t) is not None
                           for r in p.step.padded}
                if any((g.rid, g.label) in targets for g in step.segments):
                    return True  # R67: a windowed stream a running fork still writes
        if not sc.sharing:
            return False
        busy = named(p.step) if p is not None else set()
        if {(r, t) for _, t in forks for r in step.padded} & busy:
            return True  # R57: its fork targets are pages the running step's views name
        if pending:
            return True  # R57: the running step's forks would give targets other pages
        st, pool, ps = s.stream_map(), s.pool, sc.page_size
        assert pool is not None
        for g in step.segments:
            k = (g.rid, g.label)
            v = st.get(k)
            if not g.span or k not in busy or v is None:
                continue
            i = v.stored_len // ps
            if v.stored_len % ps and i < len(v.table) and v.table[i] and not self.private(
                    pool, k, v.table[i]):
                return True  # R57: it writes into a shared page the running step reads
        return False

    def _admitted(
        self, s: State, st: dict[Key, Stream], free: int, a: Admit,
        marks: frozenset[Key], undo: tuple[tuple[Key, Tokens | None], ...],
        fresh: frozenset[Key], asked: State | None = None,
    ) -> State:
        # `asked`: the state the admit was called in, which `s` differs from
        # only in its pool (the pages just reserved). A preplan's basis is
        # read from it: the lengths the running step leaves do not depend on
        # the pool, and `_settled` keeps its answer for that very object, so a
        # state's preplan admits work the running step out once, not twice each
        if not self.R2_mark_everything_named:  # the reference marks segments only
            marks = frozenset(k for k in marks if k in {(g.rid, g.label) for g in a.step.segments})
        for k in marks:
            st[k] = replace(st[k], in_flight=True)
        # set only where it changes what the forks do: no new states elsewhere
        copies = (a.preplan and self.scope.sharing and self.S18_append_copies_on_write
                  and bool(a.step.pre_forks or a.step.post_forks))
        p = Pending(a.step, ADMITTED, marks, undo if a.preplan else (), fresh,
                    preplanned=copies)
        if a.preplan:
            return replace(s, free=free, streams=_sorted(st), staged=replace(
                p, basis=self._basis(s if asked is None else asked, a.step)))
        return replace(s, free=free, streams=_sorted(st), current=p)

    def _fork_all(self, st: dict[Key, Stream], pool: pool_model.State, p: Pending,
                  forks: tuple[tuple[int, int], ...], fault: bool
                  ) -> tuple[bool, Pending, pool_model.State]:
        """Apply ``forks`` for every padded request, in order. With ``fault``,
        the first copy that moves tokens raises: its target is left empty
        (never half old, half new) and the rest still run. Returns whether it
        fired, the pending step with the written targets no longer fresh, and
        the pool."""
        fired = False
        # H1: a fork of a label forks each of its groups; a copy that fails
        # tears the label, so the same fork's target in every other group
        # is emptied as well (the groups stay alike, I30)
        g = self.scope.group_count
        torn: set[tuple[int, int, int]] = set()
        fresh = set(p.fresh)
        # a segment on a pre-fork target grows it from the forked length (R9):
        # a copy-on-write fork keeps private pages for it
        spans = ({(g.rid, g.label): g.span for g in p.step.segments}
                 if forks is p.step.pre_forks else {})
        # R57: a preplanned step's forks copy into the private pages its
        # admit made and reserved; they share nothing
        sharing = self.scope.sharing and self.S19_fork_copies_part_page and not p.preplanned
        for f, t in forks:
            for rid in p.step.padded:
                src, dst = (rid, f), (rid, t)
                length = {k: v.stored_len for k, v in st.items()}
                if not self._copies(src, length, frozenset(fresh)) or dst not in st:
                    continue
                fresh.discard(dst)  # written by a fork: a source from here on
                # the copy that can raise: every token's, or with sharing only
                # the partial last page's (the full ones are shared, S19)
                moves = st[src].stored_len % self.scope.page_size if sharing \
                    else st[src].stored_len
                if (fault and not fired and moves > 0) or (
                        g > 1 and self.H1_groups_move_together and (rid, f // g, t // g) in torn):
                    fired = True
                    torn.add((rid, f // g, t // g))
                    st[dst], pool = self._fork_pages(st[dst], dst, None, pool)
                    st[dst] = replace(st[dst], stored_len=0, contents=(), chain=0)
                    continue
                st[dst], pool = self._fork_pages(st[dst], dst, st[src], pool,
                                                 spans.get(dst, 0), share=not p.preplanned)
                st[dst] = replace(st[dst], stored_len=st[src].stored_len,
                                  contents=st[src].contents, chain=st[src].chain)
        return fired, replace(p, fresh=frozenset(fresh)), pool

    def _fork_pages(self, v: Stream, k: Key, src: Stream | None, pool: pool_model.State,
                    span: int = 0, share: bool = True) -> tuple[Stream, pool_model.State]:
        """The target's table after a fork from ``src`` (None: a copy that
        failed, the target emptied). It keeps its private pages (the admit
        reserved them: its high-water list) and lets go of the rest; with
        sharing it takes the source's retained full pages by reference and
        copies only the part page (S19); it takes the source's released
        prefix (W5). Without sharing or windows the table stays as it is."""
        if self._plain:
            return v, pool
        own = tuple(p for p in v.table if p)
        keep = tuple(p for p in own if self.private(pool, k, p))
        _, pool = self._release(pool, k, tuple(p for p in v.table if p not in keep))
        if src is None:
            return self.tab(v, keep), pool
        z = self.released(src) if self.W5_fork_inherits_window else 0
        shared: tuple[int, ...] = ()
        if self.scope.sharing and share:
            full = src.stored_len // self.scope.page_size if self.S19_fork_copies_part_page \
                else self.need(src.stored_len)
            shared = tuple(q for q in src.table[z:full] if q)
            if shared:
                r, nxt = self.pool.step(pool, pool_model.Share(self.holder(k), shared))
                pool = nxt if isinstance(r, pool_model.Ok) else pool
            if self.S19_fork_shares_full_pages:
                # the private pages past the shared ones: what the rest of its
                # length needs, or as many as keep the table's old length
                # (spare pages stay spare); the surplus goes back
                need = self.need(src.stored_len + span) - full
                tail = max(need, len(keep) - full)
                _, pool = self._release(pool, k, keep[tail:])
                keep = keep[:tail]
        return self.tab(v, (0,) * z + shared + keep), pool

    def do_Plan(self, s: State, a: Plan) -> tuple[Result, State]:
        if a.preplan:
            p = s.staged
            if p is None:
                return Misuse("StepNotAdmittedError"), s
            if p.phase != ADMITTED:
                return Misuse("PreplanPendingError"), s  # planned already
            st, pool = s.stream_map(), s.pool
            assert pool is not None
            fired = False
            if not self.R11_preplan_forks_at_promotion:
                fired, p, pool = self._fork_all(st, pool, p, p.step.pre_forks, a.fork_error)
            p = replace(p, phase=PLANNED, forked=not self.R11_preplan_forks_at_promotion)
            return (Fault("ForkCopyError") if fired else Ok()), self._next(s, st, pool, staged=p)
        s0 = s
        if s.current is None:
            if s.staged is None:
                return Misuse("StepNotAdmittedError"), s
            if self.stale(s) is not None:
                return Misuse("PreplanStaleError"), s  # R42: nothing promoted
            # promotion: the staged step becomes the running one, undo dropped;
            # one that was only admitted is planned now like any other
            s = replace(s, current=replace(s.staged, undo=(), basis=()), staged=None)
        p = s.current
        assert p is not None
        if p is s0.current and p.phase != ADMITTED:
            return Misuse("StepOrderError"), s  # a step is planned once (R27)
        st, pool = s.stream_map(), s.pool
        assert pool is not None
        fired = False
        if not p.forked:
            fired, p, pool = self._fork_all(st, pool, p, p.step.pre_forks, a.fork_error)
        if fired:  # plan again: the forks ran, the failed target stays empty (R26)
            p = replace(p, phase=ADMITTED, forked=True)
            return Fault("ForkCopyError"), self._next(s, st, pool, current=p)
        pool = self._cow(st, pool, p.step)  # the plan addresses private pages only
        p = replace(p, phase=PLANNED, forked=True)
        return Ok(), self._next(s, st, pool, current=p)

    def do_Write(self, s: State, a: Write) -> tuple[Result, State]:
        if s.current is None or s.current.phase == ADMITTED:
            return Misuse("StepNotAdmittedError"), s  # no slots to write (R27)
        return Ok(), replace(s, current=replace(s.current, phase=WRITTEN))

    def do_Read(self, s: State, a: Read) -> tuple[Result, State]:
        if s.current is None or s.current.phase == ADMITTED:
            return Misuse("StepNotAdmittedError"), s
        return Ok(), s

    def _unmark(self, st: dict[Key, Stream], keys: frozenset[Key], keep: frozenset[Key]) -> None:
        # kvref: a mark another pending step also owns stays (R43; the
        # reference clears it regardless)
        for k in keys - keep if self.R43_shared_marks else keys:
            if k in st:
                st[k] = replace(st[k], in_flight=False)

    def do_Commit(self, s: State, a: Commit) -> tuple[Result, State]:
        p = s.current
        if p is None:
            return Misuse("StepNotAdmittedError"), s
        st, pool = s.stream_map(), s.pool
        assert pool is not None
        fired = False
        if not p.forked and self.R24_commit_runs_pending_forks:
            # committed unplanned: its pre-forks run now (R24)
            fired, p, pool = self._fork_all(st, pool, p, p.step.pre_forks, a.fork_error)
        if p.phase == ADMITTED:  # never planned: its span lands in private pages too
            pool = self._cow(st, pool, p.step)
        self._unmark(st, p.marks, s.staged.marks if s.staged else frozenset())
        token = None if p.phase == WRITTEN else UNWRITTEN
        for g in p.step.segments:
            k = (g.rid, g.label)
            if not p.step.commit or g.span == 0 or k not in st:
                continue
            if st[k].offload != RESIDENT:
                continue  # the reference's "dropping committed tokens" (I15)
            v = st[k]
            st[k], pool = self._retire(k, replace(
                v, stored_len=v.stored_len + g.span,
                contents=v.contents + (g.label if token is None else token,) * g.span), pool)
        post_fired, p, pool = self._fork_all(st, pool, p, p.step.post_forks,
                                             a.fork_error and not fired)
        fired = fired or post_fired
        nxt = self._next(s, st, pool, current=None)
        if p.step.commit:
            nxt = self._key_followed(nxt, p.step)
        return (Fault("ForkCopyError") if fired else Ok()), nxt

    def _key_followed(self, s: State, step: Step) -> State:
        """S33: a commit's CachePrefix of each followed stream the step grew,
        in segment order, after its forks ran (a copy failed or not): the
        pages it filled keyed with no call from the engine. A CachePrefix
        that would be refused (S32: a staged fork still writes into the
        stream) keys nothing, and a later commit keys those pages."""
        seen: set[Key] = set()
        for g in step.segments:
            k = (g.rid, g.label)
            v = s.stream_map().get(k)
            if g.span == 0 or k in seen or v is None or not v.followed:
                continue
            seen.add(k)
            if v.offload != RESIDENT:
                continue  # its span was dropped (I15): nothing grew
            r, t = self.do_CachePrefix(s, CachePrefix(g.rid, g.label))
            if not isinstance(r, Misuse):
                s = t
        return s

    def do_ClearPreplan(self, s: State, a: ClearPreplan) -> tuple[Result, State]:
        p = s.staged
        if p is None:
            return Ok(), s
        st, pool = s.stream_map(), s.pool
        assert pool is not None
        for k, old in reversed(p.undo):
            if k not in st:
                continue
            if old is None:  # invented by the preplan: removed with its pages
                _, pool = self._release(pool, k, st.pop(k).table)
            else:
                st[k] = replace(st[k], stored_len=len(old), contents=old)
        self._unmark(st, p.marks, s.current.marks if s.current else frozenset())
        return Ok(), self._next(s, st, pool, staged=None)

    # --- offload

    def _claim(self, s: State, rid: int) -> tuple[tuple[int, int], ...]:
        """(label, pages) of each stream a claim of ``rid`` takes now; () when
        the claim is refused. The claim and the offload priority (R45) both
        decide with it."""
        if self.scope.host_pages == 0:
            # no host pool (cpu_offload_pages=0): nothing can be claimed, for
            # any request (R44's NO_HOST_POOL), and no handle ever exists
            return ()
        mine = {k: v for k, v in s.streams if k[0] == rid}
        if not mine or rid in dict(s.offloads):
            return ()
        if any(v.in_flight for v in mine.values()):  # R4: the whole request
            return ()
        if rid in s.leases:  # R33: begin_offload's refusal value, as R4's
            return ()
        return tuple((k[1], v.pages) for k, v in sorted(mine.items())
                     if v.offload == RESIDENT and v.pages > 0)

    def offload_priority(self, s: State, rid: int) -> int:
        """R45: the device pages a claim of ``rid`` would free now: 0 when the
        claim is refused, and 0 too when it is accepted but frees nothing
        (every page it holds another request holds as well, R53). A query:
        the state is unchanged, so it is a function here, not an action."""
        claim = self._claim(s, rid)
        if not claim:
            return 0
        st = s.stream_map()
        if s.pool is None:  # a projected state (`project`): page counts, no page ids
            return sum(pages for _, pages in claim)
        mine = tuple((self.holder((rid, lb)), tuple(p for p in reversed(st[(rid, lb)].table) if p))
                     for lb, _ in claim)
        r, _ = self.pool.step(s.pool, pool_model.Reclaimable(mine))
        return r.n if isinstance(r, pool_model.Count) else 0

    def do_OffloadClaim(self, s: State, a: OffloadClaim) -> tuple[Result, State]:
        claim = self._claim(s, a.rid)
        if not claim:
            return Claimed(()), s
        st = s.stream_map()
        for label, _ in claim:
            st[(a.rid, label)] = replace(st[(a.rid, label)], offload=CLAIMED)
        offloads = dict(s.offloads)
        offloads[a.rid] = Offload(claim)
        return Claimed(tuple(lb for lb, _ in claim)), replace(
            s, streams=_sorted(st), offloads=tuple(sorted(offloads.items())))

    def host_need(self, v: Stream | None, tokens: int) -> int:
        """Host pages a copy of ``tokens`` of ``v`` takes: its retained slots (W8)."""
        z = self.released(v) if v is not None and self.W8_reload_only_retained else 0
        return max(0, self.need(tokens) - z)

    def host_used(self, s: State) -> int:
        if not self.scope.windowed:
            return sum(self.need(len(c)) for _, c in s.host)
        st, offs = s.stream_map(), dict(s.offloads)
        used = 0
        for k, c in s.host:
            off = offs.get(k[0])
            # a copy of an open offload: what it took when it ran; a committed
            # one: the stream keeps its released slots (W8)
            got = dict(off.hosted).get(k[1]) if off is not None else None
            used += self.host_need(st.get(k), len(c)) if got is None else got
        return used

    def do_OffloadCopy(self, s: State, a: OffloadCopy) -> tuple[Result, State]:
        off = s.offload_of(a.rid)
        if a.group is not None:  # a group without groups (groups.step resolves it)
            return Misuse("OffloadStateError"), s
        if off is None or a.label in off.copied or a.label not in dict(off.claimed):
            # a closed handle, a label it never claimed, or one copied already
            return Misuse("OffloadStateError"), s
        k = (a.rid, a.label)
        if k in s.stream_map() and s.stream_map()[k].retrieve == PENDING:
            # the copy waits for the retrieve still writing these pages
            st = s.stream_map()
            st[k] = replace(st[k], retrieve=IDLE)
            s = replace(s, streams=_sorted(st))
        if off.touched:
            # a claimed stream changed since the claim: the commit is doomed,
            # so kvref copies nothing (and nothing can fail)
            return Flag(False), s
        v = s.stream_map().get(k, Stream())  # removed: copies nothing
        if self.host_used(s) + self.host_need(v, v.stored_len) > self.scope.host_pages:
            # host full: this stream stays on device; no copy runs, so none can fail
            return Flag(False), s
        if a.copy_error:  # R8: every claim of the offload is abandoned
            _, nxt = self.do_OffloadAbandon(s, OffloadAbandon(a.rid))
            return Fault("OffloadCopyError"), nxt
        offloads = dict(s.offloads)
        off = replace(off, copied=off.copied | {a.label})
        if self.scope.windowed:  # without, a copy's pages are its tokens' (host_used)
            off = replace(off, hosted=tuple(sorted(
                (*off.hosted, (a.label, self.host_need(v, v.stored_len))))))
        offloads[a.rid] = off
        host = dict(s.host)
        host[k] = v.contents
        return Flag(True), replace(
            s, host=tuple(sorted(host.items())), offloads=tuple(sorted(offloads.items())))

    def do_OffloadCommit(self, s: State, a: OffloadCommit) -> tuple[Result, State]:
        off = s.offload_of(a.rid)
        if off is None:
            return Misuse("OffloadStateError"), s  # committed or abandoned already
        st = s.stream_map()
        gone = any((a.rid, label) not in st for label in off.copied)
        if off.touched or gone or not off.copied:  # all or nothing: the generation guard
            _, nxt = self.do_OffloadAbandon(s, OffloadAbandon(a.rid))
            return Freed(0), nxt
        freed, pool = 0, s.pool
        assert pool is not None
        for label, _ in off.claimed:
            k = (a.rid, label)
            if label in off.copied:
                # the host copy remembers which full pages were keyed (S29)
                # (not a window's: H5, its reload computes nothing again anyway
                # past what its window reads, and shares nothing again)
                keyed = () if self.scope.window(label) is not None else self._keyed(pool, st[k])
                # only the pages whose last holder it was come free (R53); the
                # released slots stay, so a reload takes retained ones only (W8)
                n, pool = self._release(pool, k, st[k].table)
                freed += n
                st[k] = replace(self.tab(st[k], (0,) * self.released(st[k])),
                                offload=OFFLOADED, keyed=keyed, chain=0)
            elif k in st:
                st[k] = replace(st[k], offload=RESIDENT)
        return Freed(freed), self._next(
            s, st, pool, offloads=tuple(o for o in s.offloads if o[0] != a.rid))

    def do_OffloadAbandon(self, s: State, a: OffloadAbandon) -> tuple[Result, State]:
        off = s.offload_of(a.rid)
        if off is None:
            return Ok(), s  # a closed handle: abandon is a no-op
        st = s.stream_map()
        for label, _ in off.claimed:
            if (a.rid, label) in st:
                st[(a.rid, label)] = replace(st[(a.rid, label)], offload=RESIDENT)
        dropped = {(a.rid, label) for label, _ in off.claimed}
        return Ok(), replace(
            s, streams=_sorted(st), host=tuple(h for h in s.host if h[0] not in dropped),
            offloads=tuple(o for o in s.offloads if o[0] != a.rid))

    def _keyed(self, pool: pool_model.State, v: Stream) -> tuple[int, ...]:
        """The slots of ``v``'s full pages that are keyed: what its host copy
        remembers (S29). () without sharing."""
        if not self.scope.sharing:
            return ()
        full = min(v.stored_len // self.scope.page_size, len(v.table))
        return tuple(i for i in range(full)
                     if v.table[i] and pool.pages[v.table[i] - 1].key is not None)

    def _reattach(self, s: State, rid: int) -> dict[Key, dict[int, int]]:
        """Each offloaded stream of ``rid``: its slots whose remembered key the
        cache holds now, and the page under it (S29)."""
        pool = s.pool
        if not self.S29_reload_reattaches or not s.host or pool is None or not any(
                v.keyed for _, v in s.streams):
            return {}
        index = pool.index()
        st, ps = s.stream_map(), self.scope.page_size
        out: dict[Key, dict[int, int]] = {}
        for k, c in s.host:
            v = st.get(k)
            if k[0] != rid or v is None or not v.keyed:
                continue
            hits, parent = {}, None
            for i in range(max(v.keyed) + 1):
                toks = c[i * ps:(i + 1) * ps]
                key = self.pool.key_of(parent if self.S29k_reattach_by_chained_key else None,
                                       toks, self.extras(rid))
                parent = self.pool.key_of(parent, toks, self.extras(rid))
                if i in v.keyed and key in index:
                    hits[i] = index[key]
            if hits:
                out[k] = hits
        return out

    def reload_need(self, s: State, rid: int) -> int:
        """The free pages a reload of ``rid`` takes now (R46): a fresh page per
        retained slot it does not re-attach, and each free-cached page it
        re-attaches (once, though two of its streams name it); a page another
        stream holds costs nothing (S29)."""
        st = s.stream_map()
        hits = self._reattach(s, rid)
        fresh = sum(self.host_need(st.get(k), len(c)) - len(hits.get(k, {}))
                    for k, c in s.host if k[0] == rid)
        pool = s.pool
        cached = {p for h in hits.values() for p in h.values()
                  if pool is not None and not pool.pages[p - 1].holders}
        return fresh + len(cached)

    def _attach(self, pool: pool_model.State, k: Key, pages: tuple[int, ...]
                ) -> pool_model.State:
        """k takes a reference on each cached page of ``pages`` (by key, as a
        hit: a free-cached one leaves the LRU in the same section, S5)."""
        h = self.holder(k)
        got = list(pool.pages)
        for p in pages:
            got[p - 1] = replace(got[p - 1], holders=got[p - 1].holders | {h})
        return pool_model.State(tuple(got), tuple(p for p in pool.lru if p not in pages),
                                pool.blank, pool.tables, pool.order)

    def do_Reload(self, s: State, a: Reload) -> tuple[Result, State]:
        if self.R6_no_reload_mid_offload and s.offload_of(a.rid) is not None:
            return Flag(False), s
        copies = {k: c for k, c in s.host if k[0] == a.rid}
        st, pool = s.stream_map(), s.pool
        assert pool is not None
        if not copies or self.reload_need(s, a.rid) > s.free:
            return Flag(False), s  # nothing moves
        hits = self._reattach(s, a.rid)
        # first every stream shares its pages the cache still holds, then each
        # takes fresh ones for the rest: a fresh page never evicts a page the
        # reload re-attaches (S29)
        taken: list[tuple[Key, tuple[int, ...]]] = []
        for k in copies:  # in label order (S29)
            if k in hits:
                taken.append((k, tuple(hits[k].values())))
                pool = self._attach(pool, k, taken[-1][1])
        tables: dict[Key, tuple[int, ...]] = {}
        for k, c in copies.items():
            z = self.released(st.get(k, NO_STREAM)) if self.W8_reload_only_retained else 0
            mine = hits.get(k, {})
            got, pool = self._alloc(pool, k, self.need(len(c)) - z - len(mine))
            taken.append((k, got))
            fresh = iter(got)
            tables[k] = (0,) * z + tuple(mine[i] if i in mine else next(fresh)
                                         for i in range(z, self.need(len(c))))
        if a.copy_error:
            # all streams or none (R26): the streams and host copies stay as
            # they were and the pages taken go back, in the order taken. A
            # free-cached page taken as a fresh one comes back blank: the copy
            # may have written it before it failed, so its key is not kept
            for k, got in taken:
                _, pool = self._release(pool, k, got)
            return Fault("ReloadCopyError"), replace(s, pool=pool)
        for k, c in copies.items():
            st[k] = replace(self.tab(st.get(k, NO_STREAM), tables[k]), stored_len=len(c),
                            contents=c, offload=RESIDENT, keyed=())
        return Flag(True), self._next(s, st, pool,
                                      host=tuple(h for h in s.host if h[0] not in copies))

    # --- disaggregation

    def do_Publish(self, s: State, a: Publish) -> tuple[Result, State]:
        if a.rid not in s.requests():
            # R48: the engine's race with remove_request (publish after another
            # thread removed the request) is a refusal it plans around, not a bug
            return Refused("UnknownRequest"), s
        mine = [(k, v) for k, v in s.streams if k[0] == a.rid]
        if self.R13_publish_resident and any(v.offload != RESIDENT for _, v in mine):
            return Refused("RequestOffloading"), s  # its pages are not on the device (R36)
        if self.R21_publish_complete:  # its pages are still being (or were never) written
            if any(v.retrieve == FAILED for _, v in mine):
                return Refused("AdmitRuntimeError"), s
            if any(v.retrieve == PENDING for _, v in mine):
                return Refused("RetrieveInProgress"), s
        if self.R50_lease_refuses_in_place_writes and self.forks_onto(s, a.rid):
            # R50: the step would overwrite a published stream in place, under the lease
            return Refused("ForkPending"), s
        if self.R70_lease_holds_the_window and self.window_pending(s, a.rid):
            # R70: a pending commit would release window pages the lease names
            return Refused("WindowPending"), s
        lengths = tuple((k[1], v.stored_len if v.offload != OFFLOADED else 0) for k, v in mine)
        if not self.R33_publish_leases:
            return Published(lengths), s
        # taken, or renewed (a re-publish): one lease per request (R34)
        return Published(lengths), replace(s, leases=tuple(sorted({*s.leases, a.rid})))

    def do_RetrieveStart(self, s: State, a: RetrieveStart) -> tuple[Result, State]:
        if a.rid not in s.requests():
            return Misuse("UnknownRequestError"), s
        st = s.stream_map()
        k = (a.rid, a.label)
        v = st.get(k, NO_STREAM)
        if v.retrieve == FAILED:
            return Refused("AdmitRuntimeError"), s
        if v.retrieve == PENDING:
            return NotReady(), s
        if a.length <= v.stored_len:
            return Ok(), s
        if (self.R14_retrieve_refuses_named and v.in_flight) or (
            self.R15_retrieve_refuses_absent_named
            and any(k in named(p.step) for p in (s.current, s.staged) if p)
        ):
            # R14: the step planned its writes at the old length; R15: a step
            # names a label that did not exist at admit, so no mark covers it
            return Misuse("StepInFlightError"), s
        if v.offload != RESIDENT:
            return Refused("RequestOffloading"), s
        # its copy-on-write of a shared part page (W11, S18, R52)
        cow = self.scope.sharing and self.S18_append_copies_on_write and self.part_shared(
            s.pool, k, v)
        if self.R71_lease_keeps_its_pages and a.rid in s.leases and (cow or any(
                v.table[:min(self.retired_slots(a.label, a.length), self.need(v.stored_len))])):
            # R71: the window's release (W16) or the copy-on-write would give
            # back a page the lease names, which a peer may still be copying
            return Refused("PublishLeased"), s
        if a.stale and self.R35_stale_retrieve_latched:
            # terminal, as a failed copy: latched, nothing taken, nothing copied
            st[k] = replace(v, retrieve=FAILED)
            return Latched("RetrieveStale"), replace(s, streams=_sorted(st))
        pool = s.pool
        assert pool is not None
        # a page per slot it lacks, but the slots the window releases at this
        # length (W16); a private copy of its part page if shared (W11, S18)
        lo = self.window_first(a.label, a.length) // self.scope.page_size \
            if self.W16_retrieve_only_retained else 0
        slots = [i for i in range(len(v.table), self.need(a.length)) if i >= lo]
        part = v.stored_len // self.scope.page_size
        new = len(slots) + cow
        if new > s.free:
            return Refused("AllocationFailed", new - s.free), s
        if a.start_error:  # the copy never started: nothing taken, nothing latched (R26)
            return Refused("AdmitRuntimeError"), s
        # retrieved tokens carry identity labels+label: distinct from local writes
        tokens = v.contents + (self.nlab + a.label,) * (a.length - v.stored_len)
        got, pool = self._alloc(pool, k, new)
        table = list(v.table) + [0] * (self.need(a.length) - len(v.table))
        for i, q in zip(slots, got, strict=False):
            table[i] = q
        if cow:
            old, table[part] = table[part], got[-1]
            _, pool = self._release(pool, k, (old,))
        nv, pool = self._retire(k, replace(self.tab(v, tuple(table)), stored_len=a.length,
                                           contents=tokens, retrieve=PENDING), pool)
        st[k] = nv
        return NotReady(), self._next(s, st, pool)

    def do_RetrieveComplete(self, s: State, a: RetrieveComplete) -> tuple[Result, State]:
        st = s.stream_map()
        k = (a.rid, a.label)
        if st.get(k, Stream()).retrieve != PENDING:
            raise ProtocolError("no retrieve in progress")
        torn = a.moved and self.R35_stale_retrieve_latched  # latched, as a failed copy
        st[k] = replace(st[k], retrieve=IDLE if a.ok and not torn else FAILED)
        return Ok(), replace(s, streams=_sorted(st))

    # --- speculative decoding

    def do_Truncate(self, s: State, a: Truncate) -> tuple[Result, State]:
        if a.new_len < 0:
            return Misuse("InvalidArgumentError"), s
        k = (a.rid, a.label)
        st = s.stream_map()
        v = st.get(k)
        if v is None:
            return Misuse("UnknownRequestError"), s
        if self.R38_truncate_settled_only:
            if v.in_flight:  # a step (or staged preplan) writes past the new end
                return Misuse("StepInFlightError"), s
            if v.offload != RESIDENT or v.retrieve != IDLE:
                # its pages are leaving, on the host, or still (or never) written
                return Misuse("StreamUnavailableError"), s
        if a.rid in s.leases:  # R33: a peer may be copying the pages it would free
            return Misuse("PublishLeasedError"), s
        if a.new_len > v.stored_len:
            return Misuse("InvalidArgumentError"), s
        w = self.scope.window(a.label)
        if w is not None and self.W6_truncate_keeps_window and self.scope.first_read(
                a.label, a.new_len) < self.released(v) * self.scope.page_size:
            return Misuse("ReleasedPrefixError"), s  # W6: its window would reach released tokens
        if a.new_len == v.stored_len:
            return Freed(0), s  # nothing to cut: spare pages stay (R39)
        # pages past the new end go back (R39); a stream already holding fewer
        # (offloaded, only reachable without R38) has nothing more to give.
        # The answer: the pages that became free, not those let go (S20)
        keep = self.need(a.new_len)
        assert s.pool is not None
        freed, pool = self._release(s.pool, k, v.table[keep:])
        st[k] = replace(self.tab(v, v.table[:keep]), stored_len=a.new_len,
                        contents=v.contents[:a.new_len])
        return Freed(freed), self._next(s, st, pool)

    # --- the publish lease (R33, R34)

    def do_ReleasePublished(self, s: State, a: ReleasePublished) -> tuple[Result, State]:
        # idempotent: the consumer cannot know whether the lease already expired
        if a.rid not in s.leases:
            return Ok(), s  # the very state: nothing to copy
        return Ok(), replace(s, leases=tuple(r for r in s.leases if r != a.rid))

    def do_LeaseTimeout(self, s: State, a: LeaseTimeout) -> tuple[Result, State]:
        return Ok(), replace(s, leases=())

    # --- the prefix cache (S23-S26, W9, W10)

    def _cachable(self, tokens: Tokens) -> bool:
        # never KV nobody wrote, nor a peer's (R55), nor a fork of it
        return UNWRITTEN not in tokens and (not self.S30_received_never_cached
                                            or all(t < self.nlab for t in tokens))

    def _never_cached(self, label: int) -> bool:
        """W9 (a setting: Scope.window_cache off): a windowed label keys nothing."""
        return (self.scope.window(label) is not None and self.W9_window_never_cached
                and not self.scope.window_cache)

    def do_CachePrefix(self, s: State, a: CachePrefix) -> tuple[Result, State]:
        k = (a.rid, a.label)
        v = s.stream_map().get(k)
        if v is None:
            return Misuse("UnknownRequestError"), s
        if v.offload != RESIDENT or v.retrieve != IDLE:
            # claimed, offloaded, or a retrieve copies into it (or failed to):
            # its pages are not the tokens' to key
            return Misuse("StreamUnavailableError"), s
        if self.S32_no_key_under_a_pending_fork and self._fork_pending_into(s, k):
            # S32: the fork would find the private page its admit counted on
            # keyed (and no page left to write into), or copy into a keyed page
            return Misuse("StepInFlightError"), s
        if a.drafts:
            # S23/R56: uncommitted tokens' KV may still change (vLLM PRs
            # 18668/19006 cached draft tokens); nothing is keyed
            return Misuse("InvalidArgumentError"), s
        ps = self.scope.page_size
        if a.start < 0 or a.start % ps or a.start > v.chain * ps:
            # S34: a key chains from the page before it, so ids from past
            # the chain's end (or from within a page) key nothing
            return Misuse("InvalidArgumentError"), s
        if self._never_cached(a.label):
            return Count(0), s  # W9: a windowed label registers nothing
        pool, parent, added = s.pool, None, 0
        gone = self.released(v)  # H2: the chain runs on past a window's released slots
        assert pool is not None
        for i in range(v.chain):  # the chain so far: keyed or passed over (S23)
            parent = self.pool.key_of(parent, v.contents[i * ps:(i + 1) * ps],
                                      self.extras(a.rid))
        chain = v.chain
        for i in range(v.chain, min(v.stored_len // ps, len(v.table))):
            tokens = v.contents[i * ps:(i + 1) * ps]
            if i < gone and self._cachable(tokens):
                parent = self.pool.key_of(parent, tokens, self.extras(a.rid))
                chain = i + 1
                continue
            if not v.table[i] or not self._cachable(tokens):
                break  # a chain goes no further than its first gap
            fresh = pool.pages[v.table[i] - 1].key is None
            r, pool = self.pool.step(pool, pool_model.Register(
                v.table[i], parent, tokens, self.extras(a.rid)))
            if isinstance(r, pool_model.Misuse):
                return Misuse(r.kind), s
            assert isinstance(r, pool_model.Registered)
            added += fresh and r.page == v.table[i]  # a key another page had: S11
            parent = self.pool.key_of(parent, tokens, self.extras(a.rid))
            chain = i + 1
        if pool is s.pool and chain == v.chain:
            return Count(0), s
        st = s.stream_map()
        st[k] = replace(v, chain=chain)
        return Count(added), replace(s, pool=pool, streams=_sorted(st))

    def do_FollowTokens(self, s: State, a: FollowTokens) -> tuple[Result, State]:
        r, t = self.do_CachePrefix(s, CachePrefix(a.rid, a.label))
        if isinstance(r, Misuse):
            return r, s
        if self._never_cached(a.label):
            return r, t  # W9: its commits would key nothing, so nothing follows it
        k = (a.rid, a.label)
        st = t.stream_map()
        if st[k].followed:
            return r, t
        st[k] = replace(st[k], followed=True)
        return r, replace(t, streams=_sorted(st))

    @staticmethod
    def _fork_pending_into(s: State, k: Key) -> bool:
        """Whether a fork still to run writes into ``k``: the staged preplan's,
        the running step's post-forks, and its pre-forks until its plan ran them."""
        for p in (s.current, s.staged):
            if p is None:
                continue
            forks = p.step.post_forks + (() if p.forked else p.step.pre_forks)
            if any((rid, t) == k for _, t in forks for rid in p.step.padded):
                return True
        return False

    def cache_prefixes(self, s: State, keys: tuple[Key, ...]
                       ) -> tuple[tuple[Result, ...] | Misuse, State]:
        """S31: `cache_prefixes` of the streams `keys`, each call's ids the
        stream's committed tokens (what `CachePrefix` stands for): the
        `CachePrefix` of each in order, or, if any is a misuse or a stream is
        named twice, that misuse and the very state given (every call is
        checked before any page is keyed). Not an action: a composition of
        one, so the checker explores nothing new."""
        if len(set(keys)) != len(keys):
            return Misuse("InvalidArgumentError"), s
        out: list[Result] = []
        t = s
        for rid, label in keys:
            r, t = self.do_CachePrefix(t, CachePrefix(rid, label))
            if isinstance(r, Misuse):
                return r, s
            out.append(r)
        return tuple(out), t

    def do_MatchPrefix(self, s: State, a: MatchPrefix) -> tuple[Result, State]:
        if a.rid not in s.requests():
            return Misuse("UnknownRequestError"), s
        k = (a.rid, a.label)
        st = s.stream_map()
        v = st.get(k, NO_STREAM)
        if v.in_flight:
            return Misuse("StepInFlightError"), s  # the admitted step writes from 0
        if v.offload != RESIDENT or v.retrieve != IDLE:
            # offloaded, claimed, or a retrieve copies into it (or failed to)
            return Misuse("StreamUnavailableError"), s
        if v.stored_len and self.S24_match_needs_empty_stream:
            return Misuse("InvalidArgumentError"), s  # a hit onto a stream that is not empty
        if a.rid in s.leases:
            return Misuse("PublishLeasedError"), s  # R33: a leased request's streams stay
        # S24: the stream is created if missing, as an admit naming it would
        # (R16), hit or not
        made = s if k in st else replace(s, streams=_sorted({**st, k: v}))
        if self.scope.window(a.label) is not None and self.W10_window_never_hits \
                and not self.scope.window_cache:
            return Count(0), made  # W10: a windowed label never hits
        if self.scope.window(a.label) is not None:
            return self.hit_every_group(s, made, a.rid, (a.label,), a.length)
        tokens = (a.label,) * a.length
        assert s.pool is not None
        r, pool = self.pool.step(s.pool, pool_model.Match(self.holder(k), tokens,
                                                          self.extras(a.rid)))
        if isinstance(r, pool_model.Misuse):
            return Misuse(r.kind), s
        assert isinstance(r, pool_model.Hit)
        if not r.pages:
            return Count(0), made
        # the hit pages, then its old (spare, private) ones
        st[k] = replace(self.tab(v, r.pages + v.table), stored_len=r.num_tokens,
                        contents=tokens[:r.num_tokens], chain=len(r.pages))
        return Count(r.num_tokens), self._next(s, st, pool)

    def serves(self, label: int, cached: tuple[int | None, ...], pages: int) -> bool:
        """H2: whether ``label``'s stream can attach a hit of ``pages`` full
        pages: every page its window reads there is cached (a full-attention
        stream's window is all of them); the slots before hold none."""
        lo = min(pages, self.retired_slots(label, pages * self.scope.page_size))
        return all(p is not None for p in cached[lo:pages])

    def hit_every_group(self, s: State, made: State, rid: int, labels: tuple[int, ...],
                        length: int) -> tuple[Result, State]:
        """H2: the longest hit every one of ``labels`` (a label's groups) can
        serve, whole pages in each, the same tokens attached in each; a
        windowed one takes only the pages its window reads. ``made`` is ``s``
        with the streams created (S24)."""
        assert s.pool is not None
        pool, st, extras = s.pool, made.stream_map(), self.extras(rid)
        found = [self.pool.cached(pool, (lb,) * length, extras) for lb in labels]
        pages = len(found[0])
        if self.H2_hit_every_group:
            both = tuple(zip(labels, found, strict=True))
            while pages and not all(self.serves(lb, c, pages) for lb, c in both):
                pages -= 1
        else:  # each group its own longest hit: the lengths disagree (vllm-ascend 12394)
            pages = max(j for j in range(pages + 1) if self.serves(labels[0], found[0], j))
        if not pages:
            return Count(0), made
        n = pages * self.scope.page_size
        for lb, c in zip(labels, found, strict=True):
            k, lo = (rid, lb), min(pages, self.retired_slots(lb, n))
            got = tuple(p for p in c[lo:pages] if p is not None)
            r, pool = self.pool.step(pool, pool_model.Take(self.holder(k), got))
            if isinstance(r, pool_model.Misuse):
                return Misuse(r.kind), s
            v = st[k]
            # the hit pages (the released slots first), then its old spare ones
            st[k] = replace(self.tab(v, (0,) * lo + got + v.table), stored_len=n,
                            contents=(lb,) * n, chain=pages)
        return Count(n), self._next(s, st, pool)

    def do_ResetPrefixCache(self, s: State, a: ResetPrefixCache) -> tuple[Result, State]:
        if self.S14o_reset_refuses_offloaded and any(
                v.offload != RESIDENT for _, v in s.streams):
            # a host copy holds KV computed before the reset: a reload and a
            # cache_prefix would make it findable after it (issue 27, defect 3)
            return Refused("RequestOffloading"), s
        assert s.pool is not None
        r, pool = self.pool.step(s.pool, pool_model.ResetPrefixCache())
        if isinstance(r, pool_model.ResetRefused):
            return Refused("ResetRefused", r.pages_held), s
        assert isinstance(r, pool_model.Count)
        return Count(r.n), (s if not r.n else replace(s, pool=pool))

    def do_NumFree(self, s: State, a: NumFree) -> tuple[Result, State]:
        return Count(s.free), s

    def do_Reclaimable(self, s: State, a: Reclaimable) -> tuple[Result, State]:
        if a.rid not in s.requests():
            return Misuse("UnknownRequestError"), s
        mine = [(self.holder(k), tuple(p for p in reversed(v.table) if p))
                for k, v in s.streams if k[0] == a.rid]
        mine = [(h, t) for h, t in mine if t]
        if not self.S26_reclaim_counts_last_reference:  # every page it holds, once
            return Count(len({p for _, t in mine for p in t})), s
        assert s.pool is not None
        r, _ = self.pool.step(s.pool, pool_model.Reclaimable(tuple(mine)))
        return Count(r.n if isinstance(r, pool_model.Count) else 0), s

    # --- overlap: a preplan over the running step (R41-R43)

    def _settled(self, s: State) -> dict[Key, Stream]:
        """The streams as the running step leaves them once it runs as admitted,
        fault-free: its pre-forks, its spans if it keeps them, its post-forks.
        A preplan over it is reserved and planned from these lengths (R41);
        without R41, from the lengths as they are now."""
        p = s.current
        if p is None or not self.R41_preplan_over_running_step:
            return s.stream_map()
        # a function of the state alone, asked twice by every preplan admit
        # over a running step; the checker issues a state's calls one after
        # another, so the last answer is kept (a copy goes out: callers own it)
        memo: tuple[State, dict[Key, Stream]] | None = self.__dict__.get("_settled_memo")
        if memo is not None and memo[0] is s:
            return dict(memo[1])
        s0 = s
        if p.phase == ADMITTED:
            _, s = self.do_Plan(s, Plan())
        _, s = self.do_Commit(s, Commit())
        self.__dict__["_settled_memo"] = (s0, s.stream_map())
        return s.stream_map()

    def _basis(self, s: State, step: Step) -> tuple[tuple[Key, int], ...]:
        """What a preplan of ``step`` admitted in ``s`` is built from, for the
        streams it shares with the running step: the only ones whose length
        can still move under its marks."""
        if s.current is None:
            return ()
        settled = self._settled(s)
        shared = named(step) & named(s.current.step)
        return tuple(sorted((k, settled[k].stored_len) for k in shared if k in settled))

    @staticmethod
    def forks_onto(s: State, rid: int) -> bool:
        """Whether a running or staged step still has forks to apply to ``rid`` (R50)."""
        return any(rid in p.step.padded and (p.step.post_forks or (
            p.step.pre_forks and not p.forked)) for p in (s.current, s.staged) if p)

    def releases_published(self, st: dict[Key, Stream], step: Step, rid: int) -> bool:
        """R70: whether ``step``'s commit, from the streams ``st``, would release
        a page of a windowed stream of ``rid`` that holds committed tokens (a
        page a publish names; W2 may also retire pages the step reserved)."""
        if not step.commit:
            return False  # it keeps no tokens, so its commit releases nothing
        for g in step.segments:
            v = st.get((g.rid, g.label))
            if g.rid != rid or not g.span or v is None or self.scope.window(g.label) is None:
                continue
            if any(v.table[:min(self.retired_slots(g.label, v.stored_len + g.span),
                                self.need(v.stored_len))]):
                return True
        return False

    def part_shared(self, pool: pool_model.State | None, k: Key, v: Stream | None) -> bool:
        """Whether the partly filled last page of ``v`` (its committed tokens)
        is shared or keyed: a write after them copies it first (S18, R52)."""
        ps = self.scope.page_size
        if v is None or pool is None or not v.stored_len % ps:
            return False
        part = v.stored_len // ps
        return part < len(v.table) and v.table[part] != 0 and not self.private(
            pool, k, v.table[part])

    def window_pending(self, s: State, rid: int) -> bool:
        """R70: whether the running or the staged step's commit would release
        a published window page of ``rid`` (the staged one from the lengths the
        running step leaves, R41)."""
        if s.current is not None and self.releases_published(s.stream_map(), s.current.step, rid):
            return True
        return s.staged is not None and self.releases_published(
            self._settled(s), s.staged.step, rid)

    def stale(self, s: State) -> Key | None:
        """The first stream the staged preplan shares with the step it was built
        over that no longer holds the length it was built from: that step
        committed otherwise than admitted (a fork copy failed). None: the
        preplan may be promoted (R42)."""
        p = s.staged
        if p is None or not self.R42_promotion_checks_basis:
            return None
        st = s.stream_map()
        for k, n in p.basis:
            if k not in st or st[k].stored_len != n:
                return k
        return None
