#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: unit tests and real multi-process
# torchrun/gloo tests. Extra arguments go to pytest (e.g. `-k rules`, `-m "not dist"`) and
# then everything runs in one pytest, one test after another.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# wandb is disabled (never imported: ~1.5 s and a service process per training launch); the
# tests that check what it records set WANDB_MODE=offline themselves.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=${WANDB_MODE:-disabled} TOKENIZERS_PARALLELISM=false
# Bytecode of our own (editable) package is written once and reused by the hundreds of processes
# the tests start, also where the environment sets PYTHONDONTWRITEBYTECODE (~0.7 s a process).
export PYTHONDONTWRITEBYTECODE=
PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15)
if [ $# -gt 0 ] || [ "$(getconf _NPROCESSORS_ONLN)" -lt 2 ]; then
  exec "${PYTEST[@]}" "$@"
fi
# The whole suite: tests/unit (one process per test, one thread) runs beside the
# multi-process tests (tests/dist, tests/reliability), on the CPU those leave idle while
# they start up, wait on each other or sleep in their fault scenarios; its output follows
# theirs. Measured on the 2-core box: docs/contributing.md, "Test time".
unit_log=$(mktemp)
"${PYTEST[@]}" tests/unit >"$unit_log" 2>&1 &
unit_pid=$!
trap 'kill "$unit_pid" 2>/dev/null || true; rm -f "$unit_log"' EXIT
rc=0
"${PYTEST[@]}" tests/dist tests/reliability || rc=$?
unit_rc=0
wait "$unit_pid" || unit_rc=$?
echo "=== tests/unit (ran beside the multi-process tests above; exit $unit_rc) ==="
cat "$unit_log"
if [ "$rc" -ne 0 ]; then exit "$rc"; fi
exit "$unit_rc"
