"""GPU check: a CUDA IPC retrieve between two processes on one GPU, byte-exact.

    python scripts/gpu_check_transfer.py            # cuda_ipc; SKIP without CUDA
    python scripts/gpu_check_transfer.py --kind shm # the same choreography on CPU

A spawned peer builds a cache, fills it with a known pattern and publishes its
descriptor; this process retrieves a range with partial pages at both ends
and compares every byte of its cache with a token-by-token oracle. Then the
other direction. Also in one process: two caches of the engine's kind, one
NHD and one HND (the same-process shortcut and the cross-layout copy).

Prints one PASS/FAIL line per check and exits 1 if any failed; exits 0 with
a SKIP line when CUDA is absent. `run_checks()` is importable for a combined
script.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

# a checkout without an install: the repository root on the path
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import torch

from kvref.core.cache import KVCache
from kvref.core.config import KVConfig, KVLayout
from kvref.transfer.engine import KVTransferManager, TransferEngineInfo, allocate_cache_tensor

WAIT_S = 120.0
DTYPE = torch.bfloat16
Result = tuple[str, bool, str]


def _config(layout: KVLayout = KVLayout.NHD, page_size: int = 4) -> KVConfig:
    return KVConfig(
        num_layers=3,
        num_kv_heads=4,
        head_dim=64,
        max_seq_len=256,
        max_num_pages=40,
        page_size=page_size,
        num_qo_heads=4,
        layout=layout,
    )


def _device(kind: str) -> torch.device:
    return torch.device("cuda", 0) if kind == "cuda_ipc" else torch.device("cpu")


def _build(kind: str, layout: KVLayout = KVLayout.NHD) -> tuple[KVCache, KVTransferManager]:
    info = TransferEngineInfo(kind=kind, shm_prefix="kvref_gpucheck_")
    cfg, device = _config(layout), _device(kind)
    shape = KVCache.shape_for(cfg, cfg.max_num_pages)
    cache = KVCache(cfg, device, DTYPE, tensor=allocate_cache_tensor(info, shape, DTYPE, device))
    return cache, KVTransferManager(info, cache)


def _pattern(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Distinct values, computed on CPU identically in every process."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(DTYPE)


def _slot(tensor: torch.Tensor, layout: KVLayout, page_size: int, pages: list[int], p: int) -> Any:
    page, off = pages[p // page_size], p % page_size
    return tensor[:, page, :, off] if layout is KVLayout.NHD else tensor[:, page, :, :, off]


def _oracle(
    dst: torch.Tensor,
    dst_layout: KVLayout,
    dst_pages: list[int],
    src: torch.Tensor,
    src_layout: KVLayout,
    src_pages: list[int],
    start: int,
    end: int,
    page_size: int = 4,
) -> torch.Tensor:
    """``dst`` (CPU) with tokens [start, end) copied one at a time."""
    want = dst.clone()
    for p in range(start, end):
        _slot(want, dst_layout, page_size, dst_pages, p).copy_(
            _slot(src, src_layout, page_size, src_pages, p)
        )
    return want


def _mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    """ "" when byte-identical, else where they first differ."""
    a, b = got.cpu().view(torch.int16), want.cpu().view(torch.int16)
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    diff = (a != b).nonzero()
    if len(diff) == 0:
        return ""
    return f"{len(diff)} elements differ, first at {tuple(diff[0].tolist())}"


def _write_late(cache: KVCache, pattern: torch.Tensor) -> None:
    """Write ``pattern`` on an engine stream of its own, behind a ~0.1 s sleep.

    Without CUDA, a plain copy. On CUDA nothing else waits for this stream:
    only the ordering kvref promises (the cache's declared compute streams,
    the IPC event recorded at publish) keeps a reader from seeing old bytes.
    """
    if not cache.tensor.is_cuda:
        cache.tensor.copy_(pattern)
        return
    engine = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    cache.add_compute_stream(engine)
    staged = pattern.to(cache.tensor.device)
    engine.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(engine):
        torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]
        cache.tensor.copy_(staged)


def _retrieve(
    mgr: KVTransferManager, start: int, end: int, local: list[int], remote: list[int], info: Any
) -> None:
    future = mgr.start_async_retrieve(start, end, local, remote, info)
    assert future is not None
    future.result(timeout=WAIT_S)


def _recv(conn: Connection) -> Any:
    if not conn.poll(WAIT_S):
        raise TimeoutError("peer went quiet")
    return conn.recv()


# pages: scattered, different on each side, partial first and last pages
PEER_PAGES = [17, 3, 29, 8, 11, 30]
PARENT_DST = [5, 21, 2, 36, 14, 9]
PARENT_PAGES = [33, 6, 19, 1, 25]
PEER_DST = [12, 27, 4, 38, 7]


def _peer(conn: Connection, kind: str) -> None:
    """The other process: publish a patterned cache, then retrieve from the parent's."""
    try:
        cache, mgr = _build(kind)
        _write_late(cache, _pattern(tuple(cache.tensor.shape), 1))
        # no synchronize: publishing records the IPC event the parent's copy waits on
        conn.send((mgr.get_kv_transfer_info(), PEER_PAGES))
        parent_info = _recv(conn)
        before = _pattern(tuple(cache.tensor.shape), 1)  # not .cpu(): the write may be queued
        _retrieve(mgr, 3, 18, PEER_DST, PARENT_PAGES, parent_info)
        parent_pattern = _pattern(tuple(cache.tensor.shape), 2)
        want = _oracle(
            before, KVLayout.NHD, PEER_DST, parent_pattern, KVLayout.NHD, PARENT_PAGES, 3, 18
        )
        conn.send(("reverse", _mismatch(cache.tensor, want)))
        # drop the mapping of the parent's cache before the parent frees it
        mgr.cleanup()
        conn.send(("cleaned", ""))
        # and keep ours alive until the parent let go of it
        assert _recv(conn) == "bye"
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def _check_two_processes(kind: str) -> list[Result]:
    results: list[Result] = []
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    peer = ctx.Process(target=_peer, args=(child_conn, kind), daemon=True)
    peer.start()
    try:
        first = _recv(conn)
        if first[0] == "error":
            return [(f"{kind} peer setup", False, first[1])]
        remote, remote_pages = first
        cache, mgr = _build(kind)
        _write_late(cache, _pattern(tuple(cache.tensor.shape), 2))
        before = _pattern(tuple(cache.tensor.shape), 2)
        _retrieve(mgr, 2, 23, PARENT_DST, remote_pages, remote)
        peer_pattern = _pattern(tuple(cache.tensor.shape), 1)
        want = _oracle(
            before, KVLayout.NHD, PARENT_DST, peer_pattern, KVLayout.NHD, remote_pages, 2, 23
        )
        bad = _mismatch(cache.tensor, want)
        results.append((f"{kind}: peer -> this process, tokens [2, 23)", not bad, bad))

        conn.send(mgr.get_kv_transfer_info())
        tag, bad = _recv(conn)
        if tag == "error":
            results.append((f"{kind}: this process -> peer", False, bad))
            return results
        results.append((f"{kind}: this process -> peer, tokens [3, 18)", not bad, bad))
        tag, detail = _recv(conn)
        assert tag == "cleaned", detail
        mgr.cleanup()
        conn.send("bye")
        peer.join(WAIT_S)
        ok = peer.exitcode == 0
        results.append((f"{kind}: peer exited cleanly", ok, f"exit code {peer.exitcode}"))
    finally:
        if peer.is_alive():
            peer.kill()
            peer.join(10)
    return results


def _check_one_process(kind: str) -> list[Result]:
    """Two caches of one process: the registry shortcut, and NHD -> HND."""
    src, src_mgr = _build(kind, KVLayout.NHD)
    dst, dst_mgr = _build(kind, KVLayout.HND)
    _write_late(src, _pattern(tuple(src.tensor.shape), 3))
    dst_pattern = _pattern(tuple(dst.tensor.shape), 4)
    dst.tensor.copy_(dst_pattern.to(dst.tensor.device))
    src_pages, dst_pages = [4, 9, 2, 31], [22, 6, 13, 1]
    _retrieve(dst_mgr, 1, 15, dst_pages, src_pages, src_mgr.get_kv_transfer_info())
    want = _oracle(
        dst_pattern, KVLayout.HND, dst_pages, _pattern(tuple(src.tensor.shape), 3),
        KVLayout.NHD, src_pages, 1, 15,
    )
    bad = _mismatch(dst.tensor, want)
    dst_mgr.cleanup()
    src_mgr.cleanup()
    return [(f"{kind}: one process, NHD -> HND, tokens [1, 15)", not bad, bad)]


def _check_host_to_device(kind: str) -> list[Result]:
    """A CPU cache into a CUDA one (the aligned page path across devices)."""
    if kind != "cuda_ipc":
        return []
    cfg = _config()
    src = KVCache(cfg, torch.device("cpu"), DTYPE)
    src.tensor.copy_(_pattern(tuple(src.tensor.shape), 5))
    src_mgr = KVTransferManager(TransferEngineInfo(), src)
    dst, dst_mgr = _build(kind)
    before = dst.tensor.cpu()
    src_pages, dst_pages = [3, 8, 1, 20, 6], [11, 2, 30, 17, 5]
    _retrieve(dst_mgr, 2, 19, dst_pages, src_pages, src_mgr.get_kv_transfer_info())
    want = _oracle(before, KVLayout.NHD, dst_pages, src.tensor, KVLayout.NHD, src_pages, 2, 19)
    bad = _mismatch(dst.tensor, want)
    dst_mgr.cleanup()
    src_mgr.cleanup()
    return [("cpu cache -> cuda cache, tokens [2, 19)", not bad, bad)]


def run_checks(kind: str = "cuda_ipc") -> list[Result] | None:
    """(name, passed, detail) per check; None when ``kind`` needs CUDA and there is none."""
    if kind == "cuda_ipc" and not torch.cuda.is_available():
        return None
    results: list[Result] = []
    for check in (_check_one_process, _check_host_to_device, _check_two_processes):
        try:
            results.extend(check(kind))
        except Exception:
            results.append((f"{kind}: {check.__name__}", False, traceback.format_exc()))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--kind", choices=["cuda_ipc", "shm"], default="cuda_ipc")
    args = parser.parse_args(argv)
    results = run_checks(args.kind)
    if results is None:
        print("SKIP gpu_check_transfer: CUDA is not available")
        return 0
    for name, ok, detail in results:
        print(f"{'PASS' if ok else 'FAIL'} {name}" + ("" if ok else f": {detail}"))
    failed = sum(not ok for _, ok, _ in results)
    print(
        f"{'FAIL' if failed else 'PASS'} gpu_check_transfer: {len(results) - failed}/{len(results)}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
