"""Eviction to host memory: an offload's claim, copy, commit or abandon, a
reload, the host page pool, and the typed answers an engine's scheduler
reads (R44-R46)."""

from kvref._moved import moved_attr


def __getattr__(name: str) -> object:
    # the names kvref/offload.py had before the package move: deprecated (kvref._moved)
    return moved_attr(__name__, name)
