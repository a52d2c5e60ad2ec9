"""Stage pieces from the override table (backends/transformers/overrides.py OVERRIDES) for base models that are
not transformers' convention: Jamba's final norm under another name, Phi-4-multimodal's
multimodal embedding kept but not run for text, Granite-MoE-SWA's rotary module per layer theta.
Read off the meta model in process; the numbers at tp2 / pp2 / ep2 are the matrix's."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from megatron_bridge.backends.transformers.meta import model_plan
from megatron_bridge.backends.transformers.plan import override
from megatron_bridge.runtime.hf_tiny import tiny_config


def _plan(model_type: str):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    return model, model_plan(model)


def test_jamba_stages_its_final_layernorm():
    _, plan = _plan("jamba")
    assert (plan.embed, plan.pre, plan.layers, plan.post) == (
        "model.embed_tokens",
        (),
        "model.layers",
        ("model.final_layernorm",),
    )


def test_phi4_multimodal_keeps_its_multimodal_embedding_on_the_first_stage_without_running_it():
    model, plan = _plan("phi4_multimodal")
    assert plan.pre == ("model.embed_tokens_extend",) and plan.post == ("model.norm",)
    assert override("phi4_multimodal").text_identity == ("embed_tokens_extend",)
    # what makes skipping it right: for input ids alone it returns the embeddings it was given
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(tiny_config("phi4_multimodal"))
    ids = torch.randint(0, 200, (1, 6))
    emb = model.model.embed_tokens(ids)
    assert torch.equal(model.model.embed_tokens_extend(ids, emb), emb)


def test_granitemoe_swa_has_a_rotary_module_per_distinct_theta_and_nope_layers():
    model, plan = _plan("granitemoe_swa")
    assert plan.layers == "model.layers" and plan.post == ("model.norm",)
    name, key = override("granitemoe_swa").layer_rotary or ("", "")
    thetas = getattr(model.config, key)
    rotaries = getattr(model.model, name)
    # the chunk's rule (runtime/transformers/chunk.py rotary_of): the i-th distinct non-zero theta, ascending
    distinct = sorted({t for t in thetas if t})
    assert 0 in thetas and len(distinct) == len(rotaries) == 2
    assert [r.config.rope_parameters["rope_theta"] for r in rotaries] == distinct


def test_muse_layers_whose_theta_is_zero_are_the_ones_its_forward_gives_no_rotary():
    """`nope_layers` (runtime/transformers/chunk.py): the layers whose `layer_rope_theta` is 0 are
    called with position_embeddings=None, as MuseGlimmerTextModel.forward calls them (hooked here)."""
    from transformers import AutoModel

    key = override("muse_glimmer_text").nope_layers
    assert key == override("muse_spark_text").nope_layers == "layer_rope_theta"
    cfg = tiny_config("muse_glimmer").text_config
    model = AutoModel.from_config(cfg)
    given: dict[int, bool] = {}
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(
            lambda _m, _a, kw, i=i: given.__setitem__(i, kw.get("position_embeddings") is None), with_kwargs=True
        )
    model(input_ids=torch.randint(0, cfg.vocab_size, (1, 6)))
    zeros = {i for i, t in enumerate(getattr(cfg, key)) if not t}
    assert zeros and {i for i, none in given.items() if none} == zeros and len(given) == cfg.num_hidden_layers


def test_a_kind_masked_by_the_model_s_own_function_gets_the_mask_its_forward_gives():
    """`kind_masks`: Unlimited-OCR's reference_sliding_attention layers take what its module's
    create_reference_sliding_window_causal_mask returns, called as the stages call MASKS (no cache,
    no padding mask, the positions): the mask UnlimitedOcrTextModel.forward hands them (hooked here)."""
    import sys

    from transformers.models.unlimited_ocr import modeling_unlimited_ocr

    from megatron_bridge.backends.transformers.plan import LAYER_KINDS

    ((kind, fn),) = override("unlimited_ocr_text").kind_masks
    cfg = tiny_config("unlimited_ocr").text_config
    model = modeling_unlimited_ocr.UnlimitedOcrTextModel(cfg)
    assert kind not in LAYER_KINDS and set(cfg.layer_types) == {kind}
    given: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(
            lambda _m, _a, kw, i=i: given.__setitem__(i, kw["attention_mask"]), with_kwargs=True
        )
    s = 2 * cfg.sliding_window + 3  # past the window
    embeds = torch.zeros(1, s, cfg.hidden_size)
    model(inputs_embeds=embeds)
    positions = torch.arange(s).unsqueeze(0)
    mask = getattr(sys.modules[type(model).__module__], fn)(
        config=cfg, inputs_embeds=embeds, attention_mask=None, past_key_values=None, position_ids=positions
    )
    assert len(given) == cfg.num_hidden_layers and all(torch.equal(m, mask) for m in given.values())
    window = modeling_unlimited_ocr.create_sliding_window_causal_mask(
        config=cfg, inputs_embeds=embeds, attention_mask=None, past_key_values=None, position_ids=positions
    )
    assert not torch.equal(mask, window)  # not the plain sliding-window mask: the prefill tokens stay visible
