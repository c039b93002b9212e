"""KV transfer between managers: a publish and its lease, a retrieve, and
the transfer engines that move pages in one process, over shared memory or
over CUDA IPC (R33-R37)."""

from kvref._moved import moved_attr


def __getattr__(name: str) -> object:
    # the names kvref/transfer.py had before the package move: deprecated (kvref._moved)
    return moved_attr(__name__, name)
