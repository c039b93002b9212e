"""A cache that cannot exist is a config error; the manager's config is its own.

`KVConfig` refuses ``max_num_pages`` past `MAX_NUM_PAGES` (page ids are int32
in the page tables). `KVManager`'s constructor refuses, before anything is
allocated, a cache (or host pool) whose bytes exceed what the device or the
host holds in all, with the byte figures: `KVConfig(max_num_pages=2**40)`
used to pass validation and fail in torch's allocator with an untyped
`RuntimeError`. And the manager runs on a private copy of the config it was
given (documented on `KVManager` and `KVConfig`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from _manager_fixtures import Driver, fill, make_cfg

from kvref import KVConfig, KVManager, TransferEngineInfo, validate
from kvref.core.config import MAX_NUM_PAGES
from kvref.core.errors import InvalidConfigError, PublishLeasedError
from kvref.testing.manual_runtime import ManualRuntime

# 2 layers x K and V x 4 tokens x 2 heads x 4 dims, float32: 512 bytes a page
PAGE_BYTES = 2 * 2 * 4 * 2 * 4 * 4


def _build(cfg: KVConfig, device: str = "cpu", **kw: Any) -> KVManager:
    return KVManager(cfg, "kv", None, TransferEngineInfo(), device, dtype=torch.float32, **kw)


@pytest.fixture
def nothing_allocated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any allocation of a cache or a pool fails the test: the check comes first."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("allocated before the size was checked")

    monkeypatch.setattr("kvref.manager.allocate_cache_tensor", refuse)
    monkeypatch.setattr("kvref.manager.PagePool", refuse)
    monkeypatch.setattr("kvref.manager.CPUPagePool", refuse)


def test_the_issue_config_fails_in_validation() -> None:
    with pytest.raises(InvalidConfigError, match=r"max_num_pages.*2\*\*31.*1099511627776"):
        make_cfg(pages=2**40)
    assert make_cfg(pages=MAX_NUM_PAGES).max_num_pages == 2**31  # the ceiling itself is valid
    with pytest.raises(InvalidConfigError, match="max_num_pages"):
        make_cfg(pages=MAX_NUM_PAGES + 1)


def test_a_cache_past_host_memory_is_refused_before_allocation(
        monkeypatch: pytest.MonkeyPatch, nothing_allocated: None) -> None:
    monkeypatch.setattr(validate, "host_memory_bytes", lambda: 1 << 20)
    pages = 4096  # 2 MiB of cache on a host of 1 MiB
    with pytest.raises(InvalidConfigError) as err:
        _build(make_cfg(pages=pages))
    text = str(err.value)
    assert f"{pages * PAGE_BYTES:,}" in text and f"{PAGE_BYTES:,} bytes a page" in text
    assert f"max_num_pages {pages}" in text and "1,048,576 bytes of physical memory" in text


def test_the_host_pool_counts_on_the_host(monkeypatch: pytest.MonkeyPatch,
                                          nothing_allocated: None) -> None:
    monkeypatch.setattr(validate, "host_memory_bytes", lambda: 1 << 20)
    with pytest.raises(InvalidConfigError, match=r"cpu_offload_pages 4096"):
        _build(make_cfg(pages=16, cpu_pages=4096))


def test_real_host_memory_refuses_a_huge_cache(nothing_allocated: None) -> None:
    """No patching: 2**31 pages of 512 bytes is a TiB, more than any CI host."""
    host = validate.host_memory_bytes()
    assert host is not None and host > 0
    with pytest.raises(InvalidConfigError, match="physical memory"):
        _build(make_cfg(pages=MAX_NUM_PAGES))


def test_cuda_cache_is_held_to_the_device_memory(monkeypatch: pytest.MonkeyPatch,
                                                 nothing_allocated: None) -> None:
    """The device's total memory, asked through torch.cuda.mem_get_info."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 10, 1 << 20))
    monkeypatch.setattr(validate, "host_memory_bytes", lambda: 1 << 30)
    with pytest.raises(InvalidConfigError, match=r"does not fit cuda: .*1,048,576 bytes of memory"):
        _build(make_cfg(pages=4096), "cuda")
    # the cache fits the device; the pool does not fit the host
    monkeypatch.setattr(validate, "host_memory_bytes", lambda: 1 << 20)
    with pytest.raises(InvalidConfigError, match=r"this host: .*cpu_offload_pages 4096"):
        _build(make_cfg(pages=16, cpu_pages=4096), "cuda")


def test_a_cache_that_fits_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(validate, "host_memory_bytes", lambda: 1 << 20)
    mgr = _build(make_cfg(pages=64, cpu_pages=64))  # 32 KiB each
    assert mgr.num_free_pages == 63
    mgr.cleanup()


def test_the_manager_keeps_its_own_copy_of_the_config() -> None:
    """Documented on KVManager and KVConfig: fields the caller changes after
    construction (the lease, the pool, the pages) reach nothing."""
    rt = ManualRuntime()
    cfg = dataclasses.replace(make_cfg(pages=16, page_size=4, cpu_pages=8), publish_lease_s=30.0)
    mgr = _build(cfg, runtime=rt)
    cfg.publish_lease_s = None
    cfg.cpu_offload_pages = 0
    cfg.max_num_pages = 2
    assert mgr.config is not cfg
    assert (mgr.config.publish_lease_s, mgr.config.cpu_offload_pages,
            mgr.config.max_num_pages) == (30.0, 8, 16)
    drv = Driver(mgr)
    drv.ingest("a")
    fill(drv, "a", 5)
    assert mgr.publish("a")
    rt.advance(29)
    with pytest.raises(PublishLeasedError):
        mgr.remove_request("a")
    rt.advance(1)  # the manager's 30 s, not the caller's None
    assert mgr.offload("a") == 2  # and its host pool
    assert mgr.reload("a")
    drv.check("a")
    mgr.cleanup()
