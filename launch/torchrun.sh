#!/usr/bin/env bash
# Run a recipe with torchrun on this node. Single node: `launch/torchrun.sh recipe=tiny_llama`.
# Multi-node: run on every node with NODE_RANK set (0..N-1) and the same arguments, e.g.
#   NODE_RANK=1 launch/torchrun.sh recipe=llama3_70b cluster.hostnames=[n0,n1,...]
# The command each node runs is the one `mbr launch ... --dry-run` prints for it.
set -euo pipefail
cd "$(dirname "$0")/.."
MBR=${MBR:-.venv/bin/mbr}
if [ -z "${NODE_RANK:-}" ]; then exec "$MBR" launch launcher=torchrun "$@"; fi
cmd=$("$MBR" launch launcher=torchrun "$@" --dry-run | awk -v n="--- node $NODE_RANK" 'index($0, n)==1 {getline; print}')
[ -n "$cmd" ] || { echo "no command for node $NODE_RANK (check cluster.nodes)" >&2; exit 2; }
exec bash -c "$cmd"
