"""Which table rows a checkpoint fills, checked against its config before anything is written.

A conversion works row by row: one row of the family's table (`bridge.table.Mapping`) is
one megatron parameter and the HF tensor(s) it is made of. `resolve_rows` groups a
checkpoint's tensor names into rows with the bridge's own `resolve_checkpoint` (unknown
tensors are an error there) and then checks what only a whole-checkpoint view can:

* completeness: every parameter the config implies is present (`expected_names`), and no
  tensor lies beyond the config (a layer index >= num_hidden_layers, an expert >= E);
* shapes: each row's HF shapes go through the row's own transform as blocks
  (`Transform.blocks`: shapes only, so the transform's checks run — QKV head geometry,
  vocab rows, divisibility — without torch) and the resulting megatron tensor must have the
  shape megatron-core builds for this config (`megatron_shape`); all inputs of a row share
  one dtype (a mixed QKV would be upcast).

`check_layout_shards` asks the same transforms for rank 0's blocks under a layout, which
catches sizes that do not split over tp (e.g. an FFN width not divisible by tp) with the
tensor's name. Dtypes are only compared and printed: torch dtypes or `convert.formats.dtypes.DType`s.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from collections.abc import Mapping as TMapping
from typing import Any

from megatron_bridge.bridge.layout import Layout
from megatron_bridge.bridge.loader import Coords, resolve_checkpoint, shard_for, table_for
from megatron_bridge.bridge.mapping import NotBlockwise
from megatron_bridge.bridge.shards import FULL, out_shape
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.table import Resolved, resolve_megatron
from megatron_bridge.errors import UserError

Shape = tuple[int, ...]
Tensors = TMapping[str, tuple[Shape, Any]]  # HF name -> (shape, dtype)


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


def expected_names(spec: BridgeSpec) -> list[str]:
    """Global megatron parameter names the config implies, in table order per layer."""
    kinds = layer_kinds(spec)
    out: list[str] = []
    layered = []
    for m in table_for(spec):
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


def resolve_rows(spec: BridgeSpec, tensors: Tensors, tp: int = 1, where: str = "the checkpoint") -> list[Resolved]:
    """Rows of `tensors` ({HF name: (shape, dtype)}), validated against the spec (see module doc)."""
    try:
        rows = resolve_checkpoint(spec, list(tensors))
    except KeyError as e:
        raise UserError(f"{where} is incomplete: {e.args[0]}") from None
    want = expected_names(spec)
    have = {r.megatron for r in rows}
    table = table_for(spec)
    missing = [n for n in want if n not in have]
    if missing:
        found = [resolve_megatron(table, n) for n in missing[:6]]  # `want` comes from the table
        hf = [h for r in found if r is not None for h in r.hf]
        raise UserError(
            f"{where} lacks {len(missing)} tensor(s) the {spec.architecture} config needs, e.g. "
            f"{', '.join(dict.fromkeys(hf))}{' ...' if len(missing) > 6 else ''}"
        )
    wanted = set(want)
    beyond = [r for r in rows if r.megatron not in wanted]
    if beyond:
        raise UserError(
            f"{where} has tensors the config does not describe (num_hidden_layers={spec.num_layers}"
            f"{f', experts={spec.num_moe_experts}' if spec.is_moe else ''}): "
            f"{', '.join(h for r in beyond[:4] for h in r.hf)}{' ...' if len(beyond) > 4 else ''}"
        )
    shapes = spec.shapes(tp)
    bad: list[str] = []
    for r in rows:
        dtypes = {tensors[h][1] for h in r.hf}
        if len(dtypes) > 1:
            bad.append(f"{', '.join(r.hf)} mix dtypes {sorted(map(str, dtypes))}")
            continue
        hf_shapes = r.select_shapes([tensors[h][0] for h in r.hf])
        stacked = [tuple(tensors[h][0]) for h in r.hf if r.mapping.transform.stacked]
        if any(x[:1] != (spec.num_moe_experts,) for x in stacked):
            bad.append(f"{', '.join(r.hf)} {[list(x) for x in stacked]}: not {spec.num_moe_experts} stacked experts")
            continue
        try:
            g = out_shape(r.mapping.transform.blocks(hf_shapes, FULL, shapes), hf_shapes)
        except NotBlockwise as e:  # a layout the byte copier cannot describe (none in the tables today)
            raise UserError(f"{where}: {spec.architecture} cannot be converted offline: {e}") from None
        except ValueError as e:
            bad.append(f"{', '.join(r.hf)} {[list(x) for x in hf_shapes]}: {e}")
            continue
        expected = megatron_shape(r.megatron, spec, shapes.padded_vocab_size)
        if expected is not None and g != expected:
            bad.append(
                f"{', '.join(r.hf)} {[list(x) for x in hf_shapes]}: {r.megatron} would be "
                f"{list(g)}, the config implies {list(expected)}"
            )
    if bad:
        raise UserError(
            f"{where}: {len(bad)} tensor shape(s) disagree with config.json "
            f"(hidden_size={spec.hidden_size}, heads={spec.num_attention_heads}/{spec.num_query_groups}, "
            f"head_dim={spec.head_dim}, intermediate={spec.ffn_hidden_size}, vocab={spec.vocab_size}):\n"
            + "\n".join(f"  - {b}" for b in bad[:8])
        )
    return rows


def check_layout_shards(spec: BridgeSpec, layout: Layout, rows: Sequence[Resolved], tensors: Tensors) -> None:
    """Every row must split over the layout (rank 0's blocks, from shapes: nothing is read)."""
    shapes = spec.shapes(layout.tp)
    bad = []
    for r in rows:
        try:
            hf_shapes = r.select_shapes([tensors[h][0] for h in r.hf])
            r.mapping.transform.blocks(hf_shapes, shard_for(r, layout, Coords()), shapes)
        except ValueError as e:
            bad.append(f"{r.megatron}: {e}")
    if bad:
        raise UserError(
            f"the layout {layout.describe()} cannot split this model:\n" + "\n".join(f"  - {b}" for b in bad[:8])
        )


def producers(rows: Sequence[Resolved]) -> dict[tuple[str, ...], Resolved]:
    """HF names -> the exported row that stores them (the tied output layer reads the
    embedding's HF tensor but is never stored itself)."""
    return {r.hf: r for r in rows if r.mapping.export}


__all__ = ["resolve_rows", "expected_names", "megatron_shape", "check_layout_shards", "producers", "layer_kinds"]
