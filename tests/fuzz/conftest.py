"""The example database HypoFuzz workers share (docs/gpu-and-nightly.md, "Long fuzzing").

``KVREF_HYPOTHESIS_DB`` names it: a directory (on a filesystem every worker
mounts) or ``redis://host:port/db`` (needs ``hypothesis[redis]``). Loaded
here, before the targets are collected, because HypoFuzz fuzzes only tests
whose database is the default one. Unset: the default ``.hypothesis/``.
"""

from __future__ import annotations

import os

from hypothesis import settings
from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

_where = os.environ.get("KVREF_HYPOTHESIS_DB")
if _where:
    database: ExampleDatabase
    if _where.startswith("redis://"):
        import redis  # type: ignore[import-not-found]
        from hypothesis.extra.redis import RedisExampleDatabase

        database = RedisExampleDatabase(redis.Redis.from_url(_where))
    else:
        database = DirectoryBasedExampleDatabase(_where)
    settings.register_profile("fuzz-shared", parent=settings.get_profile("dev"),
                              database=database)
    settings.load_profile("fuzz-shared")
