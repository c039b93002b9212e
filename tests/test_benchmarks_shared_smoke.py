"""`python -m benchmarks.shared_pages --quick` runs and reports what it should:
the table's rows, the JSON's structure, and the facts that are not timings
(pages copied per fork, pages held by requests sharing a prompt). No timing is
asserted: this box is shared and noisy.
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import shared_pages as sp
from benchmarks.prefix_cache import PAGE_SIZE
from tests.support.bench_smoke import check_spread
from tests.support.bench_smoke import quick_run as run_quick


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    return run_quick(sp.main, tmp_path_factory.mktemp("shared") / "shared.json")


def test_the_table_has_every_row(quick_run: tuple[str, dict[str, Any]]) -> None:
    text, _ = quick_run
    assert text.startswith("### Shared pages (--quick)")
    expected = [
        "| what | kvref, sharing | baseline | ratio | target |",
        *(f"| fork of {n} tokens: {what} |" for n in sp.FORK_TOKENS
          for what in ("pages copied", "µs per pre-fork step")),
        "admission of 2048 tokens, 1792 cached", "the same + cache_prefix of the prompt",
        "hash 2048 tokens into 128 page keys",
        *(f"| decode B={b}, caching on, {how}" for b in sp.DECODE_BATCHES
          for how in ("tokens named", "no tokens named")),
        "**176 pages held** = 64 shared + 16 × 7 own", "without sharing 1136 = 16 × 71",
    ]
    assert [row for row in expected if row not in text] == []
    assert "`python -m benchmarks.shared_pages --quick`" in text


def test_json_structure_and_timings_are_well_formed(
        quick_run: tuple[str, dict[str, Any]]) -> None:
    _, data = quick_run
    assert data["benchmark"] == "shared_pages" and data["results"]["quick"] is True
    r = data["results"]
    assert {"forks", "hit", "decode", "memory"} <= r.keys()
    for f in r["forks"]:
        for k in ("shared_us", "copying_us", "ratio"):
            check_spread(f[k])
    for k in ("admission", "with_cache_prefix", "hashing"):
        for side in ("ours_us", "theirs_us", "ratio"):
            check_spread(r["hit"][k][side])
    assert [d["batch"] for d in r["decode"]] == list(sp.DECODE_BATCHES)
    for d in r["decode"]:
        for k in ("off_us", "on_us", "named_us", "on_ratio", "named_ratio", "followed_us",
                  "followed_ratio"):
            check_spread(d[k])
        assert d["cache_calls_per_step"] > 0  # the engine named tokens as pages filled
        if sp.fast_hash() is not None:  # the fast page-key hash's row, where installed
            check_spread(d["fast_us"])
            check_spread(d["fast_ratio"])
        else:
            assert d["fast_us"] is None


def test_a_copy_on_write_fork_copies_at_most_one_page(
        quick_run: tuple[str, dict[str, Any]]) -> None:
    _, data = quick_run
    forks = {f["tokens"]: f for f in data["results"]["forks"]}
    assert forks.keys() == set(sp.FORK_TOKENS)
    for tokens, f in forks.items():
        partial = tokens % PAGE_SIZE != 0
        assert f["copied_shared"] == (1 if partial else 0)
        assert f["copied_copying"] == sp.pages_for(tokens)  # the baseline copies them all
    assert forks[2048]["page_kib"] == 512


def test_the_hit_attaches_the_cached_head(quick_run: tuple[str, dict[str, Any]]) -> None:
    _, data = quick_run
    assert data["results"]["hit"]["attached"] == 1792


def test_requests_sharing_a_prompt_hold_its_pages_once(
        quick_run: tuple[str, dict[str, Any]]) -> None:
    _, data = quick_run
    m = data["results"]["memory"]
    assert (m["requests"], m["shared_pages"], m["own_pages"]) == (16, 64, 7)
    assert m["attached"] == [1024] * 15  # the first computes, the 15 others hit
    assert m["heads_shared"] is True
    assert m["held"] == 64 + 16 * 7
    assert m["held_copying"] == 16 * (64 + 7)


def test_preemption_keeps_the_prompt_shared(quick_run: tuple[str, dict[str, Any]]) -> None:
    text, data = quick_run
    e = data["results"]["preemption"]
    assert "after 8 of them are offloaded and reloaded: device pages held" in text
    # S29: the reload re-attaches every keyed page the cache still holds (the
    # prompt, held by the others, and each request's own full pages, free but
    # cached): only the part page is taken fresh
    assert (e["held_before"], e["held"]) == (64 + 16 * 7, 64 + 16 * 7)
    assert e["private_cached"] == 0 and e["pages_taken"] == 8 * 7
    # copied back, each reloaded request holds its own copy of the prompt, and of
    # its own 6 full pages still in the cache
    assert e["held_copying"] == 64 + 16 * 7 + 8 * 64
    assert e["private_cached_copying"] == 8 * 70 and e["pages_taken_copying"] == 8 * 71
    for side in ("ours_us", "theirs_us", "ratio"):
        check_spread(e["reload_us"][side])
