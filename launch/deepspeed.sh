#!/usr/bin/env bash
# Run a recipe with the DeepSpeed launcher from the first node. With cluster.nodes > 1 it
# writes a hostfile next to the command (output=DIR, default launch_out/) and uses it; the
# DeepSpeed launcher reaches the other nodes over pdsh/ssh.
#   launch/deepspeed.sh recipe=llama3_8b train.engine=deepspeed zero.stage=2 cluster.hostnames=[n0,n1] cluster.nodes=2
set -euo pipefail
cd "$(dirname "$0")/.."
MBR=${MBR:-.venv/bin/mbr}
OUT=${OUT:-launch_out}
plan=$("$MBR" launch launcher=deepspeed output="$OUT" "$@" --dry-run)
echo "$plan"
cmd=$(echo "$plan" | awk '/^--- command/ {getline; print}')
exec bash -c "$cmd"
