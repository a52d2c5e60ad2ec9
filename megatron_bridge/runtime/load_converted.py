"""`train.init_from=OUT` for `mbr convert` / `mbr reshard` outputs: weights into a live model.

* torch_dist: megatron-core's own `dist_checkpointing.load` with the chunks'
  `sharded_state_dict()`, so any TP/PP/VPP/EP/CP layout reshards on load; `common.pt`
  holds Megatron's `args` (an `argparse.Namespace`), allowlisted for the weights-only
  unpickler as Megatron-LM does.
* torch (per-rank files): this rank's `release/mp_rank_.../model_optim_rng.pt`, loaded
  strictly into each chunk. The run's layout must be the checkpoint's; `mbr reshard` makes
  another one.

Before touching files the run's model is compared with the checkpoint's config.json, so a
mismatch is one message naming the differing fields and the fix, not a shape error deep in
a load.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing

from megatron_bridge.bridge.hf_config import spec_from_hf
from megatron_bridge.convert.formats.manifest import Manifest
from megatron_bridge.convert.formats.placement import RELEASE, RankFile, chunk_key
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.weights import checkpoint_tensors, current_coords, layout_of, require_all_written

_IGNORED = ("make_vocab_size_divisible_by", "initializer_range", "attention_dropout", "max_position_embeddings")


def _check_model(spec: Any, man: Manifest, path: Path) -> None:
    mine = spec_from_hf(man.hf_config, make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by)
    diff = [
        f"{f.name}={getattr(spec, f.name)!r} (checkpoint: {getattr(mine, f.name)!r})"
        for f in dataclasses.fields(spec)
        if f.name not in _IGNORED and getattr(spec, f.name) != getattr(mine, f.name)
    ]
    if diff:
        raise UserError(
            f"train.init_from={path} holds a different model than the run builds: "
            f"{'; '.join(diff[:6])}. Build the checkpoint's model with model.hf_path={path} "
            "(the converted directory carries its config.json)."
        )


def load_converted(chunks: Sequence[Any], spec: Any, path: str | Path) -> None:
    """Load a converted checkpoint into this rank's model chunks (collective for torch_dist)."""
    path = Path(path)
    man = Manifest.read(path)
    man.check_files(path)
    _check_model(spec, man, path)
    if man.format == "torch_dist":
        _load_dist(chunks, path / RELEASE)
    else:
        _load_rank_files(chunks, spec, man, path)


def _load_dist(chunks: Sequence[Any], ckpt_dir: Path) -> None:
    sharded = {f"model{i}": c.sharded_state_dict() for i, c in enumerate(chunks)}
    with torch.serialization.safe_globals([argparse.Namespace]):
        loaded = dist_checkpointing.load(sharded, str(ckpt_dir))
    for i, c in enumerate(chunks):
        _load_chunk(c, loaded[f"model{i}"], f"train.init_from={ckpt_dir.parent}")


def _load_chunk(chunk: Any, state: dict[str, Any], source: str) -> None:
    """Strict load, after proving the state covers every parameter and persistent buffer
    (the chunk may be built without random init: `build_model(load_weights=True)`)."""
    targets = checkpoint_tensors(chunk)
    require_all_written(targets, {k for k in state if k in targets}, source)
    chunk.load_state_dict(state, strict=True)


def _load_rank_files(chunks: Sequence[Any], spec: Any, man: Manifest, path: Path) -> None:
    run, ckpt = layout_of(chunks), man.layout_obj()
    have = (ckpt.tp, ckpt.pp, ckpt.vpp, ckpt.ep, ckpt.etp)
    want = (run.tp, run.pp, run.vpp, run.ep, run.etp)
    if have != want:
        raise UserError(
            f"train.init_from={path} is a per-rank (format=torch) checkpoint for tp{ckpt.tp}·pp{ckpt.pp}"
            f"·vpp{ckpt.vpp}·ep{ckpt.ep}, the run is tp{run.tp}·pp{run.pp}·vpp{run.vpp}·ep{run.ep}. "
            f"Make one for this layout: mbr reshard src={path} dst=NEW parallel.tp={run.tp} "
            f"parallel.pp={run.pp} ... (or convert with format=torch_dist, which loads at any layout)"
        )
    if spec.padded_vocab_size(run.tp) != man.padded_vocab_size():
        raise UserError(
            f"train.init_from={path} pads the vocabulary to {man.padded_vocab_size()} rows "
            f"(make_vocab_size_divisible_by={man.make_vocab_size_divisible_by}), the run to "
            f"{spec.padded_vocab_size(run.tp)}: set model.make_vocab_size_divisible_by="
            f"{man.make_vocab_size_divisible_by}"
        )
    c = current_coords()
    f = path / RankFile(c.tp_rank, c.pp_rank, c.ep_rank).relpath(ckpt)
    with torch.serialization.safe_globals([argparse.Namespace]):
        state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    for i, chunk in enumerate(chunks):
        key = chunk_key(ckpt, i if ckpt.vpp else None)
        try:
            _load_chunk(chunk, state[key], str(f))
        except (KeyError, RuntimeError) as e:
            raise UserError(
                f"{f}: does not fit this rank's model chunk {key}: {str(e).splitlines()[0][:400]}"
            ) from None


__all__ = ["load_converted"]
