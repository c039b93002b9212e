"""`python -m benchmarks.retention --quick` runs and reports what it should:
the tables' rows, the JSON's structure, and the facts that are not timings
(device pages held by a windowed stream: flat at ceil(W / ps) + 1 once its
window has filled; linear without retention). No timing is asserted: this box
is shared and noisy.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from benchmarks import retention as rt
from tests.support.bench_smoke import check_spread
from tests.support.bench_smoke import quick_run as run_quick


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    return run_quick(rt.main, tmp_path_factory.mktemp("retention") / "retention.json")


def test_the_tables_have_every_row(quick_run: tuple[str, dict[str, Any]]) -> None:
    text, _ = quick_run
    assert text.startswith("### Sliding-window retention (--quick)")
    expected = [
        "| tokens generated | tokens stored | pages held, retention W=256 | "
        "pages held, no retention |",
        "| 0 | 32 | 2 | 2 |",
        *(f"| {g} | {g + 32} | 16 | {-(-(g + 32) // 16)} |" for g in range(512, 4097, 512)),
        "bound ceil(256 / 16) + 1 = 17", "after every step: yes",
        "| decode B=16: admit + plan + write_kv × 2 layers + commit, µs/step | retention "
        "| no retention | ratio | target |",
        "| steps 0–127 (requests of ", "| steps 128–255 (requests of ",
        "| device pages held after 256 steps (+ warmup) |",
    ]
    assert [row for row in expected if row not in text] == []
    assert "`python -m benchmarks.retention --quick`" in text


def test_json_structure_and_timings_are_well_formed(
        quick_run: tuple[str, dict[str, Any]]) -> None:
    _, data = quick_run
    assert data["benchmark"] == "retention" and data["results"]["quick"] is True
    d = data["results"]["decode"]
    assert (d["batch"], d["steps"], d["rounds"], len(d["phases"])) == (16, 256, 1, 2)
    for p in d["phases"]:
        for k in ("retained_us", "full_us", "ratio"):
            check_spread(p[k])
        assert p["retained_us"]["n"] == p["full_us"]["n"] == 128


def test_a_windowed_stream_holds_a_flat_bound_of_pages(
        quick_run: tuple[str, dict[str, Any]]) -> None:
    _, data = quick_run
    g = data["results"]["growth"]
    assert (g["window"], g["page_size"], g["prompt"], g["generated"]) == (256, 16, 32, 4096)
    assert g["bound"] == 17 == math.ceil(256 / 16) + 1
    # after every step once the window filled: within the bound, and it is reached
    assert g["max_retained_after_fill"] == 17
    assert g["min_retained_after_fill"] == 16
    points = g["checkpoints"]
    assert [c["generated"] for c in points] == list(range(0, 4097, 512))
    for c in points:
        assert c["stored"] == 32 + c["generated"]
        if c["stored"] >= 256:
            assert c["retained"] <= 17


def test_without_retention_the_pages_grow_linearly(
        quick_run: tuple[str, dict[str, Any]]) -> None:
    _, data = quick_run
    g = data["results"]["growth"]
    assert g["full_linear"] is True  # ceil(stored / 16) after every one of the 4,096 steps
    for c in g["checkpoints"]:
        assert c["full"] == math.ceil(c["stored"] / 16)
    assert g["checkpoints"][-1]["full"] == 258


def test_a_windowed_batch_holds_its_bound(quick_run: tuple[str, dict[str, Any]]) -> None:
    _, data = quick_run
    d = data["results"]["decode"]
    assert d["held_retained"] <= 16 * 17
    assert d["held_full"] > d["held_retained"]
