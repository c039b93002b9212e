"""The transfer engines' names, configuration and errors, shared by
`kvref.transfer.engine` (the manager of retrieves) and `kvref.transfer.memory`
(where the pages live and how they are copied)."""

from __future__ import annotations

from dataclasses import dataclass

from kvref.core.errors import KVRefError

KINDS = ("local", "shm", "cuda_ipc")

# where POSIX shm_open puts its names on Linux; torch maps the file itself
_SHM_DIR = "/dev/shm"


class TransferError(KVRefError):
    """A retrieve that could not run: its future raises this (or a subclass)."""


class StaleSourceError(TransferError):
    """The publisher's stream moved past the generation it published (or is
    gone) before or while its pages were copied: the copy is not its KV (R35)."""


class RemoteCacheGoneError(TransferError):
    """The descriptor names a cache that no longer exists (cleaned up, process gone)."""


class InjectedTransferError(TransferError):
    """A failure asked for through `KVTransferManager.fail_next` (tests, fault drills)."""


class TransferConfigError(KVRefError, ValueError):
    """An engine or cache that cannot work as configured; raised at construction."""


class TransferRangeError(KVRefError, ValueError):
    """A retrieve whose token range or page lists do not fit either cache."""


@dataclass(frozen=True)
class TransferEngineInfo:
    """How a worker's caches are shared (the engine hands this to every manager)."""

    kind: str = "local"
    # shm segment names are this plus a random suffix: lets an operator (and
    # the tests) find what a crashed worker left in /dev/shm
    shm_prefix: str = "kvref_"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise TransferConfigError(
                f"TransferEngineInfo.kind must be one of {KINDS}, got {self.kind!r}"
            )
        if "/" in self.shm_prefix or len(self.shm_prefix) > 200:
            raise TransferConfigError(
                f"TransferEngineInfo.shm_prefix {self.shm_prefix!r}: no '/', at most 200 chars"
            )
