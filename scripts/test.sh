#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: unit tests and real multi-process
# torchrun/gloo tests. Extra arguments go to pytest (e.g. `-k rules`, `-m "not dist"`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=${WANDB_MODE:-offline} TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
