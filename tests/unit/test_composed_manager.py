"""The harness drives a manager that wraps `KVManager` by composition
(tests/support/composed_manager.py): no subclass, no private attribute,
only `ManagerUnderTest` (issue 27, part 6). The packaged suite's run of it,
installed outside the checkout, is in tests/e2e/test_harness_outside.py."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from kvref import KVConfig, KVManager, TransferEngineInfo
from kvref.testing.driver import DriverConfig, ManagerUnderTest
from kvref.testing.exhaustive import Mismatch, run_trace
from kvref.testing.lockstep import RULES, SCOPE, Lockstep
from kvref_model import core as m
from tests.support.composed_manager import ComposedManager, make_manager


class EagerFree(ComposedManager):
    """A wrapper that lies on one public call: every reset frees its pages,
    where the model says a plain reset keeps them."""

    def reset_request(self, rid: str, free: bool = False) -> None:
        super().reset_request(rid, free=True)


def test_it_wraps_and_offers_only_the_harness_surface() -> None:
    assert not issubclass(ComposedManager, KVManager)
    surface = {n for n in vars(ManagerUnderTest) if not n.startswith("_")}
    offered = {n for n in vars(ComposedManager) if not n.startswith("_")}
    assert offered == surface, offered ^ surface
    kv = make_manager(**manager_kwargs())
    with pytest.raises(AttributeError):
        kv._streams  # type: ignore[attr-defined]  # noqa: B018


def manager_kwargs() -> dict[str, Any]:
    cfg = KVConfig(num_layers=1, num_kv_heads=1, head_dim=2, max_seq_len=16, max_num_pages=4,
                   page_size=2, num_qo_heads=1)
    return dict(cfg=cfg, name="kv", joint_comm_group=None,
                transfer_engine_info=TransferEngineInfo(), device="cpu")


TRACE = [m.Ingest(0), m.Admit(m.Step((m.Seg(0, 0, 2),), padded=(0,))), m.Plan(), m.Write(),
         m.Commit(), m.Reset(0, free=False)]


def test_a_trace_passes_on_the_wrapper_and_its_lie_is_found() -> None:
    model = m.Model(m.Scope(device_pages=3, host_pages=1, page_size=1, max_span=2))
    run_trace(model, TRACE, DriverConfig(factory=make_manager))
    with pytest.raises(Mismatch, match="states differ"):
        run_trace(model, TRACE, DriverConfig(factory=EagerFree))


def test_the_lockstep_drives_the_wrapper() -> None:
    # a handful of runs, so not `run_lockstep`, which fails a run too short to
    # exercise every action; tests/e2e runs the packaged suite on the wrapper
    Lockstep.config, Lockstep.scope = DriverConfig(factory=make_manager), SCOPE
    RULES.clear()
    run = settings(max_examples=8, stateful_step_count=40, deadline=None, derandomize=True,
                   database=None, suppress_health_check=[HealthCheck.too_slow])
    run_state_machine_as_test(Lockstep, settings=run)
    assert RULES["Commit"] and RULES["OffloadClaim"] and RULES["RetrieveStart"], RULES
