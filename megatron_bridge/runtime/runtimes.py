"""Each backend's runtime half, one object per backend, registered once (`RUNTIMES`).

The core half of a backend (`backends/`: describing, counting, limits, checkpoint tables) needs
no torch; what needs torch and megatron-core lives here, in the runtime layer, and shared code
reaches it through `runtime_of(spec)`: build this rank's chunks, load HF tensors into them
(from an HF directory, or any view with its `keys()` / `slice(name)`), load a converted
checkpoint, and gather the chunks' tensors back to HF names for export. The transformers backend's half
is imported at its first use (`later`): it pulls in transformers' modeling code, ~0.7 s of a
launch's start-up that a native model never pays (docs/benchmarks.md, "Start-up").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.runtime import chunked_loss
from megatron_bridge.runtime.build_base import later
from megatron_bridge.runtime.native import build as native_build
from megatron_bridge.runtime.native import converted as native_converted
from megatron_bridge.runtime.native import weights as native_weights


@dataclass(frozen=True)
class BackendRuntime:
    """What a backend does with torch: `build(spec, layout, load_weights=, **overrides)` ->
    this rank's chunks (each looks to megatron like a GPTModel); `load(chunks, spec, tensors)`
    copies this rank's slices of HF tensors in (`tensors`: an `HFCheckpoint` or any object with
    its `keys()` and `slice(name)`) and returns how many; `load_converted(chunks, spec, path,
    manifest)` loads an `mbr convert` output; `iter_tensors(chunks, spec, dtype, value,
    everywhere, into=)` yields (HF name, whole tensor) on the exporting ranks (collective);
    `global_names(chunk)` is {a chunk's parameter name: its table name} (layers and experts
    numbered globally); `layers(chunk)` its transformer layers, in order (what `train.compile`
    compiles: runtime/compiled.py); `chunk_loss(chunk, n)` routes its training loss through the
    LM head n positions at a time (`train.loss_chunk`: runtime/chunked_loss.py);
    `megatron_layers`: whether its layers are megatron-core's own (its fused SwiGLU and
    bias-dropout-add apply to them: `train.fused`, runtime/fast_paths.py)."""

    build: Callable[..., list[Any]]
    load: Callable[..., int]
    load_converted: Callable[..., None]
    iter_tensors: Callable[..., Iterator[tuple[str, Any]]]
    global_names: Callable[[Any], dict[str, str]]
    layers: Callable[[Any], list[Any]]
    chunk_loss: Callable[[Any, int], None]
    megatron_layers: bool


def _decoder_layers(chunk: Any) -> list[Any]:
    """A megatron-core GPTModel's: `decoder.layers`."""
    return list(chunk.decoder.layers)


def _hf_layers(chunk: Any) -> list[Any]:
    """An hf chunk's: the ModuleDict at its plan's layers path (runtime/transformers/chunk.py)."""
    return list(chunk.get_submodule(chunk.plan.layers).values())


def _same_names(chunk: Any) -> dict[str, str]:
    """An hf chunk's names are already the checkpoint's (global layer indices, runtime/transformers/chunk.py)."""
    return {n: n for n, _ in chunk.named_parameters()}


RUNTIMES: dict[str, BackendRuntime] = {
    "native": BackendRuntime(
        native_build.build_native,
        native_weights.load,
        native_converted.load_converted,
        native_weights.iter_tensors,
        native_weights.global_names,
        _decoder_layers,
        chunked_loss.install,
        megatron_layers=True,
    ),
    "transformers": BackendRuntime(  # each deferred: transformers' modeling code
        later("megatron_bridge.runtime.transformers.build:build_transformers"),  # deferred
        later("megatron_bridge.runtime.transformers.weights:load"),  # deferred
        later("megatron_bridge.runtime.transformers.weights:load_converted"),  # deferred
        later("megatron_bridge.runtime.transformers.weights:iter_tensors"),  # deferred
        _same_names,
        _hf_layers,
        chunked_loss.install_hf,
        megatron_layers=False,  # transformers' own modeling code
    ),
}


def runtime_of(spec: BridgeSpec) -> BackendRuntime:
    """The runtime half of `spec`'s backend."""
    return RUNTIMES[spec.backend]


__all__ = ["RUNTIMES", "BackendRuntime", "runtime_of"]
