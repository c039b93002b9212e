"""Resident memory of this or another process (Linux /proc; 0 elsewhere)."""

from __future__ import annotations

import os
import resource


def _status(pid: int | str, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss(pid: int | str = "self") -> int:
    """Bytes resident now."""
    return _status(pid, "VmRSS")


def peak_rss(pid: int | str = "self") -> int:
    """Bytes resident at the peak (the high-water mark)."""
    got = _status(pid, "VmHWM")
    if not got and pid in ("self", os.getpid()):
        got = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return got
