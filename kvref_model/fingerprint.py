"""Fingerprints of visited states and the compact set that holds them.

The checker keeps no visited *state*, only a 64-bit fingerprint of its
canonical byte encoding (as TLC does).  Two distinct states that share a
fingerprint would merge, hiding the second one: `collision_odds` bounds the
chance of that for a run, and the report prints it.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import BinaryIO

BITS = 64
_EMPTY = 0  # slot marker; a fingerprint of 0 is stored as 1 (odds unchanged in practice)
_MAX_LOAD = 0.75  # linear probing stays short below this


def fingerprint(data: bytes) -> int:
    """A 64-bit hash of `data`, the same in every process and every run
    (Python's own hash() is salted per process, which would break resume)."""
    fp = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    return fp or 1


def collision_odds(states: int, bits: int = BITS) -> float:
    """Upper bound on the chance that any two of `states` distinct states
    share a fingerprint (the birthday bound n(n-1)/2 / 2^bits)."""
    return states * (states - 1) / 2 / 2.0**bits


class FingerprintSet:
    """An open-addressing hash set of 64-bit fingerprints in one flat array:
    8 bytes a slot, at most 4/3 slots a state between resizes, so 10.7 to
    21.3 bytes a state (a Python set of ints costs about 90)."""

    def __init__(self, capacity: int = 1 << 10) -> None:
        cap = 1 << max(capacity - 1, 1).bit_length()
        self._slots = array("Q", bytes(8 * cap))
        self._mask = cap - 1
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        return len(self._slots) * 8

    def add(self, fp: int) -> bool:
        """Insert `fp`; True if it was not there yet."""
        slots, mask = self._slots, self._mask
        i = fp & mask
        while True:
            v = slots[i]
            if v == _EMPTY:
                break
            if v == fp:
                return False
            i = (i + 1) & mask
        slots[i] = fp
        self._count += 1
        if self._count > _MAX_LOAD * (mask + 1):
            self._grow()
        return True

    def __contains__(self, fp: object) -> bool:
        if not isinstance(fp, int):
            return False
        slots, mask = self._slots, self._mask
        i = fp & mask
        while True:
            v = slots[i]
            if v == _EMPTY:
                return False
            if v == fp:
                return True
            i = (i + 1) & mask

    def _grow(self) -> None:
        old = self._slots
        cap = 2 * len(old)
        self._slots = array("Q", bytes(8 * cap))
        self._mask = cap - 1
        self._count = 0
        for v in old:
            if v != _EMPTY:
                self.add(v)

    def to_file(self, f: BinaryIO) -> None:
        self._slots.tofile(f)

    @classmethod
    def from_file(cls, f: BinaryIO, slots: int) -> FingerprintSet:
        out = cls(1)
        out._slots = array("Q")
        out._slots.fromfile(f, slots)
        out._mask = slots - 1
        out._count = len(out._slots) - out._slots.count(_EMPTY)
        return out

    def to_bytes(self) -> bytes:
        return self._slots.tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> FingerprintSet:
        out = cls(1)
        out._slots = array("Q")
        out._slots.frombytes(data)
        out._mask = len(out._slots) - 1
        out._count = len(out._slots) - out._slots.count(_EMPTY)
        return out
