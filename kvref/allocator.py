"""Device page free list."""

from __future__ import annotations

from collections import deque


class PageAllocator:
    """FIFO free list over pages ``[0, num_pages)``.

    Invariant: every page is either in ``_free`` (exactly once) or owned by a
    caller; ``_is_free[p]`` mirrors membership so a double free is caught at
    the call that makes it, not pages later as two streams sharing a page.
    FIFO from page 0, so the first allocation is ``[0]``: the manager takes
    it as the sink before anything else can.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"PageAllocator needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._is_free = bytearray(b"\x01") * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def try_allocate(self, n: int) -> list[int] | None:
        """``n`` pages, oldest-freed first, or None (taking nothing) if short."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        free, is_free = self._free, self._is_free
        pages = [free.popleft() for _ in range(n)]
        for p in pages:
            is_free[p] = 0
        return pages

    def free(self, pages: list[int]) -> None:
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
        return bool(self._is_free[page])
