"""Paged attention over kvref's page tables: the torch reference, one
batched SDPA gather, and FlashInfer's wrappers on CUDA."""

from kvref._moved import moved_attr


def __getattr__(name: str) -> object:
    # the names kvref/attention.py had before the package move: deprecated (kvref._moved)
    return moved_attr(__name__, name)
