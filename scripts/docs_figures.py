"""Render the performance page's figures from a benchmark run's JSON.

Two steps, so that no page is edited by hand with numbers:

    python -m benchmarks --json docs/performance/data/benchmarks.json            # 1: measure
    python -m benchmarks.attention --json docs/performance/data/attention.json   #    (all
    python -m benchmarks.shared_pages --json docs/performance/data/shared_pages.json #  four)
    python -m benchmarks.retention --json docs/performance/data/retention.json
    python -m benchmarks.vs_vllm --runs 5 --json docs/performance/data/vs_vllm.json # (a vLLM copy)
    python -m benchmarks.hybrid --json docs/performance/data/hybrid.json           # (a vLLM copy)
    python scripts/docs_figures.py                                               # 2: render

Step 2 reads the JSON only (it measures nothing) and writes
`docs/performance/figures.md` with the same tables the benchmarks print, read
back into their row types and rendered by the benchmarks' own functions, plus
a summary of the ratios. ``--check`` renders to memory and exits 1 when the
committed page differs from what the committed JSON gives (the docs test runs
it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import (
    attention,
    control_plane,
    data_plane,
    hybrid,
    retention,
    shared_pages,
    vs_vllm,
)
from benchmarks.__main__ import control_tables, data_tables

DATA = ROOT / "docs" / "performance" / "data"
PAGE = ROOT / "docs" / "performance" / "figures.md"

T = TypeVar("T")


def rebuild(cls: type[T], data: dict[str, Any]) -> T:
    """A row dataclass (and the dataclasses and tuples inside it) from its JSON dict."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in data and f.default is not dataclasses.MISSING:
            continue  # a row added since the JSON was recorded: its default
        kind, value = hints[f.name], data[f.name]
        if typing.get_origin(kind) in (typing.Union, types.UnionType) and value is not None:
            kind = next(k for k in typing.get_args(kind) if k is not type(None))
        if dataclasses.is_dataclass(kind) and isinstance(kind, type):
            value = rebuild(kind, value)
        elif typing.get_origin(kind) is tuple:
            value = tuple(value)
        elif typing.get_origin(kind) is list:
            (item,) = typing.get_args(kind)
            if dataclasses.is_dataclass(item) and isinstance(item, type):
                value = [rebuild(item, v) for v in value]
        kwargs[f.name] = value
    return cls(**kwargs)


def short(entry: control_plane.ProfileEntry) -> control_plane.ProfileEntry:
    """A profiled function outside kvref is named by its path where the run was:
    keep the part from the checkout's top folder on."""
    where = re.sub(r"/\S*/(benchmarks|examples|tests)/", r"\1/", entry.function)
    return dataclasses.replace(entry, function=where)


def span(values: list[float], digits: int = 2) -> str:
    """``lo–hi`` of some values (one value, or both alike when rounded: just it)."""
    lo, hi = (f"{v:.{digits}f}" for v in (min(values), max(values)))
    return lo if lo == hi else f"{lo}–{hi}"


def conditions(run: dict[str, Any], command: str) -> str:
    text = (f"Recorded {run.get('recorded', 'at an unrecorded time')} at commit "
            f"`{run.get('commit', 'unrecorded')}` with `{command}` in "
            f"{run['seconds']:.0f} s on {run['machine']}; load average "
            f"{run['load_start']:.1f} at the start and {run['load_end']:.1f} at the end.")
    cpus = run.get("cpus") or 1
    if max(run["load_start"], run["load_end"]) >= cpus / 2:
        # other work shared the machine: say so where the figures are
        text += (" **Measured under load** (other processes shared the CPUs): absolute "
                 "times are inflated and noisy; read the same-run ratios.")
    return text


def control_section(run: dict[str, Any]) -> list[str]:
    c = run["control"]
    rows = [rebuild(control_plane.DecodeRow, r) for r in c["decode"]]
    mixed = [rebuild(control_plane.MixedRow, r) for r in c["mixed"]]
    pre = rebuild(control_plane.PrefillRow, c["prefill"])
    profiles = {int(b): [short(rebuild(control_plane.ProfileEntry, e)) for e in entries]
                for b, entries in c["profiles"].items()}
    return [
        f"- A decode step (admit + plan + commit) costs {span([r.ratio for r in rows])} of "
        f"the reference's at batch {rows[0].batch}–{rows[-1].batch}.",
        f"- A mixed step (decodes plus a {control_plane.CHUNK}-token prefill chunk) costs "
        f"{span([r.ratio for r in mixed])} of the reference's; the chunk adds "
        f"{span([r.extra_us.median for r in mixed], 1)} µs to a decode step (the reference: "
        f"{span([r.ref_extra_us.median for r in mixed], 1)} µs).",
        "",
        control_tables(rows, mixed, pre, profiles),
    ]


def data_section(run: dict[str, Any]) -> list[str]:
    rows = [rebuild(data_plane.CopyRow, r) for r in run["data"]]
    slow = [r for r in rows if r.below_half]
    return [
        f"- Page copies run at {span([r.ratio.median for r in rows])} of a plain copy of "
        f"the same bytes; {len(slow)} of {len(rows)} paths under half of it (bold below).",
        "",
        data_tables(rows),
    ]


def attention_section(run: dict[str, Any]) -> list[str]:
    rows = [rebuild(attention.Row, r) for r in run["rows"]]
    return [
        f"- The batched SDPA path runs at {span([r.sdpa_ratio for r in rows])} of dense "
        f"attention over the same tokens, the per-request reference at "
        f"{span([r.ref_ratio for r in rows])}.",
        "",
        attention.tables(rows),
    ]


def retention_summary(r: retention.Results) -> list[str]:
    g, d = r.growth, r.decode
    last = g.checkpoints[-1]
    return [
        f"- A stream windowed to W = {g.window} tokens (page size {g.page_size}) holds "
        f"at most {g.max_retained_after_fill} device pages once its window has filled "
        f"(bound {g.bound}); without retention it holds {last.full} after "
        f"{last.generated} generated tokens.",
        f"- A decode step of B = {d.batch} with retention costs "
        f"{span([p.ratio.median for p in d.phases])} of the same step without, the "
        f"requests growing from {d.phases[0].stored_min} to {d.phases[-1].stored_max} "
        "tokens.",
    ]


def render(data: Path = DATA) -> str:
    """The page, from the JSON files under ``data``."""
    out = [
        "# Figures",
        "",
        "<!-- generated by scripts/docs_figures.py from docs/performance/data/*.json: "
        "do not edit; rerun the benchmarks with --json, then the script -->",
        "",
        "Generated by `scripts/docs_figures.py` from the JSON a benchmark run wrote "
        "(`docs/performance/data/`); [Performance](index.md) says how to measure and how "
        "to read them. Read the ratios: both sides of each were timed in the same run.",
    ]
    bench = data / "benchmarks.json"
    if bench.exists():
        run = json.loads(bench.read_text())
        command = "python -m benchmarks" + (" --quick" if run["quick"] else "")
        out += ["", "## Control and data plane", "", conditions(run, command), ""]
        if "control" in run:
            out += [*control_section(run), ""]
        if "data" in run:
            out += [*data_section(run), ""]
    att = data / "attention.json"
    if att.exists():
        run = json.loads(att.read_text())
        command = "python -m benchmarks.attention" + (" --quick" if run["quick"] else "")
        out += ["", "## Attention on CPU", "", conditions(run, command), ""]
        out += [*attention_section(run), ""]
    shared = data / "shared_pages.json"
    if shared.exists():
        run = json.loads(shared.read_text())
        results = rebuild(shared_pages.Results, run["results"])
        command = "python -m benchmarks.shared_pages" + (" --quick" if results.quick else "")
        out += ["", "## Shared pages", "", conditions(run, command), "",
                shared_pages.tables(results), ""]
    windowed = data / "retention.json"
    if windowed.exists():
        run = json.loads(windowed.read_text())
        kept = rebuild(retention.Results, run["results"])
        command = "python -m benchmarks.retention" + (" --quick" if kept.quick else "")
        out += ["", "## Sliding-window retention", "", conditions(run, command), "",
                *retention_summary(kept), "", retention.tables(kept), ""]
    beside = data / "vs_vllm.json"
    if beside.exists():
        run = json.loads(beside.read_text())
        rows = [rebuild(vs_vllm.Row, r) for r in run["rows"]]
        command = "python -m benchmarks.vs_vllm" + (" --tiny" if run.get("tiny") else
                                                     " --quick" if run["quick"] else "") + (
            f" --runs {run['runs']}" if run.get("runs", 1) > 1 else "")
        out += ["", "## Beside vLLM's KV-cache manager", "", conditions(run, command), "",
                f"{vs_vllm.heading(run['vllm'])}; each ratio is vLLM's time over kvref's, "
                "median [p10, p90] of per-pair ratios (the module's docstring says what "
                "each side's timed call holds).", "", vs_vllm.table(rows), "",
                "kvref against itself, from the same run:", "",
                *[f"- {line}" for line in vs_vllm.derived(rows)], ""]
    groups = data / "hybrid.json"
    if groups.exists():
        run = json.loads(groups.read_text())
        res = rebuild(hybrid.Results, run["results"])
        command = "python -m benchmarks.hybrid" + (" --tiny" if run.get("tiny") else
                                                    " --quick" if run["quick"] else "")
        out += ["", "## Hybrid models beside vLLM's hybrid coordinator", "",
                conditions(run, command), "", f"{hybrid.heading(run['vllm'], res.sizes)}; "
                "the module's docstring says what each side holds and times.", "",
                hybrid.tables(res)]
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if the page differs from what the JSON renders to")
    ap.add_argument("--data", type=Path, default=DATA, help="where the JSON files are")
    ap.add_argument("--out", type=Path, default=PAGE, help="the page to write")
    args = ap.parse_args(argv)
    text = render(args.data)
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is not what {args.data} renders to: "
                  "run python scripts/docs_figures.py", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
