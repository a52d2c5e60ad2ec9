"""The conversion commands' own config fields: `ConvertConfig`, `ExportConfig`, `ReshardConfig`.

Each command composes the usual recipe (`compose(argv, schema=...)`), so `parallel.*`,
`model.make_vocab_size_divisible_by` and `recipe=` mean what they mean everywhere; the
fields below are the command's own top-level keys (`src=... dst=... format=...`). A module of
its own, importing only the recipe's schema: the command composes it in a child process
while the parent imports the pipeline (`convert.command`), and that child should not import
the pipeline too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron_bridge.config.schema import Config


@dataclass
class ConvertConfig(Config):
    # The input *is* an HF model directory, so `model.hf_path=` names it too (see Config).
    CLI_ALIASES: ClassVar[dict[str, str]] = {"model.hf_path": "src"}

    src: str | None = None  # HF model directory
    dst: str | None = None  # output directory (must not exist unless overwrite=true)
    format: str = "torch_dist"  # torch_dist (reshardable on load) | torch (per-rank files for parallel.*)
    dtype: str = "source"  # source | bf16 | fp32 | fp16
    overwrite: bool = False
    progress: str = "auto"  # auto (bar on a terminal, quiet in CI) | on | off
    # NaN or infinity in a source tensor is refused (found during the conversion's own reads,
    # before anything is published); true converts such a checkpoint as it is.
    allow_nonfinite: bool = False
    # Threads that move bytes and dequantise fp8 (0: one per core this process may use, at least
    # 2); the output is the same bytes whatever the count, and memory grows by one row's buffers each.
    workers: int = 0


@dataclass
class ExportConfig(Config):
    src: str | None = None  # an `mbr convert` / `mbr reshard` output, or a training checkpoint.dir
    dst: str | None = None  # HF directory to create
    dtype: str = "source"
    max_shard_gb: float = 5.0  # size cap of each model-0000i-of-0000n.safetensors
    overwrite: bool = False
    progress: str = "auto"
    adapter: bool = False  # src is a peft=lora training checkpoint: write its HF PEFT adapter
    workers: int = 0  # as ConvertConfig.workers


@dataclass
class ReshardConfig(Config):
    src: str | None = None  # an `mbr convert` / `mbr reshard` output (either format), or a training checkpoint.dir
    dst: str | None = None
    # torch (per-rank files for parallel.*) | torch_dist | training (a training checkpoint for the
    # recipe's layout, optimizer state included); unset: torch, or training for a training checkpoint
    format: str | None = None
    dtype: str = "source"
    overwrite: bool = False
    progress: str = "auto"
    workers: int = 0  # as ConvertConfig.workers
