"""What a manager publishes about a request for another to retrieve, and the
answer when it publishes nothing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvref.core.refusals import AdmitFailedReason, AdmitRuntimeError
from kvref.core.resource import PublishedInfo


@dataclass
class KVSequenceInfo:
    """One stream as published: its length, where its pages live, and which."""

    seq_len: int
    # the publishing cache's transfer descriptor (`KVTransferManager.get_kv_transfer_info`)
    latest_kv_transfer_info: Any
    # the retained pages: page_indices[i] holds slot released // page_size + i,
    # tokens [(released // ps + i) * ps, ...) (W17 of specs/retention.md)
    page_indices: list[int] = field(default_factory=list)
    # the stream's generation at publish: a retrieve checks the publisher still
    # holds it before and after copying (R35). None: built by hand, unchecked
    generation: int | None = None
    # tokens a windowed stream released, whole pages from the front; they have
    # no page here. 0 (the default, and every full-attention stream): all held
    released: int = 0


@dataclass
class PublishedKVInfo(PublishedInfo):
    """``{rank: {label: KVSequenceInfo}}``: each tensor-parallel rank publishes its shard."""

    info: dict[int, dict[str, KVSequenceInfo]] = field(default_factory=dict)
    world_size: int = 1
    # the publisher's request id: whose streams the generations are of
    request_id: str | None = None

    @classmethod
    def build_for_rank(
        cls, rank: int, world_size: int, seq_info: dict[str, KVSequenceInfo],
        request_id: str | None = None,
    ) -> PublishedKVInfo:
        return cls(info={rank: seq_info}, world_size=world_size, request_id=request_id)

    def update(self, other: PublishedKVInfo) -> None:
        """Merge another rank's (or a later) publication; later labels win."""
        for rank, labels in other.info.items():
            self.info[rank] = {**self.info.get(rank, {}), **labels}
        if other.request_id is not None:
            self.request_id = other.request_id

    def get(self, rank: int) -> dict[str, KVSequenceInfo]:
        return self.info.get(rank, {})


@dataclass(frozen=True, kw_only=True)
class UnknownRequest(AdmitFailedReason):
    """`publish` of a request this manager does not hold: never ingested, or
    removed, possibly by another thread between the engine's forward and its
    publish (R48). Nothing to publish; nothing was leased."""


@dataclass(frozen=True)
class PublishRefused:
    """`publish` published nothing, and why (R36, R48): `UnknownRequest` (never
    ingested, or removed meanwhile), `RequestOffloading` (reload and publish
    again), `RetrieveInProgress` (publish once it landed) or
    `AdmitRuntimeError` (a failed retrieve is latched: terminal). Falsy, so
    ``if not info:`` reads as it did when the answer was None; handing it to
    `admit_retrieve` raises `PublishedInfoError` instead of retrieving nothing."""

    reason: AdmitFailedReason

    def __bool__(self) -> bool:
        return False


class RetrieveStale(AdmitRuntimeError):
    """The published pages no longer hold what was published: the publisher's
    stream changed generation, or is gone (R35). Latched like a failed copy
    (I11): reset the request and retrieve a fresh publication."""


class RetrieveAborted(AdmitRuntimeError):
    """A hybrid label's retrieve whose later group's copy could not start
    after an earlier group's had (H1): a started copy cannot be called back,
    so every group of the label is latched failed, as a failed copy is
    (I11); reset the request (it drains the started copies) and retry."""
