"""The stream table: what every mechanism of a `KVManager` reads and writes.

One object, built by the manager and handed to each mechanism (stepping,
offload, retrieval), so none of them reaches back into the manager. Every
read-modify-write of ``streams`` and every page taken from or given back
to ``allocator`` happens under ``lock``: the manager's one lock, from the
runtime seam so the concurrency tests can schedule it.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from kvref.allocator import PageAllocator
from kvref.config import KVReqConfig
from kvref.errors import UnknownRequestError
from kvref.lease import LeaseTable
from kvref.runtime import Runtime
from kvref.streams import CacheStream

Key = tuple[str, str]  # (request id, label)


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


@dataclass
class StreamTable:
    """Streams per request, the device page allocator, and the lock over both."""

    allocator: PageAllocator
    lock: AbstractContextManager[Any]
    runtime: Runtime
    page_size: int
    # rid -> label -> stream; a request is present from ingest until removal.
    # Passed in: the runtime seam may hand a recording container
    streams: dict[str, dict[str, CacheStream]] = field(default_factory=dict)
    overrides: dict[str, KVReqConfig] = field(default_factory=dict)
    # publish leases (R33): offload, reset and remove read them under ``lock``
    leases: LeaseTable = field(default_factory=lambda: LeaseTable(None, time.monotonic))

    def request(self, rid: str) -> dict[str, CacheStream]:
        streams = self.streams.get(rid)
        if streams is None:
            raise UnknownRequestError("unknown request (never ingested, or removed)",
                                      request_id=rid)
        return streams

    def stream(self, rid: str, label: str) -> CacheStream:
        stream = self.request(rid).get(label)
        if stream is None:
            raise UnknownRequestError("request has no such label", request_id=rid, label=label)
        return stream
