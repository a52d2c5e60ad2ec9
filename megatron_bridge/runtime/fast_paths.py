"""The per-run fast paths on a rank's freshly built chunks, in the order they compose: float8
GEMMs (`train.precision=fp8`: runtime/fp8.py) go into the linears before `train.compile`
compiles the layers around them (runtime/compiled.py); `train.loss_chunk` routes the loss
through the LM head a piece at a time (runtime/chunked_loss.py). `train.fused` is set in the
chunks' TransformerConfig at build (train/job.py model_overrides, runtime/tconfig.py keeps what
the model's MLP allows); here it is reported. Each is printed once, by rank 0."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_bridge.runtime.compiled import compile_layers
from megatron_bridge.runtime.fp8 import use_fp8
from megatron_bridge.runtime.runtimes import BackendRuntime


def set_up(chunks: Sequence[Any], rt: BackendRuntime, train: Any, rank: int) -> int:
    """Apply the fast paths `train` asks for to `chunks`; the layers compiled (0 = none)."""
    lines = []
    if train.fused:
        lines.append(fused_line(chunks[0].config, rt.megatron_layers))
    if train.precision == "fp8":
        lines.append(use_fp8(chunks, rt.layers, train.fp8_recipe))
    if rank == 0:
        for line in lines:
            print(line, flush=True)
    compiled = compile_layers(chunks, rt.layers) if train.compile else 0
    if train.loss_chunk:
        for chunk in chunks:
            rt.chunk_loss(chunk, train.loss_chunk)
    return compiled


def fused_line(config: Any, megatron_layers: bool) -> str:
    """What `train.fused` fused, from the chunks' TransformerConfig (megatron-core's fused SwiGLU
    and bias-dropout-add exist only in its own layers, not in transformers' code)."""
    swiglu = megatron_layers and bool(config.bias_activation_fusion)
    on = (["SwiGLU"] if swiglu else []) + (["bias-dropout-add"] if megatron_layers else [])
    on += ["vocab-parallel cross entropy"] if config.cross_entropy_loss_fusion else []
    kernels = "torch.compile'd kernels" if torch.cuda.is_available() else "run eagerly on CPU"
    line = f"train.fused: megatron-core's fused {', '.join(on) or 'nothing'} ({kernels})"
    if not megatron_layers:
        line += "; the layers are transformers' code (train.compile fuses them)"
    elif not swiglu:
        line += "; the MLP's activation has no exact fused kernel"
    if not config.cross_entropy_loss_fusion:
        line += "; the cross entropy unfused (its fused kernel's gradient is bf16: bf16 runs only)"
    return line


__all__ = ["fused_line", "set_up"]
