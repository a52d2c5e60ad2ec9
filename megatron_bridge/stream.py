"""Weights out of a training job in HF names, in memory-bounded buckets (RL weight sync).

Why: RL frameworks (verl, slime, NeMo-RL) push the trainer's weights into an inference engine
after every update. Handing over one tensor at a time costs a collective per tensor; handing
over a whole pipeline stage costs the stage's size in host memory. `hf_buckets` groups the
exporter's full HF tensors (`runtime.weights.iter_hf_tensors`: gathered over TP, EP and
expert-TP, merged back to HF names and shapes, either backend) into buckets of at most
`bucket_bytes`, so a rank holds at most one bucket plus the one tensor being gathered (each
tensor is gathered straight into its merged HF tensor: runtime/weights_base.gather_merged),
whatever the model size; `apply_bucket` copies a bucket into a transformers model in place (the
receiver side). docs/rl.md has the verl/slime-style loop and the measured memory.

Two modes (`mode=`):

* `"stage"` (for a separate inference engine): the buckets arrive on the ranks that gather —
  per pipeline stage its first data- and tensor-parallel rank (for MoE experts, that rank of
  every expert-parallel group); a receiver per stage gets that stage's part.
* `"broadcast"` (for engines colocated with every training rank, verl's and slime's colocated
  mode): every rank receives every bucket. Every rank of a stage all-gathers its stage's
  tensors (`iter_hf_tensors(everywhere=True)`: the same sequence on all of them, so their
  bucket boundaries agree), packing each bucket into one byte buffer as its tensors arrive;
  the stages take turns over the pipeline group: at its turn a stage makes its next bucket,
  broadcasts its names and shapes (one small object), then the buffer. Extra memory per rank:
  the bucket it holds (its own or the one received) and the next tensor its stream gathered —
  max(`bucket_bytes`, the largest tensor) + the largest tensor (a tensor over `bucket_bytes`
  is a bucket of its own), as in stage mode.

`adapter=True` streams a LoRA run's adapters alone, under HF PEFT's names. Every rank must
iterate `hf_buckets` to the end, as it is collective; in broadcast mode under expert parallelism
the experts' adapters (small) are all-gathered over the EP group. `layout=` picks per-expert /
stacked tensors: "checkpoint" (what `save_pretrained` writes) or "model" (transformers' in-memory
tensors, experts stacked; each expert gathered straight into its slot of the stacked tensor).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from megatron.core import parallel_state as ps

from megatron_bridge.backends.describe import describe_hf
from megatron_bridge.backends.registry import backend_of
from megatron_bridge.backends.transformers.backend import meta
from megatron_bridge.backends.transformers.split import ChunkPiece
from megatron_bridge.bridge.hf_config import BridgeSpec
from megatron_bridge.bridge.shards import FULL
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.groups import comm_device
from megatron_bridge.runtime.lora_modules import iter_adapter_tensors
from megatron_bridge.runtime.weights import iter_hf_tensors

Bucket = list[tuple[str, torch.Tensor]]
DEFAULT_BUCKET_BYTES = 512 << 20  # slime's default chunk size


def bucket_nbytes(bucket: Bucket) -> int:
    """The bytes a bucket's tensors hold."""
    return sum(t.numel() * t.element_size() for _, t in bucket)


MODES = ("stage", "broadcast")
LAYOUTS = ("checkpoint", "model")


def hf_buckets(
    chunks: Sequence[Any],
    spec: BridgeSpec,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    mode: str = "stage",
    adapter: bool = False,
    layout: str = "checkpoint",
) -> Iterator[Bucket]:
    """Collective over all ranks: yield lists of (HF name, full tensor), each holding at most
    `bucket_bytes` (a single tensor bigger than that comes alone), cast to `dtype` if given.
    A bucket is handed over as soon as the next tensor would overflow it. `mode`: "stage"
    (each stage's gathering rank gets its stage's buckets) or "broadcast" (every rank gets
    every bucket), as the module docstring says. `adapter=True`: a LoRA run's adapter weights
    only, under HF PEFT's names (`...q_proj.lora_A.weight`, as `adapter_model.safetensors`
    holds them), for an engine that applies LoRA itself (vLLM's LoRA requests). `layout`:
    "checkpoint" (the names and shapes `save_pretrained` writes: what vLLM's and SGLang's
    `load_weights` take) or "model" (transformers' in-memory modules: experts fused as
    transformers 5 holds them, renamed tensors under their module names — what `apply_bucket`
    into a transformers model needs)."""
    if bucket_bytes <= 0:
        raise UserError(f"bucket_bytes must be positive, got {bucket_bytes}: pass e.g. {DEFAULT_BUCKET_BYTES}")
    if mode not in MODES:
        raise UserError(f"mode={mode!r} is not a streaming mode: pass one of {', '.join(MODES)}")
    if layout not in LAYOUTS:
        raise UserError(f"layout={layout!r} is not a streaming layout: pass one of {', '.join(LAYOUTS)}")
    if layout == "model" and (adapter or (mode == "stage" and ps.get_expert_model_parallel_world_size() > 1)):
        raise UserError(
            "layout='model' streams a whole model's tensors; with adapter=True, or with mode='stage' under expert "
            "parallelism (ep>1: each receiving rank sees only its experts, so fused experts never complete), it "
            "is not available: use layout='checkpoint', or mode='broadcast'"
        )
    everywhere = mode == "broadcast"
    tensors: Iterator[tuple[str, torch.Tensor]]
    if adapter:
        found = iter_adapter_tensors(chunks, everywhere=everywhere)
        tensors = ((n, t if dtype is None else t.to(dtype)) for n, t in found)
    elif layout == "model":
        shaped = ModelLayout(spec)
        tensors = shaped(iter_hf_tensors(chunks, spec, dtype, everywhere=everywhere, into=shaped.slot))
    else:
        tensors = iter_hf_tensors(chunks, spec, dtype, everywhere=everywhere)
    if mode == "stage" or ps.get_pipeline_model_parallel_world_size() == 1:
        yield from _bucketed(tensors, bucket_bytes)
    else:
        yield from _turns(_packed(tensors, bucket_bytes, comm_device()))


def in_model_layout(
    tensors: Iterator[tuple[str, torch.Tensor]], spec: BridgeSpec
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint-layout (name, tensor) pairs -> transformers' in-memory ones (`ModelLayout`)."""
    return ModelLayout(spec)(tensors)


class ModelLayout:
    """Checkpoint-layout (name, tensor) pairs -> transformers' in-memory ones: renamed tensors
    under their module names; per-expert pieces land in the stacked experts tensor (allocated at
    the first: memory is that tensor, not it and its pieces), and a fused tensor's pieces (a
    linear-attention q/k/v conv, backends/transformers/fused.py; small) are concatenated once the last
    piece has arrived. `slot` is the exporter's `into` (runtime/weights_base.Into): handed to
    `iter_hf_tensors`, each expert piece is gathered straight into its slot, so no piece-sized
    buffer is held beside the stack (a piece that arrives elsewhere, e.g. after a dtype cast, is
    copied in). The names come from transformers' own conversion mapping, run on the meta-device
    model (backends/transformers/backend.py)."""

    def __init__(self, spec: BridgeSpec) -> None:
        cfg = backend_of(spec).hf_config(spec)
        self.model_type = cfg.get("model_type")
        self.m = m = meta(describe_hf(cfg, make_vocab_size_divisible_by=1, backend="transformers"))
        self.module_of = {saved: name for name, saved in m.saved_as.items() if name not in m.split}
        self.shapes = spec.shapes(1)
        self.cut: dict[str, list[str]] = {}  # a checkpoint tensor the model holds in pieces (split.py)
        for name, c in m.split.items():
            self.cut.setdefault(c.source, []).append(name)
        self.groups = {**m.experts, **{name: pieces for name, (pieces, _) in m.fused.items()}}
        self.piece_of = {p: (whole, i) for whole, pieces in self.groups.items() for i, p in enumerate(pieces)}
        self.stacks: dict[str, tuple[torch.Tensor, list[int]]] = {}  # experts: the whole tensor, pieces arrived

    def slot(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """Where the expert piece `name` goes in its stacked tensor (allocated at its first piece,
        in that piece's dtype); None for any other tensor."""
        whole, i = self.piece_of.get(name, ("", 0))
        if whole not in self.m.experts or not _fits_stack(self.m, whole, tuple(shape)):
            return None
        if whole not in self.stacks:
            self.stacks[whole] = (torch.empty(self.m.shapes[whole], dtype=dtype, device=device), [0])
        out = self.stacks[whole][0]
        if out.dtype != dtype or out.device != device:
            return None
        e, k = divmod(i, len(self.groups[whole]) // out.shape[0])
        return out[e, k * shape[0] : (k + 1) * shape[0]]

    def __call__(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        m, groups = self.m, self.groups
        pending: dict[str, dict[int, torch.Tensor]] = {}
        for name, t in tensors:
            if name in self.piece_of:
                whole, i = self.piece_of[name]
                if whole in m.experts and _fits_stack(m, whole, tuple(t.shape)):
                    dest = self.slot(name, tuple(t.shape), t.dtype, t.device)
                    assert dest is not None, f"{name}: pieces of {whole} in more than one dtype"
                    if dest.data_ptr() != t.data_ptr():  # not gathered in place: copied in
                        dest.copy_(t)
                    del t, dest
                    left = self.stacks[whole][1]
                    left[0] += 1
                    if left[0] == len(groups[whole]):
                        yield whole, self.stacks.pop(whole)[0]
                    continue
                got = pending.setdefault(whole, {})
                got[i] = t
                if len(got) < len(groups[whole]):
                    continue
                pieces = [t for _, t in sorted(pending.pop(whole).items())]
                yield whole, _joined(m, whole, pieces)
            elif name in self.cut:  # its run of rows (per-head permuted) for each model tensor
                for part in self.cut[name]:
                    c = m.split[part]
                    yield (
                        part,
                        ChunkPiece(c.at, c.rows, c.nth, c.pieces, c.heads).shard([t], FULL, self.shapes).contiguous(),
                    )
            elif name in self.module_of:
                yield self.module_of[name], t
            else:
                raise UserError(f"{name}: no tensor of transformers' {self.model_type} model is saved under this name")
        if pending or self.stacks:
            short = sorted({*pending, *self.stacks})[:2]
            raise UserError(f"pieces of {short} arrived incomplete: stream with mode='broadcast'")


def _fits_stack(m: Any, whole: str, piece: tuple[int, ...]) -> bool:
    """Whether an expert's piece is an equal dim-0 share of its slab (gate and up of gate_up_proj,
    or the slab itself), so it can land straight in the stacked tensor; else the pieces are held
    and joined (`_joined`)."""
    shape = m.shapes[whole]
    per = len(m.experts[whole]) // shape[0]
    return len(shape) == len(piece) + 1 and piece[0] * per == shape[1] and tuple(piece[1:]) == tuple(shape[2:])


def _joined(m: Any, whole: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The in-memory tensor `whole` of its checkpoint pieces, in order: a fused tensor joins them
    on its dim, stacked experts stack each expert's pieces (concatenated on dim 0)."""
    if whole in m.fused:
        return torch.cat(pieces, m.fused[whole][1])
    per = len(pieces) // m.shapes[whole][0]
    return torch.stack([torch.cat(pieces[e : e + per], 0) for e in range(0, len(pieces), per)])


def _bucketed(tensors: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    bucket: Bucket = []
    size = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


ALIGN = 64  # a packed tensor's byte offset: a view of any dtype at it is aligned


def _packed(
    tensors: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int, device: torch.device
) -> Iterator[tuple[Bucket, torch.Tensor]]:
    """Broadcast mode's buckets with the bytes that travel: each tensor is copied into the
    bucket's one byte buffer as it arrives and dropped, its entry a view of the buffer, so the
    bucket is never held twice (as tensors and as their packed copy); a tensor over
    `bucket_bytes` comes alone, as its own bytes. Offsets as `_layout` computes them."""
    buf: torch.Tensor | None = None
    bucket: Bucket = []
    at = 0
    for name, t in tensors:
        n = _nbytes(tuple(t.shape), t.dtype)
        if bucket and _aligned(at) + n > bucket_bytes:
            assert buf is not None
            yield bucket, buf[:at]
            buf, bucket, at = None, [], 0
        if n > bucket_bytes:
            t = t.to(device).contiguous()
            yield [(name, t)], t.reshape(-1).view(torch.uint8)
            continue
        if buf is None:
            buf = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
        at = _aligned(at)
        view = buf[at : at + n].view(t.dtype).reshape(t.shape)
        view.copy_(t)
        del t
        bucket.append((name, view))
        at += n
    if bucket:
        assert buf is not None
        yield bucket, buf[:at]


def _aligned(at: int) -> int:
    return -(-at // ALIGN) * ALIGN


def _layout(names: list[tuple[str, tuple[int, ...], torch.dtype]]) -> tuple[list[int], int]:
    """The byte offsets `_packed` gives a bucket's tensors, and its end."""
    offsets, at = [], 0
    for _, shape, dtype in names:
        at = _aligned(at)
        offsets.append(at)
        at += _nbytes(shape, dtype)
    return offsets, at


def _turns(own: Iterator[tuple[Bucket, torch.Tensor]]) -> Iterator[Bucket]:
    """Broadcast mode over the pipeline group: the stages take turns, round by round; at its
    turn a stage makes its next bucket (its ranks gather together while the others wait),
    broadcasts its names and shapes, then its bytes from where they lie, and yields it. A rank
    holds no bucket of its own while it receives another stage's, only the next tensor its
    own stream has gathered (docs/rl.md "Memory")."""
    group = ps.get_pipeline_model_parallel_group()
    me = torch.distributed.get_rank(group)
    device = comm_device()
    live = list(range(torch.distributed.get_world_size(group)))
    while live:
        for stage in list(live):
            src = torch.distributed.get_global_rank(group, stage)
            mine = next(own, None) if stage == me else None
            meta: list[Any] = [None if mine is None else [(n, tuple(t.shape), t.dtype) for n, t in mine[0]]]
            torch.distributed.broadcast_object_list(meta, src=src, group=group)
            names = meta[0]
            if names is None:
                live.remove(stage)
                continue
            if mine is not None:
                bucket, data = mine
                del mine
                torch.distributed.broadcast(data, src=src, group=group)
                del data
                yield bucket
                del bucket
                continue
            offsets, end = _layout(names)
            data = torch.empty(end, dtype=torch.uint8, device=device)
            torch.distributed.broadcast(data, src=src, group=group)
            got = [
                (n, data[o : o + _nbytes(shape, dt)].view(dt).reshape(shape))
                for (n, shape, dt), o in zip(names, offsets)
            ]
            del data  # the views keep it while the receiver holds them
            yield got
            del got


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def apply_bucket(model: torch.nn.Module, bucket: Bucket) -> int:
    """Copy a bucket into a transformers model's parameters and buffers in place (cast to each
    target's dtype and device); a name the model lacks, or a shape that differs, is an error
    before anything of the bucket is copied. Returns the number of tensors copied."""
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    missing = [n for n, _ in bucket if n not in targets]
    if missing:
        raise UserError(f"the receiving model has no tensor named {missing[:4]}: stream the same architecture")
    wrong = [(n, tuple(t.shape), tuple(targets[n].shape)) for n, t in bucket if t.shape != targets[n].shape]
    if wrong:
        raise UserError(f"streamed shape differs from the receiving model's (name, streamed, model): {wrong[:4]}")
    with torch.no_grad():
        for n, t in bucket:
            targets[n].copy_(t)
    return len(bucket)


__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "apply_bucket",
    "bucket_nbytes",
    "ModelLayout",
    "hf_buckets",
    "in_model_layout",
]
