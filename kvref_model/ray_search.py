"""The search of kvref_model.search on a Ray cluster (`check --ray`).

The same breadth-first search, level by level and chunk by chunk; only where
the work runs changes:

- the chunks are expanded by `Expander` actors (one per worker), anywhere on
  the cluster, each with its own copy of the spec built from a factory;
- the visited set is cut by fingerprint into `Partition` actors: a
  fingerprint's partition is its high bits modulo their number (the low bits
  index each partition's own table, so they must stay spread);
- an expander asks the partitions, in one batch per chunk, which of its
  successors are visited already, and encodes and state-checks only the
  rest (TLC's distributed workers ask their fingerprint servers likewise);
- this process still merges each chunk's results in chunk order, asking the
  partitions which successors are new: so the states, their ids, parents
  and shortest traces, the counts and the verdict are those of one process.

What an expander is told is visited is only ever a subset of what the merge
took before its chunk (merges go in chunk order, and a chunk's results are
merged only after its expander answered): it only spares the merge work, it
never decides which state is new.

Ray is optional (the `ray` extra); nothing else in kvref_model imports this.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from array import array
from collections.abc import Callable, Generator, Iterable, Iterator
from pathlib import Path
from typing import Any

from kvref_model.fingerprint import FingerprintSet, fingerprint
from kvref_model.frontier import Entry
from kvref_model.memory import peak_rss, rss
from kvref_model.search import ChunkResult, Search, Spec, expand_chunk, finish_chunk, successors

SpecFactory = Callable[[], Spec]


class RayUnavailable(RuntimeError):
    """`--ray` without Ray installed, or a cluster that cannot be reached."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RayUnavailable(
            "Ray is not installed: pip install 'kvref[ray]' (or pip install ray)") from None
    return ray


def source_digest() -> str:
    """A digest of kvref_model's sources: the driver and every actor must run
    the same model, or the merge would mix two searches."""
    h = hashlib.blake2b(digest_size=12)
    here = Path(__file__).resolve().parent
    for f in sorted(here.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def partition_of(fp: int, n: int) -> int:
    return (fp >> 40) % n


def split(fps: Iterable[int], n: int) -> list[array[int]]:
    """Fingerprints by partition, each list in the order given."""
    out = [array("Q") for _ in range(n)]
    for fp in fps:
        out[partition_of(fp, n)].append(fp)
    return out


class Partition:
    """One slice of the visited set (a Ray actor)."""

    def __init__(self) -> None:
        self.fps = FingerprintSet()

    def add(self, data: bytes) -> bytes:
        """Add the fingerprints, in order; those that were new."""
        got = array("Q")
        got.frombytes(data)
        new = array("Q", [fp for fp in got if self.fps.add(fp)])
        return new.tobytes()

    def known(self, data: bytes) -> bytes:
        got = array("Q")
        got.frombytes(data)
        fps = self.fps
        return array("Q", [fp for fp in got if fp in fps]).tobytes()

    def stats(self) -> tuple[int, int, int]:
        """(fingerprints held, bytes of the table, peak resident bytes)."""
        return len(self.fps), self.fps.nbytes, peak_rss()


class Expander:
    """A worker (a Ray actor): expands the chunks it is sent."""

    def __init__(self, factory: SpecFactory, digest: str, partitions: list[Any]) -> None:
        mine = source_digest()
        if mine != digest:
            raise RayUnavailable(
                f"this node's kvref_model ({mine}) is not the driver's ({digest}): "
                "start the cluster from the same checkout, or let check --ray ship it")
        self.spec = factory()
        self.partitions = partitions

    def node(self) -> str:
        """The id of the cluster node this actor runs on."""
        import ray
        got: str = ray.get_runtime_context().get_node_id()
        return got

    def expand(self, chunk: list[Entry], expand: bool, leaves: bool
               ) -> tuple[bytes, int, int, int]:
        """(the pickled ChunkResult, fingerprint bytes asked, resident and
        peak resident bytes of this process)."""
        import ray
        res = expand_chunk(self.spec, chunk, expand, leaves, defer=True)
        n = len(self.partitions)
        parts = split(successors(res), n)
        asks = [(p, a) for p, a in enumerate(parts) if a]
        known: set[int] = set()
        for got in ray.get([self.partitions[p].known.remote(a.tobytes()) for p, a in asks]):
            known.update(array("Q", got))
        res = finish_chunk(self.spec, res, leaves, known)
        data = pickle.dumps(res, pickle.HIGHEST_PROTOCOL)
        return data, 8 * sum(len(a) for _, a in asks), rss(), peak_rss()


class _Handle:
    def __init__(self, pool: RayPool, worker: int, ref: Any) -> None:
        self.pool, self.worker, self.ref = pool, worker, ref

    def get(self) -> ChunkResult:
        data, asked, now, peak = self.pool.ray.get(self.ref)
        self.pool.received += len(data)
        self.pool.asked += asked
        self.pool.seen[self.worker] = (now, peak)
        res: ChunkResult = pickle.loads(data)
        return res


class RayPool:
    """The Expander and Partition actors of one search, spread over the cluster."""

    def __init__(self, ray: Any, factory: SpecFactory, workers: int, partitions: int) -> None:
        self.ray = ray
        spread = {"scheduling_strategy": "SPREAD"}
        part = ray.remote(num_cpus=0, **spread)(Partition)
        exp = ray.remote(num_cpus=1, **spread)(Expander)
        self.partitions = [part.remote() for _ in range(partitions)]
        digest = source_digest()
        self.expanders = [exp.remote(factory, digest, self.partitions) for _ in range(workers)]
        self.seen: dict[int, tuple[int, int]] = {}  # per expander: (resident, peak)
        self.sent = 0  # bytes of states sent to expanders
        self.received = 0  # bytes of pickled chunk results back
        self.asked = 0  # bytes of fingerprints expanders asked partitions about
        self.merged = 0  # bytes of fingerprints the merge sent partitions

    def submit(self, i: int, task: tuple[list[Entry], bool, bool], taken: Any) -> _Handle:
        w = i % len(self.expanders)
        chunk = task[0]
        self.sent += sum(len(d) + 16 for _, d in chunk)
        return _Handle(self, w, self.expanders[w].expand.remote(*task))

    def trim(self, taken: Any) -> None:
        pass  # expanders keep nothing of what the merge took: they ask

    def add(self, fps: list[int]) -> set[int]:
        """Add to the visited set; the fingerprints that were new."""
        n = len(self.partitions)
        parts = split(fps, n)
        self.merged += 8 * len(fps)
        new: set[int] = set()
        for got in self.ray.get([self.partitions[p].add.remote(a.tobytes())
                                 for p, a in enumerate(parts) if a]):
            new.update(array("Q", got))
        return new

    def partition_stats(self) -> list[tuple[int, int, int]]:
        got: list[tuple[int, int, int]] = self.ray.get([p.stats.remote()
                                                        for p in self.partitions])
        return got

    def memory(self) -> int:
        return sum(now for now, _ in self.seen.values())

    def peaks(self) -> list[int]:
        """Each expander's peak resident bytes (as of its last chunk)."""
        return [self.seen.get(w, (0, 0))[1] for w in range(len(self.expanders))]

    def stop(self) -> None:
        for a in [*self.expanders, *self.partitions]:
            self.ray.kill(a)


class RaySearch(Search):
    """`Search`, its workers Ray actors and its visited set in Ray actors.

    `address`: a running cluster's (``"auto"``, ``"ray://host:10001"``, ...);
    None or "": `ray.init()`'s own choice (RAY_ADDRESS, else a local Ray for
    this run). Ray already initialised by the caller is used as it is.
    Checkpoints are not supported (the visited set lives in the actors)."""

    def __init__(self, factory: SpecFactory, *, address: str | None = None,
                 partitions: int | None = None, **kwargs: Any) -> None:
        if kwargs.get("checkpoint") or kwargs.get("resume"):
            raise ValueError("checkpoints are not supported on Ray")
        super().__init__(factory(), **kwargs)
        self.ray = import_ray()
        self.factory = factory
        self.address = address
        self.n_partitions = partitions or self.workers
        self._share_taken = False
        self._started_ray = False
        self.pool: RayPool | None = None
        self._accepted = 1  # the root
        # per partition: (fingerprints, table bytes, peak resident bytes)
        self.partition_stats: list[tuple[int, int, int]] = []
        self.traffic: dict[str, int] = {}
        self.nodes: list[str] = []  # each expander's cluster node

    def _connect(self) -> None:
        ray = self.ray
        if ray.is_initialized():
            return
        here = os.path.dirname(os.path.abspath(__file__))
        try:
            # ship this checkout's kvref_model to every node: the actors must
            # run the driver's model, whatever the nodes have installed
            ray.init(address=self.address or None, log_to_driver=False,
                     runtime_env={"py_modules": [here]})
        except (ConnectionError, RuntimeError, ValueError) as err:
            raise RayUnavailable(f"cannot reach a Ray cluster at {self.address!r}: {err}") from err
        self._started_ray = True

    def _open_pool(self) -> RayPool:
        self._connect()
        self.pool = RayPool(self.ray, self.factory, self.workers, self.n_partitions)
        self.nodes = self.ray.get([e.node.remote() for e in self.pool.expanders])
        # the root (_start added it to this process's set) goes to its partition
        spec = self.spec
        self.pool.add([fingerprint(spec.key(spec.model.init()))])
        return self.pool

    def _accepting(self, res: ChunkResult) -> Callable[[int], bool]:
        assert self.pool is not None
        new = self.pool.add(successors(res))
        self._accepted += len(new)
        return new.__contains__

    def _visited_count(self) -> int:
        # the states the merge took: the partitions may hold more, added
        # past a violation the search stopped at
        return len(self.parents)

    def run(self) -> Iterator[tuple[int, bytes]]:
        try:
            yield from super().run()
        finally:
            if self.pool is not None:
                pool = self.pool
                self.traffic = {"states_sent": pool.sent, "results_received": pool.received,
                                "fingerprints_asked": pool.asked,
                                "fingerprints_merged": pool.merged}
                if self.partition_stats:  # the visited set is theirs, not this process's
                    self.report.visited_bytes = (sum(b for _, b, _ in self.partition_stats)
                                                 + 6 * len(self.parents))
            if self._started_ray:
                self.ray.shutdown()

    def _levels(self, *args: Any) -> Generator[tuple[int, bytes], None, None]:
        yield from super()._levels(*args)
        if self.pool is not None:  # before the pool stops
            self.partition_stats = self.pool.partition_stats()
