"""`mbr init dir=DIR`: start a user config dir with a commented recipe and cluster file to edit.

    mbr init dir=~/my-configs        # or, the same: mbr init ~/my-configs
    mbr check recipe=my_recipe --config-dir ~/my-configs     # or: export MBR_CONFIG_PATH=~/my-configs

Refuses to overwrite: if either file exists, nothing is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from omegaconf import MISSING

from megatron_bridge.config.compose import CommandArgs, parse_command
from megatron_bridge.errors import UserError


@dataclass
class InitArgs(CommandArgs):
    """`mbr init`'s fields. A bare word is `dir=` (`mbr init DIR` is `mbr init dir=DIR`)."""

    CLI_POSITIONAL: ClassVar[tuple[str, ...]] = ("dir",)
    CLI_USAGE: ClassVar[str] = (
        "usage: `mbr init DIR` (or `mbr init dir=DIR`): writes DIR/recipes/my_recipe.yaml and "
        "DIR/cluster/my_cluster.yaml."
    )

    dir: str = MISSING  # the config dir to create


RECIPE = """\
# A recipe: one option per config group, then this recipe's own values (`_self_`, last, wins).
# Options are looked up in your config dirs first (--config-dir DIR, $MBR_CONFIG_PATH), then
# in the built-ins; `mbr recipes --config-dir {dir}` lists them all with where each comes from.
# A file in DIR/<group>/NAME.yaml adds the option NAME, or overrides a built-in of that name.
defaults:
  - mbr_schema            # the typed schema: unknown keys and wrong types are errors
  - model: tiny_llama     # or llama3_8b, ..., or your own DIR/model/NAME.yaml
  - parallel: default
  - zero: none            # none | stage1 | stage2 | stage3
  - cluster: my_cluster   # {dir}/cluster/my_cluster.yaml
  - optimizer: adam
  - data: synthetic       # synthetic | indexed (data.paths, data.tokenizer)
  - train: default
  - checkpoint: default
  - logger: default       # wandb (offline), TensorBoard, MLflow: docs/train.md "Loggers"
  - _self_

# Any field of any group, as on the command line (`parallel.tp=2` there is `parallel: {{tp: 2}}` here).
parallel:
  tp: 2                   # tensor parallel: inside a node
  pp: 1                   # pipeline stages
train:
  seq_length: 64
  micro_batch_size: 2
  global_batch_size: 8
  steps: 10
# model:
#   hf_path: /path/to/hf_model   # take the architecture from an HF config.json
# checkpoint:
#   dir: /path/to/checkpoints
#   save_interval: 100
"""

CLUSTER = """\
# A cluster: how many machines, how big, how connected (bandwidths per GPU, GB/s, one direction).
# `mbr check` and `mbr plan` use these numbers; `mbr launch` uses nodes, gpus_per_node and the
# rendezvous fields. Select it with `cluster: my_cluster` in a recipe or `cluster=my_cluster`.
name: my_cluster
nodes: 1
gpus_per_node: 4
gpu_memory_gb: 80.0
peak_tflops: 312.0                # dense bf16 per GPU
# achieved_efficiency: 0.45       # fraction of peak for `mbr plan` (default fitted, docs/plan.md); e.g. the GPU kit's MFU
intra_node_bandwidth_gbps: 300.0  # NVLink
inter_node_bandwidth_gbps: 25.0   # InfiniBand
backend: gloo                     # auto (nccl on GPU, gloo on CPU) | nccl | gloo
# hostnames: [node-a, node-b]     # multi-node torchrun/deepspeed; or hostfile: /path/to/hostfile
master_addr: 127.0.0.1
master_port: 29500
"""


def main(argv: Sequence[str]) -> int:
    args, _ = parse_command(argv, InitArgs, doc=__doc__)
    root = Path(args.dir).expanduser()
    files = {
        root / "recipes" / "my_recipe.yaml": RECIPE.format(dir=root),
        root / "cluster" / "my_cluster.yaml": CLUSTER,
    }
    existing = [str(p) for p in files if p.exists()]
    if existing:
        raise UserError(f"{', '.join(existing)} already exist(s); `mbr init` does not overwrite. Pick a new DIR.")
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    print(
        f"next: mbr check recipe=my_recipe --config-dir {root}   "
        f"(or export MBR_CONFIG_PATH={root.absolute()}; `mbr recipes --config-dir {root}` lists what it adds)"
    )
    return 0
