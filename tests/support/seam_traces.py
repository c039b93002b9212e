"""Short traces at the seams of two mechanisms, replayed on the model and
kvref together (`kvref.testing.exhaustive.run_trace`: results, states, page
holders and keys, host lengths and bytes after every call). Each reaches
the state one interaction plant breaks; tests/conformance/
test_interaction_plants.py runs them clean and with each plant."""

from __future__ import annotations

from kvref.testing.lockstep import SHIPPED_SCOPE as LOCKSTEP_SCOPE
from kvref_model import core as m
from kvref_model.core import replace
from tests.support.sched_harness import SHIPPED_SCOPE as SCHED_SCOPE

# full attention on labels 0 and 1 (a fork between them shares pages and
# the prefix cache keys them), label 2 windowed (W=2, margin 1)
SHARED = SCHED_SCOPE
# labels 1 and 2 windowed alike (W=2, margin 1): forks between windows
WINDOWS = LOCKSTEP_SCOPE
# SHARED with tenants: r0 and r1 salted alike, r2 told apart by a typed
# extra key alone (no salt: `kvref.testing.driver.request_keys`)
TENANTS = replace(SHARED, salts=("a", "a", "lora=b"))


def run(rid: int, label: int, span: int, pre: tuple[tuple[int, int], ...] = (),
        preplan: bool = False) -> list[m.Action]:
    """An engine's whole step: admit, plan, write, commit (a preplan first
    staged and planned, then promoted)."""
    step = m.Step((m.Seg(rid, label, span),), pre_forks=pre, padded=(rid,))
    head: list[m.Action] = [m.Admit(step, preplan=True), m.Plan(preplan=True)] if preplan \
        else []
    return [*head, m.Admit(step), m.Plan(), m.Write(), m.Commit()]


# r0 computes four tokens (two full pages) and keys them; r1 hits them
SHARED_PREFIX = [m.Ingest(0), *run(0, 0, 4), m.CachePrefix(0, 0), m.Ingest(1),
                 m.MatchPrefix(1, 0, 5)]

TRACES: dict[str, tuple[m.Scope, list[m.Action]]] = {
    # the sharer's pages offloaded, then reloaded (shared again, S29)
    "offload and reload under a sharer": (SHARED, [
        *SHARED_PREFIX, m.OffloadClaim(0), m.OffloadCopy(0, 0), m.OffloadCommit(0),
        m.Reload(0), *run(1, 0, 1)]),
    # one sharer reset; the other keys on
    "reset of one sharer": (SHARED, [
        *SHARED_PREFIX, m.Reset(1, False), *run(0, 0, 2), m.CachePrefix(0, 0)]),
    # reset_prefix_cache while a request is on the host (S30)
    "prefix reset while offloaded": (SHARED, [
        m.Ingest(0), *run(0, 0, 2), m.CachePrefix(0, 0), m.OffloadClaim(0),
        m.OffloadCopy(0, 0), m.OffloadCommit(0), m.ResetPrefixCache(), m.Reload(0)]),
    # a windowed stream that released a page, offloaded and reloaded (W8)
    "offload of a window": (SHARED, [
        m.Ingest(0), *run(0, 2, 3), *run(0, 2, 3), m.OffloadClaim(0), m.OffloadCopy(0, 2),
        m.OffloadCommit(0), m.Reload(0), *run(0, 2, 1)]),
    # a fork between windowed labels once the source released a page (W5,
    # W15), and a rollback of the target into its margin
    "fork of a window": (WINDOWS, [
        m.Ingest(0), *run(0, 1, 3), *run(0, 1, 3), *run(0, 1, 0, pre=((1, 2),)),
        m.Truncate(0, 2, 5)]),
    # a copy-on-write fork onto a keyed target, then the target keys on (S23)
    "fork onto a keyed stream": (SHARED, [
        m.Ingest(0), *run(0, 1, 2), m.CachePrefix(0, 1), *run(0, 0, 3), m.CachePrefix(0, 0),
        *run(0, 0, 0, pre=((0, 1),)), *run(0, 1, 3), m.CachePrefix(0, 1)]),
    # a keyed stream truncated back (a rejected draft), then decoded on
    "truncate of a keyed stream": (SHARED, [
        m.Ingest(0), *run(0, 0, 4), m.CachePrefix(0, 0), m.Truncate(0, 0, 2),
        *run(0, 0, 2), m.CachePrefix(0, 0)]),
    # a step with a fork that also writes a windowed stream which released a page
    "fork beside a window's writer": (WINDOWS, [
        m.Ingest(0), *run(0, 1, 3), *run(0, 1, 3), m.Ingest(1), *run(1, 1, 1),
        m.Admit(m.Step((m.Seg(0, 1, 2),), pre_forks=((1, 2),), padded=(0,)))]),
    # a copy-on-write fork whose copy of the partial page fails (R26, R51)
    "failed copy-on-write fork": (SHARED, [
        m.Ingest(0), *run(0, 0, 3), *run(0, 0, 0, pre=((0, 1),)),
        m.Admit(m.Step((m.Seg(0, 0, 0),), pre_forks=((0, 1),), padded=(0,))),
        m.Plan(fork_error=True), m.Commit(), *run(0, 1, 2)]),
    # a peer's KV received, then cache_prefix and a match (R55)
    "received KV keyed": (SHARED, [
        m.Ingest(0), m.RetrieveStart(0, 0, 4), m.RetrieveComplete(0, 0, True),
        m.CachePrefix(0, 0), m.Ingest(1), m.MatchPrefix(1, 0, 5)]),
    # a retrieve into a windowed stream (W16)
    "retrieve into a window": (SHARED, [
        m.Ingest(0), *run(0, 2, 2), m.RetrieveStart(0, 2, 6), m.RetrieveComplete(0, 2, True)]),
    # a shared page truncated into, then written (R52, R54), plainly and preplanned
    "write after a truncate into a shared page": (SHARED, [
        *SHARED_PREFIX, m.Truncate(1, 0, 3), *run(1, 0, 1)]),
    "preplanned write after a truncate into a shared page": (SHARED, [
        *SHARED_PREFIX, m.Truncate(1, 0, 3), *run(1, 0, 1, preplan=True)]),
    # pages keyed as they fill (S33): a followed stream decoded a token a
    # step, truncated back into its keyed pages, decoded on, reset, recomputed
    "decode of a followed stream": (SHARED, [
        m.Ingest(0), *run(0, 0, 1), m.FollowTokens(0, 0), *run(0, 0, 1), *run(0, 0, 1),
        *run(0, 0, 1), m.Truncate(0, 0, 1), *run(0, 0, 1), *run(0, 0, 2), m.Reset(0, True),
        *run(0, 0, 3)]),
    # issue 44's classes, each a seam no layer reached:
    # cache_prefix from a later page, its ids from there (S34)
    "cache_prefix from a keyed page": (SHARED, [
        m.Ingest(0), *run(0, 0, 4), m.CachePrefix(0, 0), *run(0, 0, 2),
        m.CachePrefix(0, 0, start=2), m.CachePrefix(0, 0, start=4)]),
    # a preplanned fork onto a stream that alone holds keyed pages (R57)
    "preplanned fork onto a keyed stream": (SHARED, [
        m.Ingest(0), *run(0, 1, 2), m.CachePrefix(0, 1), *run(0, 0, 3),
        *run(0, 0, 0, pre=((0, 1),), preplan=True), m.Ingest(1), m.MatchPrefix(1, 1, 3)]),
    # a fork of a retrieved stream, then its target keyed (R55)
    "fork of received KV keyed": (SHARED, [
        m.Ingest(0), m.RetrieveStart(0, 0, 4), m.RetrieveComplete(0, 0, True),
        *run(0, 0, 0, pre=((0, 1),)), m.CachePrefix(0, 1), m.FollowTokens(0, 1)]),
    # a window's fork target truncated within its margin into a page it
    # shares, then written (R52 past the released slots)
    "write after a truncate into a window's shared page": (WINDOWS, [
        m.Ingest(0), *run(0, 1, 3), *run(0, 1, 3), *run(0, 1, 0, pre=((1, 2),)),
        m.Truncate(0, 2, 5), *run(0, 2, 1)]),
    # a followed stream forked into from a keyed one: its label changes (S25, S33)
    "fork into a followed stream": (SHARED, [
        m.Ingest(0), *run(0, 1, 1), m.FollowTokens(0, 1), *run(0, 0, 2), m.CachePrefix(0, 0),
        *run(0, 0, 0, pre=((0, 1),)), *run(0, 1, 2)]),
    # a reset that keeps its pages, over two keyed pages only it holds (S6, R62)
    "reset keeping keyed pages": (SHARED, [
        m.Ingest(0), *run(0, 0, 4), m.CachePrefix(0, 0), m.Reset(0, False)]),
    # a reload whose copy fails, taking two pages (I17)
    "failed reload of two pages": (SHARED, [
        m.Ingest(0), *run(0, 0, 4), m.OffloadClaim(0), m.OffloadCopy(0, 0),
        m.OffloadCommit(0), m.Reload(0, copy_error=True)]),
    # a request told apart by extra keys alone keys one page (S25)
    "a page keyed under extra keys": (TENANTS, [
        m.Ingest(2), *run(2, 0, 2), m.CachePrefix(2, 0), m.Ingest(0), m.MatchPrefix(0, 0, 3)]),
    # a request id used again by another tenant (S25, S22)
    "a request id used again": (TENANTS, [
        m.Ingest(2), m.Remove(2), m.Ingest(0), *run(0, 0, 2), m.CachePrefix(0, 0),
        m.Ingest(1), m.MatchPrefix(1, 0, 3)]),
    # two followed requests fill the same page in one step: the first segment's
    # page takes the key (S11), the other stays its own
    "one step fills a key twice": (SHARED, [
        m.Ingest(0), m.Ingest(1), m.FollowTokens(0, 0), m.FollowTokens(1, 0),
        m.Admit(m.Step((m.Seg(0, 0, 2), m.Seg(1, 0, 2)), padded=(0, 1))), m.Plan(),
        m.Write(), m.Commit(), m.Remove(1), m.Remove(0), m.NumFree()]),
    # a retrieve into a request whose own publication is leased (R71): a
    # windowed stream's release of the published slot 0 (W16), then a
    # full-attention keyed page truncated into and copied first (R52), by a
    # retrieve and by a step
    "retrieve into a leased window": (SHARED, [
        m.Ingest(0), *run(0, 2, 2), m.Publish(0), m.RetrieveStart(0, 2, 6),
        m.ReleasePublished(0), m.RetrieveStart(0, 2, 6), m.RetrieveComplete(0, 2, True)]),
    "write after a truncate into a keyed page, leased": (SHARED, [
        m.Ingest(0), *run(0, 0, 2), m.CachePrefix(0, 0), m.Truncate(0, 0, 1), m.Publish(0),
        m.RetrieveStart(0, 0, 3), m.Admit(m.Step((m.Seg(0, 0, 1),), padded=(0,))),
        m.LeaseTimeout(), *run(0, 0, 1)]),
}
