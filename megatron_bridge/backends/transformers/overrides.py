"""The transformers backend's override table (torch-free): what a model type's forward does outside its
modules, which the transformers backend's stages must redo (backends/transformers/plan.py re-exports it).

The transformers backend keeps transformers' modules and rebuilds the forward around them (runtime/transformers/
chunk.py), so every step of a model's forward that is not a module — a logit scale, an embedding
multiplier, a stage layout without a pp plan, Falcon's whole tp plan, hyper-connection streams —
is one `Override` entry keyed by model type. A config that switches such a step on without an
entry is refused naming it (`forward_refusals`), never run wrong.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from megatron_bridge.backends.transformers.override import FORWARD, MQA_QKV, PP_CONVENTION, Override

_SOFTCAP = "CausalLM.forward: logits / c, tanh, * c"
OVERRIDES: dict[str, Override] = {
    "llama4_text": Override(
        "Llama4ForCausalLM.base_model_prefix is `language_model` (its composite parent's name); it holds `model`; "
        "its config has no base_model_ep_plan (nothing to dispatch), but its pre-scaled experts split over EP "
        "by a fixed exchange (runtime/transformers/experts.py PrescaledExpertsEP)",
        prefix="model",
        ep_plan=(
            ("layers.*.feed_forward.experts", "ep_dispatch_experts"),
            ("layers.*.feed_forward.experts.gate_up_proj", "grouped_gemm"),
            ("layers.*.feed_forward.experts.down_proj", "grouped_gemm"),
        ),
    ),
    "qwen3_vl_text": Override(
        "Qwen3VLTextConfig declares no base_model_tp_plan: Qwen3's (its decoder layers are Qwen3's, q/k norms per "
        "head over head_dim)",
        tp_plan=(
            ("layers.*.self_attn.q_proj", "colwise"),
            ("layers.*.self_attn.k_proj", "colwise"),
            ("layers.*.self_attn.v_proj", "colwise"),
            ("layers.*.self_attn.q_norm", "replicated_with_grad_allreduce"),
            ("layers.*.self_attn.k_norm", "replicated_with_grad_allreduce"),
            ("layers.*.self_attn.o_proj", "rowwise"),
            ("layers.*.mlp.gate_proj", "colwise"),
            ("layers.*.mlp.up_proj", "colwise"),
            ("layers.*.mlp.down_proj", "rowwise"),
        ),
    ),
    "muse_glimmer_text": Override(
        "MuseGlimmerTextModel.forward: no position_embeddings for the layers whose layer_rope_theta is 0 (NoPE)",
        nope_layers="layer_rope_theta",
    ),
    "muse_spark_text": Override(
        "MuseSparkTextModel.forward: no position_embeddings for the layers whose layer_rope_theta is 0 (NoPE)",
        nope_layers="layer_rope_theta",
    ),
    "unlimited_ocr_text": Override(
        "UnlimitedOcrTextModel.forward masks its reference_sliding_attention layers with its module's "
        "create_reference_sliding_window_causal_mask (every prefill token kept beside the window)",
        kind_masks=(("reference_sliding_attention", "create_reference_sliding_window_causal_mask"),),
    ),
    # VLMs: their ForConditionalGeneration.forward's head arithmetic (backends/transformers/vision.py;
    # the rest of the forward is their language model's entry)
    "mistral_large4": Override(
        _SOFTCAP.replace("CausalLM", "MistralLarge4ForConditionalGeneration"), logit_softcap="final_logit_softcapping"
    ),
    "muse_glimmer": Override(
        "MuseGlimmerForConditionalGeneration.forward: logits * output_multiplier, then softcapped",
        logit_scale="output_multiplier",
        logit_softcap="final_logit_softcapping",
    ),
    "muse_spark": Override(
        "MuseSparkForConditionalGeneration.forward: logits * output_multiplier, then softcapped",
        logit_scale="output_multiplier",
        logit_softcap="final_logit_softcapping",
    ),
    "gemma4": Override(
        _SOFTCAP.replace("CausalLM", "Gemma4ForConditionalGeneration"), logit_softcap="final_logit_softcapping"
    ),
    "gemma4_unified": Override(
        _SOFTCAP.replace("CausalLM", "Gemma4UnifiedForConditionalGeneration"), logit_softcap="final_logit_softcapping"
    ),
    "paligemma": Override(
        _SOFTCAP.replace("CausalLM", "PaliGemmaForConditionalGeneration"), logit_softcap="final_logit_softcapping"
    ),
    "granite_docling_text": Override(
        "GraniteDoclingTextModel.forward: inputs_embeds * embedding_multiplier", embed_scale="embedding_multiplier"
    ),
    "granite4_vision_text": Override(
        "Granite4VisionTextModel.forward: inputs_embeds * embedding_multiplier", embed_scale="embedding_multiplier"
    ),
    "hyperclovax_vision_v2": Override(
        "HyperCLOVAXVisionV2ForConditionalGeneration.forward: logits * logits_scaling", logit_scale="logits_scaling"
    ),
    "granite4_vision": Override(
        "Granite4VisionForConditionalGeneration.forward: logits / logits_scaling", logit_divide="logits_scaling"
    ),
    "granite_docling": Override(
        "GraniteDoclingForConditionalGeneration.forward: logits / logits_scaling", logit_divide="logits_scaling"
    ),
    "cohere": Override("CohereForCausalLM.forward: logits * logit_scale", logit_scale="logit_scale"),
    "cohere2": Override("Cohere2ForCausalLM.forward: logits * logit_scale", logit_scale="logit_scale"),
    "gemma2": Override(_SOFTCAP, logit_softcap="final_logit_softcapping"),
    "vaultgemma": Override(_SOFTCAP, logit_softcap="final_logit_softcapping"),
    # Gemma 4 softcaps where the config sets it (released configs do; the class default None: no softcap)
    "gemma4_text": Override(_SOFTCAP, logit_softcap="final_logit_softcapping"),
    "gemma4_unified_text": Override(_SOFTCAP, logit_softcap="final_logit_softcapping"),
    # still refused for AltUp (FORWARD_MATH); its softcap alone would be this entry
    "gemma3n_text": Override(_SOFTCAP, logit_softcap="final_logit_softcapping"),
    # still refused for its hybrid layer kinds and its embedding and logits slice (FORWARD_MATH)
    "inkling2_text": Override(
        "Inkling2ForCausalLM.forward: its logit_softcap module (tanh(logits / c) * c) after the LM head",
        logit_softcap="final_logit_softcapping",
    ),
    "inkling_text": Override(
        "InklingForCausalLM.forward: the final hidden states / logits_mup_width_multiplier before the (bias-free) "
        "LM head, the same as the logits divided",
        logit_divide="logits_mup_width_multiplier",
    ),
    # still refused for the H/L-cycle recurrence (FORWARD_MATH)
    "hrm_text": Override("HrmTextModel.forward: embeddings * embedding_scale", embed_scale="embedding_scale"),
    "granite": Override(
        "GraniteModel.forward: embeddings * embedding_multiplier; GraniteForCausalLM: logits / logits_scaling",
        embed_scale="embedding_multiplier",
        logit_divide="logits_scaling",
    ),
    "nanochat": Override(
        "no base_model_pp_plan: its model norms (weightless RMSNorm) before and after the layers; "
        "CausalLM.forward softcaps the logits",
        pp_plan=("embed_tokens", "norm", "layers", "norm"),
        logit_softcap="final_logit_softcapping",
    ),
    "minicpm3": Override(
        "MiniCPM3ForCausalLM.forward: hidden states / logits_scaling before the (bias-free) LM head",
        logit_divide="logits_scaling",
    ),
    "granite_swa": Override(
        "as granite: embeddings * embedding_multiplier, logits / logits_scaling; its model holds one rotary "
        "module per distinct layer_rope_theta (rotary_embs; 0: NoPE)",
        embed_scale="embedding_multiplier",
        logit_divide="logits_scaling",
        layer_rotary=("rotary_embs", "layer_rope_theta"),
    ),
    "granitemoe": Override(
        "as granite: GraniteMoeModel.forward: embeddings * embedding_multiplier; its CausalLM: logits / logits_scaling",
        embed_scale="embedding_multiplier",
        logit_divide="logits_scaling",
    ),
    "granitemoeshared": Override(
        "as granite: embeddings * embedding_multiplier, logits / logits_scaling",
        embed_scale="embedding_multiplier",
        logit_divide="logits_scaling",
    ),
    "granitemoehybrid": Override(
        "as granite: GraniteMoeHybridModel.forward: embeddings * embedding_multiplier; its CausalLM: logits / "
        "logits_scaling",
        embed_scale="embedding_multiplier",
        logit_divide="logits_scaling",
    ),
    "granitemoe_swa": Override(
        "as granite: embeddings * embedding_multiplier, logits / logits_scaling; no base_model_pp_plan, its "
        "model holds one rotary module per distinct layer_rope_theta (rotary_embs; 0: NoPE) beside the convention",
        embed_scale="embedding_multiplier",
        logit_divide="logits_scaling",
        pp_plan=PP_CONVENTION,
        layer_rotary=("rotary_embs", "layer_rope_theta"),
    ),
    "cohere2_moe": Override("Cohere2MoeForCausalLM.forward: logits * logit_scale", logit_scale="logit_scale"),
    "afmoe": Override(
        "AfmoeModel.forward: embeddings * hidden_size**0.5 when mup_enabled (muP input scaling)",
        embed_sqrt_hidden="mup_enabled",
    ),
    "beam": Override(
        "BeamForCausalLM.forward softcaps the logits; BeamModel.forward passes NoPE (full-attention) layers "
        "attention_scaling=compute_attention_scaling(position_ids)",
        logit_softcap="final_logit_softcapping",
        nope_kwargs=(("attention_scaling", "compute_attention_scaling"),),
    ),
    "minimax": Override(
        "MiniMaxModel.forward: the full-attention layers' mask is the sliding-window one when sliding_window is set",
        window_full_attention="sliding_window",
    ),
    "lfm2_moe": Override(
        "no base_model_pp_plan: its final norm is named embedding_norm (Lfm2MoeModel.forward applies it after the layers)",
        pp_plan=("embed_tokens", "layers", "embedding_norm"),
    ),
    "hy_v4": Override(
        "HYV4Model.forward runs the layers on hc_mult hyper-connection streams ([b, s, hc_mult, h], the "
        "embeddings repeated) and folds them with hc_head before the norm",
        streams=("hc_mult", "hc_head"),
    ),
    "deepseek_v4": Override(
        "DeepseekV4Model.forward runs the layers on hc_mult hyper-connection streams folded by hc_head before "
        "the norm, hands every layer the {'main', 'compress'} rotary pair and input_ids (hash-routed MoE)",
        streams=("hc_mult", "hc_head"),
        rotary_types=("main", "compress"),
        layer_inputs=(("input_ids", "input_ids"),),
    ),
    "glm5_next_text": Override(
        "Glm5NextTextModel.forward runs the layers on hc_mult hyper-connection streams ([b, s, hc_mult, h], the "
        "embeddings repeated) folded by hc_head (a mean) before the norm, hands every layer input_ids and, for both "
        "its layer kinds, the boolean padding mask (all True unpadded; its indexer makes attention causal itself); "
        "its tp plan splits the MLA attention, and its o_proj entry (rowwise) would match the KDA linear attention's "
        "too, whose q/k/v are not split: that attention runs whole",
        streams=("hc_mult", "hc_head"),
        kind_tp_plan=(("linear_attention", (("layers.*.self_attn.o_proj", "replicate"),)),),
        layer_inputs=(("input_ids", "input_ids"),),
        padding_masks=("indexed_attention", "linear_attention"),
    ),
    "qwen4_exp_text": Override(
        "no base_model_pp_plan: Qwen4ExpTextModel.forward repeats the embeddings into hc_count hyper-connection "
        "streams side by side in the hidden dim ([b, s, hc_count·h]), runs the layers on them and folds them with "
        "hyper_connection_mixer (no final norm); every layer takes the causal mask, the linear-attention padding "
        "mask as conv_mask and the token ids as ple_input_ids (its n-gram embeddings)",
        pp_plan=("embed_tokens", "layers"),
        streams=("hc_count", "hyper_connection_mixer"),
        flat_streams=True,
        layer_inputs=(("ple_input_ids", "input_ids"),),
        layer_masks=(("conv_mask", "linear_attention"),),
    ),
    "nemotron_h": Override(
        "no base_model_pp_plan: NemotronHModel.forward runs embeddings -> layers -> norm_f",
        pp_plan=("embeddings", "layers", "norm_f"),
    ),
    "falcon": Override(
        "no base_model_tp_plan or pp_plan: FalconModel is word_embeddings -> h -> ln_f; query_key_value is "
        "fused per K/V group ([H/G query heads, key, value] x G: per head with G = H by default, "
        "new_decoder_architecture's num_kv_heads groups), so a row split gives each rank whole groups; "
        "multi_query's one K/V head (after all query heads) stays whole (mqa_fused_qkv); the decoder "
        "layer takes `alibi` positionally (None: rotary)",
        tp_plan=(
            ("h.*.self_attention.query_key_value", "colwise"),
            ("h.*.self_attention.dense", "rowwise"),
            ("h.*.mlp.dense_h_to_4h", "colwise"),
            ("h.*.mlp.dense_4h_to_h", "rowwise"),
        ),
        tp_plan_when=(
            (
                (("multi_query", True), ("new_decoder_architecture", False)),
                (("h.*.self_attention.query_key_value", MQA_QKV),),
            ),
        ),
        pp_plan=("word_embeddings", "h", "ln_f"),
        layers="h",
        layer_kwargs=(("alibi", None),),
        refused=(
            (
                "alibi",
                "FalconModel.forward adds the ALiBi bias (per head, from the padding mask) to the attention "
                "mask; the transformers backend's stages build plain causal masks",
            ),
        ),
    ),
    "jamba": Override(
        "no base_model_pp_plan: JambaModel.forward applies its final norm, named final_layernorm, after the layers",
        pp_plan=("embed_tokens", "layers", "final_layernorm"),
    ),
    "phi4_multimodal": Override(
        "Phi4MultimodalModel.forward runs embed_tokens_extend (the vision and audio encoders) after the embedding; "
        "with no image or audio input it returns the text embeddings unchanged",
        pp_plan=("embed_tokens", "embed_tokens_extend", "layers", "norm"),
        text_identity=("embed_tokens_extend",),
    ),
    "hyperclovax": Override(
        "HyperCLOVAXModel.forward: embeddings * embedding_multiplier; its CausalLM: logits * logits_scaling (muP)",
        embed_scale="embedding_multiplier",
        logit_scale="logits_scaling",
    ),
}
# config keys that switch on forward-level arithmetic; without an override entry they are refused
FORWARD_KEYS = (
    "logit_scale",
    "logits_scaling",
    "embedding_multiplier",
    "final_logit_softcapping",
    "embedding_scale",
    "mup_enabled",
    "logits_mup_width_multiplier",
)
# the Override fields of the LM head's arithmetic (the class holding the head applies them), and the
# FORWARD_KEYS it reads them from
HEAD_FIELDS = ("logit_scale", "logit_divide", "logit_softcap")
HEAD_KEYS = ("logit_scale", "logits_scaling", "final_logit_softcapping", "logits_mup_width_multiplier")
# model types whose forward does arithmetic no config key announces (gemma's sqrt(hidden) embedding
# scale is its ScaledWordEmbedding module's, which the transformers backend keeps: runtime/transformers/build.py)
FORWARD_MATH: dict[str, str] = {
    "inkling2_text": "Inkling2TextModel.forward stacks the hidden states of every n_layers_per_attn_res_block-th "
    "layer into block_states, which every later layer and final_input (before the norm) read, a stack growing "
    "along the layers that no stage boundary carries; Inkling2ForCausalLM.forward slices the (softcapped) logits "
    "to unpadded_vocab_size, and its embed_tokens is an Inkling2NormedEmbedding (a norm inside the embedding, "
    "not nn.Embedding)",
    "inkling_text": "InklingForCausalLM.forward slices the logits to unpadded_vocab_size where it is set, and its "
    "embed_tokens is an InklingNormedEmbedding (a norm inside the embedding, not nn.Embedding)",
    "doge": "DogeCDMoE.forward views the router logits of all batch x sequence tokens as (2, tokens, -1), mixing "
    "tokens across the batch (transformers' own note), so its outputs depend on the micro-batch split; and its "
    "dt_proj (rowwise) hands every TP rank all kv heads' mask values for its own heads",
    "gemma3n_text": "Gemma3nTextModel.forward: AltUp (the embeddings widened to altup_num_inputs magnitude-matched "
    "copies by altup_projections, that [altup_num_inputs, b, s, h] stack run through the layers, then unembedded by "
    "altup_unembed_projections and averaged before the norm) is arithmetic of the forward around the layers, no "
    "stage piece",
    "diffusion_gemma_text": "DiffusionGemmaForBlockDiffusion is a block-diffusion LM, not a next-token one: an "
    "encoder reads the prompt into a KV cache and a decoder (its own embedding and layers) denoises a canvas of "
    "decoder_input_ids, with self-conditioning on the previous step's logits; its logits are the canvas's, not "
    "the input tokens', and there is no one decoder stack to stage",
    "hrm_text": "HrmTextModel.forward: the H/L-cycle recurrence (L_module and H_module stacks run H_cycles x "
    "L_cycles times on carried states, no one list of decoder layers to stage)",
}


def override(model_type: str) -> Override:
    return OVERRIDES.get(model_type, Override())


def stage_override(text_type: str, vlm_type: str | None = None) -> Override:
    """What the stages redo: the language model's entry, and for a VLM (`vlm_type`, its composite
    model type) the LM-head arithmetic of the VLM's own entry instead (its
    ForConditionalGeneration.forward holds the head, not the text causal LM's: Cohere2-Vision
    does not scale its logits, Mistral-Large-4 softcaps them)."""
    text = override(text_type)
    if vlm_type is None:
        return text
    vlm = override(vlm_type)
    return dataclasses.replace(text, **{f: getattr(vlm, f) for f in HEAD_FIELDS})


def forward_refusals(
    model_type: str, hf: Mapping[str, Any], vlm_type: str | None = None, head_source: str = ""
) -> list[str]:
    """One line per piece of forward arithmetic the transformers backend would drop for this config
    (`hf`: the language model's config.json part). A VLM's head keys (`HEAD_KEYS`) count only where
    its class's forward (`head_source`) reads them."""
    out = []
    if model_type in FORWARD_MATH:
        out.append(
            f"{FORWARD_MATH[model_type]} (backends/transformers/overrides.py FORWARD_MATH: no Override field rebuilds it)"
        )
    handled = stage_override(model_type, vlm_type).handled()
    out += [
        f"{key}=True: {why} (backends/transformers/overrides.py OVERRIDES)"
        for key, why in override(model_type).refused
        if hf.get(key)
    ]
    for key in FORWARD_KEYS:
        v = hf.get(key)
        if vlm_type is not None and key in HEAD_KEYS and key not in head_source:
            continue  # the text causal LM's head arithmetic: the VLM's own head does not do it
        if key not in handled and (v is True or v not in (None, 0, 1, 1.0, False)):  # a flag, or a constant
            out.append(
                f"{key}={v!r} is applied in the model's forward (no entry in backends/transformers/overrides.py OVERRIDES)"
            )
    return out


__all__ = [
    "FORWARD",
    "FORWARD_KEYS",
    "FORWARD_MATH",
    "HEAD_FIELDS",
    "HEAD_KEYS",
    "MQA_QKV",
    "OVERRIDES",
    "PP_CONVENTION",
    "Override",
    "forward_refusals",
    "override",
    "stage_override",
]
