#!/usr/bin/env bash
# The developer gate, one command: lint (ruff check), format check (ruff format --check) and
# the type check (mypy) over megatron_bridge/. `.ci/run` runs it before the tests; the
# pre-commit config runs the same tools. `bash scripts/lint.sh --fix` applies ruff's fixes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${1:-}" = "--fix" ]; then
  .venv/bin/ruff check --fix . && .venv/bin/ruff format .
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
if grep -q '^\[tool.mypy\]' pyproject.toml; then
  .venv/bin/mypy megatron_bridge
fi
echo "lint, format and type check: clean"
