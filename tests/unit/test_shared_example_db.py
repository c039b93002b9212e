"""Two nodes share failures through a real Redis (issue 41).

A ``redis-server`` started here on localhost; node A's lockstep finds a
planted bug and saves it (its local directory and Redis); node B, with an
empty local directory and the same Redis, runs only Hypothesis's reuse
phase (saved examples, nothing generated) and fails on its first example;
node C, the control, the same without Redis, runs nothing and passes.
Skipped where redis-server or the redis client is not installed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.example_db import redis_url, shared_database

ROOT = Path(__file__).resolve().parents[2]
PLANT = "a: a second step is admitted"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def redis_address(tmp_path: Path) -> Iterator[str]:
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    redis = pytest.importorskip("redis")
    port = free_port()
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                time.sleep(0.05)
        else:
            pytest.fail("redis-server did not answer within 5 s")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def node(where: Path, redis: str | None, phases: str, examples: int) -> dict[str, object]:
    where.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "KVREF_HYPOTHESIS_REDIS"}
    env.update(PYTHONPATH=str(ROOT), HYPOTHESIS_PROFILE="nightly",
               KVREF_TRACE_DIR=str(where / "traces"))
    if redis is not None:
        env["KVREF_HYPOTHESIS_REDIS"] = redis
    out = subprocess.run([sys.executable, "-m", "tests.support.shared_db_child", PLANT,
                          phases, str(examples)], cwd=where, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_address_forms() -> None:
    assert redis_url("10.0.0.5:6379") == "redis://10.0.0.5:6379/0"
    assert redis_url("h:1/2") == "redis://h:1/2"
    assert redis_url("redis://h:1/3") == "redis://h:1/3"
    with pytest.raises(ValueError, match="host:port"):
        redis_url("nohost")
    assert shared_database({}) is None


@pytest.mark.slow  # three processes: about 20 s on a quiet machine
def test_a_failure_found_on_one_node_is_replayed_first_on_another(
        redis_address: str, tmp_path: Path) -> None:
    a = node(tmp_path / "a", redis_address, "generate", 300)
    assert a["failed"], f"node A did not find the plant: {a}"
    b = node(tmp_path / "b", redis_address, "reuse", 300)
    assert b["failed"] and b["at"] == 1, f"node B did not replay A's failure first: {b}"
    c = node(tmp_path / "c", None, "reuse", 300)
    assert not c["failed"] and c["ran"] == 0, f"without Redis, node C ran something: {c}"
    # B's failure is A's: the same first disagreement
    assert b["error"] == a["error"]
