"""Publish and retrieve between managers: the public face of
`kvref.transfer.retrieval` (the lease, R33-R37)."""

from __future__ import annotations

from kvref import validate
from kvref.stepping.step import AdmitOutcome
from kvref.transfer.published import PublishedKVInfo, PublishRefused
from kvref.transfer.retrieval import Retrieval


class TransferCalls:
    """KV transfer between managers; `KVManager` is one."""

    # set by the subclass's constructor
    _retrieval: Retrieval
    _rank: int

    def publish(self, request_id: str) -> PublishedKVInfo | PublishRefused:
        """What another manager needs to retrieve this request's KV, leased.

        The pages it names are pinned until `release_published` or the lease
        timeout (`KVConfig.publish_lease_s`): meanwhile `begin_offload` and
        `offload` refuse (None, 0) and `reset_request` and `remove_request`
        raise `PublishLeasedError` (R33). Publishing again renews the lease and
        stamps the generations now (R34). Each stream's generation travels
        with it: a retrieve of pages changed since is refused, latched (R35).
        A falsy `PublishRefused` when the request is not held (`UnknownRequest`:
        never ingested, or removed, perhaps by another thread since the
        forward; R48), or any stream is off the device (`RequestOffloading`),
        still receiving a retrieve (`RetrieveInProgress`) or holds a failed
        one (`AdmitRuntimeError`): its pages do not hold what its length
        counts (R36). Only a request id that is not a `str` raises.
        """
        validate.request_id(request_id, "publish")
        return self._retrieval.publish(request_id)

    def release_published(self, request_id: str) -> None:
        """End the lease `publish` took: the peer copied what it needed (R34).

        Idempotent, also for a request whose lease expired or that is gone: the
        consumer cannot tell those from a lease it still holds.
        """
        validate.request_id(request_id, "release_published")
        self._retrieval.release_published(request_id)

    def admit_retrieve(
        self,
        rid: str,
        node_name: str | None = None,
        graph_walk: str | None = None,
        published: PublishedKVInfo | None = None,
    ) -> AdmitOutcome:
        """Start copying what another manager published; ready once it landed.

        ``node_name``/``graph_walk`` route the labels through the request's
        `KVReqConfig` (the reference's call); without them (an engine without a
        graph) every published label is retrieved, and readiness covers every
        label (R37). ``published=None`` is a readiness check that starts
        nothing (R29). ``ok=True, ready=False`` while a copy runs; a failed
        copy is latched and reported on every later call (I11) until reset or
        removal, and so is a publication whose pages changed since publish
        (`RetrieveStale`, R35). A `PublishRefused` raises `PublishedInfoError`.
        """
        validate.request_id(rid, "admit_retrieve")
        if node_name is not None or graph_walk is not None:
            validate.label(node_name, "admit_retrieve", rid, what="node_name")
            validate.label(graph_walk, "admit_retrieve", rid, what="graph_walk")
        validate.published(published, rid, self._rank)
        return self._retrieval.admit_retrieve(rid, node_name, graph_walk, published)
