"""The example database nightly runs on several nodes share.

``KVREF_HYPOTHESIS_REDIS=host:port[/db]`` (or a ``redis://`` URL): Hypothesis
saves every failing example to a Redis server as well as to the local
``.hypothesis/`` directory, and reads both, so a failure one node found is
replayed first by every node's next run (its reuse phase runs saved
examples before generating any). Needs the ``redis`` client (the
``nightly`` extra, ``hypothesis[redis]``). Unset: the profiles keep
Hypothesis's own default, the local directory only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    ExampleDatabase,
    MultiplexedDatabase,
)

ENV = "KVREF_HYPOTHESIS_REDIS"


def redis_url(address: str) -> str:
    """``host:port[/db]`` or a URL, as a ``redis://`` URL."""
    if "://" in address:
        return address
    host, _, rest = address.partition(":")
    port, _, db = rest.partition("/")
    if not host or not port.isdigit():
        raise ValueError(f"{ENV}={address!r}: expected host:port[/db] or redis://...")
    return f"redis://{host}:{port}/{db or 0}"


def shared_database(env: Mapping[str, str] = os.environ,
                    local: str = os.path.join(".hypothesis", "examples")
                    ) -> ExampleDatabase | None:
    """The local directory and the Redis server ``env`` names, as one
    database; None where none is named."""
    address = env.get(ENV)
    if not address:
        return None
    try:
        import redis
        from hypothesis.extra.redis import RedisExampleDatabase
    except ImportError as err:  # asked for by name: say what is missing
        raise ImportError(f"{ENV} is set but the redis client is not installed: "
                          "pip install 'kvref[nightly]'") from err
    client = redis.Redis.from_url(redis_url(address))
    return MultiplexedDatabase(DirectoryBasedExampleDatabase(local),
                               RedisExampleDatabase(client))
