#!/usr/bin/env bash
# Write the sbatch script for a recipe (one torchrun agent per node under srun) and submit it:
#   launch/slurm.sh recipe=gpt3_175b cluster.nodes=128
# Set SUBMIT=0 to only write job/job.sbatch.
set -euo pipefail
cd "$(dirname "$0")/.."
MBR=${MBR:-.venv/bin/mbr}
OUT=${OUT:-job}
"$MBR" launch launcher=slurm output="$OUT" "$@" --dry-run
if [ "${SUBMIT:-1}" = 1 ]; then sbatch "$OUT/job.sbatch"; fi
