"""LoRA adapter directories in HF PEFT's layout (`adapter_config.json` +
`adapter_model.safetensors`, keys `base_model.model.<hf module>.lora_A/B.weight`) on disk:

* `check_adapter_dir` — an adapter `peft.init_from` may start from: its rank, targets and
  every module's shape against the base model (the trainer's preflight);
* `export_checkpoint_adapter` — `mbr export adapter=true`: the adapter a training checkpoint
  carries, verified against its manifest and copied out.

Neither needs a model, so importing this module imports no torch (safetensors reads the
adapter's shapes through its own torch binding). Writing an adapter from a live model is
`lora_modules.export_adapter`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from safetensors import safe_open

from megatron_bridge.bridge.loader import HFCheckpoint
from megatron_bridge.bridge.lora import (
    ADAPTER_CONFIG,
    ADAPTER_DIR,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
)
from megatron_bridge.convert.formats.manifest import check_data_crc32
from megatron_bridge.convert.formats.safetensors_io import read_header
from megatron_bridge.convert.pipeline.run import atomic_output, check_paths
from megatron_bridge.errors import UserError
from megatron_bridge.train import manifest


def check_adapter_dir(path: str | Path, base_dir: str | Path | None, peft: Any) -> dict[str, Any]:
    """An HF PEFT adapter `peft.init_from` may start from: a LoRA of this rank, whose every
    module exists in the base checkpoint with matching shapes. Returns its config."""
    p = Path(path)
    cfg_file, weights = p / ADAPTER_CONFIG, p / ADAPTER_WEIGHTS
    if not cfg_file.is_file() or not weights.is_file():
        raise UserError(
            f"peft.init_from={path} is not an HF PEFT adapter directory ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}). "
            "Point it at what `PeftModel.save_pretrained` or `export_adapter_to=DIR` wrote."
        )
    conf = json.loads(cfg_file.read_text())
    if conf.get("peft_type") != "LORA" or conf.get("r") != peft.rank or conf.get("use_dora"):
        raise UserError(
            f"peft.init_from={path} is a {conf.get('peft_type')} adapter of rank {conf.get('r')}, but this run "
            f"trains LoRA of rank peft.rank={peft.rank}. Set peft.rank={conf.get('r')} (and peft.alpha="
            f"{conf.get('lora_alpha')}) to continue that adapter, or drop peft.init_from."
        )
    theirs = conf.get("target_modules")
    theirs = [theirs] if isinstance(theirs, str) else sorted(theirs or [])
    if theirs != sorted(peft.target_modules):
        raise UserError(
            f"peft.init_from={path} adapts target_modules={theirs}, but peft.target_modules="
            f"{sorted(peft.target_modules)}. Set peft.target_modules=[{','.join(theirs)}] to continue that adapter."
        )
    read_header(weights)  # no manifest: the header's own offsets against the file's size (a truncated copy)
    check_data_crc32(weights, f"peft.init_from={path}")  # an adapter we wrote records its data's CRC-32
    base = HFCheckpoint(base_dir) if base_dir else None
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():
            if not key.startswith(PEFT_PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
                raise UserError(f"peft.init_from={path}: tensor {key} is not a LoRA A/B weight of a module.")
            name = key[len(PEFT_PREFIX) :].rsplit(".lora_", 1)[0] + ".weight"
            shape = list(f.get_slice(key).get_shape())
            if base is None:
                continue
            if name not in base.infos:
                raise UserError(
                    f"peft.init_from={path} adapts {name}, which the base model {base_dir} does not have: "
                    "the adapter was trained on another model. Use the base it was made for (model.hf_path)."
                )
            out_f, in_f = list(base.slice(name).shape)
            want = [peft.rank, in_f] if ".lora_A." in key else [out_f, peft.rank]
            if shape != want:
                raise UserError(
                    f"peft.init_from={path}: {key} has shape {shape}, the base model {base_dir} needs {want}: "
                    "the adapter was trained on a model of another size. Use the base it was made for."
                )
    return conf


def export_checkpoint_adapter(cfg: Any) -> int:
    """`mbr export src=CKPT dst=DIR adapter=true`: the HF PEFT adapter a `peft=lora` training
    checkpoint carries (written at save time, checksummed by its manifest), verified and
    copied atomically. `src` is a checkpoint directory (its latest iteration) or one
    `iter_*` directory of it."""
    src, dst = check_paths(cfg.src, cfg.dst, cfg.overwrite)
    if not (src / manifest.MANIFEST).is_file():
        it = manifest.latest_iteration(src)
        if it is None:
            raise UserError(
                f"src={cfg.src} is not a training checkpoint (no {manifest.MANIFEST}, no {manifest.LATEST}). With adapter=true, "
                "point src at the checkpoint.dir of a peft=lora run or one of its iter_* directories."
            )
        src = manifest.iter_dir(src, it)
    manifest.verify(src)
    if not (src / ADAPTER_DIR / ADAPTER_WEIGHTS).is_file():
        raise UserError(
            f"{src} holds no LoRA adapter: it was not written by a peft=lora run. Drop adapter=true to export "
            "an `mbr convert` output, or point src at a peft=lora checkpoint."
        )
    with atomic_output(dst, cfg.overwrite) as tmp:
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            shutil.copy2(src / ADAPTER_DIR / name, tmp / name)
    print(f"exported the LoRA adapter of {src} (HF PEFT format) to {dst}", flush=True)
    return 0


__all__ = ["check_adapter_dir", "export_checkpoint_adapter"]
