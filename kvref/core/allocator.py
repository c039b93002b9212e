"""Device (or host) page free list."""

from __future__ import annotations

from collections import deque

from kvref.core.runtime import Runtime, default_runtime, shared


class PageAllocator:
    """FIFO free list over pages ``[0, num_pages)``; safe to call from any thread.

    Invariant: every page is either in ``_free`` (exactly once) or owned by a
    caller; ``_is_free[p]`` mirrors membership so a double free is caught at
    the call that makes it, not pages later as two streams sharing a page.
    FIFO from page 0, so the first allocation is ``[0]``: the manager takes
    it as the sink before anything else can.

    Every call is one critical section under the allocator's own lock (R30),
    as the reference's allocator: ``try_allocate`` compares the free count
    and pops in one step, so two callers cannot both pass the check and
    then pop more pages than there are.
    """

    def __init__(self, num_pages: int, runtime: Runtime | None = None,
                 name: str = "pages") -> None:
        if num_pages <= 0:
            raise ValueError(f"PageAllocator needs at least one page, got {num_pages}")
        rt = runtime if runtime is not None else default_runtime()
        self.num_pages = num_pages
        self._lock = rt.lock()
        self._free: deque[int] = shared(rt, deque(range(num_pages)), f"{name}.free")
        self._is_free = bytearray(b"\x01") * num_pages

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def try_allocate(self, n: int) -> list[int] | None:
        """``n`` pages, oldest-freed first, or None (taking nothing) if short."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        with self._lock:
            free = self._free
            if n > len(free):
                return None
            is_free = self._is_free
            pages = [free.popleft() for _ in range(n)]
            for p in pages:
                is_free[p] = 0
            return pages

    def free(self, pages: list[int]) -> None:
        with self._lock:
            is_free = self._is_free
            for i, p in enumerate(pages):
                if not 0 <= p < self.num_pages or is_free[p]:
                    # undo this call's marks so a rejected free changes nothing
                    for q in pages[:i]:
                        is_free[q] = 0
                    what = "out of range" if not 0 <= p < self.num_pages else "already free"
                    raise ValueError(f"free of page {p}: {what}")
                is_free[p] = 1
            self._free.extend(pages)

    def is_free(self, page: int) -> bool:
        with self._lock:
            return bool(self._is_free[page])

    def free_pages(self) -> list[int]:
        """A snapshot of the free list, in allocation order (for checks)."""
        with self._lock:
            return list(self._free)
