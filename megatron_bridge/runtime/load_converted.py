"""`train.init_from=OUT` for `mbr convert` / `mbr reshard` outputs: weights into a live model.

Before touching files the run's model is compared with the checkpoint's config.json, so a
mismatch is one message naming the differing fields and the fix, not a shape error deep in
a load. The load itself is the backend's (`runtime_of(spec).load_converted`): the native
backend reads each chunk's boxes as megatron-core's `sharded_state_dict()` states them
(runtime/native/converted.py), the transformers backend cuts its shards from the checkpoint's HF tensors
(convert/sources/hf_view.py) with the code that loads an HF directory. Rank-local: no collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_bridge.backends.describe import describe_hf
from megatron_bridge.bridge.spec import field_names
from megatron_bridge.convert.formats.manifest import Manifest
from megatron_bridge.convert.sources.hf_view import ConvertedTensors
from megatron_bridge.convert.sources.megatron_source import open_for
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.runtimes import runtime_of

_IGNORED = ("make_vocab_size_divisible_by", "initializer_range", "attention_dropout", "max_position_embeddings")


def _check_model(spec: Any, man: Manifest, path: Path) -> None:
    mine = describe_hf(
        man.hf_config, make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by, backend=man.backend
    )
    diff = [
        f"{k}={getattr(spec, k, None)!r} (checkpoint: {getattr(mine, k, None)!r})"
        for k in sorted(field_names())
        if k not in _IGNORED and getattr(spec, k, None) != getattr(mine, k, None)
    ]
    if diff:
        raise UserError(
            f"train.init_from={path} holds a different model than the run builds: "
            f"{'; '.join(diff[:6])}. Build the checkpoint's model with model.hf_path={path} "
            "(the converted directory carries its config.json)."
        )


def load_converted(chunks: Sequence[Any], spec: Any, path: str | Path) -> None:
    """Load a converted checkpoint into this rank's model chunks (rank-local: no collective)."""
    path = Path(path)
    man = Manifest.read(path)
    man.check_files(path)  # sizes; the CRC-32 of every file was checked by the preflight (check_init_source)
    _check_model(spec, man, path)
    runtime_of(spec).load_converted(chunks, spec, path, man)


def load_megatron(chunks: Sequence[Any], spec: Any, path: str | Path) -> None:
    """A checkpoint Megatron-LM, NeMo or Megatron-Bridge wrote (any format, written at any
    layout) into this rank's chunks: its HF tensors, as the model `model.hf_path` describes
    names them (convert/sources/megatron_source.py), cut as an HF directory's are."""
    source = open_for(Path(path), spec, None)
    with ConvertedTensors(Path(path), source) as tensors:
        runtime_of(spec).load(chunks, spec, tensors)


__all__ = ["load_converted", "load_megatron"]
