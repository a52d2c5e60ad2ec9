"""`train.init_from=OUT` for the native backend: an `mbr convert` / `mbr reshard` output into GPTModels.

* torch_dist: each chunk's `sharded_state_dict()` — megatron-core's own statement of which
  box of which stored global tensor each of its parameters is (so any TP/PP/VPP/EP/CP
  layout reshards on load, SwiGLU's split fc1 and a different vocabulary padding included)
  — is filled by the converter's reader (`formats.dist_read`, the one torch_dist reader):
  each rank reads only the bytes its shards span, straight into the parameters, with no
  collective and no `torch.load(weights_only=False)` of stored objects, which megatron's
  `dist_checkpointing.load` (torch DCP) would do; the result is the same, bit for bit.
* torch (per-rank files): this rank's `release/mp_rank_.../model_optim_rng.pt`, loaded as
  data only (`runtime/safe_load.torch_load`: weights_only plus `argparse.Namespace`) and
  strictly into each chunk. The run's layout must be the checkpoint's; `mbr reshard` makes
  another one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factory_merges
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.convert.formats.dist_read import DistReader
from megatron_bridge.convert.formats.manifest import MANIFEST, Manifest
from megatron_bridge.convert.formats.paths import confined
from megatron_bridge.convert.formats.pickle_guard import CONVERTED
from megatron_bridge.convert.formats.safetensors_io import PositionedReader
from megatron_bridge.convert.placement.manifest_model import manifest_layout, stored_vocab_rows
from megatron_bridge.convert.placement.rank_files import RELEASE, RankFile, chunk_key
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.safe_load import torch_load
from megatron_bridge.runtime.weights_base import checkpoint_tensors, current_coords, layout_of, require_all_written


def load_converted(chunks: Sequence[Any], spec: BridgeSpec, path: Path, man: Manifest) -> None:
    """The checkpoint at `path` (its manifest `man`, checked) into this rank's chunks."""
    if man.format == "torch_dist":
        _load_dist(chunks, path / RELEASE)
    else:
        _load_rank_files(chunks, spec, man, path)


def _load_dist(chunks: Sequence[Any], ckpt_dir: Path) -> None:
    io = PositionedReader()
    try:
        reader = DistReader(ckpt_dir, io)
        for c in chunks:
            load_chunk(c, dist_state(c, reader), f"train.init_from={ckpt_dir.parent}")
    finally:
        io.close()


def dist_state(chunk: Any, reader: DistReader) -> dict[str, Any]:
    """`chunk`'s state dict read from a torch_dist checkpoint: what megatron-core's
    `dist_checkpointing.load(chunk.sharded_state_dict(), ...)` returns, its steps kept
    (factories applied, every sharded tensor and object read, factory merges applied)."""
    sharded, nonpersistent, factories = load_preprocess(chunk.sharded_state_dict())
    with torch.no_grad():
        dict_list_map_inplace(lambda x: _read_sharded(x, reader), sharded)
    merge(sharded, nonpersistent)
    return apply_factory_merges(sharded, factories)


def _read_sharded(x: Any, reader: DistReader) -> Any:
    if isinstance(x, ShardedObject):
        return reader.read_object(x.unique_key)
    if not isinstance(x, ShardedTensor):
        return x
    if x.flattened_range is not None:
        raise UserError(f"{reader.dir}: {x.key} is asked for as a flattened range (an optimizer state, not a weight)")
    stored, p = reader.size(x.key), x.prepend_axis_num
    if stored != tuple(x.global_shape) and not x.allow_shape_mismatch:
        raise UserError(
            f"{reader.dir}: {x.key} is stored with shape {list(stored)}, the model's is {list(x.global_shape)}"
        )
    data = torch.empty(x.local_shape, dtype=x.dtype) if x.data is None else x.data.detach()
    lo = tuple(x.global_offset)
    hi = tuple(min(o + n, s) for o, n, s in zip(lo, (1,) * p + tuple(x.local_shape), stored))
    if x.allow_shape_mismatch:  # the rows the checkpoint does not have (vocabulary padding) read as zeros
        data.zero_()
    if all(a < b for a, b in zip(lo, hi)):
        box = reader.read_box(x.key, lo, hi)
        data[tuple(slice(0, b - a) for a, b in zip(lo[p:], hi[p:]))] = box.reshape(box.shape[p:])
    return data


def load_chunk(chunk: Any, state: dict[str, Any], source: str) -> None:
    """Strict load, after proving the state covers every parameter and persistent buffer
    (the chunk may be built without random init: `build_model(load_weights=True)`)."""
    targets = checkpoint_tensors(chunk)
    require_all_written(targets, {k for k in state if k in targets}, source)
    chunk.load_state_dict(state, strict=True)


def _load_rank_files(chunks: Sequence[Any], spec: Any, man: Manifest, path: Path) -> None:
    run, ckpt = layout_of(chunks), manifest_layout(man)
    have = (ckpt.tp, ckpt.pp, ckpt.vpp, ckpt.ep, ckpt.etp)
    want = (run.tp, run.pp, run.vpp, run.ep, run.etp)
    if have != want:
        raise UserError(
            f"train.init_from={path} is a per-rank (format=torch) checkpoint for tp{ckpt.tp}·pp{ckpt.pp}"
            f"·vpp{ckpt.vpp}·ep{ckpt.ep}, the run is tp{run.tp}·pp{run.pp}·vpp{run.vpp}·ep{run.ep}. "
            f"Make one for this layout: mbr reshard src={path} dst=NEW parallel.tp={run.tp} "
            f"parallel.pp={run.pp} ... (or convert with format=torch_dist, which loads at any layout)"
        )
    if spec.padded_vocab_size(run.tp) != stored_vocab_rows(man):
        raise UserError(
            f"train.init_from={path} pads the vocabulary to {stored_vocab_rows(man)} rows "
            f"(make_vocab_size_divisible_by={man.make_vocab_size_divisible_by}), the run to "
            f"{spec.padded_vocab_size(run.tp)}: set model.make_vocab_size_divisible_by="
            f"{man.make_vocab_size_divisible_by}"
        )
    c = current_coords()
    rel = RankFile(c.tp_rank, c.pp_rank, c.ep_rank).relpath(ckpt)
    f = confined(path, rel, source=path / MANIFEST, what="rank file")
    if not f.is_file():
        raise UserError(f"train.init_from={path}: {rel} is missing (the checkpoint is incomplete)")
    state = torch_load(f, CONVERTED, map_location="cpu", mmap=True)  # data only: never code
    for i, chunk in enumerate(chunks):
        key = chunk_key(ckpt, i if ckpt.vpp else None)
        try:
            load_chunk(chunk, state[key], str(f))
        except (KeyError, RuntimeError) as e:
            raise UserError(
                f"{f}: does not fit this rank's model chunk {key}: {str(e).splitlines()[0][:400]}"
            ) from None


__all__ = ["dist_state", "load_chunk", "load_converted"]
