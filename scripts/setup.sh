#!/usr/bin/env bash
# Idempotent setup on a fresh machine: a virtualenv in .venv with torch (CPU wheel, pinned
# first so nothing pulls CUDA wheels) and megatron_bridge installed editable with its pinned
# dependencies. Re-runs are no-ops unless pyproject.toml changed.
#
# The installs go through uv (pinned, installed into the venv by pip) when it installs: the
# same versions as pip in ~70 s instead of ~3 min (docs/contributing.md, "Test time"). Like
# pip, it compiles the bytecode at install time: where PYTHONDONTWRITEBYTECODE is set, nothing
# compiles it later and every import of torch/megatron would be parsed again (34 s vs 13 s).
# uv does not read pip's configuration, so pip's find-links (where the CPU torch wheel lies)
# are handed to it; without uv, pip does it all.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.mbr-setup-$(sha1sum pyproject.toml | cut -c1-12)
if [ -f "$stamp" ]; then exit 0; fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
quiet() { grep -v -e "is ignored: it is neither" -e "^Using Python" || true; }
install=(.venv/bin/python -m pip install -q)
if .venv/bin/python -m pip install -q "uv==0.13.8" 2>&1 | quiet && [ -x .venv/bin/uv ]; then
  install=(.venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python)
  links=${PIP_FIND_LINKS:-$(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)}
  for link in $links; do install+=(--find-links "$link"); done
fi
"${install[@]}" "torch==2.13.0" 2>&1 | quiet
"${install[@]}" -e ".[dev]" 2>&1 | quiet
versions=$(.venv/bin/python -c 'import torch, megatron.core as m, deepspeed as d, transformers, hydra
print(f"torch {torch.__version__}, megatron-core {m.__version__}, deepspeed {d.__version__}")' 2>/dev/null | tail -1) \
  || { echo "setup failed: dependencies do not import" >&2; exit 1; }
rm -f .venv/.mbr-setup-*; touch "$stamp"
echo "setup done: $versions"
