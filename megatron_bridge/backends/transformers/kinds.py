"""The transformers backend's layer kinds, and what else a model's forward does between its layers (torch-free).

`config.layer_types` names each decoder layer's kind; a stage rebuilds each kind's mask with
the model's own mask function (runtime/transformers/chunk.py `MASKS`, one entry per `LAYER_KINDS` kind).
Here, declared once: which kinds are built, which are known but not (with the piece the stages
lack), which submodules stay whole on every TP rank, what a layer hands the next, which kinds
run under context parallelism (and why the others cannot), and the config keys that switch on
state the stages do not rebuild. backends/transformers/backend.py refuses from these tables; transformers/plan.py re-exports
them with the plans it reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# layer kinds (`config.layer_types`) whose masks the stages rebuild (runtime/transformers/chunk.py MASKS);
# `indexed_attention` (DeepSeek-V3.2's sparse attention, GLM-5): the causal mask, which the
# layer's indexer narrows to its top-k keys inside the layer; `minimax_m3_sparse` (MiniMax-M3):
# the causal mask, narrowed to the indexer's key blocks inside the layer; `chunked_attention`:
# Llama 4's local attention (blocks of attention_chunk_size tokens); `compressed_sparse_attention` /
# `heavily_compressed_attention` (DeepSeek-V4): the sliding-window mask, which the layer extends
# with its compressor's pooled keys inside the layer
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
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "mlp",
    "moe",
)
# layer kinds known but not built, and the piece the stages lack for them (instead of the
# generic "not one of LAYER_KINDS" line)
_INKLING = (
    "InklingModel.forward gives every layer a conv_mask (create_recurrent_attention_mask) for its short "
    "convolutions besides its attention mask ('hybrid' full, 'hybrid_sliding' sliding): no mask of the stages' "
    "(runtime/transformers/chunk.py MASKS) is built for these kinds yet"
)
UNBUILT_KINDS = {
    "hybrid": _INKLING,
    "hybrid_sliding": _INKLING,
}
# nn.Linear subclasses whose forward is the linear's own arithmetic, x @ W.T + b (FalconLinear
# adds the bias after the matmul, for bf16 rounding as trained): megatron's linears replace them
# where the plan splits them, and a LoRA may adapt them where it does not (meta.py `whole_linears`)
PLAIN_LINEARS = ("Linear", "FalconLinear")
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
    "compressed_sparse_attention": "its compressor pools blocks of the sequence's keys (and its indexer scores "
    "them all); a CP rank holds a slice of the sequence",
    "heavily_compressed_attention": "its compressor pools blocks of the sequence's keys; a CP rank holds a slice "
    "of the sequence",
    "linear_attention": _RECURRENT,
    "conv": _RECURRENT,
}
# layer kinds that run under context parallelism (runtime/transformers/cp.py: K/V all-gathered, the mask
# from global positions) -> the config key holding their window; linear attention, convs and
# sparse indexers keep state or selections over the local tokens and are refused at cp > 1
CP_LAYER_KINDS = {"full_attention": None, "sliding_attention": "sliding_window"}

# layer kinds packed SFT samples run through: their masks come from transformers' mask functions,
# which read the restarting position ids of a packed row as its conversations' boundaries
# (masking_utils.find_packed_sequence_indices: block-diagonal causal attention); the rotary
# embeddings take the same positions. The other kinds, and why a packed row would mix its conversations
_MIXES = "it carries a state along the row, from one packed conversation into the next"
_SELECTS = (
    "its indexer selects keys over the row with a mask of its own, not verified to keep to one packed conversation"
)
PACKING_KINDS = ("full_attention", "sliding_attention", "chunked_attention", "mlp", "moe")
NO_PACKING_KINDS = {
    "linear_attention": _MIXES,
    "conv": _MIXES,
    "indexed_attention": _SELECTS,
    "minimax_m3_sparse": _SELECTS,
    "compressed_sparse_attention": "its compressor pools blocks of the row's keys across packed conversations",
    "heavily_compressed_attention": "its compressor pools blocks of the row's keys across packed conversations",
}


def builds_windows(base: type) -> bool:
    """Whether the base model class `base` can give its layers a sliding-window mask: its
    source names one (Mistral's forward picks `create_sliding_window_causal_mask` when
    `sliding_window` is set). Qwen3-Omni's thinker text model keeps a `sliding_window` field its
    forward never reads: it builds the causal mask alone, its attention passes no window."""
    import inspect

    try:
        return "sliding" in inspect.getsource(base)
    except (OSError, TypeError):  # no source to read: the config decides
        return True


def layer_kinds(cfg: Any, n_layers: int, windows: bool) -> tuple[str, ...]:
    """Each decoder layer's kind, the one place it is derived (the refusals here, the stages'
    masks): `cfg.layer_types` (the language model's config object, class defaults filled in),
    else sliding or full attention as `sliding_window` / `use_sliding_window` say, where the base
    model builds sliding-window masks at all (`windows`: `builds_windows`)."""
    kinds = getattr(cfg, "layer_types", None)
    if kinds:
        return tuple(str(k) for k in kinds)
    sliding = getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True)
    return ("sliding_attention" if sliding and windows else "full_attention",) * n_layers


def packing_refusals(layer_types: Any, image_positions: str = "") -> list[str]:
    """Why packed SFT samples (several conversations per row) cannot run: a layer kind that would
    mix them (`NO_PACKING_KINDS`), or a VLM whose positions its forward derives from the images
    (`image_positions`: vision.IMAGE_POSITIONS), which a packed row's restarting positions do not give."""
    kinds = list(layer_types or ())
    out = [
        f"layer kind {kind!r} (layers {', '.join(str(i) for i, k in enumerate(kinds) if k == kind)}): "
        + NO_PACKING_KINDS.get(kind, "not verified with packed rows")
        for kind in dict.fromkeys(kinds)
        if kind not in PACKING_KINDS
    ]
    if image_positions:
        out.append(
            f"its forward derives the token positions from the images ({image_positions}: M-RoPE), over the whole "
            "row; a packed row's positions restart per conversation"
        )
    return out


# values the base model's forward computes once from the inputs and hands every layer its slice of:
# {config key switching it on: (the decoder layer's keyword, the base model's forward keyword a
# VLM's forward hands it the token part by, the base model's modules that make it)}.
# Gemma 4's per-layer inputs (Gemma4TextModel.get_per_layer_inputs / project_per_layer_inputs:
# embed_tokens_per_layer(input_ids) plus a normed projection of the embeddings, [b, s, L, d_pl],
# layer i takes [:, :, i]; Gemma4Model.forward looks the ids up itself, image tokens as padding,
# and hands that as `per_layer_inputs`). The first stage computes them (the projection reads the
# embeddings, which only it holds) and they travel between stages packed behind the hidden states
# (runtime/transformers/per_layer.py): megatron's schedules pass one tensor, so it is widened.
PER_LAYER_INPUTS = {
    "hidden_size_per_layer_input": (
        "per_layer_input",
        "per_layer_inputs",
        ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm"),
    )
}
# a container the base model's forward creates once and passes to every layer, which layers
# write to and later layers read from: {the layers' keyword: the config key switching the reading
# on}. Gemma 4's KV sharing (Gemma4TextModel.forward: `shared_kv_states`): the last
# num_kv_shared_layers layers reuse the keys and values the last earlier layer of their layer kind
# stored. A stage passes one container to its layers; a stage split that puts a reader and its
# writer on different stages is refused (`layer_limits`): keys and values are not carried.
SHARED_STATE = {"shared_kv_states": "num_kv_shared_layers"}

# config keys that switch on state the base model's forward threads past its layers' own
# inputs, which the stages do not rebuild (nor carry across pipeline stages) yet: refused by value
# (Gemma 3n's per-layer inputs and KV sharing come with AltUp: refused by `plan.FORWARD_MATH`)
UNBUILT: dict[str, str] = {}


def kv_share_sources(hf: Mapping[str, Any]) -> dict[int, int]:
    """{layer reading shared keys and values: the layer that stores them}, by transformers' rule
    (Gemma4TextConfig.kv_sharing_modes: the last `num_kv_shared_layers` layers read; each reads
    the last earlier, non-reading layer of its own layer kind)."""
    kinds = list(hf.get("layer_types") or ())
    shared = int(hf.get("num_kv_shared_layers") or 0)
    first = len(kinds) - shared
    if not shared or first <= 0:
        return {}
    last = {k: i for i, k in enumerate(kinds[:first])}
    return {i: last[kinds[i]] for i in range(first, len(kinds)) if kinds[i] in last}


def unbuilt_refusals(hf: Mapping[str, Any]) -> list[str]:
    """One line per UNBUILT key this config switches on."""
    return [
        f"{key}={hf[key]!r}: {why}, not built by the transformers backend yet"
        for key, why in UNBUILT.items()
        if hf.get(key)
    ]


def layer_limits(hf: Mapping[str, Any], layout: Any) -> list[tuple[str, str]]:
    """(problem, fix) for the carried values this layout cannot run: a pipeline stage that would
    start at a layer reading a value the previous layer hands over (`CARRY`), or separate a
    layer reading shared keys and values from the one storing them (`SHARED_STATE`). (Layer kinds under
    context parallelism: `cp_refusals`.)"""
    out = []
    kinds = list(hf.get("layer_types") or ())
    n = int(hf.get("num_hidden_layers") or len(kinds))
    starts = {layout.stage_layers(n, r, v).start for r in range(layout.pp) for v in range(layout.vpp_or_1)}
    stage_of = {
        i: (r, v) for r in range(layout.pp) for v in range(layout.vpp_or_1) for i in layout.stage_layers(n, r, v)
    }
    for reader, writer in kv_share_sources(hf).items():
        if layout.pp > 1 and stage_of.get(reader) != stage_of.get(writer):
            out.append(
                (
                    f"layer {reader} reuses the keys and values layer {writer} stores (KV sharing, "
                    f"num_kv_shared_layers={hf.get('num_kv_shared_layers')}), which is on another pipeline stage "
                    "(the transformers backend passes shared_kv_states between the layers of one stage only)",
                    f"choose a stage split that keeps layers {writer}..{reader} on one stage "
                    "(parallel.layers_first_stage / layers_last_stage)",
                )
            )
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
            f"under context parallelism (cp={cp}) in the transformers backend: "
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
    "NO_PACKING_KINDS",
    "PACKING_KINDS",
    "PLAIN_LINEARS",
    "PER_LAYER_INPUTS",
    "SHARED_STATE",
    "UNBUILT",
    "UNBUILT_KINDS",
    "WHOLE_MODULES",
    "builds_windows",
    "cp_refusals",
    "kv_share_sources",
    "layer_kinds",
    "layer_limits",
    "packing_refusals",
    "unbuilt_refusals",
]
