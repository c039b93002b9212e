"""Admit, plan and commit: one step running and one preplanned (R23). The
step vocabulary, admission's grants and refusals, page tables and write
slots, forks, truncation, CUDA-graph staging, and the K/V reads and writes
attention layers make between plan and commit."""

from kvref._moved import moved_attr


def __getattr__(name: str) -> object:
    # the names kvref/stepping.py had before the package move: deprecated (kvref._moved)
    return moved_attr(__name__, name)
