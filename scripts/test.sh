#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: unit tests and real multi-process
# torchrun/gloo tests. Extra arguments go to pytest (e.g. `-k rules`, `-m "not dist"`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# wandb is disabled (never imported: ~1.5 s and a service process per training launch); the
# tests that check what it records set WANDB_MODE=offline themselves.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=${WANDB_MODE:-disabled} TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
