"""The native backend's megatron-core checkpoint names: what `mbr convert` writes for a GPTModel.

Everything here speaks megatron's local-spec names (`decoder.layers.3.self_attention.linear_qkv.weight`):

* which parameters a config implies and their global shapes at tp=1 (`expected_names`,
  `megatron_shape`): the converter's completeness and shape checks;
* where a parameter lives in torch_dist (`location`, `extra_state_location`): keys, global
  shapes and chunking of megatron-core's `GPTModel.sharded_state_dict()`
  (tests/unit/convert/test_dist_ckpt_keys_families.py holds them equal for every family) —
  layers of a homogeneous stack share a key with a leading layer axis (`decoder.layers.<name>`
  [L, ...], one chunk per layer); with MoE and dense layers mixed, keys keep the layer index, as
  megatron does for non-homogeneous stacks; experts add an expert axis
  (`...mlp.experts.experts.linear_fc1.weight` [L, E, ...]); norms use the local spec's fused names
  (`bridge.layout.dist_ckpt_key`); every linear has an `_extra_state` object (value None);
* which chunk of which rank holds a parameter (`owned`: the embedding on the first chunk, the
  final norm and output layer on the last, experts by EP rank, layers renumbered from 0) and what
  a rank file's state dict holds besides (`chunk_state_dict`: module order, the linears'
  `_extra_state`; `megatron_args`: the `args` Megatron-LM stores).

`backends/native/backend.py` hands these to the converter (`Backend.expected`, `dist_location`, ...).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence

from megatron_bridge.bridge.layout import Coords, Layout, dist_ckpt_key, local_experts, megatron_degrees, to_local_name
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.table import Mapping, Resolved
from megatron_bridge.convert.formats.dist_ckpt import DistLocation
from megatron_bridge.convert.formats.dtypes import BFLOAT16, FLOAT16, DType
from megatron_bridge.errors import UserError

Shape = tuple[int, ...]

# megatron linears (an `_extra_state` each); MLA's too, except its kv down-projection, which
# the bridge keeps whole on every TP rank in a plain module (features/mla.py: no extra state)
LINEAR_MODULES = (
    "linear_qkv",
    "linear_proj",
    "linear_fc1",
    "linear_fc2",
    "linear_q_proj",
    "linear_q_down_proj",
    "linear_q_up_proj",
    "linear_kv_up_proj",
)


def _is_moe_row(template: str) -> bool:
    """Rows of an MoE layer's MLP (router, experts, shared experts) vs a dense layer's MLP."""
    return re.search(r"\.mlp\.(router|experts|shared_experts)\.", template) is not None


def layer_kinds(spec: BridgeSpec) -> tuple[int, ...]:
    """1 = MoE layer, 0 = dense, per layer (megatron's moe_layer_freq as the spec holds it)."""
    if not spec.is_moe:
        return (0,) * spec.num_layers
    return tuple(spec.moe_layer_pattern) or (1,) * spec.num_layers


def _moe(size: int | None) -> int:
    """One of the spec's MoE sizes, asked for only by rows that exist in MoE tables."""
    if size is None:
        raise ValueError("an MoE size of a dense model's spec")
    return size


def expected_names(spec: BridgeSpec, table: Sequence[Mapping]) -> list[str]:
    """Global megatron parameter names the config implies, in table order per layer."""
    kinds = layer_kinds(spec)
    out: list[str] = []
    layered = []
    for m in table:
        if "{layer}" not in m.megatron:
            out.append(m.megatron)
        else:
            layered.append(m)
    for layer in range(spec.num_layers):
        for m in layered:
            if ".mlp." in m.megatron and _is_moe_row(m.megatron) != bool(kinds[layer]):
                continue
            experts = range(_moe(spec.num_moe_experts)) if "{expert}" in m.megatron else [None]
            out += [
                m.megatron_name(layer=layer, expert=e) if e is not None else m.megatron_name(layer=layer)
                for e in experts
            ]
    return list(dict.fromkeys(out))


# Multi-latent attention (bridge/features/mla.py) and the DeepSeek router's correction bias.
_MLA_SHAPES: Sequence[tuple[str, Callable[[BridgeSpec], Shape]]] = (
    (r"self_attention\.q_layernorm\.weight$", lambda s: (s.q_lora_rank or 0,)),
    (r"self_attention\.kv_layernorm\.weight$", lambda s: (s.kv_lora_rank,)),
    (
        r"linear_q_proj\.weight$",
        lambda s: (s.num_attention_heads * (s.qk_head_dim + s.qk_pos_emb_head_dim), s.hidden_size),
    ),
    (r"linear_q_down_proj\.weight$", lambda s: (s.q_lora_rank or 0, s.hidden_size)),
    (
        r"linear_q_up_proj\.weight$",
        lambda s: (s.num_attention_heads * (s.qk_head_dim + s.qk_pos_emb_head_dim), s.q_lora_rank or 0),
    ),
    (r"linear_kv_down_proj\.weight$", lambda s: (s.kv_lora_rank + s.qk_pos_emb_head_dim, s.hidden_size)),
    (r"linear_kv_up_proj\.weight$", lambda s: (s.num_attention_heads * (s.qk_head_dim + s.v_head_dim), s.kv_lora_rank)),
    (r"self_attention\.linear_proj\.weight$", lambda s: (s.hidden_size, s.num_attention_heads * s.v_head_dim)),
    (r"mlp\.router\.expert_bias$", lambda s: (_moe(s.num_moe_experts),)),
)

# megatron-core's parameter shapes at tp=1 (local spec), by name suffix. `V` = padded vocab.
_SHAPES: Sequence[tuple[str, Callable[[BridgeSpec, int], Shape]]] = (
    (r"(embedding\.word_embeddings|output_layer)\.weight$", lambda s, V: (V, s.hidden_size)),
    (r"layernorm\.weight$", lambda s, V: (s.hidden_size,)),
    (
        r"linear_qkv\.weight$",
        lambda s, V: ((s.num_attention_heads + 2 * s.num_query_groups) * s.head_dim, s.hidden_size),
    ),
    (r"linear_qkv\.bias$", lambda s, V: ((s.num_attention_heads + 2 * s.num_query_groups) * s.head_dim,)),
    (r"linear_proj\.weight$", lambda s, V: (s.hidden_size, s.num_attention_heads * s.head_dim)),
    (r"local_experts\.\d+\.linear_fc1\.weight$", lambda s, V: (2 * _moe(s.moe_ffn_hidden_size), s.hidden_size)),
    (r"local_experts\.\d+\.linear_fc2\.weight$", lambda s, V: (s.hidden_size, _moe(s.moe_ffn_hidden_size))),
    (
        r"shared_experts\.linear_fc1\.weight$",
        lambda s, V: (2 * _moe(s.moe_shared_expert_intermediate_size), s.hidden_size),
    ),
    (r"shared_experts\.linear_fc2\.weight$", lambda s, V: (s.hidden_size, _moe(s.moe_shared_expert_intermediate_size))),
    (r"shared_experts\.gate_weight$", lambda s, V: (1, s.hidden_size)),
    (r"mlp\.linear_fc1\.weight$", lambda s, V: (2 * s.ffn_hidden_size, s.hidden_size)),
    (r"mlp\.linear_fc2\.weight$", lambda s, V: (s.hidden_size, s.ffn_hidden_size)),
    (r"mlp\.router\.weight$", lambda s, V: (_moe(s.num_moe_experts), s.hidden_size)),
)


def megatron_shape(name: str, spec: BridgeSpec, padded_vocab: int) -> Shape | None:
    """The shape megatron-core gives global parameter `name` (None: not known here)."""
    if spec.multi_latent_attention:
        for mla_pattern, mla_fn in _MLA_SHAPES:
            if re.search(mla_pattern, name):
                return tuple(mla_fn(spec))
    qk = re.search(r"\.(q|k)_layernorm\.weight$", name)
    if qk:  # per head, or over the whole q / k projection (qk_norm_type "full")
        heads = spec.num_attention_heads if qk.group(1) == "q" else spec.num_query_groups
        return (spec.head_dim * (heads if spec.qk_norm_type == "full" else 1),)
    for pattern, fn in _SHAPES:
        if re.search(pattern, name):
            return tuple(fn(spec, padded_vocab))
    return None


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(.*\.experts)\.local_experts\.(\d+)\.(.*)$")


def location(name: str, spec: BridgeSpec) -> DistLocation:
    """Where global megatron parameter `name` is stored."""
    name = dist_ckpt_key(name, fused_norm_names=not spec.multi_latent_attention)
    m = _LAYER.match(name)
    if not m:
        return DistLocation(name)
    layer, rest = int(m.group(1)), m.group(2)
    stacked = not spec.moe_layer_pattern  # megatron: moe_layer_freq as a list -> non-homogeneous layers
    key = "decoder.layers." if stacked else f"decoder.layers.{layer}."
    offsets: tuple[int, ...] = (layer,) if stacked else ()
    axes: tuple[int, ...] = (spec.num_layers,) if stacked else ()
    e = _EXPERT.match(rest)
    if e:
        if not spec.num_moe_experts:
            raise UserError(f"{name} is an expert's parameter, but the config has no experts")
        rest = f"{e.group(1)}.experts.{e.group(3)}"
        offsets, axes = offsets + (int(e.group(2)),), axes + (spec.num_moe_experts,)
    return DistLocation(key + rest, offsets, axes)


# The names megatron-core's other layer specs give a local-spec parameter, in a state dict or
# a torch_dist key: Transformer Engine's spec fuses the norms into the linear after them
# (`linear_qkv.layer_norm_weight`; MLA's q/kv norms into their up-projections; its MoE layers keep
# `pre_mlp_layernorm`, which the local spec's keys map renames) and its grouped-GEMM experts
# are one module with a weight per local expert (`experts.linear_fc1.weight3`). A checkpoint
# written with either spec reads the same (`aliases`).
_ALIASES: Sequence[tuple[re.Pattern[str], str]] = tuple(
    (re.compile(p), r)
    for p, r in (
        (r"\.input_layernorm\.(weight|bias)$", r".self_attention.linear_qkv.layer_norm_\1"),
        (r"\.pre_mlp_layernorm\.(weight|bias)$", r".mlp.linear_fc1.layer_norm_\1"),
        (r"\.mlp\.linear_fc1\.layer_norm_(weight|bias)$", r".pre_mlp_layernorm.\1"),
        (r"\.self_attention\.q_layernorm\.weight$", r".self_attention.linear_q_up_proj.layer_norm_weight"),
        (r"\.self_attention\.kv_layernorm\.weight$", r".self_attention.linear_kv_up_proj.layer_norm_weight"),
        (r"\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$", r".experts.\2.\3\1"),
    )
)


def aliases(name: str) -> list[str]:
    """Other names of local-spec parameter (or torch_dist key) `name` in checkpoints written
    with megatron-core's Transformer Engine spec (see `_ALIASES`)."""
    return [p.sub(r, name) for p, r in _ALIASES if p.search(name)]


def extra_state_location(name: str, spec: BridgeSpec) -> DistLocation | None:
    """The `_extra_state` object that goes with a linear layer's weight (inside the layers)."""
    module, _, leaf = name.rpartition(".")
    if leaf != "weight" or module.rsplit(".", 1)[-1] not in LINEAR_MODULES or not _LAYER.match(name):
        return None
    return location(f"{module}._extra_state", spec)


def owned(row: Resolved, spec: BridgeSpec, layout: Layout, coords: Coords, layers: range) -> str | None:
    """The rank-local name of `row` on the chunk at `coords`, or None if it lives elsewhere.

    megatron's structure, not a family's: the embedding sits in the first chunk, the final
    norm and output layer in the last; a tied output layer exists only when those differ."""
    name = row.megatron
    pre, post = coords.pre_process(layout), coords.post_process(layout)
    if name.startswith("embedding."):
        return name if pre else None
    if name.startswith(("output_layer.", "decoder.final_layernorm.")):
        if not post or (name.startswith("output_layer.") and spec.tie_word_embeddings and pre):
            return None
        return name
    experts = None
    if row.mapping.is_expert:
        assert spec.num_moe_experts is not None  # expert rows apply to MoE specs only
        experts = local_experts(spec.num_moe_experts, layout.ep, coords.ep_rank)
    return to_local_name(name, layers, experts)


def _order(name: str, position: int):
    if name.startswith("embedding."):
        return (0, 0, position)
    if name.startswith("decoder.layers."):
        return (1, int(name.split(".")[2]), position)
    return (2 if name.startswith("decoder.") else 3, 0, position)


def chunk_state_dict(entries: dict[str, tuple[int, object]], post_process: bool) -> dict[str, object]:
    """A chunk's state dict in module order (entries: local name -> (position of its row in
    table order, value)), with the `_extra_state` entries (value None) that megatron's
    local-spec linear layers put into `state_dict()` (strict loading expects them)."""
    out: dict[str, object] = {}
    for name in sorted(entries, key=lambda n: _order(n, entries[n][0])):
        out[name] = entries[name][1]
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in LINEAR_MODULES:
            out[f"{module}._extra_state"] = None
    if post_process:
        out["output_layer._extra_state"] = None
    return out


def megatron_args(spec: BridgeSpec, layout: Layout, dtype: DType, ckpt_format: str) -> argparse.Namespace:
    """The `args` Megatron-LM stores with a checkpoint (it reads the model-parallel sizes
    from a torch_dist checkpoint's args; other fields document the model). `params_dtype` is a
    DType, which the converter's pickler writes as the torch dtype of that name."""
    return argparse.Namespace(
        **megatron_degrees(layout),
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        group_query_attention=spec.num_query_groups != spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        vocab_size=spec.vocab_size,
        padded_vocab_size=spec.padded_vocab_size(layout.tp),
        make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by,
        position_embedding_type="rope",
        add_position_embedding=False,
        rotary_base=spec.rotary_base,
        normalization=spec.normalization,
        norm_epsilon=spec.norm_epsilon,
        swiglu=spec.gated_linear_unit and spec.activation == "silu",
        add_bias_linear=spec.add_bias_linear,
        add_qkv_bias=spec.add_qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        untie_embeddings_and_output_weights=not spec.tie_word_embeddings,
        num_experts=spec.num_moe_experts,
        moe_router_topk=spec.moe_router_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
        params_dtype=dtype,
        bf16=dtype == BFLOAT16,
        fp16=dtype == FLOAT16,
        ckpt_format=ckpt_format,
        iteration=0,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        no_save_optim=True,
        no_save_rng=True,
    )


__all__ = [
    "LINEAR_MODULES",
    "aliases",
    "chunk_state_dict",
    "expected_names",
    "extra_state_location",
    "layer_kinds",
    "location",
    "megatron_args",
    "megatron_shape",
    "owned",
]
