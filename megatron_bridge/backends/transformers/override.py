"""One entry of the transformers backend's override table (torch-free): the `Override` fields, each
naming what a model type's forward does outside its modules and the config key holding its
constant; the table itself, keyed by model type, is backends/transformers/overrides.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# `mqa_fused_qkv` (the transformers backend's own plan string, from OVERRIDES only): a fused projection laid
# out [query heads..., key, value] with one K/V head for every query head (Falcon's multi-query
# attention). One head does not split over TP, so the linear stays whole on every rank and each
# rank keeps its query heads and the K/V head of the output (runtime/transformers/layers.py `mqa_qkv_hooks`);
# its input's gradient is summed over TP as a column-parallel linear's is, its weight's too
# (`grad_allreduce`: each rank's part of the gradient comes from its own heads).
MQA_QKV = "mqa_fused_qkv"


@dataclass(frozen=True)
class Override:
    """What one model type's forward does outside its modules, that a stage must redo; each
    field names the config key that holds the constant (checked by `mbr verify --matrix
    model.backend=transformers`, docs/bridge.md)."""

    reason: str = ""  # where transformers' forward does it
    logit_scale: str | None = None  # config key: logits multiplied by it
    logit_divide: str | None = None  # config key: logits divided by it
    logit_softcap: str | None = None  # config key c: logits = c * tanh(logits / c)
    embed_scale: str | None = None  # config key: the embeddings multiplied by it (first stage)
    embed_sqrt_hidden: str | None = None  # config key of a flag: when on, embeddings * sqrt(hidden_size) (muP)
    tp_plan: tuple[tuple[str, str], ...] = ()  # extra or replacement plan entries (models without a plan)
    # extra base_model_ep_plan entries (`ep_dispatch_experts`, `grouped_gemm`; runtime/transformers/experts.py), merged
    # over the config's as tp_plan is: Llama 4 declares none though its experts exchange over EP
    ep_plan: tuple[tuple[str, str], ...] = ()
    pp_plan: tuple[str, ...] = ()  # the base model's stage pieces in forward order (over its base_model_pp_plan)
    # stage pieces kept (weights loaded, exported, no gradient) but not called: for a text-only batch they
    # return the embeddings unchanged (Phi-4-multimodal's embed_tokens_extend merges image/audio embeddings)
    text_identity: tuple[str, ...] = ()
    # (decoder-layer kwarg, function of position_ids in the modeling module) the forward passes to
    # the layers whose layer kind has no rotary embedding (Beam's NoPE query scale)
    nope_kwargs: tuple[tuple[str, str], ...] = ()
    window_full_attention: str | None = (
        None  # config key: when set, `full_attention` layers take the sliding-window mask
    )
    prefix: str | None = None  # the base model's attribute, where the class's base_model_prefix names none
    # (config key of the stream count n, the base model's module that folds them): the forward runs
    # the layers on n hyper-connection streams [b, s, n, h] (the embeddings repeated n times on the
    # first stage), folded by that module before the post pieces (HY-V4's hc_mult, hc_head)
    streams: tuple[str, str] | None = None
    # the streams side by side in the hidden dim, [b, s, n·h] (the embeddings `repeat`ed along it:
    # Qwen4-Exp), not a dim of their own
    flat_streams: bool = False
    # rope types (keys of config.rope_parameters): every layer takes position_embeddings as the dict
    # {type: rotary(x, position_ids, type)} and picks its own (DeepSeek-V4's 'main' / 'compress')
    rotary_types: tuple[str, ...] = ()
    # (decoder-layer kwarg, the chunk's forward input) the model's forward hands every layer
    # (DeepSeek-V4's hash-routed MoE reads input_ids, Qwen4-Exp's n-gram embeddings ple_input_ids);
    # every stage has them (megatron's schedule feeds each stage the micro-batch's ids)
    layer_inputs: tuple[tuple[str, str], ...] = ()
    # (decoder-layer kwarg, layer kind): every layer also takes that kind's mask (runtime/transformers/chunk.py
    # MASKS) by that keyword, as the model's forward hands it (Qwen4-Exp's conv_mask: the linear-attention
    # padding mask, None for an unpadded batch)
    layer_masks: tuple[tuple[str, str], ...] = ()
    # layer kinds whose mask is the boolean [b, s] padding mask, all True for an unpadded batch, where the model's
    # forward hands them that instead of the kind's own (runtime/transformers/chunk.py MASKS): GLM-5.3-Flash's
    # indexer and linear attention
    padding_masks: tuple[str, ...] = ()
    layers: str = "layers"  # the pp plan's piece that is the ModuleList of decoder layers
    # (the base model's ModuleList of rotary modules, the config's per-layer list): layer i takes the
    # rotary module of its value, the list holding one per distinct non-zero value in ascending
    # order; 0 means no rotary (NoPE). Granite-MoE-SWA's rotary_embs by layer_rope_theta.
    layer_rotary: tuple[str, str] | None = None
    # (layer kind, mask function of the modeling module): a kind outside kinds.LAYER_KINDS whose mask the model's
    # forward makes with a function of its own, called as the stages call MASKS' (runtime/transformers/chunk.py)
    kind_masks: tuple[tuple[str, str], ...] = ()
    # config key of a per-layer list: a layer whose value is 0 is called with position_embeddings=None (NoPE),
    # the others with the one rotary module's (Muse's layer_rope_theta)
    nope_layers: str | None = None
    # (kwarg, value) every decoder layer is called with, where its forward takes it without a default
    layer_kwargs: tuple[tuple[str, Any], ...] = ()
    # (config key, why): a config with the key truthy is refused, naming it (a feature the stages do not rebuild)
    refused: tuple[tuple[str, str], ...] = ()
    # ({config key: value, ...}, tp plan entries): entries that replace tp_plan's where the config matches
    # (a fused projection whose layout follows a config flag)
    tp_plan_when: tuple[tuple[tuple[tuple[str, Any], ...], tuple[tuple[str, str], ...]], ...] = ()
    # (layer kind, tp plan entries): entries that win over the plan's in the decoder layers of that kind
    # (config.layer_types), their `*` the layer's index (a plan entry meant for another kind's modules of the
    # same name: GLM-5.3-Flash's o_proj, rowwise after its split MLA, whole after its unsplit linear attention)
    kind_tp_plan: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()

    def tp_entries(self, cfg: Any = None) -> dict[str, str]:
        """tp_plan with the `tp_plan_when` entries whose config values `cfg` (an object) holds."""
        out = dict(self.tp_plan)
        for when, entries in self.tp_plan_when:
            if cfg is not None and all(getattr(cfg, k, None) == v for k, v in when):
                out.update(entries)
        return out

    def kind_entries(self, cfg: Any) -> dict[str, str]:
        """`kind_tp_plan`'s entries, one per layer of its kind in `cfg.layer_types` (`*` its index)."""
        kinds = list(getattr(cfg, "layer_types", None) or ()) if cfg is not None else []
        return {
            pattern.replace("*", str(i), 1): style
            for kind, entries in self.kind_tp_plan
            for i, k in enumerate(kinds)
            if k == kind
            for pattern, style in entries
        }

    def handled(self) -> set[str | None]:
        return {self.logit_scale, self.logit_divide, self.logit_softcap, self.embed_scale, self.embed_sqrt_hidden}

    def constants(self, cfg: Any) -> dict[str, float]:
        """{FORWARD field: value} that the chunk's forward applies, read off the transformers config."""
        out = {k: float(c) for k in FORWARD if (v := getattr(self, k)) and (c := getattr(cfg, v, None)) is not None}
        if self.embed_sqrt_hidden and getattr(cfg, self.embed_sqrt_hidden):
            out["embed_scale"] = out.get("embed_scale", 1.0) * float(cfg.hidden_size) ** 0.5
        return out

    def stream_count(self, cfg: Any) -> int:
        """How many hyper-connection streams the layers run on (1: one plain stream)."""
        return int(getattr(cfg, self.streams[0])) if self.streams else 1


# the Override fields that hold a config key of a constant the chunk's forward applies
FORWARD = ("logit_scale", "logit_divide", "logit_softcap", "embed_scale")
# the stage pieces of a model that declares no base_model_pp_plan: transformers' own convention
# (`base_model_pp_plan = {"embed_tokens": ..., "layers": ..., "norm": ...}`), taken where the base
# model has exactly these children with weights (`hf.model_plan` checks, and refuses the others)
PP_CONVENTION = ("embed_tokens", "layers", "norm")


__all__ = ["FORWARD", "MQA_QKV", "PP_CONVENTION", "Override"]
