"""The kept decode table (`kvref.stepping.decode_table`, issue 28) hands out,
step after step, what the tables built from scratch over the same state
hold: every plan below is compared with `kvref.testing.plan_oracle` (page
table and views) and with `plan_tables`' write slots, and the token bytes
each step wrote are read back (`Driver.check`). Every plan is held to the
end: its tables, write slots and views must stay what they were when it
was handed out, though the kept table hands its page indices array out as
the plan's own (a plant that writes that array in place is found below).

Between the decode steps of one batch, each call that changes a stream
other than by the step itself runs: a copy-on-write swap (a truncate into a
page a fork shares), a window release, a truncate, an offload and reload,
a fork, a reset (keeping or freeing pages), a remove and re-ingest, a
registration, an uncommitted step, a prefill step of another shape.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from kvref.core.config import RetentionPolicy
from kvref.manager import KVManager
from kvref.stepping import admit_plan_commit, decode_table, plan
from kvref.stepping.plan import KVPlanOutputs, KVPlanState, SequenceView, plan_tables
from kvref.stepping.step import KVStep, StepContext
from kvref.testing import plan_oracle
from tests.unit._manager_fixtures import Driver, Key, fill, make_manager, token_values

PS = 4


@pytest.fixture(autouse=True, params=[1, 1 << 20], ids=["kept", "fresh"])
def kept_from_one_row(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kept table plans batches of any size here (in production from
    `SMALL_BATCH` rows): these batches have four. ``fresh``: every batch is
    below `SMALL_BATCH`, planned afresh from its streams (`fresh_plan`).
    Chunks of 9 tokens or more take the vector slots (`_VECTOR_CHUNK`, 64
    in production), so the mixed steps below reach both slot builders."""
    monkeypatch.setattr(decode_table, "SMALL_BATCH", request.param)
    monkeypatch.setattr(plan, "_VECTOR_CHUNK", 9)
    # and the same four streams decoded twice in a row are a decode batch
    # (`StreamBatch`, issue 42; in production from 32 rows), whose admits
    # and commits move its rows at once between the calls below
    monkeypatch.setattr(admit_plan_commit, "BATCH_ROWS", 2)
    monkeypatch.setattr(admit_plan_commit, "_BATCH_AFTER", 1)  # from the second in a row


TABLE_FIELDS = ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")


def view_rows(views: list[SequenceView]) -> list[tuple[Any, ...]]:
    return [(v.request_id, v.label, v.page_idxs, v.length, v.to_compute, v.generation,
             v.offset) for v in views]


class Held:
    """An earlier plan, as a caller may keep it: its tables and write slots
    (the tensors handed out, and their values then), and its views' maker,
    which may first be called steps later."""

    def __init__(self, n: int, out: KVPlanOutputs, states: dict[str, KVPlanState]) -> None:
        self.n = n
        self.tensors = [(f"{label} {field}", getattr(o.cpu_indptrs, field))
                        for label, o in out.items() for field in TABLE_FIELDS]
        self.tensors += [(f"{label} {field}", getattr(st, field))
                         for label, st in states.items()
                         for field in ("token_to_page", "token_to_cache")]
        self.values = [t.clone() for _, t in self.tensors]
        self.make_views = [(label, o._make_views) for label, o in out.items()
                           if o._make_views is not None]
        self.views: dict[str, list[tuple[Any, ...]]] = {}

    def seen(self, out: KVPlanOutputs) -> None:
        """Its views, as the oracle read (and checked) them."""
        self.views = {label: view_rows(out[label].views) for label, _ in self.make_views}

    def changed(self) -> str | None:
        for (what, t), was in zip(self.tensors, self.values, strict=True):
            if not torch.equal(t, was):
                return f"plan {self.n}'s {what} is now {t.tolist()}, was {was.tolist()}"
        for label, make in self.make_views:
            rows = view_rows(make())
            if rows != self.views[label]:
                return f"plan {self.n}'s {label} views built now: {rows}, {self.views[label]}"
        return None


class Checked:
    """Wraps ``mgr.plan``: each plan is compared with its scratch build, and
    every earlier plan's tables, write slots and views with what they were
    when handed out (a plan's tables never change under later plans)."""

    def __init__(self, mgr: KVManager) -> None:
        self.mgr = mgr
        self.kept = 0  # plans the kept table made (views built lazily)
        self.held: list[Held] = []
        self._plan = mgr.plan
        mgr.plan = self.plan  # type: ignore[method-assign]

    def plan(self, step: KVStep, ctx: StepContext) -> KVPlanOutputs:
        out = self._plan(step, ctx)
        if ctx.is_preplan:
            return out
        for held in self.held:
            wrong = held.changed()
            assert wrong is None, wrong
        self.kept += any(o._views is None for o in out.values())
        held = Held(len(self.held), out, self.mgr._current_plan_states)
        wrong = plan_oracle.mismatch(self.mgr, step, out)
        assert wrong is None, wrong
        held.seen(out)
        self.held.append(held)
        views = plan_oracle.scratch_views(self.mgr, step)
        for label, vs in views.items():
            _, want, want_dev = plan_tables(vs, PS, torch.device("cpu"))
            # a mixed step's table on the device too (None for a decode step)
            dev = out[label].cuda_indptrs
            assert (dev is None) == (want_dev is None), (label, dev, want_dev)
            if dev is not None and want_dev is not None:
                for field in TABLE_FIELDS:
                    a, b = getattr(dev, field), getattr(want_dev, field)
                    assert a.dtype == b.dtype and torch.equal(a, b), (label, field, a, b)
            got = self.mgr._current_plan_states[label]
            assert got.total_tokens == want.total_tokens
            for a, b in ((got.token_to_page, want.token_to_page),
                         (got.token_to_cache, want.token_to_cache)):
                assert a.dtype == b.dtype and torch.equal(a, b), (label, a, b)
        return out


class WindowDriver(Driver):
    """`Driver` whose rows name absolute positions: a windowed view's length
    counts from its released offset."""

    def write_planned(self, outputs: KVPlanOutputs) -> dict[str, list[tuple[Key, int, int]]]:
        cfg = self.mgr.config
        rows_by_label: dict[str, list[tuple[Key, int, int]]] = {}
        for plan_label, out in outputs.items():
            rows = rows_by_label[plan_label] = [
                ((v.request_id, v.label), self.tag((v.request_id, v.label)), v.offset + pos)
                for v in out.views for pos in range(v.length - v.to_compute, v.length)]
            for layer in range(cfg.num_layers):
                kv = torch.stack([token_values(tag, pos, layer, cfg.num_kv_heads, cfg.head_dim)
                                  for _, tag, pos in rows])
                self.mgr.write_kv(kv[:, 0].contiguous(), kv[:, 1].contiguous(),
                                  layer_idx=layer, label=plan_label)
        return rows_by_label


def tokens(rid: str, n: int) -> list[int]:
    """Token ids by position: the same ids for a position at every call."""
    return [ord(rid[-1]) * 1000 + i for i in range(n)]


def run(seed: int, **cfg: Any) -> int:
    rng = random.Random(seed)
    window = cfg["retention"]["main"].context_budget if cfg.get("retention") else None
    mgr = make_manager(pages=160, page_size=PS, cpu_pages=64, heads=1, head_dim=2,
                       layers=1, **cfg)
    checked = Checked(mgr)
    drv = WindowDriver(mgr)
    batch = ["a", "b", "c", "d"]
    drv.ingest(*batch)
    for rid in batch:
        fill(drv, rid, rng.randint(1, 9))

    def trim(rid: str, label: str, n: int) -> None:
        drv.model[(rid, label)] = drv.model[(rid, label)][:n]

    for _ in range(60):
        live = [r for r in batch if mgr.stored_len(r) > 0]
        op = rng.choice(["decode"] * 6 + ["no-commit", "truncate", "cow", "offload",
                                          "fork", "reset", "remove", "register", "prefill",
                                          "mixed", "mixed", "chunk"])
        rid = rng.choice(live)
        n = mgr.stored_len(rid)
        if op == "truncate" and n > 1 and not cfg.get("retention"):
            new = rng.randrange(1, n)
            mgr.truncate(rid, "main", new)
            trim(rid, "main", new)
        elif op == "cow" and n > PS and not cfg.get("retention"):
            # a fork shares main's full pages; a truncate into one of them
            # leaves main's last page shared: its next write copies it first
            drv.step([(rid, "main", 1)], post_forks=[("main", "side")])
            new = (mgr.stored_len(rid) // PS - 1) * PS + rng.randint(1, PS - 1)
            mgr.truncate(rid, "main", new)
            trim(rid, "main", new)
        elif op == "offload":
            if mgr.offload(rid):
                assert mgr.reload(rid)
        elif op == "fork" and not cfg.get("retention"):
            # another label forked onto main: main's pages become the source's
            fill(drv, rid, rng.randint(1, 6), label="other")
            drv.step([(rid, "other", 1)], post_forks=[("other", "main")])
        elif op == "reset":
            mgr.reset_request(rid, free=rng.random() < 0.5)
            for key in [k for k in drv.model if k[0] == rid]:
                drv.model[key] = []
            fill(drv, rid, rng.randint(1, 9))
        elif op == "remove":
            mgr.remove_request(rid)
            for key in [k for k in drv.model if k[0] == rid]:
                del drv.model[key]
            drv.ingest(rid)
            fill(drv, rid, rng.randint(1, 9))
        elif op == "register" and n >= PS:
            mgr.cache_prefix(rid, "main", tokens(rid, n))
        elif op == "prefill":
            drv.step([(rid, "main", rng.randint(2, 5))])
        elif op == "mixed":
            # a mixed step (issue 42): the batch decodes while one row takes a
            # chunk (long enough, past `_VECTOR_CHUNK` here, for the vector
            # slots) and maybe one takes nothing (span 0)
            spans = {r: 1 for r in batch}
            spans[rid] = rng.choice([2, 3, PS + 1, 2 * PS + 3, rng.randint(9, 20)])
            other = rng.choice(batch)
            if other != rid and rng.random() < 0.4:
                spans[other] = 0
            drv.step([(r, "main", spans[r]) for r in batch], commit=rng.random() < 0.9)
        elif op == "chunk":
            # a fresh request's chunks beside the batch's decode (it starts
            # empty: its stream is made by the mixed step's admit), then gone
            drv.ingest("x")
            for _ in range(rng.randint(1, 3)):
                drv.step([*((r, "main", 1) for r in batch), ("x", "main", rng.randint(2, 9))])
            mgr.remove_request("x")
            del drv.model[("x", "main")]
        # then a decode step of the whole batch (or one that keeps nothing)
        drv.step([(r, "main", 1) for r in batch], commit=op != "no-commit")
        for r in batch:
            # a windowed stream reads back its last W tokens (W1)
            got = mgr.read_stream(r, "main")
            want = drv.expected(r, "main")
            assert torch.equal(got, want[:, want.shape[1] - got.shape[1]:]), r
            assert got.shape[1] == min(want.shape[1], window or want.shape[1]), r
    return checked.kept


@pytest.mark.parametrize("seed", range(4))
def test_kept_table_matches_a_rebuild(seed: int) -> None:
    kept = run(seed)
    assert kept > 30  # the kept table planned most decode steps


@pytest.mark.parametrize("seed", range(2))
def test_kept_table_matches_a_rebuild_without_sharing(seed: int) -> None:
    assert run(seed, sharing=False) > 30


@pytest.mark.parametrize("seed", range(3))
def test_kept_table_matches_a_rebuild_under_a_window(seed: int) -> None:
    """Each decode step past the window releases a page of some streams."""
    policy = RetentionPolicy(context_budget=6)
    assert run(seed, retention={"main": policy}) > 30


class KeptWrittenInPlace(decode_table.DecodeTable):
    """Planted: a step whose rows fill as many pages as the kept array holds
    writes them into that array, saving the allocation, though an earlier
    plan handed the array out as its table."""

    def _emit(self, gens: Any, view_len: Any, npages: Any, offset: Any,
              indices: Any) -> decode_table.DecodePlan:
        kept = self._indices
        if indices is not kept and indices.shape == kept.shape:
            kept[:] = indices
            indices = kept
        return super()._emit(gens, view_len, npages, offset, indices)


@pytest.mark.parametrize("window", [False, True], ids=["full", "window"])
def test_an_earlier_plans_table_written_by_a_later_plan_is_found(
        window: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plant above hands out correct tables at every plan (the oracle
    agrees); only holding earlier plans' tables finds it."""
    if decode_table.SMALL_BATCH > 1:
        pytest.skip("the plant is in the kept table; these batches are planned afresh")
    monkeypatch.setattr(admit_plan_commit, "DecodeTable", KeptWrittenInPlace)
    cfg: dict[str, Any] = {"retention": {"main": RetentionPolicy(context_budget=6)}} if (
        window) else {}
    with pytest.raises(AssertionError, match=r"plan \d+'s main paged_kv_indices is now"):
        run(0, **cfg)


def test_a_step_that_adds_no_page_hands_out_the_last_steps_indices() -> None:
    """The kept indices are copied only when a row's pages change: a decode
    step in which no stream crosses into a new page hands out the array of
    the step before (both plans checked against their scratch build)."""
    if decode_table.SMALL_BATCH > 1:
        pytest.skip("planned afresh: each plan builds its own table")
    mgr = make_manager(pages=40, page_size=PS, heads=1, head_dim=2, layers=1)
    Checked(mgr)
    drv = Driver(mgr)
    batch = ["a", "b", "c", "d"]
    drv.ingest(*batch)
    for rid in batch:
        fill(drv, rid, PS + 1)  # a page and one token: the next steps stay in page 2
    drv.step([(r, "main", 1) for r in batch])  # the kept rows
    tables = [drv.step([(r, "main", 1) for r in batch])["main"].cpu_indptrs
              for _ in range(2)]
    assert tables[0].paged_kv_indices is tables[1].paged_kv_indices
    assert tables[0].paged_kv_indptr.tolist() == [0, 2, 4, 6, 8]
    crossing = drv.step([(r, "main", 1) for r in batch])["main"].cpu_indptrs  # the 2nd page full
    assert crossing.paged_kv_indptr.tolist() == [0, 3, 6, 9, 12]
    assert crossing.paged_kv_indices.data_ptr() != tables[1].paged_kv_indices.data_ptr()
