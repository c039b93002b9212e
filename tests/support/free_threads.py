"""Free-running threads for the stress checks: each role calls its function
in a loop until the deadline, a typed refusal (`KVRefError`: a call raced
into a state another thread made) is part of the run, anything else ends it
and is raised. The switch interval is shortened so threads interleave
densely; and the end every run checks. Used by tests/concurrency/
test_stress.py and the shared-pages and retention thread checks."""

from __future__ import annotations

import contextlib
import random
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from kvref import KVManager, KVRefError
from kvref.testing.page_checks import check_device_pages

Role = Callable[[random.Random], None]


def run_roles(roles: Sequence[Role], seconds: float) -> None:
    """Run each role on its own thread (seeded by its index) for ``seconds``;
    raise AssertionError if a thread hung or any raised something untyped."""
    stop = time.monotonic() + seconds
    errors: list[BaseException] = []

    def loop(fn: Role, seed: int) -> Callable[[], None]:
        def go() -> None:
            rng = random.Random(seed)
            try:
                while time.monotonic() < stop and not errors:
                    with contextlib.suppress(KVRefError):
                        fn(rng)
            except BaseException as err:
                errors.append(err)
        return go

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=loop(fn, i), name=getattr(fn, "__name__", "role"))
                   for i, fn in enumerate(roles)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + 30)
        assert not any(t.is_alive() for t in threads), "a thread hung"
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors


def remove_all_and_check_nothing_leaked(kv: KVManager, rids: Iterable[str]) -> None:
    """After the threads joined: the page invariant, then every request removed
    and no device or host page lost (I12)."""
    check_device_pages(kv)
    for rid in rids:
        kv.remove_request(rid)
    assert kv.num_free_pages == kv.config.max_num_pages - 1, "I12: device pages leaked"
    pool = kv._cpu_pool
    assert pool is not None and pool.num_free == pool.capacity, "I12: host pages leaked"
