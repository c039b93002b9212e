"""Helpers shared by the manager unit tests: small managers, a step driver
that writes token-identity values, and a snapshot of observable state.

Values: token ``pos`` of a stream tagged ``tag`` at layer ``l`` is written
as ``((tag * 1000 + pos) * 8 + l) * 2 + kv`` in every head and dim, exact in
float32, so any read-back names the stream, position, layer and K/V it came
from.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from kvref.core.config import KVConfig, KVLayout, KVReqConfig, RetentionPolicy
from kvref.core.groups import AttentionGroup
from kvref.manager import KVManager
from kvref.stepping.plan import KVPlanOutputs
from kvref.stepping.step import Fork, KVStep, Segment, StepContext
from kvref.testing.manual_runtime import ManualRuntime
from kvref.testing.page_checks import check_device_pages
from kvref.transfer.engine import TransferEngineInfo
from kvref.transfer.published import PublishedKVInfo

Key = tuple[str, str]


def make_cfg(
    *,
    pages: int = 16,
    page_size: int = 4,
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 4,
    layout: KVLayout = KVLayout.NHD,
    cpu_pages: int = 0,
    max_seq_len: int = 256,
    sharing: bool = True,
    retention: dict[str, RetentionPolicy] | None = None,
    groups: tuple[AttentionGroup, ...] = (),
) -> KVConfig:
    return KVConfig(
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=head_dim,
        max_seq_len=max_seq_len,
        max_num_pages=pages,
        enable_prefix_caching=sharing,
        page_size=page_size,
        num_qo_heads=heads,
        layout=layout,
        cpu_offload_pages=cpu_pages,
        retention=retention or {},
        groups=groups,
    )


def make_manager(**kw: Any) -> KVManager:
    return KVManager(make_cfg(**kw), "kv", None, TransferEngineInfo(), "cpu", dtype=torch.float32)


def token_values(tag: int, pos: int, layer: int, heads: int, head_dim: int) -> torch.Tensor:
    """``[2, H, D]`` for one token: K then V."""
    base = ((tag * 1000 + pos) * 8 + layer) * 2
    out = torch.empty(2, heads, head_dim, dtype=torch.float32)
    out[0] = base
    out[1] = base + 1
    return out


def held_pages(mgr: KVManager) -> list[int]:
    return [p for streams in mgr._streams.values() for s in streams.values()
            for p in s.page_indices]


def check_conservation(mgr: KVManager) -> None:
    """I1/I2: free + held + sink == all pages, no page in two places, sink unheld."""
    check_device_pages(mgr)


@dataclass
class Snapshot:
    free: int
    streams: dict[Key, tuple[Any, ...]]
    host_free: int | None
    offloads: tuple[str, ...]
    preplan: bool
    contents: dict[Key, torch.Tensor] = field(default_factory=dict)


def snapshot(mgr: KVManager) -> Snapshot:
    streams: dict[Key, tuple[Any, ...]] = {}
    contents: dict[Key, torch.Tensor] = {}
    for rid, labels in mgr._streams.items():
        for label, s in labels.items():
            streams[(rid, label)] = (
                list(s.page_indices), s.stored_len, s.generation, s.step_in_flight,
                s.offloaded, s.read_pending, s.read_error is not None,
            )
            if not s.offloaded:
                contents[(rid, label)] = mgr.kv_cache.gather_stream(
                    s.page_indices, s.stored_len - s.released).clone()
    pool = mgr._cpu_pool
    return Snapshot(
        free=mgr.num_free_pages,
        streams=streams,
        host_free=None if pool is None else pool.num_free,
        offloads=tuple(sorted(mgr._offloads)),
        preplan=mgr._preplan is not None,
        contents=contents,
    )


def assert_same(a: Snapshot, b: Snapshot) -> None:
    assert a.free == b.free
    assert a.streams == b.streams
    assert a.host_free == b.host_free
    assert a.offloads == b.offloads
    assert a.preplan == b.preplan
    assert a.contents.keys() == b.contents.keys()
    for k in a.contents:
        assert torch.equal(a.contents[k], b.contents[k]), k


class Driver:
    """Runs steps against a manager and keeps the contents they should leave.

    ``model[(rid, label)]`` is the list of token codes ``(tag, pos)`` the
    stream holds; `check` compares it with `read_stream`.
    """

    def __init__(self, mgr: KVManager) -> None:
        self.mgr = mgr
        self.model: dict[Key, list[tuple[int, int]]] = {}
        self._tags: dict[Key, int] = {}

    def tag(self, key: Key) -> int:
        return self._tags.setdefault(key, len(self._tags) + 1)

    def ingest(self, *rids: str) -> None:
        for rid in rids:
            self.mgr.ingest_request(rid)
            self.model.setdefault((rid, "main"), [])

    def expected(self, rid: str, label: str = "main") -> torch.Tensor:
        cfg = self.mgr.config
        codes = self.model.get((rid, label), [])
        out = torch.zeros(cfg.num_layers, len(codes), 2, cfg.num_kv_heads, cfg.head_dim)
        for layer in range(cfg.num_layers):
            for i, (tag, pos) in enumerate(codes):
                out[layer, i] = token_values(tag, pos, layer, cfg.num_kv_heads, cfg.head_dim)
        return out

    def check(self, rid: str, label: str = "main") -> None:
        got = self.mgr.read_stream(rid, label)
        want = self.expected(rid, label)
        assert got.shape == want.shape, (rid, label, got.shape, want.shape)
        assert torch.equal(got, want), (rid, label)

    def write_planned(self, outputs: KVPlanOutputs) -> dict[str, list[tuple[Key, int, int]]]:
        """Write every planned token; returns, per plan label, (key, tag, pos) rows."""
        cfg = self.mgr.config
        rows_by_label: dict[str, list[tuple[Key, int, int]]] = {}
        for plan_label, out in outputs.items():
            rows: list[tuple[Key, int, int]] = []
            for v in out.views:
                key = (v.request_id, v.label)
                for pos in range(v.length - v.to_compute, v.length):
                    rows.append((key, self.tag(key), pos))
            rows_by_label[plan_label] = rows
            state = self.mgr._current_plan_states[plan_label]
            n = state.write_len
            for layer in range(cfg.num_layers):
                kv = torch.zeros(n, 2, cfg.num_kv_heads, cfg.head_dim)
                for i, (_, tag, pos) in enumerate(rows):
                    kv[i] = token_values(tag, pos, layer, cfg.num_kv_heads, cfg.head_dim)
                self.mgr.write_kv(kv[:, 0].contiguous(), kv[:, 1].contiguous(),
                                  layer_idx=layer, label=plan_label)
        return rows_by_label

    def step(
        self,
        segments: Iterable[tuple[str, str, int]] | Iterable[Segment],
        *,
        commit: bool = True,
        pre_forks: Sequence[Fork] = (),
        post_forks: Sequence[Fork] = (),
        combined: Sequence[Sequence[str]] = (),
        padded: Sequence[str] | None = None,
    ) -> KVPlanOutputs:
        segs = [s if isinstance(s, Segment) else Segment(*s) for s in segments]
        if padded is None:
            padded = sorted({s.request_id for s in segs})
        step = KVStep(segs, commit=commit, pre_forks=tuple(pre_forks),
                      post_forks=tuple(post_forks), combined_labels=tuple(combined))
        ctx = StepContext(padded_request_ids=tuple(padded))
        outcome = self.mgr.admit(step, ctx)
        assert outcome.ok, outcome
        outputs = self.mgr.plan(step, ctx)
        self.apply_pre_forks(step, ctx)
        rows = self.write_planned(outputs)
        self.mgr.commit(step, ctx)
        self.apply_commit(step, ctx, rows)
        return outputs

    def apply_pre_forks(self, step: KVStep, ctx: StepContext) -> None:
        for src, dst in step.pre_forks:
            for rid in ctx.padded_request_ids:
                if (rid, src) in self.model:
                    self.model[(rid, dst)] = list(self.model[(rid, src)])

    def apply_commit(
        self, step: KVStep, ctx: StepContext, rows: dict[str, list[tuple[Key, int, int]]]
    ) -> None:
        if step.commit:
            for label_rows in rows.values():
                for key, tag, pos in label_rows:
                    seq = self.model.setdefault(key, [])
                    assert len(seq) == pos, (key, len(seq), pos)
                    seq.append((tag, pos))
        for seg in step.segments:
            if seg.span > 0:
                self.model.setdefault((seg.request_id, seg.label), [])
        for src, dst in step.post_forks:
            for rid in ctx.padded_request_ids:
                if (rid, src) in self.model:
                    self.model[(rid, dst)] = list(self.model[(rid, src)])


def fill(drv: Driver, rid: str, n: int, label: str = "main", chunk: int | None = None) -> None:
    """Prefill ``n`` tokens onto one stream (in chunks, if given)."""
    left = n
    while left > 0:
        span = left if chunk is None else min(chunk, left)
        drv.step([(rid, label, span)])
        left -= span


def offloadable(pages: int = 32, cpu_pages: int = 16,
                runtime: ManualRuntime | None = None) -> Driver:
    """Request ``a``: ``main`` 6 tokens over three steps (generation >= 2), and
    a host pool to offload it to."""
    mgr = KVManager(make_cfg(pages=pages, page_size=4, cpu_pages=cpu_pages), "kv", None,
                    TransferEngineInfo(), "cpu", dtype=torch.float32, runtime=runtime)
    d = Driver(mgr)
    d.ingest("a")
    fill(d, "a", 6, chunk=2)
    return d


def publisher(pages: int = 16, page_size: int = 4, cpu_pages: int = 0) -> Driver:
    """``r``: ``main`` 10 tokens (3 pages), ``cfg`` 3 tokens (1 page)."""
    d = Driver(make_manager(pages=pages, page_size=page_size, cpu_pages=cpu_pages))
    d.ingest("r")
    fill(d, "r", 10)
    fill(d, "r", 3, "cfg")
    return d


def consumer(rt: ManualRuntime, pages: int = 16, cpu_pages: int = 0,
             labels: tuple[str, ...] = ("main", "cfg")) -> KVManager:
    """A manager with request ``r`` ingested (no tokens), whose copies the
    hand-driven runtime ``rt`` completes."""
    dst = KVManager(make_cfg(pages=pages, page_size=4, cpu_pages=cpu_pages), "kv", None,
                    TransferEngineInfo(), "cpu", dtype=torch.float32, runtime=rt)
    dst.ingest_request("r", KVReqConfig(default_labels=labels))
    return dst


def publish_now(d: Driver) -> PublishedKVInfo:
    """``r``'s publication (the test expects publish to succeed)."""
    pub = d.mgr.publish("r")
    assert isinstance(pub, PublishedKVInfo)
    return pub


@contextmanager
def failing_page_copy(mgr: KVManager, fault: BaseException | None = None) -> Iterator[None]:
    """The next page copy of the cache (a fork's) raises ``fault`` (default: an
    injected ``OSError``), as a device copy that failed would."""
    cache = mgr.kv_cache
    real = cache.copy_pages

    def broken(*args: object, **kwargs: object) -> None:
        cache.copy_pages = real  # type: ignore[method-assign]
        raise fault or OSError("page copy failed (injected)")

    cache.copy_pages = broken  # type: ignore[method-assign]
    try:
        yield
    finally:
        cache.copy_pages = real  # type: ignore[method-assign]


def three_tokens(sharing: bool = True) -> Driver:
    """Request ``a`` with 3 tokens on ``main`` (32 pages of 4 tokens)."""
    d = Driver(make_manager(sharing=sharing, pages=32, page_size=4))
    d.ingest("a")
    fill(d, "a", 3)
    return d
