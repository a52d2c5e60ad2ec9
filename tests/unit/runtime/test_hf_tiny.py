"""The catalogue of tiny HF architectures (megatron_bridge/runtime/hf_tiny.py): a handful built, run
forward and backward with transformers alone, saved and loaded back; their constant weights perturbed."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_bridge.runtime import hf_tiny

# dense; MoE; MoE with sliding/full layer kinds; linear attention + MoE + layer kinds; per-head qk norm; MLA
SAMPLE = ["llama", "qwen3_moe", "gemma3_text", "qwen3_next", "cohere", "deepseek_v3"]


def _ids(cfg, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(seed))


def test_architectures_come_from_the_library_and_all_have_a_tp_plan():
    archs = hf_tiny.architectures()
    assert archs == sorted(archs) and len(archs) >= 90
    assert {"llama", "cohere", "gpt_neox", "starcoder2", "phi", "qwen3_next", "llama4_text", "deepseek_v32"} <= set(
        archs
    )
    from megatron_bridge.backends.transformers.plan import override

    # a tp plan of transformers' own, or the transformers backend's override for a model type without one (Falcon)
    assert all(hf_tiny.config_class(a).base_model_tp_plan or override(hf_tiny.model_type_of(a)).tp_plan for a in archs)
    assert {"falcon", "falcon_new_decoder", "falcon_rw"} <= set(archs)


def test_a_variant_is_its_model_type_with_its_own_fields():
    assert hf_tiny.model_type_of("falcon_new_decoder") == "falcon" and hf_tiny.model_type_of("llama") == "llama"
    default, grouped = hf_tiny.tiny_config("falcon"), hf_tiny.tiny_config("falcon_new_decoder")
    assert default.multi_query and not default.new_decoder_architecture and default.bias
    assert grouped.new_decoder_architecture and grouped.num_kv_heads == 2 and grouped.bias
    for name, (model_type, reason, fields) in hf_tiny.VARIANTS.items():
        assert model_type in hf_tiny.architectures() and reason and "\n" not in reason and fields, name


def test_every_override_names_an_architecture_and_says_why_in_one_line():
    archs = set(hf_tiny.architectures())
    for model_type, (reason, fields) in hf_tiny.OVERRIDES.items():
        assert model_type in archs, model_type
        assert reason and "\n" not in reason and fields, model_type


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "gemma3_text", "qwen3_next"])
def test_tiny_config_is_tiny_and_has_its_features_on(model_type):
    cfg = hf_tiny.tiny_config(model_type)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (96, 4, 256)
    assert cfg.num_attention_heads % 2 == 0 and cfg.num_key_value_heads >= 2
    if model_type in ("qwen3_moe", "qwen3_next"):
        assert cfg.num_experts >= 4 and cfg.num_experts_per_tok == 2
    if model_type == "gemma3_text":
        assert set(cfg.layer_types) == {"sliding_attention", "full_attention"} and cfg.sliding_window == 8
    if model_type == "qwen3_next":
        assert set(cfg.layer_types) == {"linear_attention", "full_attention"}


def test_a_size_the_rule_missed_is_refused_before_any_weight_exists():
    with pytest.raises(ValueError, match="a size field is not tiny"):
        hf_tiny.build_tiny("llama", hidden_size=4096, intermediate_size=16384)


@pytest.mark.parametrize("model_type", SAMPLE)
def test_tiny_model_runs_and_its_constant_weights_are_perturbed(model_type, tmp_path):
    model = hf_tiny.build_tiny(model_type)
    named = dict(model.named_parameters())
    norms = [n for n in named if "norm" in n and n.endswith("weight")]
    biases = [n for n in named if n.endswith("bias")]
    assert norms, model_type
    for n in norms:
        assert not (named[n] == 1).any() and not (named[n] == 0).any(), n
    for n in biases:
        assert not (named[n] == 0).any(), n
    persistent = set(model.state_dict())
    for n, b in model.named_buffers():  # routing-correction biases are weights too
        if n in persistent and b.is_floating_point() and b.numel() > 1:
            assert b.unique().numel() > 1, n

    cfg = model.config
    ids = _ids(cfg)
    out = model(input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    no_grad = [n for n, p in named.items() if p.grad is None]
    assert not no_grad, no_grad
    assert all(torch.isfinite(p.grad).all() for p in named.values())

    if model_type in ("qwen3_moe", "gemma3_text"):  # the saved model loads back with equal logits
        model.eval()
        with torch.no_grad():
            want = model(input_ids=ids).logits
        model.save_pretrained(tmp_path)
        back = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
        with torch.no_grad():
            assert torch.equal(back(input_ids=ids).logits, want)


def test_make_tiny_is_deterministic(tmp_path):
    a = hf_tiny.make_tiny("qwen3_moe", tmp_path / "a", seed=3)
    b = hf_tiny.make_tiny("qwen3_moe", tmp_path / "b", seed=3)
    assert (a / "config.json").exists()
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_an_infinite_constant_becomes_a_finite_bound_of_its_sign():
    """Gemma 4's clipped linears start at ±inf (no bound yet); c·(1 + noise) of an infinity is NaN
    for every negative draw, which `mbr convert` refuses. A released checkpoint's bounds are finite."""
    clip = torch.nn.Module()
    clip.register_buffer("input_max", torch.full((3,), float("inf")))
    clip.register_buffer("input_min", torch.tensor(float("-inf")))
    assert hf_tiny.perturb_constants_(clip) == ["input_max", "input_min"]
    assert torch.isfinite(clip.input_max).all() and (clip.input_max > 50).all()
    assert torch.isfinite(clip.input_min) and clip.input_min < -50
    model = hf_tiny.build_tiny("gemma4", image_text=True)
    bounds = {n: b for n, b in model.state_dict().items() if n.endswith(("_min", "_max"))}
    assert bounds and all(torch.isfinite(b).all() for b in bounds.values())
