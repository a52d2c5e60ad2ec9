"""The per-run fast paths on a rank's freshly built chunks, in the order they compose: float8
GEMMs (`train.precision=fp8`: runtime/fp8.py) go into the linears before `train.compile`
compiles the layers around them (runtime/compiled.py); `train.loss_chunk` routes the loss
through the LM head a piece at a time (runtime/chunked_loss.py). Each is printed once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_bridge.runtime.compiled import compile_layers
from megatron_bridge.runtime.fp8 import use_fp8
from megatron_bridge.runtime.runtimes import BackendRuntime


def set_up(chunks: Sequence[Any], rt: BackendRuntime, train: Any, rank: int) -> int:
    """Apply the fast paths `train` asks for to `chunks`; the layers compiled (0 = none)."""
    if train.precision == "fp8":
        line = use_fp8(chunks, rt.layers, train.fp8_recipe)
        if rank == 0:
            print(line, flush=True)
    compiled = compile_layers(chunks, rt.layers) if train.compile else 0
    if train.loss_chunk:
        for chunk in chunks:
            rt.chunk_loss(chunk, train.loss_chunk)
    return compiled


__all__ = ["set_up"]
