"""LoRA adapters on megatron's parallel linears, laid out by the bridge's own transforms.

HF PEFT puts one (A, B) pair on every HF linear: delta_m(x) = alpha/r · B_m A_m dropout(x).
A megatron linear may fuse several HF linears (linear_qkv = q, k, v interleaved per query
group; linear_fc1 = [gate; up]) and holds only its TP shard. The adapter keeps:

* column-parallel (output rows split): one full A_m per adapted HF module (replicated over
  TP) and ONE B whose rows are exactly the rows `transform.shard([B_q, B_k, B_v], shard)`
  gives — the same row placement the base weight gets from the same transform, so the
  merged weight is base + transform(HF deltas) and `transform.merge` of the gathered B
  shards gives HF PEFT's B_m back. Rows of an HF module that is not adapted stay zero and
  unused (they get no gradient).
* row-parallel (input columns split): A sharded along its input like the weight
  (`Row.shard`), B replicated.

The forward hook adds the delta with megatron's own TP/SP region functions (so autograd
reduces exactly as the base linear does); replicated parameters that see only a sequence
shard carry `sequence_parallel` so finalize_model_grads all-reduces them over TP. Expert
adapters are marked `allreduce=False` (expert-DP grads and optimizer, like expert weights).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import mappings as tpm
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from safetensors.torch import load_file
from zlib_ng import zlib_ng

from megatron_bridge.backends.registry import backend_of
from megatron_bridge.bridge.loader import shard_for, table_for
from megatron_bridge.bridge.lora import (
    ADAPTER_CHILD,
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    Target,
    adapter_config,
    is_adapter_param,
    peft_key,
)
from megatron_bridge.bridge.shards import Shard
from megatron_bridge.bridge.table import Resolved, resolve_megatron
from megatron_bridge.convert.formats.dtypes import dtype_of
from megatron_bridge.convert.formats.manifest import DATA_CRC32, crc_hex
from megatron_bridge.convert.formats.safetensors_io import SafetensorsWriter, tensor_bytes
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.runtimes import runtime_of
from megatron_bridge.runtime.safetensors_stream import save_file_key
from megatron_bridge.runtime.weights import current_coords, gather_shards, layout_of, vp_stage_of


class LoraAdapter(torch.nn.Module):
    """The adapters of one megatron linear (`row` says which HF modules it holds)."""

    def __init__(
        self,
        row: Resolved,
        target: Target,
        linear: Any,
        shard: Shard,
        shapes: Any,
        peft: Any,
        init,
        names: list[str] | None = None,
    ):
        super().__init__()
        self.row, self.column, self.shard, self.shapes = row, target.column, shard, shapes
        self.whole = target.whole  # a linear whole on every TP rank (a VLM's vision tower): so are A and B
        # the tensor names the adapter file keys are made of (`Backend.adapter_names`): the HF modules'
        self.names = list(names or row.hf)
        self.srcs = target.srcs
        self.scale = peft.alpha / peft.rank
        self.drop = torch.nn.Dropout(peft.dropout) if peft.dropout > 0 else torch.nn.Identity()
        w = linear.weight
        hf_shapes = [
            tuple(t.shape) for t in row.mapping.merge([torch.empty(w.shape, device="meta")] * shard.size, shapes)
        ]
        full = {i: init(self.names[i], hf_shapes[i]) for i in self.srcs}  # HF layout: (A [r, in], B [out, r])
        tf = row.mapping.transform
        kw = dict(device=w.device, dtype=w.dtype)
        if self.whole:
            a, b = full[0]
            self.A = torch.nn.ParameterDict({"0": torch.nn.Parameter(a.to(**kw).clone())})
            self.B = torch.nn.Parameter(b.to(**kw).clone())
            if getattr(w, "sequence_parallel", False):  # on sequence-split hidden states: summed over TP
                for ab in (self.A["0"], self.B):
                    ab.sequence_parallel = True  # type: ignore[union-attr]  # megatron reads it
        elif self.column:
            b_all = [full[i][1] if i in full else torch.zeros(s[0], peft.rank) for i, s in enumerate(hf_shapes)]
            self.blocks = [(b.src, b.n) for b in tf.blocks([tuple(b.shape) for b in b_all], shard, shapes)]
            self.A = torch.nn.ParameterDict({str(i): torch.nn.Parameter(full[i][0].to(**kw)) for i in self.srcs})
            self.B = torch.nn.Parameter(tf.shard(b_all, shard, shapes).to(**kw).clone())
            _tp_attrs(self.B, True, 0)
            for a in self.A.values():
                _tp_attrs(a, False, 0)
                a.sequence_parallel = _sp(linear)
        else:
            a, b = full[0]
            self.A = torch.nn.ParameterDict({"0": torch.nn.Parameter(tf.shard([a], shard, shapes).to(**kw).clone())})
            self.B = torch.nn.Parameter(b.to(**kw).clone())
            _tp_attrs(self.A["0"], True, 1)
            _tp_attrs(self.B, False, 0)
            self.B.sequence_parallel = _sp(linear)  # type: ignore[attr-defined]  # megatron reads it
        if row.mapping.is_expert:
            for p in self.parameters():
                p.allreduce = False  # type: ignore[attr-defined]  # megatron: expert params skip DP all-reduce
        self.enabled = True  # False inside `adapters_off`: the base model alone (a DPO reference)
        self._group = getattr(linear, "tp_group", None)
        self._explicit = bool(getattr(linear, "explicit_expert_comm", False))
        self._sp = _sp(linear)

    # -- forward ------------------------------------------------------------------------
    def hook(self, _linear, inputs, output):
        """megatron's linears return (output, bias); the transformers backend's (runtime/transformers/layers.py)
        return the output alone, as the transformers module they replace."""
        if not self.enabled:
            return output
        if isinstance(output, torch.Tensor):
            return output + self.delta(inputs[0]).to(output.dtype)
        out, bias = output
        return out + self.delta(inputs[0]).to(out.dtype), bias

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        F = torch.nn.functional
        xd = self._dropout(x)
        if self.whole:
            return F.linear(F.linear(xd, self.A["0"]), self.B) * self.scale
        if not self.column:
            y = F.linear(xd, self.A["0"])
            if not self._explicit:
                y = (
                    tpm.reduce_scatter_to_sequence_parallel_region(y, group=self._group)
                    if self._sp
                    else tpm.reduce_from_tensor_model_parallel_region(y, group=self._group)
                )
            return F.linear(y, self.B) * self.scale
        ys: dict[int, torch.Tensor] = {}
        for k, a in self.A.items():
            y = F.linear(xd, a)
            if not self._explicit:
                y = (
                    tpm.gather_from_sequence_parallel_region(y, group=self._group)
                    if self._sp
                    else tpm.copy_to_tensor_model_parallel_region(y, group=self._group)
                )
            ys[int(k)] = y
        lead = next(iter(ys.values())).shape[:-1]
        pieces, off = [], 0
        for src, n in self.blocks:
            ysrc = ys.get(src) if src is not None else None
            pieces.append(F.linear(ysrc, self.B[off : off + n]) if ysrc is not None else x.new_zeros(lead + (n,)))
            off += n
        return torch.cat(pieces, dim=-1) * self.scale

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        """HF PEFT's dropout on the adapter input. A TP-sharded input (row-parallel, or a
        sequence shard under SP) draws from megatron's model-parallel RNG so the shards get
        independent masks; a TP-replicated one from the default RNG, the same on every TP
        rank (as megatron's hidden dropout), so the replicated A sees one mask."""
        if not self.training or isinstance(self.drop, torch.nn.Identity):
            return x
        if (self._sp or not self.column) and not self._explicit and not self.whole:
            with get_cuda_rng_tracker().fork():
                return self.drop(x)
        return self.drop(x)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """This rank's shard of alpha/r · transform([B_m A_m]): what merging adds to the weight."""
        if not self.column:  # a row-parallel linear's, or a whole one's
            return self.B @ self.A["0"] * self.scale
        a0 = next(iter(self.A.values()))
        pieces, off = [], 0
        for src, n in self.blocks:
            a = self.A[str(src)] if str(src) in self.A else None
            pieces.append(self.B[off : off + n] @ a if a is not None else a0.new_zeros(n, a0.shape[1]))
            off += n
        return torch.cat(pieces, dim=0) * self.scale

    # -- back to HF layout (collective over the TP / expert-TP group) --------------------
    def hf_tensors(self, value, group, everywhere: bool = False) -> list[tuple[str, torch.Tensor]] | None:
        """[(peft key, full HF-layout tensor)] on the group's first rank, None elsewhere (on
        every rank with `everywhere`)."""
        tf, hf = self.row.mapping.transform, self.names
        if self.whole:  # the same on every TP rank: the group's first rank's
            if not everywhere and torch.distributed.get_rank(group) != 0:
                return None
            return [
                (peft_key(hf[0], "A"), value(self.A["0"]).detach().clone()),
                (peft_key(hf[0], "B"), value(self.B).clone()),
            ]
        if self.column:
            shards = gather_shards(value(self.B).detach(), group, everywhere)
            if shards is None:
                return None
            bs = tf.merge(shards, self.shapes)
            out = []
            for i in self.srcs:
                out += [(peft_key(hf[i], "A"), value(self.A[str(i)]).detach().clone()), (peft_key(hf[i], "B"), bs[i])]
            return out
        shards = gather_shards(value(self.A["0"]).detach(), group, everywhere)
        if shards is None:
            return None
        return [(peft_key(hf[0], "A"), tf.merge(shards, self.shapes)[0]), (peft_key(hf[0], "B"), value(self.B).clone())]


def _sp(linear) -> bool:
    return bool(getattr(linear, "sequence_parallel", False)) and not getattr(linear, "explicit_expert_comm", False)


def _tp_attrs(p: torch.nn.Parameter, parallel: bool, dim: int) -> None:
    # the attributes megatron-core's own TP layers set (set_tensor_model_parallel_attributes)
    for k, v in (("tensor_model_parallel", parallel), ("partition_dim", dim), ("partition_stride", 1)):
        setattr(p, k, v)


def adapters(chunk: Any) -> Iterator[tuple[str, Any, LoraAdapter]]:
    """(module name, megatron linear, its adapter) of one chunk."""
    for name, mod in chunk.named_modules():
        ad = getattr(mod, ADAPTER_CHILD, None)
        if isinstance(ad, LoraAdapter):
            yield name, mod, ad


def _initializer(seed: int, rank: int, given: dict[str, torch.Tensor] | None, source: str | None):
    """Full HF-layout (A, B) of one HF module: from the given adapter, else HF PEFT's default
    init (A Kaiming-uniform, B zero), seeded by the module's name so every layout and rank
    draws the same A."""

    def init(hf_tensor: str, shape: tuple[int, ...]):
        if given is not None:
            ka, kb = peft_key(hf_tensor, "A"), peft_key(hf_tensor, "B")
            if ka not in given or kb not in given:
                raise UserError(
                    f"peft.init_from={source} has no LoRA weights for {hf_tensor.rsplit('.', 1)[0]}, which "
                    "peft.target_modules adapts. Set peft.target_modules to the adapter's target_modules "
                    "(its adapter_config.json)."
                )
            return given[ka].float(), given[kb].float()
        g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(hf_tensor.encode())) % (2**63))
        bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)), as nn.Linear and PEFT
        a = (torch.rand(rank, shape[1], generator=g) * 2 - 1) * bound
        return a, torch.zeros(shape[0], rank)

    return init


def apply_lora(chunks: Sequence[Any], spec: Any, peft: Any, *, seed: int = 0) -> int:
    """Freeze every weight of the built (and loaded) chunks and attach adapters to the
    linears `peft.target_modules` names. Returns the number of adapted megatron linears."""
    given = None
    if peft.init_from:
        given = load_file(f"{peft.init_from}/{ADAPTER_WEIGHTS}")
    table, backend = table_for(spec), backend_of(spec)
    targets = {id(t.mapping): t for t in backend.lora_targets(spec, peft.target_modules, table)}
    layout = layout_of(chunks)
    shapes = spec.shapes(layout.tp)
    init = _initializer(seed, peft.rank, given, peft.init_from)
    n = 0
    if layout.etp > 1 and any(t.mapping.is_expert for t in targets.values()):
        raise UserError(  # the same rule `mbr check` applies (lora.lora_targets)
            f"LoRA on expert linears needs whole experts per rank (etp=1), the layout has etp={layout.etp}."
        )
    for i, chunk in enumerate(chunks):
        for p in chunk.parameters():
            p.requires_grad_(False)
        coords = current_coords(vp_stage_of(chunks, i))
        names = runtime_of(spec).global_names(chunk)
        for mod_name, mod in list(chunk.named_modules()):
            wname = f"{mod_name}.weight"
            row = resolve_megatron(table, names[wname]) if wname in names else None
            if row is None or id(row.mapping) not in targets:
                continue
            keys = backend.adapter_names(spec, row)
            ad = LoraAdapter(
                row, targets[id(row.mapping)], mod, shard_for(row, layout, coords), shapes, peft, init, keys
            )
            mod.add_module(ADAPTER_CHILD, ad)
            mod.register_forward_hook(ad.hook)
            n += 1
    return n


def iter_adapter_tensors(
    chunks: Sequence[Any], value=None, *, everywhere: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: (peft key, full HF-layout tensor) of every adapter, on one replica (the
    first DP rank, first rank of its TP / expert-TP group; experts' adapters on their EP rank).
    With `everywhere`, on every rank of the stage: under expert parallelism each chunk's
    expert adapters are then all-gathered over the EP group (adapters are small; via host
    memory, in EP rank order) after its other adapters. `value(p)` picks what (default the
    weight; `lambda p: p.main_grad` for gradients)."""
    value = value or (lambda p: p)
    dense = everywhere or ps.get_data_parallel_rank(with_context_parallel=True) == 0
    expert = everywhere or ps.get_expert_data_parallel_rank() == 0
    ep = ps.get_expert_model_parallel_world_size()
    for chunk in chunks:
        mine: list[tuple[str, torch.Tensor]] = []  # this EP rank's expert adapters, when gathered
        for _, _, ad in adapters(chunk):
            is_expert = ad.row.mapping.is_expert
            if not (expert if is_expert else dense):
                continue
            group = ps.get_expert_tensor_parallel_group() if is_expert else ps.get_tensor_model_parallel_group()
            got = ad.hf_tensors(value, group, everywhere) or ()
            if is_expert and everywhere and ep > 1:
                mine += [(k, t.cpu()) for k, t in got]
            else:
                yield from got
        if everywhere and ep > 1:
            device = next(chunk.parameters()).device
            parts: list[Any] = [None] * ep
            torch.distributed.all_gather_object(parts, mine, group=ps.get_expert_model_parallel_group())
            for part in parts:
                yield from ((k, t.to(device)) for k, t in part)


@contextlib.contextmanager
def adapters_off(chunks: Sequence[Any]):
    """The base model without its adapters (PEFT's `disable_adapter`): what DPO's reference is
    under LoRA when no other reference is named, so no second copy of the weights is held."""
    ads = [ad for chunk in chunks for _, _, ad in adapters(chunk)]
    for ad in ads:
        ad.enabled = False
    try:
        yield
    finally:
        for ad in ads:
            ad.enabled = True


@contextlib.contextmanager
def merged(chunks: Sequence[Any]):
    """Base weights with the adapters merged in (for the HF export), restored afterwards."""
    saved = []
    with torch.no_grad():
        for chunk in chunks:
            for _, mod, ad in adapters(chunk):
                saved.append((mod.weight, mod.weight.detach().clone()))
                mod.weight.add_(ad.delta_weight().to(mod.weight.dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for w, old in saved:
                w.copy_(old)


def export_adapter(chunks: Sequence[Any], peft: Any, out_dir: str, base: str | None) -> None:
    """Collective: write `adapter_config.json` + `adapter_model.safetensors` (HF PEFT's
    layout and names) into `out_dir`, atomically (a temporary sibling renamed into place)."""
    mine = {k: v.float().cpu().contiguous() for k, v in iter_adapter_tensors(chunks)}
    parts: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, mine)
    if torch.distributed.get_rank() == 0:
        tensors = {k: v for p in parts for k, v in p.items()}
        out = Path(out_dir)
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        tmp.mkdir(parents=True)
        save_adapter_weights(tensors, tmp / ADAPTER_WEIGHTS)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(peft, base), indent=2) + "\n")
        if out.exists():
            out.rmdir()  # preflight allows only an empty directory
        os.replace(tmp, out)
    torch.distributed.barrier()


def save_adapter_weights(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """`adapter_model.safetensors` with its data section's CRC-32 in the header's metadata
    (manifest.DATA_CRC32), which `peft.init_from` checks: the data in `save_file`'s order, the
    header by the converter's `SafetensorsWriter` (metadata keys in a fixed order, so the same
    adapter gives the same bytes in every process; safetensors orders a map of several keys
    differently from one process to the next)."""
    order = sorted(tensors.items(), key=lambda kv: save_file_key(dtype_of(kv[1].dtype).st, kv[0]))
    crc = 0
    for _, t in order:
        crc = zlib_ng.crc32(tensor_bytes(t), crc)
    entries = [(n, dtype_of(t.dtype), tuple(t.shape)) for n, t in order]
    out = SafetensorsWriter(path, entries, {"format": "pt", DATA_CRC32: crc_hex(crc)})
    for n, t in order:
        out.write(n, t)
    out.close()


def model_state(chunk: Any) -> dict[str, Any]:
    """What a checkpoint keeps of a chunk: its adapters only when it has any (the base
    weights come back from the base model the checkpoint refers to), else everything."""
    sd = chunk.state_dict()
    if any(True for _ in adapters(chunk)):
        return {k: v for k, v in sd.items() if is_adapter_param(k)}
    return sd


def load_model_state(chunk: Any, state: dict[str, Any]) -> None:
    has = any(True for _ in adapters(chunk))
    missing, unexpected = chunk.load_state_dict(state, strict=not has)
    if has and (unexpected or any(is_adapter_param(k) for k in missing)):
        raise UserError(f"the checkpoint's adapters do not match this model's: {missing[:4]} {unexpected[:4]}")


__all__ = [
    "LoraAdapter",
    "apply_lora",
    "adapters",
    "adapters_off",
    "iter_adapter_tensors",
    "merged",
    "export_adapter",
    "model_state",
    "load_model_state",
]
