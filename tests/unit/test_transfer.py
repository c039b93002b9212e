"""KVTransferManager: byte-exact retrieves in one process and across processes."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.core.cache import KVCache
from kvref.core.config import KVConfig, KVLayout
from kvref.transfer.engine import (
    InjectedTransferError,
    KVTransferInfo,
    KVTransferManager,
    RemoteCacheGoneError,
    TransferConfigError,
    TransferEngineInfo,
    TransferError,
    TransferRangeError,
    allocate_cache_tensor,
)

# the spawned child imports its target by module name; make that name the same
# however pytest imported this file (rootdir-relative or as a package)
sys.path.insert(0, os.path.dirname(__file__))
import _transfer_workers as workers

T = TypeVar("T")
CPU = torch.device("cpu")


class InlineRuntime:
    """Runs submitted work at once, and counts it: retrieves must go through the seam."""

    def __init__(self) -> None:
        self.submitted = 0

    def lock(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        self.submitted += 1
        future: Future[T] = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as e:
            future.set_exception(e)
        return future

    def wait(self, futures: Iterable[Future[Any]]) -> None:
        del futures

    def checkpoint(self, name: str) -> None:
        del name


def make_cache(
    layout: KVLayout = KVLayout.NHD, page_size: int = 4, num_pages: int = 12, head_dim: int = 8
) -> KVCache:
    cfg = KVConfig(
        num_layers=2,
        num_kv_heads=2,
        head_dim=head_dim,
        max_seq_len=64,
        max_num_pages=num_pages,
        page_size=page_size,
        num_qo_heads=2,
        layout=layout,
    )
    return KVCache(cfg, CPU, torch.float32)


def fill(cache: KVCache, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=g))


def slot(cache: KVCache, pages: list[int], p: int) -> torch.Tensor:
    """Token ``p``'s K and V, every layer: ``[layers, 2, H, D]`` (a view)."""
    page, off = pages[p // cache.page_size], p % cache.page_size
    if cache.layout is KVLayout.NHD:
        return cache.tensor[:, page, :, off]
    return cache.tensor[:, page, :, :, off]


def expected_after(
    dst: KVCache, dst_pages: list[int], src: KVCache, src_pages: list[int], start: int, end: int
) -> torch.Tensor:
    """The oracle: the destination tensor with tokens [start, end) copied one by one."""
    want = dst.tensor.clone()
    view = KVCache(dst.config, CPU, dst.dtype, tensor=want)
    for p in range(start, end):
        slot(view, dst_pages, p).copy_(slot(src, src_pages, p))
    return want


def retrieve(
    dst_mgr: KVTransferManager,
    start: int,
    end: int,
    dst_pages: list[int],
    src_pages: list[int],
    info: KVTransferInfo,
) -> None:
    future = dst_mgr.start_async_retrieve(start, end, dst_pages, src_pages, info)
    assert future is not None
    future.result(timeout=10)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a.view(torch.int32), b.view(torch.int32)))


@pytest.fixture
def shm_prefix() -> Iterator[str]:
    """A prefix no other run uses; afterwards nothing with it may be left in /dev/shm."""
    prefix = f"kvref_t{uuid.uuid4().hex[:8]}_"
    yield prefix
    gc.collect()
    assert [n for n in os.listdir("/dev/shm") if n.startswith(prefix)] == []


# -- in one process -----------------------------------------------------------


@pytest.mark.parametrize("layout", [KVLayout.NHD, KVLayout.HND])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(
    ("start", "end"),
    [(0, 12), (0, 16), (3, 13), (5, 7), (4, 8), (1, 2), (0, 1), (15, 16)],
)
def test_local_retrieve_is_byte_exact(
    layout: KVLayout, page_size: int, start: int, end: int
) -> None:
    src, dst = make_cache(layout, page_size, 20), make_cache(layout, page_size, 20)
    fill(src, 1)
    fill(dst, 2)
    n_pages = -(-16 // page_size)
    # scattered, non-consecutive pages on both sides, never the same order
    src_pages = [(3 * i + 1) % 19 + 1 for i in range(n_pages)]
    dst_pages = list(reversed(range(1, n_pages + 1)))
    runtime = InlineRuntime()
    src_mgr = KVTransferManager(TransferEngineInfo(), src)
    dst_mgr = KVTransferManager(TransferEngineInfo(), dst, runtime)
    want = expected_after(dst, dst_pages, src, src_pages, start, end)
    retrieve(dst_mgr, start, end, dst_pages, src_pages, src_mgr.get_kv_transfer_info())
    # the whole tensor: the range landed, and nothing outside it moved
    assert same_bytes(dst.tensor, want)
    assert runtime.submitted == 1


@settings(max_examples=60, deadline=None)
@given(
    src_layout=st.sampled_from(list(KVLayout)),
    dst_layout=st.sampled_from(list(KVLayout)),
    src_ps=st.sampled_from([1, 2, 4, 8]),
    dst_ps=st.sampled_from([1, 2, 4, 8]),
    span=st.tuples(st.integers(0, 24), st.integers(0, 24)),
    data=st.data(),
)
def test_retrieve_across_layouts_and_page_sizes(
    src_layout: KVLayout,
    dst_layout: KVLayout,
    src_ps: int,
    dst_ps: int,
    span: tuple[int, int],
    data: st.DataObject,
) -> None:
    start, end = min(span), max(span)
    src, dst = make_cache(src_layout, src_ps, 26), make_cache(dst_layout, dst_ps, 26)
    fill(src, 3)
    fill(dst, 4)
    src_pages = data.draw(st.permutations(range(1, 26)))[: -(-24 // src_ps)]
    dst_pages = data.draw(st.permutations(range(1, 26)))[: -(-24 // dst_ps)]
    src_mgr = KVTransferManager(TransferEngineInfo(), src, InlineRuntime())
    dst_mgr = KVTransferManager(TransferEngineInfo(), dst, InlineRuntime())
    want = expected_after(dst, dst_pages, src, src_pages, start, end)
    future = dst_mgr.start_async_retrieve(
        start, end, dst_pages, src_pages, src_mgr.get_kv_transfer_info()
    )
    if start == end:
        assert future is None
    else:
        assert future is not None
        future.result()
    assert same_bytes(dst.tensor, want)


def test_retrieve_runs_on_the_default_runtime() -> None:
    src, dst = make_cache(), make_cache()
    fill(src, 5)
    src_mgr, dst_mgr = (
        KVTransferManager(TransferEngineInfo(), src),
        KVTransferManager(TransferEngineInfo(), dst),
    )
    want = expected_after(dst, [1, 2], src, [3, 4], 2, 7)
    retrieve(dst_mgr, 2, 7, [1, 2], [3, 4], src_mgr.get_kv_transfer_info())
    assert same_bytes(dst.tensor, want)
    dst_mgr.cleanup()
    src_mgr.cleanup()


@pytest.mark.parametrize(("start", "end"), [(0, 0), (5, 5), (7, 3)])
def test_empty_range_returns_none(start: int, end: int) -> None:
    src, dst = make_cache(), make_cache()
    runtime = InlineRuntime()
    src_mgr = KVTransferManager(TransferEngineInfo(), src)
    dst_mgr = KVTransferManager(TransferEngineInfo(), dst, runtime)
    before = dst.tensor.clone()
    assert (
        dst_mgr.start_async_retrieve(start, end, [1], [2], src_mgr.get_kv_transfer_info()) is None
    )
    assert runtime.submitted == 0
    assert same_bytes(dst.tensor, before)


def test_fail_next_fails_exactly_that_many_retrieves() -> None:
    src, dst = make_cache(), make_cache()
    fill(src, 6)
    src_mgr = KVTransferManager(TransferEngineInfo(), src)
    dst_mgr = KVTransferManager(TransferEngineInfo(), dst, InlineRuntime())
    info = src_mgr.get_kv_transfer_info()
    before = dst.tensor.clone()
    dst_mgr.fail_next = 1
    future = dst_mgr.start_async_retrieve(0, 8, [1, 2], [3, 4], info)
    assert future is not None
    with pytest.raises(InjectedTransferError, match=r"tokens \[0, 8\)"):
        future.result()
    assert same_bytes(dst.tensor, before)  # a failed retrieve wrote nothing
    assert dst_mgr.fail_next == 0
    retrieve(dst_mgr, 0, 8, [1, 2], [3, 4], info)  # the next one runs
    assert same_bytes(dst.tensor, expected_after(dst, [1, 2], src, [3, 4], 0, 8))


def test_retrieve_from_a_cleaned_up_cache_fails_the_future() -> None:
    src, dst = make_cache(), make_cache()
    src_mgr = KVTransferManager(TransferEngineInfo(), src)
    dst_mgr = KVTransferManager(TransferEngineInfo(), dst, InlineRuntime())
    info = src_mgr.get_kv_transfer_info()
    src_mgr.cleanup()
    src_mgr.cleanup()  # idempotent
    future = dst_mgr.start_async_retrieve(0, 4, [1], [1], info)
    assert future is not None
    with pytest.raises(RemoteCacheGoneError, match=info.cache_id):
        future.result()
    # a failure is an exception of the library's own family
    assert isinstance(future.exception(), TransferError)


def test_retrieve_from_a_collected_cache_fails_the_future() -> None:
    dst_mgr = KVTransferManager(TransferEngineInfo(), make_cache(), InlineRuntime())
    src_mgr = KVTransferManager(TransferEngineInfo(), make_cache())
    info = src_mgr.get_kv_transfer_info()
    del src_mgr
    gc.collect()
    future = dst_mgr.start_async_retrieve(0, 4, [1], [1], info)
    assert future is not None
    with pytest.raises(RemoteCacheGoneError):
        future.result()


def test_bad_ranges_and_pages_are_rejected_before_anything_runs() -> None:
    src, dst = make_cache(num_pages=6), make_cache(num_pages=6)
    runtime = InlineRuntime()
    info = KVTransferManager(TransferEngineInfo(), src).get_kv_transfer_info()
    dst_mgr = KVTransferManager(TransferEngineInfo(), dst, runtime)
    with pytest.raises(TransferRangeError, match="remote pages: page 9 out of range"):
        dst_mgr.start_async_retrieve(0, 8, [1, 2], [1, 9], info)
    with pytest.raises(TransferRangeError, match="local pages: 8 tokens need 2 pages"):
        dst_mgr.start_async_retrieve(0, 8, [1], [1, 2], info)
    with pytest.raises(TransferRangeError, match="negative"):
        dst_mgr.start_async_retrieve(-1, 8, [1, 2], [1, 2], info)
    with pytest.raises(TransferRangeError, match="KVTransferInfo"):
        dst_mgr.start_async_retrieve(0, 8, [1, 2], [1, 2], "not a descriptor")  # type: ignore[arg-type]
    other = KVTransferManager(TransferEngineInfo(), make_cache(head_dim=4))
    with pytest.raises(TransferRangeError, match="head_dim"):
        dst_mgr.start_async_retrieve(0, 8, [1, 2], [1, 2], other.get_kv_transfer_info())
    assert runtime.submitted == 0


def test_pages_before_the_range_are_not_checked() -> None:
    # a retrieve of [8, 12) only touches logical page 2; the manager passes the
    # stream's whole list, whose earlier entries are not this call's business
    src, dst = make_cache(num_pages=6), make_cache(num_pages=6)
    fill(src, 7)
    info = KVTransferManager(TransferEngineInfo(), src).get_kv_transfer_info()
    dst_mgr = KVTransferManager(TransferEngineInfo(), dst, InlineRuntime())
    want = expected_after(dst, [0, 0, 3], src, [0, 0, 5], 8, 12)
    retrieve(dst_mgr, 8, 12, [0, 0, 3], [99, 99, 5], info)
    assert same_bytes(dst.tensor, want)


def test_descriptor_is_picklable_hashable_and_names_its_cache() -> None:
    a = KVTransferManager(TransferEngineInfo(), make_cache(page_size=4, num_pages=7))
    b = KVTransferManager(TransferEngineInfo(), make_cache())
    info = a.get_kv_transfer_info()
    assert info == a.get_kv_transfer_info()  # stable across publishes
    assert pickle.loads(pickle.dumps(info)) == info
    assert hash(pickle.loads(pickle.dumps(info))) == hash(info)
    assert info != b.get_kv_transfer_info()
    assert (info.kind, info.num_pages, info.page_size, info.layout, info.dtype) == (
        "local",
        7,
        4,
        "NHD",
        "float32",
    )
    assert info.page_problem([1, 2], 8) is None
    assert info.page_problem([1, 2], 9) == "9 tokens need 3 pages of 4, got 2"
    assert info.page_problem([1, 7], 8) == "page 7 out of range [0, 7)"


def test_engine_info_and_allocation_are_validated() -> None:
    with pytest.raises(TransferConfigError, match="kind must be one of"):
        TransferEngineInfo(kind="rdma")
    with pytest.raises(TransferConfigError, match="no '/'"):
        TransferEngineInfo(kind="shm", shm_prefix="a/b")
    with pytest.raises(TransferConfigError, match="CUDA device"):
        allocate_cache_tensor(TransferEngineInfo(kind="cuda_ipc"), (2, 2), torch.float32, "cpu")
    with pytest.raises(TransferConfigError, match="CPU cache"):
        allocate_cache_tensor(TransferEngineInfo(kind="shm"), (2, 2), torch.float32, "meta")
    # a cache whose tensor no shm segment backs cannot be published over shm
    with pytest.raises(TransferConfigError, match="allocate_cache_tensor"):
        KVTransferManager(TransferEngineInfo(kind="shm"), make_cache())
    with pytest.raises(TransferConfigError, match="CUDA cache"):
        KVTransferManager(TransferEngineInfo(kind="cuda_ipc"), make_cache())
    local = allocate_cache_tensor(TransferEngineInfo(), (2, 3), torch.float16, "cpu")
    assert local.dtype == torch.float16 and not local.any()


def test_shm_allocation_is_zeroed_and_unlinked_on_cleanup(shm_prefix: str) -> None:
    info = TransferEngineInfo(kind="shm", shm_prefix=shm_prefix)
    cfg = make_cache().config
    tensor = allocate_cache_tensor(info, KVCache.shape_for(cfg, 12), torch.float32, CPU)
    assert not tensor.any()
    cache = KVCache(cfg, CPU, torch.float32, tensor=tensor)
    mgr = KVTransferManager(info, cache)
    name = mgr.get_kv_transfer_info().shm_name
    assert name is not None and name.startswith(shm_prefix)
    assert os.path.exists(f"/dev/shm/{name}")
    mgr.cleanup()
    assert not os.path.exists(f"/dev/shm/{name}")
    cache.tensor.fill_(1.0)  # the mapping outlives the name


def test_shm_tensor_never_published_is_unlinked_when_dropped(shm_prefix: str) -> None:
    info = TransferEngineInfo(kind="shm", shm_prefix=shm_prefix)
    tensor = allocate_cache_tensor(info, (4, 4), torch.float32, CPU)
    assert any(n.startswith(shm_prefix) for n in os.listdir("/dev/shm"))
    del tensor  # the fixture checks the segment went with it
    gc.collect()
    # and the hand-off entry with it, so no later tensor is taken for it
    from kvref.transfer import engine as transfer

    assert not [n for n, _ in transfer._shm_segments.values() if n.startswith(shm_prefix)]


# -- across processes -----------------------------------------------------------


def test_shm_retrieve_between_two_processes(shm_prefix: str) -> None:
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    child_pages = [7, 2, 9, 4]
    child = ctx.Process(target=workers.shm_peer, args=(child_conn, shm_prefix, child_pages, 100.0))
    child.start()
    try:
        assert parent_conn.poll(60), "child did not publish"
        remote, remote_pages = parent_conn.recv()
        assert remote.kind == "shm" and remote_pages == child_pages

        # parent <- child: a range with partial pages at both ends
        cache, mgr = workers.shm_cache(shm_prefix)
        cache.tensor.copy_(workers.pattern(tuple(cache.tensor.shape), -50.0))
        local_pages = [1, 5, 3, 10]
        child_view = KVCache(
            cache.config,
            CPU,
            torch.float32,
            tensor=workers.pattern(tuple(cache.tensor.shape), 100.0),
        )
        want = expected_after(cache, local_pages, child_view, child_pages, 2, 15)
        retrieve(mgr, 2, 15, local_pages, remote_pages, remote)
        assert same_bytes(cache.tensor, want)

        # child <- parent
        parent_pages = [11, 6, 8]
        child_dst = [3, 1, 5]
        parent_conn.send((mgr.get_kv_transfer_info(), parent_pages, child_dst, 1, 10))
        assert parent_conn.poll(60), "child did not retrieve"
        tag, before_raw, after_raw = parent_conn.recv()
        assert tag == "retrieved", before_raw
        shape = tuple(cache.tensor.shape)
        before = torch.frombuffer(bytearray(before_raw), dtype=torch.float32).view(shape)
        after = torch.frombuffer(bytearray(after_raw), dtype=torch.float32).view(shape)
        child_before = KVCache(cache.config, CPU, torch.float32, tensor=before)
        assert same_bytes(
            after, expected_after(child_before, child_dst, cache, parent_pages, 1, 10)
        )

        parent_conn.send("cleanup")
        assert parent_conn.poll(60)
        assert parent_conn.recv()[0] == "done"
        child.join(30)
        assert child.exitcode == 0

        # the child unlinked its segment: the (cached) mapping must not serve it
        future = mgr.start_async_retrieve(0, 4, local_pages, remote_pages, remote)
        assert future is not None
        with pytest.raises(RemoteCacheGoneError, match=str(remote.shm_name)):
            future.result(timeout=10)
        mgr.cleanup()
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)


def test_gpu_check_script_imports_and_skips_without_cuda(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # the GPU run executes it; here it must at least import and skip cleanly
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "gpu_check_transfer.py")
    spec = importlib.util.spec_from_file_location("gpu_check_transfer", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the GPU run executes this script for real")
    assert module.main([]) == 0
    assert "SKIP gpu_check_transfer" in capsys.readouterr().out
