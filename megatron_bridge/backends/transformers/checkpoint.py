"""The transformers backend's checkpoints: what `mbr convert` writes for a model of transformers' modules.

A chunk of a transformers-backed model holds transformers' own tensors under their module names with
global layer indices (`model.layers.3.self_attn.q_proj.weight`, the stacked
`model.layers.3.mlp.experts.gate_up_proj`), so the checkpoints keep those names:

* torch_dist: one key per module tensor (no layer axis: layers differ in kind), global shape =
  the tensor at tp=1 and ep=1 (vocabulary rows padded as the run pads them, every expert
  stacked), the tensor the backend's table builds from the HF tensors with its transform at
  `FULL`. A run at any layout reads it back through the same transforms (runtime/transformers/weights.py):
  the stored tensor merged to the HF tensors, then split as that run splits them;
* per-rank files: a chunk's `state_dict()` as the hf builder makes it — this rank's TP shards,
  a stacked experts tensor's run of experts under EP (`ep_stacked`), the stage's pieces only,
  megatron's linears' `_extra_state` entries (`rank_state`).

Which stage holds a tensor follows the builder (runtime/transformers/build.py `Stage.chunk`): the
embedding, the pieces between it and the layers and the per-layer-input modules on the first
chunk; layer i on the chunk whose `stage_layers` hold it; the final pieces and the LM head on the
last (a tied head only where the last is not also the first); anything else (a rotary module's
persistent buffers) on every chunk.
"""

from __future__ import annotations

import argparse

from megatron_bridge.backends.transformers.kinds import PER_LAYER_INPUTS
from megatron_bridge.backends.transformers.meta import Meta
from megatron_bridge.backends.transformers.plan import COLUMN, EP_TENSOR, ROW, VOCAB
from megatron_bridge.bridge.layout import Coords, Layout, megatron_degrees
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.table import Resolved
from megatron_bridge.convert.formats.dtypes import DType

Shape = tuple[int, ...]
PRE, POST, LM_HEAD, EVERY = "pre", "post", "head", "every"


def expected(m: Meta, spec: BridgeSpec, padded_vocab: int) -> dict[str, Shape | None]:
    """Every module tensor of the meta model with its shape at tp=1 (the embedding's and LM
    head's rows padded to `padded_vocab`), and the tied LM head's row where the table has one."""
    out: dict[str, Shape | None] = {}
    for name, shape in m.shapes.items():
        vocab = m.kinds[name] == VOCAB and len(shape) >= 1
        out[name] = (padded_vocab, *shape[1:]) if vocab else tuple(shape)
    head = f"{m.plan.head}.weight"
    if spec.tie_word_embeddings and head not in out:
        embed = m.shapes[f"{m.plan.embed}.weight"]
        out[head] = (padded_vocab, *embed[1:])
    return out


def pieces(m: Meta, cfg: object, names: list[str]) -> dict[str, str | int]:
    """{tensor name: the stage piece it belongs to}: a layer index, or PRE / POST / LM_HEAD /
    EVERY (`cfg`: the transformers config, for the per-layer-input modules)."""
    per_layer = [
        f"{m.plan.prefix}.{mod}" for k, (*_, mods) in PER_LAYER_INPUTS.items() if getattr(cfg, k, None) for mod in mods
    ]
    out: dict[str, str | int] = {}
    for name in names:
        i = m.plan.layer_index(name)
        if i is not None:
            out[name] = i
        elif _under(name, (m.plan.embed, *m.plan.pre, *per_layer)) or _under(name, m.plan.vision, itself=True):
            out[name] = PRE
        elif _under(name, m.plan.post):
            out[name] = POST
        elif _under(name, (m.plan.head,)):
            out[name] = LM_HEAD
        else:
            out[name] = EVERY
    return out


def _under(name: str, modules: tuple[str, ...] | list[str], itself: bool = False) -> bool:
    """Whether tensor `name` is in one of `modules` (`itself`: or is one: a VLM's own parameter)."""
    return any(name.startswith(p + ".") or (itself and name == p) for p in modules)


def owned(
    where: str | int, spec: BridgeSpec, stored: bool, row: Resolved, layout: Layout, coords: Coords, layers: range
) -> str | None:
    """`row`'s name on the chunk at `coords` (its global name: the chunk keeps transformers'), or
    None where that chunk does not hold it (see the module doc); `where`: its piece (`pieces`),
    `stored`: whether the model has the tensor itself (a tied LM head reads the embedding's)."""
    pre, post = coords.pre_process(layout), coords.post_process(layout)
    if isinstance(where, int):
        held = where in layers
    elif where == PRE:
        held = pre
    elif where == POST:
        held = post
    elif where == LM_HEAD:  # a tied head has no weight of its own on the embedding's chunk
        held = post and (stored or not pre)
    else:
        held = True
    return row.megatron if held else None


def ep_stacked(m: Meta, spec: BridgeSpec, row: Resolved) -> bool:
    """The experts module's stacked tensors (`grouped_gemm` in `base_model_ep_plan`): an EP rank
    keeps its run of experts on dim 0."""
    return spec.is_moe and m.plan.ep_style(row.megatron) == EP_TENSOR


def rank_state(m: Meta, entries: dict[str, tuple[int, object]], post_process: bool) -> dict[str, object]:
    """A chunk's state dict: its tensors in table order, and the `_extra_state` entries (None)
    megatron's linears add to it — every planned linear (its tensors are `column` / `row` kind)
    and the LM head on the last chunk — as the built chunk's `state_dict()` holds them."""
    linears = {n.rpartition(".")[0] for n, k in m.kinds.items() if k in (COLUMN, ROW)}
    out: dict[str, object] = {}
    for name in sorted(entries, key=lambda n: entries[n][0]):
        out[name] = entries[name][1]
        module = name.rpartition(".")[0]
        if module in linears:
            out[f"{module}._extra_state"] = None
    if post_process:
        out[f"{m.plan.head}._extra_state"] = None
    return out


def checkpoint_args(spec: BridgeSpec, layout: Layout, dtype: DType, ckpt_format: str) -> argparse.Namespace:
    """The parallel sizes and the few sizes megatron reads; the architecture is config.json's
    (Megatron-LM cannot build these models: the args only document the checkpoint)."""
    return argparse.Namespace(
        **megatron_degrees(layout),
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        vocab_size=spec.vocab_size,
        padded_vocab_size=spec.padded_vocab_size(layout.tp),
        make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by,
        num_experts=spec.num_moe_experts,
        untie_embeddings_and_output_weights=not spec.tie_word_embeddings,
        params_dtype=dtype,
        ckpt_format=ckpt_format,
        model_backend=spec.backend,
        hf_architecture=spec.architecture,
        iteration=0,
        no_save_optim=True,
        no_save_rng=True,
    )


__all__ = [
    "EVERY",
    "LM_HEAD",
    "POST",
    "PRE",
    "checkpoint_args",
    "ep_stacked",
    "expected",
    "owned",
    "pieces",
    "rank_state",
]
