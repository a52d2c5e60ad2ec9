"""`mbr reshard`: a converted checkpoint -> the same weights in another layout, without HF.

    mbr reshard src=OUT dst=OUT2 parallel.tp=4 parallel.pp=1            # per-rank files at tp4
    mbr reshard src=OUT dst=OUT2 format=torch_dist                      # per-rank -> torch_dist

Reads either format, writes per-rank torch files for `parallel.*` (default) or torch_dist.

    mbr reshard src=CKPT dst=CKPT2 model.hf_path=HF_SRC parallel.tp=1 parallel.pp=2 cluster.gpus_per_node=2

reshards a training checkpoint (`checkpoint.dir`) into one for the recipe's layout and world,
optimizer state included, that training resumes (train/reshard.py).
Without a cast the target shards are byte moves from the source records (export's pieces
composed with the target's blocks, convert/bytemove/direct_reshard.py); otherwise each
parameter's shards are merged and re-split with the bridge's mapping. Both are checked
against the manifest's checksums and give the same bytes; A -> B -> A is bit-exact. See
docs/convert.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_bridge.convert.command import run_command
from megatron_bridge.train.manifest import is_training_checkpoint


def _reshard(cfg: Any) -> int:
    if cfg.src and is_training_checkpoint(cfg.src):
        from megatron_bridge.train.reshard import reshard_training  # a training checkpoint: torch's rank files

        return reshard_training(cfg)
    from megatron_bridge.convert.pipeline.run import reshard  # after run_command's huge pages and read-ahead

    return reshard(cfg)


def main(argv: Sequence[str]) -> int:
    return run_command(argv, "ReshardConfig", _reshard, __doc__)
