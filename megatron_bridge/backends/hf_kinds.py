"""The hf backend's layer kinds, and what else a model's forward does between its layers (torch-free).

`config.layer_types` names each decoder layer's kind; a stage rebuilds each kind's mask with
the model's own mask function (runtime/hf/chunk.py `MASKS`, one entry per `LAYER_KINDS` kind).
Here, declared once: which kinds are built, which are known but not (with the piece the stages
lack), which submodules stay whole on every TP rank, what a layer hands the next, which kinds
run under context parallelism (and why the others cannot), and the config keys that switch on
state the stages do not rebuild. backends/hf.py refuses from these tables; hf_plan.py re-exports
them with the plans it reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# layer kinds (`config.layer_types`) whose masks the stages rebuild (runtime/hf/chunk.py MASKS);
# `indexed_attention` (DeepSeek-V3.2's sparse attention, GLM-5): the causal mask, which the
# layer's indexer narrows to its top-k keys inside the layer; `minimax_m3_sparse` (MiniMax-M3):
# the causal mask, narrowed to the indexer's key blocks inside the layer; `chunked_attention`:
# Llama 4's local attention (blocks of attention_chunk_size tokens)
# `linear_attention` / `conv` mixers (gated DeltaNet, lightning attention, short convolutions) run
# whole on every TP rank, as transformers' plans declare: their projections `colwise_gather_output`
# or unplanned, their other tensors (conv1d, A_log, dt_bias, gated norm) `replicated`;
# `mlp` / `moe` (Nemotron-H's blocks without a token mixer): no mask (NemotronHModel.forward
# passes `causal_mask_mapping.get(block_type)`, None for them)
LAYER_KINDS = (
    "full_attention",
    "sliding_attention",
    "indexed_attention",
    "minimax_m3_sparse",
    "linear_attention",
    "conv",
    "chunked_attention",
    "mlp",
    "moe",
)
# layer kinds known but not built, and the piece the stages lack for them (instead of the
# generic "not one of LAYER_KINDS" line)
_V4 = (
    "DeepseekV4Model.forward runs every layer on hc_mult hyper-connection streams ([b, s, hc_mult, h], folded "
    "by hc_head before the norm) with a {'main', 'compress'} rotary pair and input_ids (hash-routed MoE): "
    "the stages pass one [b, s, h] stream and one rotary embedding"
)
_INKLING = (
    "InklingModel.forward gives every layer a conv_mask (create_recurrent_attention_mask) besides its "
    "attention mask ('hybrid' full, 'hybrid_sliding' sliding): the stages pass one mask per layer"
)
UNBUILT_KINDS = {
    "compressed_sparse_attention": _V4,
    "heavily_compressed_attention": _V4,
    "hybrid": _INKLING,
    "hybrid_sliding": _INKLING,
}
# submodules (by attribute name) that stay whole on every TP rank and are never split by head,
# whatever the plan next to them splits: a sparse-attention indexer reads whole tensors (the
# hidden states, the q latent) under `torch.no_grad` and returns top-k key indices shared by all
# heads, so every rank computes the same selection for its own heads (no gradient reaches it)
WHOLE_MODULES = ("indexer",)
# what a decoder layer hands the next one: {keyword the next layer takes: (index in the layer's
# output tuple, config list marking the layers that read it, the marking value)}. GLM-5's and
# HY-V4's "shared" indexer layers reuse the previous layer's top-k (GlmMoeDsaModel.forward);
# megatron's schedules pass one activation tensor between stages, so no stage may start at one
CARRY = {"prev_topk_indices": (1, "indexer_types", "shared")}
# layer kinds context parallelism cannot run, and why
_RECURRENT = "it carries a state along the sequence: a CP rank's chunks would need the earlier chunks' state"
NO_CP_KINDS = {
    "indexed_attention": "its indexer scores every query against all keys and keeps the top-k; a CP rank holds a "
    "slice of the keys",
    "linear_attention": _RECURRENT,
    "conv": _RECURRENT,
}
# layer kinds that run under context parallelism (runtime/hf/cp.py: K/V all-gathered, the mask
# from global positions) -> the config key holding their window; linear attention, convs and
# sparse indexers keep state or selections over the local tokens and are refused at cp > 1
CP_LAYER_KINDS = {"full_attention": None, "sliding_attention": "sliding_window"}

# config keys that switch on state the base model's forward threads past its layers' own
# inputs, which the stages do not rebuild (nor carry across pipeline stages) yet: refused by value
UNBUILT: dict[str, str] = {
    "hidden_size_per_layer_input": "per-layer inputs (Gemma 3n / Gemma 4): the base model embeds input_ids "
    "per layer (embed_tokens_per_layer) plus a projection of the embeddings and hands layer i its slice",
    "num_kv_shared_layers": "KV sharing (Gemma 3n / Gemma 4): the last layers reuse earlier layers' keys "
    "and values, passed between layers in the base model's forward (shared_kv_states)",
}


def unbuilt_refusals(hf: Mapping[str, Any]) -> list[str]:
    """One line per UNBUILT key this config switches on."""
    return [f"{key}={hf[key]!r}: {why}, not built by the hf backend yet" for key, why in UNBUILT.items() if hf.get(key)]


def layer_limits(hf: Mapping[str, Any], layout: Any) -> list[tuple[str, str]]:
    """(problem, fix) for the carried values this layout cannot run: a pipeline stage that would
    start at a layer reading a value the previous layer hands over (`CARRY`). (Layer kinds under
    context parallelism: `cp_refusals`.)"""
    out = []
    kinds = list(hf.get("layer_types") or ())
    n = int(hf.get("num_hidden_layers") or len(kinds))
    starts = {layout.stage_layers(n, r, v).start for r in range(layout.pp) for v in range(layout.vpp_or_1)}
    for kw, (_, field, value) in CARRY.items():
        marks = list(hf.get(field) or ())
        for s in sorted(i for i in starts if 0 < i < len(marks) and marks[i] == value):
            out.append(
                (
                    f"layer {s} ({field}[{s}]={value!r}) takes {kw} from layer {s - 1}, which is on the previous "
                    "pipeline stage (megatron's schedules pass one activation tensor between stages)",
                    f"choose a stage split whose stages start at a layer that is not {value!r}",
                )
            )
    return out


def cp_refusals(layer_types: list[str] | None, cp: int) -> list[tuple[str, str]]:
    """One refusal per layer kind that cannot run at cp > 1 (see `CP_LAYER_KINDS`), with the
    reason where `NO_CP_KINDS` gives one."""
    kinds = list(layer_types or ())
    return [
        (
            f"layer kind {kind!r} (layers {', '.join(str(i) for i, k in enumerate(kinds) if k == kind)}) cannot run "
            f"under context parallelism (cp={cp}) in the hf backend: "
            + NO_CP_KINDS.get(kind, f"it runs {tuple(CP_LAYER_KINDS)}"),
            "set cp=1",
        )
        for kind in dict.fromkeys(kinds)
        if kind not in CP_LAYER_KINDS
    ]


__all__ = [
    "CARRY",
    "CP_LAYER_KINDS",
    "LAYER_KINDS",
    "NO_CP_KINDS",
    "UNBUILT",
    "UNBUILT_KINDS",
    "WHOLE_MODULES",
    "cp_refusals",
    "layer_limits",
    "unbuilt_refusals",
]
