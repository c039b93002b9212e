"""Plant one bug per class of defect that test_bad_input / test_boundaries claim to
catch, and check that the tests named for it fail; the clean tree passes them.

    python tests/unit/_plant_validate.py [WORD]   # from the repository root; WORD: only
                                                  # the plants whose name holds it

Each plant runs in a scratch copy of kvref/, kvref_model/ and tests/ (the tree is not touched).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BAD = "tests/unit/test_bad_input.py"
BOUND = "tests/unit/test_boundaries.py"
MEMO = "tests/unit/test_step_validator.py"
PATHS = "tests/unit/test_admission_paths.py"

# (defect class, file, text, replacement, tests that must fail)
PLANTS: list[tuple[str, str, str, str, list[str]]] = [
    ("request id not checked", "kvref/manager.py",
     '        validate.request_id(rid, "remove_request")\n', "",
     [f"{BAD}::test_bad_input[remove-int]"]),
    ("bool span taken for an int", "kvref/validate.py",
     "type(seg.span) is int and seg.span >= 0", "isinstance(seg.span, int) and seg.span >= 0",
     [f"{BAD}::test_bad_input[span-bool-admit]"]),
    ("a bare str taken as a sequence of ids", "kvref/validate.py",
     "isinstance(value, Sequence) and not isinstance(value, str))",
     "isinstance(value, Sequence))",
     [f"{BAD}::test_bad_input[padded-bare-str]"]),
    ("negative layer index accepted", "kvref/validate.py",
     "if not 0 <= idx < num_layers:", "if not -num_layers <= idx < num_layers:",
     [f"{BAD}::test_bad_input[write-layer-neg]"]),
    ("max_seq_len ignores the pre-fork length", "kvref/validate.py",
     "        if pre and (seg.request_id, seg.label) in pre:", "        if False:",
     [f"{BAD}::test_bad_input[max-seq-len-pre-fork-target]"]),
    ("max_seq_len off by one", "kvref/validate.py",
     "if base + seg.span > max_seq_len:", "if base + seg.span >= max_seq_len:",
     [f"{BAD}::test_max_seq_len_boundary_is_admitted[main]",
      f"{BAD}::test_max_seq_len_boundary_is_admitted[cfg]"]),
    ("K/V device not checked", "kvref/validate.py",
     "        if t.device != device:", "        if False:",
     [f"{BAD}::test_bad_input[write-k-meta]"]),
    ("a check after the state change", "kvref/manager.py",
     '        validate.request_id(rid, "ingest_request")\n'
     '        validate.req_config(overrides, rid)\n'
     '        with self._lock:\n'
     '            # idempotent: one request reaches a worker once per partition it\n'
     '            # serves, and replacing the streams on the second ingest dropped\n'
     '            # the lengths the first partition had already filled\n'
     '            self._streams.setdefault(rid, {"main": CacheStream()})\n',
     '        with self._lock:\n'
     '            self._streams.setdefault(rid, {"main": CacheStream()})\n'
     '        validate.request_id(rid, "ingest_request")\n'
     '        validate.req_config(overrides, rid)\n'
     '        with self._lock:\n',
     [f"{BAD}::test_bad_input[ingest-int]"]),
    ("config not type-checked", "kvref/core/config.py",
     "return isinstance(value, int) and not isinstance(value, bool)",
     "return isinstance(value, (int, float))",
     [f"{BAD}::test_bad_config_fails_at_construction[page_size-2.5]"]),
    ("manager shares the caller's config", "kvref/manager.py",
     "cfg = cfg.sharded(joint_comm_group.world_size) if joint_comm_group else cfg.copy()",
     "cfg = cfg.shard(joint_comm_group.world_size) if joint_comm_group else cfg",
     [f"{BAD}::test_config_mutated_after_build_does_not_reach_the_manager",
      f"{BOUND}::test_sharding_copies_the_config"]),
    ("world-size check dropped", "kvref/transfer/retrieval.py",
     "        if published is not None and published.world_size != self._world_size:",
     "        if False:",
     [f"{BOUND}::test_world_size_mismatch_is_a_typed_refusal"]),
    ("descriptor compared by identity", "kvref/transfer/engine.py",
     "@dataclass(frozen=True)\nclass KVTransferInfo:",
     "@dataclass(frozen=True, eq=False)\nclass KVTransferInfo:",
     [f"{BOUND}::test_self_retrieve_recognised_after_pickle"]),
    ("graph buffers may grow after capture", "kvref/stepping/graph_staging.py",
     "if self.static_plan_states and max_seq_len > self.max_seq_len:",
     "if False:",
     [f"{BOUND}::test_captures_of_several_sizes"]),
    ("lease fit checked only inside plan", "kvref/manager.py",
     "        validate.slot_lease(step, ctx, self._graph_staging.max_seq_len)\n", "",
     [f"{BOUND}::test_lease_that_does_not_fit_is_refused_before_plan_changes_anything",
      f"{BOUND}::test_second_plan_label_too_big_leaves_the_first_buffer_alone"]),
    ("step memo trusts the objects alone", "kvref/validate.py",
     "            if (st.segments is seen.segments and st.commit is seen.commit",
     "            if True or (st.segments is seen.segments and st.commit is seen.commit",
     [f"{MEMO}::test_a_step_changed_after_admit_is_caught[commit-swapped-commit]",
      f"{MEMO}::test_a_step_changed_after_admit_is_caught[padded-appended-int-plan]"]),
    ("step memo ignores a segment list changed in place", "kvref/validate.py",
     "                    and st.segments == seen.segments_copy\n", "",
     [f"{MEMO}::test_a_step_changed_after_admit_is_caught[segment-replaced-negative-commit]",
      f"{MEMO}::test_a_step_changed_after_admit_is_caught[segment-replaced-bool-span-plan]"]),
    ("plain admission misses a latched retrieve failure", "kvref/stepping/admission.py",
     "stream.offloaded or stream.read_future is not None or (\n"
     "                    stream.read_error is not None)",
     "stream.offloaded or stream.read_future is not None",
     [f"{PATHS}::test_each_stream_that_may_refuse_is_ruled_as_in_general"]),
    ("plain admission counts a page short", "kvref/stepping/admission.py",
     "short = (-(-end // page_size) - stream.released // page_size",
     "short = (-(-(end - 1) // page_size) - stream.released // page_size",
     [f"{PATHS}::test_plain_pass_answers_as_the_general_rules"]),
    ("plain admission skips max_seq_len", "kvref/stepping/admission.py",
     "        if end >= max_seq_len:\n", "        if False:\n",
     [f"{PATHS}::test_plain_pass_answers_as_the_general_rules",
      f"{PATHS}::test_a_plain_step_past_max_seq_len_is_refused_on_the_plain_path[main]",
      f"{PATHS}::test_a_plain_step_past_max_seq_len_is_refused_on_the_plain_path[draft]"]),
]


def _run(tree: Path, tests: list[str]) -> tuple[int, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=tree, capture_output=True, text=True, check=False,
    )
    return proc.returncode, proc.stdout.strip().splitlines()[-1] if proc.stdout else ""


def main() -> int:
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        only = sys.argv[1] if len(sys.argv) > 1 else ""
        for name, path, old, new, tests in PLANTS:
            if only not in name:
                continue
            tree = Path(tmp) / "tree"
            shutil.rmtree(tree, ignore_errors=True)
            for part in ("kvref", "kvref_model", "tests", "pyproject.toml"):
                src = ROOT / part
                if src.is_dir():
                    shutil.copytree(src, tree / part)
                else:
                    shutil.copy(src, tree / part)
            rc, clean = _run(tree, tests)
            target = tree / path
            text = target.read_text()
            if text.count(old) != 1 or rc != 0:
                print(f"SETUP  {name}: text found {text.count(old)}x, clean rc={rc} ({clean})")
                ok = False
                continue
            target.write_text(text.replace(old, new))
            rc, planted = _run(tree, tests)
            caught = rc != 0
            ok = ok and caught
            print(f"{'CAUGHT' if caught else 'MISSED'} {name}: clean [{clean}] "
                  f"planted [{planted}]")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
