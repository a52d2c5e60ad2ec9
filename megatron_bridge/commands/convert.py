"""`mbr convert`: a Hugging Face model directory -> a megatron-core checkpoint, on one CPU process.

    mbr convert src=HF_DIR dst=OUT                                  # torch_dist: loads at any TP/PP/EP
    mbr convert src=HF_DIR dst=OUT format=torch parallel.tp=2 parallel.pp=2 [parallel.vpp=2] [parallel.ep=2]
    mbr convert src=HF_DIR dst=OUT dtype=bf16 overwrite=true

Streams one tensor at a time (bounded memory whatever the model size), writes into a
temporary directory renamed into place on success, and ends with one line: tensors, bytes,
seconds, GB/s. Every bad input (missing/corrupt/truncated files, shapes that disagree with
config.json, unsupported architecture, invalid layout, existing dst) is one message, exit 2,
nothing written. See docs/convert.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_bridge.convert.command import run_command


def main(argv: Sequence[str]) -> int:
    return run_command(argv, "ConvertConfig", "convert", __doc__)
