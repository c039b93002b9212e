"""The BFS frontier on disk: one file per level, in fixed-size chunks.

A level of a deep scope holds hundreds of thousands of states; in memory
they would dominate the checker's footprint.  States travel as pickled
bytes in chunks of `CHUNK` entries; the chunk is also the unit of work a
worker process gets, so its boundaries must not depend on the worker count
(they depend only on the order states were accepted in).
"""

from __future__ import annotations

import os
import pickle
import tempfile
from collections.abc import Iterator
from typing import BinaryIO

CHUNK = 256
Entry = tuple[int, bytes]  # (state id, pickled state)


class LevelWriter:
    """Appends entries to a level file, a chunk (one pickle record) at a time."""

    def __init__(self, directory: str) -> None:
        fd, self.path = tempfile.mkstemp(prefix="level-", suffix=".q", dir=directory)
        self._f: BinaryIO = os.fdopen(fd, "w+b")
        self.buffer: list[Entry] = []
        self.count = 0  # entries, buffered ones included

    def append(self, entry: Entry) -> None:
        self.buffer.append(entry)
        self.count += 1
        if len(self.buffer) == CHUNK:
            self._flush()

    def _flush(self) -> None:
        if self.buffer:
            pickle.dump(self.buffer, self._f, protocol=pickle.HIGHEST_PROTOCOL)
            self.buffer = []

    def size(self) -> int:
        """Bytes of full chunks so far (a checkpoint copies them; `buffer`
        holds the rest)."""
        self._f.flush()
        return os.path.getsize(self.path)

    def copy_to(self, out: BinaryIO) -> None:
        with open(self.path, "rb") as f:
            copy(f, out, self.size())

    def restore(self, src: BinaryIO, nbytes: int, buffer: list[Entry], count: int) -> None:
        copy(src, self._f, nbytes)
        self.buffer = list(buffer)
        self.count = count

    def close(self) -> LevelReader:
        """Flush and reopen for reading as the next level."""
        self._flush()
        self._f.close()
        return LevelReader(self.path, self.count)


class LevelReader:
    """Reads a level file chunk by chunk; `offset` is where the next one starts."""

    def __init__(self, path: str, count: int, offset: int = 0) -> None:
        self.path = path
        self.count = count
        self._f = open(path, "rb")  # noqa: SIM115 - closed by close()
        self._f.seek(offset)

    def chunks(self) -> Iterator[tuple[int, list[Entry]]]:
        """(offset of the chunk, its entries), to the end of the file."""
        while True:
            at = self._f.tell()
            try:
                chunk: list[Entry] = pickle.load(self._f)
            except EOFError:
                return
            yield at, chunk

    def position(self) -> int:
        return self._f.tell()

    def size_from(self, offset: int) -> int:
        return os.path.getsize(self.path) - offset

    def copy_from(self, offset: int, out: BinaryIO) -> None:
        """The file from `offset` on into `out` (for a checkpoint)."""
        with open(self.path, "rb") as f:
            f.seek(offset)
            copy(f, out, self.size_from(offset))

    def close(self) -> None:
        self._f.close()
        os.unlink(self.path)


def level_from(directory: str, src: BinaryIO, nbytes: int, count: int) -> LevelReader:
    w = LevelWriter(directory)
    w.restore(src, nbytes, [], count)
    return w.close()


def copy(src: BinaryIO, dst: BinaryIO, nbytes: int) -> None:
    """`nbytes` from `src` to `dst`, a megabyte at a time (a level can be
    hundreds of megabytes: it must not pass through memory whole)."""
    while nbytes > 0:
        block = src.read(min(nbytes, 1 << 20))
        if not block:
            raise EOFError("checkpoint truncated")
        dst.write(block)
        nbytes -= len(block)
