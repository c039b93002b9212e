"""A new attention type is one new class (issue 29, build item 3).

`ChunkedLocal` below is chunked local attention (Llama 4's, vLLM's
ChunkedLocalAttentionManager): a token reads only the tokens of its own
chunk of ``chunk`` tokens, so everything before the current chunk's start
may go. This one is the test's own, uncached, on a label; kvref's, for a
hybrid model's chunked group, is `kvref.core.labels.ChunkedLocal`. It is
plugged into a manager's table (`StreamTable.behaviours`) with no edit to
any mechanism, and admission, plan, commit, truncate, forks, offload,
reload, the prefix cache and
`read_stream` follow it: each check below is worked out here from the
chunk rule, not read back from kvref.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvref import KVStep, PreplanRefused, ReleasedPrefixError, Segment, StepContext
from kvref.core.errors import InvalidArgumentError
from kvref.core.labels import LabelBehaviour
from kvref.manager import KVManager
from kvref.testing.page_checks import check_device_pages
from tests.unit._manager_fixtures import check_conservation, make_manager
from tests.unit.test_retention import HEADS, LAYERS, PS, kv_of, step

CHUNK = 8  # two pages of PS = 4


@dataclass(frozen=True)
class ChunkedLocal:
    """Chunked local attention: the next token of a stream ``n`` long reads
    from its chunk's start ``n // chunk * chunk``; whole pages before it go."""

    chunk: int

    @property
    def releases(self) -> bool:
        return True

    @property
    def cacheable(self) -> bool:
        return False  # a released chunk cannot be hit

    def first_read(self, length: int) -> int:
        return length // self.chunk * self.chunk

    def released_after(self, released: int, length: int, page_size: int) -> int:
        return max(released, self.first_read(length) // page_size * page_size)

    def next_release(self, released: int, page_size: int) -> int:
        # the first chunk start past the page after ``released``
        return -(-(released + page_size) // self.chunk) * self.chunk


@dataclass(frozen=True)
class ChunkedLocalBefore:
    """The same type written before `LabelBehaviour.next_release`, as an
    engine's own class may be: no ``next_release``."""

    chunk: int
    releases = True
    cacheable = False

    def first_read(self, length: int) -> int:
        return length // self.chunk * self.chunk

    def released_after(self, released: int, length: int, page_size: int) -> int:
        return max(released, self.first_read(length) // page_size * page_size)


def chunked(labels: tuple[str, ...] = ("c",), **kw: object) -> KVManager:
    kw.setdefault("pages", 32)
    kv = make_manager(page_size=PS, heads=HEADS, head_dim=4, layers=LAYERS, **kw)
    behaviour: LabelBehaviour = ChunkedLocal(CHUNK)
    for label in labels:
        kv._table.behaviours[label] = behaviour  # the one place it is named
    return kv


def reads_its_chunk(kv: KVManager, rid: str, label: str) -> None:
    n = kv.stored_len(rid, label)
    first = n // CHUNK * CHUNK
    got = kv.read_stream(rid, label)
    want = torch.tensor([[kv_of(p, layer) for p in range(first, n)] for layer in range(LAYERS)])
    assert torch.equal(got[:, :, 0, 0, 0], want)


def held(kv: KVManager, rid: str, label: str) -> tuple[int, int]:
    s = kv._streams[rid][label]
    return s.released, len(s.page_indices)


def test_a_commit_releases_what_the_chunk_no_longer_reads() -> None:
    kv = chunked()
    step(kv, "r", "c", 13)  # chunk of token 13 starts at 8: slots 0, 1 go
    assert held(kv, "r", "c") == (8, 2)
    reads_its_chunk(kv, "r", "c")
    step(kv, "r", "main", 13)  # a full-attention label beside it keeps everything
    assert held(kv, "r", "main") == (0, 4)
    for n in range(14, 26):  # decode across the next chunk boundary (16, 24)
        step(kv, "r", "c", 1)
        assert held(kv, "r", "c")[0] == n // CHUNK * CHUNK
        reads_its_chunk(kv, "r", "c")
    kv.remove_request("r")
    assert kv.num_free_pages == 31  # the sink page aside


def test_admission_and_the_plan_count_from_the_released_prefix() -> None:
    kv = chunked()
    step(kv, "r", "c", 15)  # released 8, slots 2, 3 held
    s = KVStep([Segment("r", "c", 2)])  # to 17: slot 4 is new
    ctx = StepContext(("r",))
    assert kv.pages_needed(s, ctx) == 1
    free = kv.num_free_pages
    assert kv.admit(s, ctx).ok and kv.num_free_pages == free - 1
    (view,) = [v for o in kv.plan(s, ctx).values() for v in o.views]
    assert (view.offset, view.length) == (8, 17 - 8)
    kv.commit(s, ctx)
    assert held(kv, "r", "c") == (16, 1) and kv.num_free_pages == free + 1
    check_conservation(kv)


def test_truncate_into_what_the_chunk_released_is_refused() -> None:
    kv = chunked()
    step(kv, "r", "c", 18)  # released 16
    with pytest.raises(ReleasedPrefixError):
        kv.truncate("r", "c", 15)  # its chunk would start at 8
    assert kv.truncate("r", "c", 16) == 1  # from 16 it reads nothing released
    reads_its_chunk(kv, "r", "c")


def test_forks_carry_the_released_prefix_and_join_only_the_same_type() -> None:
    kv = chunked(labels=("c", "c2"))
    step(kv, "r", "c", 13)
    step(kv, "r", "c", 0, pre_forks=(("c", "c2"),))
    assert held(kv, "r", "c2") == held(kv, "r", "c") == (8, 2)
    reads_its_chunk(kv, "r", "c2")
    with pytest.raises(InvalidArgumentError):
        kv.admit(KVStep([Segment("r", "c", 0)], pre_forks=(("c", "main"),)),
                 StepContext(("r",)))
    # a preplan may not fork a label that releases (R67)
    running = KVStep([Segment("r", "c", 1)])
    assert kv.admit(running, StepContext(("r",))).ok
    pre = kv.admit(KVStep([Segment("r", "c2", 1)], pre_forks=(("c", "c2"),)),
                   StepContext(("r",), is_preplan=True))
    assert not pre.ok and isinstance(pre.reason, PreplanRefused)
    kv.plan(running, StepContext(("r",)))
    kv.commit(running, StepContext(("r",)))
    check_device_pages(kv)


def test_offload_moves_only_the_pages_the_chunk_keeps() -> None:
    kv = chunked(cpu_pages=16)
    step(kv, "r", "c", 22)  # released 16: slots 4, 5
    free = kv.num_free_pages
    assert kv.offload_outcome("r").pages_freed == 2 and kv.num_free_pages == free + 2
    assert kv.reload_outcome("r").pages_taken == 2
    assert held(kv, "r", "c") == (16, 2)
    reads_its_chunk(kv, "r", "c")
    step(kv, "r", "c", 3)  # 25: chunk at 24, slot 6
    assert held(kv, "r", "c") == (24, 1)
    reads_its_chunk(kv, "r", "c")


def test_its_pages_are_neither_cached_nor_hit() -> None:
    kv = chunked()
    step(kv, "r", "c", 6)
    assert kv.cache_prefix("r", "c", list(range(6))) == 0
    kv.ingest_request("q")
    assert kv.match_prefix("q", "c", list(range(6))) == 0


@pytest.mark.parametrize("kind", [ChunkedLocal, ChunkedLocalBefore])
def test_a_decode_batch_releases_as_row_by_row(kind: type) -> None:
    """A decode batch of its rows (`StreamBatch`, from two rows here) lets go
    of what each chunk passes at the batch's own commits, as stepping row
    by row does; a class without ``next_release`` is never made a batch."""
    fast, slow = chunked(), chunked()
    for kv in (fast, slow):
        kv._table.behaviours["c"] = kind(CHUNK)
    fast._stepping.batch_rows = 2
    rids = ["a", "b", "c"]
    for kv in (fast, slow):
        for i, rid in enumerate(rids):
            step(kv, rid, "c", 3 + 2 * i)
    batches = set()
    for _ in range(20):
        for kv in (fast, slow):
            s = KVStep([Segment(r, "c", 1) for r in rids])
            ctx = StepContext(tuple(rids))
            assert kv.admit(s, ctx).ok
            kv.plan(s, ctx)
            kv.commit(s, ctx)
        if fast._stepping._decode_batch is not None:
            batches.add(fast._stepping._decode_batch)
        assert fast.observe() == slow.observe()
        for rid in rids:
            assert held(fast, rid, "c")[0] == fast.stored_len(rid, "c") // CHUNK * CHUNK
    if kind is ChunkedLocal:
        # one batch from its third step on, across two chunk starts, still whole
        (batch,) = batches
        assert batch.intact and batch.ticks >= 15
    else:
        assert not batches
    check_conservation(fast)
