#!/usr/bin/env bash
# The nightly verification run, inside a fixed budget.
#
#   scripts/nightly.sh --budget MINUTES [--artifacts DIR] [--device cpu|cuda]
#                      [--redis HOST:PORT]
#
# Four parts, in this order, each under a hard timeout of its share of what
# is left (a part that ends early passes its time on):
#   lockstep     HYPOTHESIS_PROFILE=nightly pytest -m nightly tests/conformance/test_lockstep.py
#                on CUDA when there is one, else CPU                          (weight 35)
#   exhaustive   python -m kvref.testing.exhaustive at the nightly scope         (weight 25)
#   concurrency  pytest -m nightly tests/concurrency, the stress test aside    (weight 20)
#   stress       tests/concurrency/test_stress.py, KVREF_STRESS_SECONDS = share (weight 20)
# The lockstep runs first, so it is always reached (the old nightly command
# ran the exhaustive test first, and it took the whole budget).
#
# Each part ends as PASS (it finished clean), BUDGET (a fuzzing part used its
# time and found nothing: the expected end), INCOMPLETE (the exhaustive part
# was cut before it covered its scope: not a pass) or FAIL. Exit 1 on any
# FAIL. Logs, the Hypothesis example database (.hypothesis/, failures are
# replayed from it first on the next run) and a summary go to the artifacts
# directory; shrunk reproducers are printed at the end.
#
# --redis HOST:PORT (or KVREF_HYPOTHESIS_REDIS): the nodes running this
# nightly share failing examples through that Redis server as well as the
# local .hypothesis/ (tests/support/example_db.py): a failure one node found
# is replayed first by every node's next run. Every failure also writes a
# trace file to $ARTIFACTS/traces/; `python -m kvref.testing.replay FILE`
# runs it again anywhere, without Hypothesis's draws.
set -uo pipefail
cd "$(dirname "$0")/.."

BUDGET_MIN=""
ARTIFACTS="${KVREF_ARTIFACTS:-${TMPDIR:-/tmp}/kvref-nightly-$(date -u +%Y%m%dT%H%M%SZ)}"
DEVICE=""
PY="${PYTHON:-python}"
# the nightly scope of the exhaustive conformance replay: kvref as it ships
# (the prefix cache on, label 1 windowed with a rollback margin), docs/gpu-and-nightly.md
EXHAUSTIVE_SCOPE="${KVREF_EXHAUSTIVE_SCOPE:---requests 2 --labels 2 --device-pages 3 --host-pages 2 --max-span 2 --depth 5 --sharing --windows None,1 --margins 0,1}"

while [ $# -gt 0 ]; do
  case "$1" in
    --budget) BUDGET_MIN="$2"; shift 2 ;;
    --artifacts) ARTIFACTS="$2"; shift 2 ;;
    --device) DEVICE="$2"; shift 2 ;;
    --redis) export KVREF_HYPOTHESIS_REDIS="$2"; shift 2 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
if ! [[ "$BUDGET_MIN" =~ ^[0-9]+$ ]] || [ "$BUDGET_MIN" -lt 2 ]; then
  echo "usage: scripts/nightly.sh --budget MINUTES (at least 2)" >&2
  exit 2
fi
if [ -z "$DEVICE" ]; then
  DEVICE=$("$PY" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')
fi
mkdir -p "$ARTIFACTS"
export KVREF_TRACE_DIR="$ARTIFACTS/traces"
if [ -n "${KVREF_HYPOTHESIS_REDIS:-}" ]; then
  # fail now, not as every part's first example
  if ! "$PY" -c 'import sys
from tests.support.example_db import redis_url
import redis
try:
    redis.Redis.from_url(redis_url(sys.argv[1])).ping()
except (redis.RedisError, ValueError) as err:
    sys.exit(f"{type(err).__name__}: {err}")' "$KVREF_HYPOTHESIS_REDIS"; then
    echo "nightly: the shared example database at $KVREF_HYPOTHESIS_REDIS does not answer" >&2
    exit 2
  fi
fi

START=$(date +%s)
DEADLINE=$((START + BUDGET_MIN * 60))
GRACE=20           # after SIGINT, seconds before SIGKILL
PARTS=(lockstep exhaustive concurrency stress)
WEIGHTS=(35 25 20 20)
declare -A STATUS SECS DETAIL

keep_database() {
  if [ -d .hypothesis ]; then
    rm -rf "$ARTIFACTS/hypothesis-db"
    cp -r .hypothesis "$ARTIFACTS/hypothesis-db"
  fi
}
trap keep_database EXIT

# seconds for part $1 (its index): its weight's share of the time left,
# less the grace its timeout may need
share_of() {
  local i=$1 left weight_left=0 j
  left=$((DEADLINE - $(date +%s)))
  for ((j = i; j < ${#PARTS[@]}; j++)); do weight_left=$((weight_left + WEIGHTS[j])); done
  echo $(((left * WEIGHTS[i]) / weight_left - GRACE))
}

# run_part NAME SECONDS KIND CMD...: KIND fuzz (a timeout is BUDGET) or exhaustive
run_part() {
  local name=$1 secs=$2 kind=$3
  shift 3
  local log="$ARTIFACTS/$name.log" t0 rc
  if [ "$secs" -lt 10 ]; then
    STATUS[$name]=FAIL SECS[$name]=0 DETAIL[$name]="no time left ($secs s): budget too small"
    return
  fi
  echo "=== $name: up to ${secs}s: $*" | tee "$log"
  t0=$(date +%s)
  timeout --signal=INT --kill-after="$GRACE" "$secs" "$@" >>"$log" 2>&1
  rc=$?
  SECS[$name]=$(($(date +%s) - t0))
  local last
  if [ "$kind" = exhaustive ]; then
    # its progress line every 5 s, or the summary once it finished
    last=$(grep -E "conformance: |exhaustive conformance:" "$log" | tail -1)
    last=${last:-"no progress line before the end"}
  else
    last=$(grep -E "passed|failed|deselected|error" "$log" | tail -1)
  fi
  if [ $rc -ne 0 ] && grep -qE "$FAILURE_MARKS" "$log"; then
    STATUS[$name]=FAIL
  elif [ $rc -eq 0 ]; then
    STATUS[$name]=PASS
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    if [ "$kind" = exhaustive ]; then STATUS[$name]=INCOMPLETE; else STATUS[$name]=BUDGET; fi
    last="cut at ${secs}s, nothing failed before: ${last}"
  else
    STATUS[$name]=FAIL
  fi
  DETAIL[$name]=$last
  echo "=== $name: ${STATUS[$name]} in ${SECS[$name]}s" | tee -a "$log"
}

PYTEST=("$PY" -m pytest -p no:cacheprovider -m nightly -q -s)
# what a found defect leaves in a log (Hypothesis's shrunk example, pytest's
# failure, the exhaustive checker's mismatch, the scheduler's schedule)
FAILURE_MARKS="Falsifying|Failing test case|^FAILED|MISMATCH|VIOLATION|schedule=\[|AssertionError"

s=$(share_of 0)
HYPOTHESIS_PROFILE=nightly KVREF_NIGHTLY_EXAMPLES="${KVREF_NIGHTLY_EXAMPLES:-1000000}" \
  run_part lockstep "$s" fuzz "${PYTEST[@]}" tests/conformance/test_lockstep.py \
  --kvref-device "$DEVICE"

s=$(share_of 1)
# shellcheck disable=SC2086  # the scope is a list of options
run_part exhaustive "$s" exhaustive "$PY" -m kvref.testing.exhaustive $EXHAUSTIVE_SCOPE

s=$(share_of 2)
HYPOTHESIS_PROFILE=nightly run_part concurrency "$s" fuzz "${PYTEST[@]}" tests/concurrency \
  --deselect tests/concurrency/test_stress.py

s=$(share_of 3)
# the stress test stops itself after KVREF_STRESS_SECONDS; leave time for its end checks
KVREF_STRESS_SECONDS=$((s > 60 ? s - 30 : s / 2)) \
  run_part stress "$s" fuzz "${PYTEST[@]}" tests/concurrency/test_stress.py

keep_database
{
  echo
  echo "nightly: budget ${BUDGET_MIN} min, device $DEVICE, used $(($(date +%s) - START)) s"
  printf '%-12s %-10s %6s  %s\n' part result secs detail
  for p in "${PARTS[@]}"; do
    printf '%-12s %-10s %6s  %s\n' "$p" "${STATUS[$p]:-NOT RUN}" "${SECS[$p]:-0}" "${DETAIL[$p]:-}"
  done
  echo "shared example database: ${KVREF_HYPOTHESIS_REDIS:-none (local .hypothesis/ only)}"
  echo "trace files: $(find "$KVREF_TRACE_DIR" -name '*.json' 2>/dev/null | wc -l)" \
    "in $KVREF_TRACE_DIR (python -m kvref.testing.replay FILE)"
  echo "artifacts: $ARTIFACTS (logs, hypothesis-db, traces)"
} | tee "$ARTIFACTS/summary.txt"

failed=0
for p in "${PARTS[@]}"; do
  if [ "${STATUS[$p]:-}" = FAIL ]; then
    failed=1
    echo
    echo "--- reproducer ($p), from $ARTIFACTS/$p.log:"
    # pytest's "E" lines carry Hypothesis's shrunk example (the rule calls
    # of a state machine, or the drawn program and schedule); the checker
    # prints MISMATCH lines; Hypothesis also writes .hypothesis/patches/,
    # copied into hypothesis-db/
    grep -E "^E |MISMATCH|VIOLATION|schedule=\[|reproduce_failure|git apply|^FAILED" \
      "$ARTIFACTS/$p.log" | head -200
  fi
done
exit $failed
