"""The weights training starts from: `model.hf_path` (`spec.source`), or `train.init_from=DIR`.

An HF directory (config.json + safetensors) goes through the bridge's mapping tables, each
rank reading only its shard (runtime/weights.py). `mbr convert` outputs and checkpoints
Megatron-LM, NeMo or Megatron-Bridge wrote are loaded by runtime/load_converted.py, on the
converter's formats and the same tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_bridge.backends.describe import frozen_parts
from megatron_bridge.backends.registry import backend_of
from megatron_bridge.convert.sources.preflight import init_kind
from megatron_bridge.runtime.load_converted import load_converted, load_megatron
from megatron_bridge.runtime.lora_modules import apply_lora
from megatron_bridge.runtime.weights import load_hf_weights


def loads_weights(cfg: Any, spec: Any) -> bool:
    """Whether `init_weights` loads every weight of the base model: `train.init_from` when set,
    else the HF directory the model was described from (`model.hf_path`) — unless the run resumes, where the checkpoint brings
    the weights (reading the HF files first would only cost time). With `peft=lora` the base
    is always loaded (checkpoints hold only the adapters). The one place that decides it: the
    runner builds the model with `build_model(..., load_weights=loads_weights(cfg, spec))`, which
    skips megatron's random init exactly when it would be overwritten."""
    lora = cfg.peft.method == "lora"
    return bool(cfg.train.init_from) or bool(spec.source and (lora or not cfg.checkpoint.resume))


def init_weights(chunks: Sequence[Any], spec: Any, cfg: Any) -> None:
    """Load the starting weights into freshly built chunks (`loads_weights` says when);
    megatron's random init otherwise. With `peft=lora` the loaded base is then frozen and
    the adapters are added."""
    lora = cfg.peft.method == "lora"
    if cfg.train.init_from:
        load_initial_weights(chunks, spec, cfg.train.init_from)
    elif loads_weights(cfg, spec):
        load_hf_weights(chunks, spec, spec.source)
    if lora:  # frozen base + adapters (peft.init_from's, or HF PEFT's initial ones)
        apply_lora(chunks, spec, cfg.peft, seed=cfg.train.seed)
    freeze(chunks, spec, frozen_parts(cfg.model))


def freeze(chunks: Sequence[Any], spec: Any, groups: Sequence[str]) -> int:
    """`model.freeze`: every tensor (adapters included) of the named parts keeps its loaded value:
    no gradient, no optimizer state (megatron's DDP and optimizers skip it). Returns how many."""
    if not groups:
        return 0
    backend, n = backend_of(spec), 0
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if backend.group_of(spec, name) in groups:
                p.requires_grad_(False)
                n += 1
    return n


def load_initial_weights(chunks: Sequence[Any], spec: Any, path: str) -> None:
    """`train.init_from`: an HF directory, a converted checkpoint or a Megatron-written one
    (`init_kind`; the runner's preflight has checked it with `check_init_source` already)."""
    kind = init_kind(path)
    if kind == "hf_dir":
        load_hf_weights(chunks, spec, Path(path))
    elif kind == "megatron":
        load_megatron(chunks, spec, path)
    else:
        load_converted(chunks, spec, Path(path))
