"""`mbr export`: an `mbr convert` / `mbr reshard` output -> a Hugging Face model directory.

    mbr export src=OUT dst=HF_DIR [dtype=source|bf16|fp32] [max_shard_gb=5] [overwrite=true]

Writes model-0000i-of-0000n.safetensors + model.safetensors.index.json, config.json and
the tokenizer files kept at conversion; the result loads with
`transformers.AutoModelForCausalLM.from_pretrained`. Every tensor is rebuilt with the
bridge's mapping and checked against the CRC-32 recorded at conversion, so a round trip
HF -> convert -> export is bit-exact or fails loudly. See docs/convert.md.

    mbr export src=CKPT dst=DIR adapter=true

copies the HF PEFT adapter a `peft=lora` training checkpoint carries (runtime/lora_files.py).

    mbr export src=CKPT dst=HF_DIR model.hf_path=HF_SRC

writes the trained weights of a training checkpoint (`checkpoint.dir`: its `latest`, or one
`iter_N`) of the model `model.hf_path` names (train/reshard.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_bridge.convert.command import run_command
from megatron_bridge.train.manifest import is_training_checkpoint


def _export(cfg: Any) -> int:
    if cfg.adapter:  # a LoRA training checkpoint's adapter instead
        from megatron_bridge.runtime.lora_files import export_checkpoint_adapter  # adapter=true only

        return export_checkpoint_adapter(cfg)
    if cfg.src and is_training_checkpoint(cfg.src):
        from megatron_bridge.train.reshard import export_training  # a training checkpoint: torch's rank files

        return export_training(cfg)
    from megatron_bridge.convert.pipeline.run import export  # after run_command's huge pages and read-ahead

    return export(cfg)


def main(argv: Sequence[str]) -> int:
    return run_command(argv, "ExportConfig", _export, __doc__)
