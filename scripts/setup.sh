#!/usr/bin/env bash
# Idempotent setup on a fresh machine: a virtualenv in .venv with torch (CPU wheel, pinned
# first so nothing pulls CUDA wheels) and megatron_bridge installed editable with its pinned
# dependencies. Re-runs are no-ops unless pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.mbr-setup-$(sha1sum pyproject.toml | cut -c1-12)
if [ -f "$stamp" ]; then exit 0; fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored: it is neither" || true
.venv/bin/python -m pip install -q -e ".[dev]" 2>&1 | grep -v "is ignored: it is neither" || true
.venv/bin/python -c "import torch, megatron.core, deepspeed, transformers, hydra" >/dev/null 2>&1 \
  || { echo "setup failed: dependencies do not import" >&2; exit 1; }
rm -f .venv/.mbr-setup-*; touch "$stamp"
echo "setup done: $(.venv/bin/python -c 'import torch, megatron.core as m, deepspeed as d; print(f"torch {torch.__version__}, megatron-core {m.__version__}, deepspeed {d.__version__}")' 2>/dev/null)"
