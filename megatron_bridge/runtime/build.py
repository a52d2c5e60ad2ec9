"""Build the megatron-core GPTModel of a `BridgeSpec` for a `Layout` (this rank's part).

The layer specs are megatron's local specs edited per layer by the bridge's building blocks
(`layer_specs.py`, `blocks/`): the core attention is Transformer Engine's where TE and
CUDA are present and compute the same thing, else `ContextParallelAttention`; the blocks
a family's config turns on (windows, norms, scalings, ...) replace or wrap modules. Weight
names are the local spec's on every machine, which is what the mapping tables speak.

`build_model` returns one GPTModel per virtual pipeline chunk (a list of one without VPP),
each with pre_process/post_process set for its stage; the blocks' `model` hooks finish it
(blocks/rope.py puts in rotary frequencies computed exactly as transformers does).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel

from megatron_bridge.bridge.layout import Layout
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.blocks.base import blocks
from megatron_bridge.runtime.layer_specs import decoder_block_spec
from megatron_bridge.runtime.tconfig import gpt_model_kwargs, transformer_config


def check_groups(layout: Layout) -> None:
    """The initialized megatron groups must be the layout's (built by runtime.groups)."""
    if not ps.model_parallel_is_initialized():
        raise UserError(
            "megatron-core parallel groups are not initialized; call "
            "megatron_bridge.runtime.groups.initialize(dims) first"
        )
    have = dict(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
    )
    want = dict(tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, etp=layout.etp, vpp=layout.vpp)
    if (want["vpp"] or 1) == 1 and (have["vpp"] or 1) == 1:
        want["vpp"] = have["vpp"] = None
    bad = {k: (have[k], want[k]) for k in want if have[k] != want[k]}
    if bad:
        raise UserError(
            "the initialized process groups do not match the layout: "
            + ", ".join(f"{k}={h} (layout {w})" for k, (h, w) in bad.items())
        )


def build_model(spec: BridgeSpec, layout: Layout, *, load_weights: bool = False, **config_overrides: Any) -> list[Any]:
    """This rank's GPTModel chunks for `spec` under `layout` (groups must be initialized).

    `load_weights=False` (training from scratch): megatron's random initialisation, unchanged.
    `load_weights=True`: the caller is about to load every weight (`loader.load_hf_weights`,
    `runtime.load_converted.load_converted`, which prove that they did): the tensor-parallel weights
    are allocated at this rank's shard shape and left uninitialised (`skip_weight_init`),
    instead of drawing each full-size fp32 master weight and keeping a slice — the random
    init was ~80% of a tp2 build + load and a full-size weight per rank (docs/benchmarks.md).
    `config_overrides` go to TransformerConfig (params_dtype, bf16, recompute_granularity, ...).
    """
    check_groups(layout)
    tconfig = transformer_config(spec, layout, **config_overrides)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    vpp = tconfig.virtual_pipeline_model_parallel_size
    chunks = []
    for vp in range(vpp) if vpp else [None]:
        layers = layout.stage_layers(spec.num_layers, pp_rank, vp)
        layer_spec = decoder_block_spec(spec, tconfig, layers)
        with skip_weight_init(load_weights):
            model = GPTModel(
                config=tconfig,
                transformer_layer_spec=layer_spec,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                vp_stage=vp,
                **gpt_model_kwargs(spec, layout),
            )
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        if model.post_process:
            mask_vocab_padding(model, spec.vocab_size)
        for block in blocks():
            block.model(spec, model)
        chunks.append(model)
    return chunks


# megatron-core modules that call its affine-weight initialisers (imported by name there).
_INIT_MODULES = (
    "megatron.core.tensor_parallel.layers",
    "megatron.core.transformer.moe.experts",
    "megatron.core.extensions.transformer_engine",
)


@contextmanager
def skip_weight_init(active: bool = True) -> Iterator[None]:
    """While active, megatron's tensor-parallel weights are created but not initialised.

    Every TP-split weight (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
    GroupedMLP, TE linears) is initialised by `_initialize_affine_weight_cpu` — which draws
    the *full* master weight in fp32 on every rank, casts it and copies this rank's slice —
    or by `_initialize_affine_weight_gpu`. Both also set the weight's tensor-parallel
    attributes (`tensor_model_parallel`, `partition_dim`, `partition_stride`), which the
    grad-norm, the optimizer and resharding read. `perform_initialization=False` would skip
    those attributes too (megatron-core 0.16 sets them only inside the initialisers), so a
    TP-split weight would count as a duplicate; instead both initialisers are replaced by
    one that sets exactly the attributes megatron would, with megatron's own arguments.
    The small remaining inits (zero biases, router and gate weights) are untouched."""
    if not active:
        yield
        return
    layers = importlib.import_module(_INIT_MODULES[0])
    importlib.import_module(_INIT_MODULES[1])
    originals = {"_initialize_affine_weight_cpu": layers._initialize_affine_weight_cpu}
    originals["_initialize_affine_weight_gpu"] = layers._initialize_affine_weight_gpu
    set_attrs = layers.set_tensor_model_parallel_attributes

    def affine_cpu(
        weight,
        output_size,
        input_size,
        per_partition_size,
        partition_dim,
        init_method,
        stride=1,
        return_master_weight=False,
        *,
        skip_set_tensor_parallel_attributes=False,
        **_,
    ):
        if not skip_set_tensor_parallel_attributes:
            set_attrs(tensor=weight, is_parallel=True, dim=partition_dim, stride=stride)

    def affine_gpu(weight, init_method, partition_dim, stride=1, is_expert=False):
        set_attrs(tensor=weight, is_parallel=True, dim=partition_dim, stride=stride)

    replacements = {"_initialize_affine_weight_cpu": affine_cpu, "_initialize_affine_weight_gpu": affine_gpu}
    patched = []
    for mod in (sys.modules[m] for m in _INIT_MODULES if m in sys.modules):
        for name, orig in originals.items():
            if getattr(mod, name, None) is orig:
                setattr(mod, name, replacements[name])
                patched.append((mod, name, orig))
    try:
        yield
    finally:
        for mod, name, orig in patched:
            setattr(mod, name, orig)


def mask_vocab_padding(model: Any, vocab_size: int) -> None:
    """Give the padded vocabulary rows logit -inf on the rank that holds them.

    Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by · tp; the
    padding rows would otherwise take part in the softmax, so the loss would differ from the
    Hugging Face model's and — because the padding depends on tp — between layouts. With the
    mask the loss and its gradients equal the unpadded model's at every tp."""
    layer = model.output_layer
    per_rank = layer.output_size_per_partition
    first_pad = vocab_size - ps.get_tensor_model_parallel_rank() * per_rank  # local column index
    if first_pad >= per_rank:
        return
    first_pad = max(first_pad, 0)

    def hook(_module, _inputs, output):
        logits, bias = output
        mask = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        mask[first_pad:] = True
        return logits.masked_fill(mask, float("-inf")), bias

    layer.register_forward_hook(hook)


def model_config(chunks: list[Any]):
    return chunks[0].config


__all__ = ["build_model", "check_groups", "model_config", "skip_weight_init"]
