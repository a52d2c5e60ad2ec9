"""The transformers backend's core half: which backend describes a config, what the transformers backend refuses
(one line per missing piece), its weight table (transformers' checkpoint names, how each
tensor splits over TP) and its exact parameter count — all without building a model."""

from __future__ import annotations

import json

import pytest

from megatron_bridge.backends.describe import describe, describe_hf
from megatron_bridge.backends.registry import BACKENDS, backend_of
from megatron_bridge.backends.transformers.backend import meta
from megatron_bridge.backends.transformers.plan import (
    COLUMN,
    GRAD_ALLREDUCE,
    HEAD,
    REPLICATED,
    ROW,
    VOCAB,
    WHOLE_ATTENTION,
    sp_whole,
)
from megatron_bridge.bridge.hf_config import UnsupportedFeatures
from megatron_bridge.bridge.tiny import HF_TINY
from megatron_bridge.config.compose import compose
from megatron_bridge.errors import LayoutError


def _config(family: str, **overrides) -> dict:
    from megatron_bridge.runtime.tiny import tiny_config

    cfg = tiny_config(family, **overrides)
    out = cfg.to_dict()
    out["architectures"] = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    return out


def _hf(model_type: str, **kw) -> dict:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return {**CONFIG_MAPPING[model_type](**kw).to_dict(), "model_type": model_type}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every HF_TINY model (and llama) saved by transformers: the checkpoint the table must name."""
    from megatron_bridge.runtime.tiny import make_tiny

    root = tmp_path_factory.mktemp("hf_tiny")
    return {f: make_tiny(f, root / f) for f in [*HF_TINY, "llama"]}


def test_auto_takes_the_native_family_where_one_exists_else_hf(capsys):
    assert describe_hf(_config("llama")).backend == "native"
    spec = describe_hf(_config("cohere"))
    assert (spec.backend, spec.family, spec.architecture) == ("transformers", "cohere", "CohereForCausalLM")
    describe_hf(_config("cohere"))
    assert capsys.readouterr().err.count("has no native family; using the transformers backend") <= 1  # said once


@pytest.mark.parametrize("family", list(HF_TINY))
def test_every_sample_architecture_is_described_by_the_hf_backend(family):
    hf = _config(family)
    native = BACKENDS["native"].handles(hf)
    assert native == (family == "qwen3_swa")  # the others have no native family: auto runs them on hf
    spec = describe_hf(hf, make_vocab_size_divisible_by=8, backend="transformers")
    assert spec.backend == "transformers" and backend_of(spec) is BACKENDS["transformers"]
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size) == (4, 32, 250)
    assert spec.num_query_groups == (4 if family == "gpt_neox" else 2)
    assert backend_of(spec).hf_config(spec) == json.loads(json.dumps(hf))  # what export writes back
    assert hash(spec) == hash(
        describe_hf(hf, make_vocab_size_divisible_by=8, backend="transformers")
    )  # frozen, hashable


def test_model_backend_forces_one(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_config("llama")))
    cfg, _ = compose(["recipe=tiny_llama", f"model.hf_path={tmp_path}", "model.backend=transformers"])
    spec = describe(cfg.model)
    assert spec.backend == "transformers" and spec.family == "llama" and spec.source == str(tmp_path)
    assert backend_of(spec).family_of(spec) is None  # no native family declarations
    cfg.model.backend = "native"
    assert describe(cfg.model).backend == "native"
    cfg.model.backend = "hf"  # another spelling of transformers
    assert describe(cfg.model) == spec


def test_native_refuses_an_architecture_without_a_family_naming_what_is_missing(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_config("cohere")))
    cfg, _ = compose(["recipe=tiny_llama", f"model.hf_path={tmp_path}", "model.backend=native"])
    with pytest.raises(LayoutError) as e:
        describe(cfg.model)
    msg = str(e.value)
    assert [v.rule for v in e.value.violations] == ["hf-model"]
    assert "has no native family" in msg and "model.backend=transformers runs it" in msg
    assert "MistralForCausalLM" not in msg  # not a list of every supported architecture


@pytest.mark.parametrize(
    "overrides,rule",
    [(["model.backend=megatron"], "model-backend"), (["model.backend=transformers"], "model-backend")],
)
def test_a_backend_that_cannot_describe_the_model_is_refused_by_a_named_rule(overrides, rule):
    cfg, _ = compose(["recipe=tiny_llama", *overrides])
    with pytest.raises(LayoutError) as e:
        describe(cfg.model)
    assert [v.rule for v in e.value.violations] == [rule]


@pytest.mark.parametrize(
    "model_type,kw,needle",
    [
        ("bloom", {}, "no base_model_tp_plan"),
        ("falcon", {"alibi": True}, "alibi=True: FalconModel.forward adds the ALiBi bias"),
        ("inkling_text", {}, "layer kind 'hybrid_sliding'"),
        ("gemma3n_text", {}, "AltUp (the embeddings widened to altup_num_inputs"),
        ("hrm_text", {}, "H/L-cycle recurrence"),
        ("llama", {"logits_mup_width_multiplier": 24.0}, "logits_mup_width_multiplier=24.0 is applied"),
    ],
)
def test_the_hf_backend_refuses_what_it_cannot_do_yet_one_line_each(model_type, kw, needle):
    with pytest.raises(UnsupportedFeatures) as e:
        describe_hf(_hf(model_type, **kw), backend="transformers")
    assert needle in str(e.value)
    assert "Traceback" not in str(e.value)


def test_an_architecture_no_backend_handles_is_refused_saying_why():
    with pytest.raises(UnsupportedFeatures) as e:
        describe_hf({"model_type": "not_a_model", "architectures": ["NotAModelForCausalLM"]})
    assert "no native family" in str(e.value) and "transformers has no causal-LM class" in str(e.value)


def test_tensor_kinds_follow_the_plan_and_the_shapes():
    k = {f: meta(describe_hf(_config(f), backend="transformers")).kinds for f in HF_TINY}
    L = "model.layers.1"
    assert k["cohere"][f"{L}.self_attn.q_proj.weight"] == COLUMN
    assert k["cohere"][f"{L}.self_attn.o_proj.weight"] == ROW
    assert k["cohere"][f"{L}.self_attn.q_norm.weight"] == HEAD  # [heads, head_dim], not in the plan
    assert k["cohere"][f"{L}.self_attn.k_norm.weight"] == HEAD
    assert k["cohere"]["model.embed_tokens.weight"] == VOCAB
    assert k["qwen3_swa"][f"{L}.self_attn.q_norm.weight"] == GRAD_ALLREDUCE  # the plan says so
    assert k["phi"][f"{L}.self_attn.q_layernorm.weight"] == GRAD_ALLREDUCE  # unplanned, next to split q_proj
    assert k["phi"]["lm_head.bias"] == VOCAB
    assert k["olmo3"][f"{L}.self_attn.q_norm.weight"] == REPLICATED  # q/k/v gathered: nothing is split
    assert k["olmo3"][f"{L}.self_attn.q_proj.weight"] == COLUMN
    assert k["olmo3"][f"{L}.self_attn.o_proj.weight"] == ROW
    assert k["gpt_neox"]["gpt_neox.layers.1.attention.query_key_value.bias"] == COLUMN
    assert k["gpt_neox"]["gpt_neox.layers.1.attention.dense.bias"] == REPLICATED
    assert k["starcoder2"][f"{L}.mlp.c_proj.bias"] == REPLICATED


@pytest.mark.parametrize("family", [*HF_TINY, "llama"])
def test_the_table_names_every_checkpoint_tensor_and_the_count_is_transformers(family, saved):
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_bridge.bridge.hf_config import read_hf_config
    from megatron_bridge.bridge.loader import HFCheckpoint, resolve_checkpoint

    spec = describe_hf(read_hf_config(saved[family]), backend="transformers")
    with HFCheckpoint(saved[family]) as ck:
        rows = resolve_checkpoint(spec, ck.keys())  # raises on a tensor no row names
        assert {h for r in rows for h in r.hf} == set(ck.keys())
    model = AutoModelForCausalLM.from_pretrained(saved[family], dtype=torch.float32)
    c = backend_of(spec).count(spec)
    assert c.total == c.active == sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    assert c.embedding == (emb if spec.tie_word_embeddings else emb + model.get_output_embeddings().weight.numel()) + (
        0 if model.get_output_embeddings().bias is None else model.get_output_embeddings().bias.numel()
    )
    if family == "gpt_neox":  # transformers saves GPT-NeoX's lm_head as embed_out
        assert any(r.hf == ("embed_out.weight",) and r.megatron == "lm_head.weight" for r in rows)


def test_the_backend_layout_rule_refuses_what_the_hf_backend_cannot_split(tmp_path):
    from megatron_bridge.parallel.dims import ParallelDims
    from megatron_bridge.parallel.rules.registry import validate

    (tmp_path / "config.json").write_text(json.dumps(_config("cohere", num_key_value_heads=1)))
    cfg, _ = compose(["recipe=tiny_llama", f"model.hf_path={tmp_path}", "train.seq_length=32"])
    spec = describe(cfg.model)
    with pytest.raises(LayoutError) as e:
        validate(cfg, spec, dims=ParallelDims.parse("cp2tp2").with_world(4), layout_only=True)
    found = [v for v in e.value.violations if v.rule == "backend-layout"]
    assert len(found) == 1 and "whole KV heads" in str(e.value)  # cp itself runs (runtime/transformers/cp.py)
    validate(cfg, describe(cfg.model), dims=ParallelDims.parse("pp2").with_world(2), layout_only=True)
    validate(cfg, describe(cfg.model), dims=ParallelDims.parse("cp2").with_world(2), layout_only=True)


def test_layer_kinds_that_cannot_run_under_cp_are_refused_by_kind():
    """Full and sliding attention run under CP (K/V gathered, masks from global positions);
    any other layer kind is refused at cp > 1 naming the kind and its layers, once per kind."""
    from megatron_bridge.backends.transformers.plan import cp_refusals

    kinds = ["linear_attention", "full_attention", "linear_attention", "sliding_attention", "conv"]
    out = cp_refusals(kinds, 2)
    assert [w.split(" (")[0] for w, _ in out] == ["layer kind 'linear_attention'", "layer kind 'conv'"]
    assert "(layers 0, 2)" in out[0][0] and "cp=2" in out[0][0] and out[0][1] == "set cp=1"
    assert cp_refusals(["full_attention", "sliding_attention"], 2) == cp_refusals(None, 2) == []


def test_what_the_hf_backend_cannot_train_yet_is_refused(tmp_path, saved):
    """A plain training run of a transformers-backend model passes every rule; what it cannot do yet is
    refused before anything starts (`backend-run`, what `mbr check` and the trainer apply):
    selective recomputation (full recomputation trains). Packed and padded SFT data train. LoRA is allowed, its targets checked against the backend's table
    (transformers' module names)."""
    from megatron_bridge.parallel.rules.registry import validate

    cohere = saved["cohere"]
    base = ["recipe=tiny_llama", f"model.hf_path={cohere}", "parallel.tp=1", "parallel.pp=1"]
    cfg, _ = compose(base)
    spec = describe(cfg.model)
    validate(cfg, spec, world_size=1)  # trains
    validate(compose([*base, "train.recompute=full"])[0], spec, world_size=1)  # each layer recomputed
    cfg, _ = compose([*base, "peft=lora", "train.recompute=selective"])
    with pytest.raises(LayoutError) as e:
        validate(cfg, spec, world_size=1)
    assert [v.rule for v in e.value.violations] == ["backend-run"], str(e.value)
    assert "train.recompute=selective" in str(e.value) and "train.recompute=full" in str(e.value)
    cfg, _ = compose([*base, "peft=lora", "peft.target_modules=[qkv_proj]"])
    with pytest.raises(LayoutError) as e:
        validate(cfg, spec, world_size=1)
    assert [v.rule for v in e.value.violations] == ["lora-targets"], str(e.value)
    assert "cohere family" in str(e.value) and "q_proj" in str(e.value)
    sft = [*base, "data=sft", f"data.paths=[{tmp_path / 'chat'}]"]
    for packing in ("true", "false"):  # packed (the default) and padded SFT train
        cfg, _ = compose([*sft, f"data.packing={packing}"])
        validate(cfg, spec, world_size=1)


def test_packed_samples_are_refused_where_a_row_would_mix_its_conversations():
    """Packed SFT rows keep each conversation to itself through the restarting position ids, which
    transformers' mask functions read; a layer kind carrying state along the row, or a VLM deriving
    its positions from the images (M-RoPE), is refused naming why and the fix."""
    from megatron_bridge.backends.transformers.plan import packing_refusals

    assert packing_refusals(None) == packing_refusals(["full_attention", "sliding_attention", "moe"]) == []
    out = packing_refusals(["linear_attention", "full_attention", "linear_attention", "conv"])
    assert [w.split(" (")[0] for w in out] == ["layer kind 'linear_attention'", "layer kind 'conv'"]
    assert "(layers 0, 2)" in out[0] and "from one packed conversation into the next" in out[0]
    assert "M-RoPE" in packing_refusals(None, "get_rope_index")[0]


def test_every_override_entry_is_an_architecture_the_hf_backend_now_describes():
    """overrides.OVERRIDES: each entry names a tp-planned causal LM, says why, and lifts its
    refusal (the matrix, `mbr verify --matrix model.backend=transformers`, checks the numbers)."""
    from megatron_bridge.backends.transformers.plan import OVERRIDES
    from megatron_bridge.runtime.hf_tiny import architectures, tiny_config, vlm_architectures

    known = set(architectures())
    for model_type, entry in OVERRIDES.items():
        assert entry.reason, model_type
        if model_type not in known:  # a VLM or its language model (the VLM matrix describes them, docs/vlm.md)
            assert model_type in _vlm_text_types() | set(vlm_architectures()), model_type
            continue
        hf = {**tiny_config(model_type).to_dict(), "model_type": model_type}
        if model_type in STILL_REFUSED:
            continue  # test_an_entry_leaves_a_refused_model_only_its_named_blocker
        assert describe_hf(hf, make_vocab_size_divisible_by=8, backend="transformers").backend == "transformers"


def _vlm_text_types() -> set[str]:
    """The language models' model types of transformers' image-text-to-text configs."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    out = set()
    for mt in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        text = (getattr(CONFIG_MAPPING[mt], "sub_configs", None) or {}).get("text_config")
        if isinstance(text, type) and getattr(text, "model_type", None):
            out.add(text.model_type)
    return out


# model types with an OVERRIDES entry for their logit / embedding arithmetic that stay refused for
# another piece of their forward, each named: {model type: what the one refusal left names}
STILL_REFUSED = {
    "gemma3n_text": ["AltUp"],
    "hrm_text": ["H/L-cycle recurrence"],
    "inkling2_text": ["layer kind 'hybrid_sliding'", "layer kind 'hybrid'", "stacks the hidden states"],
    "inkling_text": ["layer kind 'hybrid_sliding'", "layer kind 'hybrid'", "slices the logits to unpadded"],
}


@pytest.mark.parametrize("model_type", sorted(STILL_REFUSED))
def test_an_entry_leaves_a_refused_model_only_its_named_blocker(model_type):
    """The tiny config sets the constants the entry handles (a softcap, an embedding scale, a logit
    divisor), and none of them is refused any more: what is left is the named piece, one line each."""
    from megatron_bridge.backends.transformers.plan import override
    from megatron_bridge.runtime.hf_tiny import tiny_config

    cfg = tiny_config(model_type)
    assert override(model_type).constants(cfg), model_type  # the entry has a constant to apply
    with pytest.raises(UnsupportedFeatures) as e:
        describe_hf({**cfg.to_dict(), "model_type": model_type}, backend="transformers")
    lines = [ln for ln in str(e.value).splitlines() if ln.startswith("  - ")]
    assert len(lines) == len(STILL_REFUSED[model_type]), lines
    for line, needle in zip(lines, STILL_REFUSED[model_type], strict=True):
        assert needle in line and "is applied in the model's forward" not in line, line


def test_override_constants_are_read_off_the_config_and_an_unhandled_flag_is_refused():
    """afmoe's muP flag becomes the chunk's embedding scale sqrt(hidden_size) (off: none); Granite-MoE's
    constants are its config's; the same flag on a model type without an entry is a refusal line."""
    from types import SimpleNamespace

    from megatron_bridge.backends.transformers.plan import forward_refusals, override

    on = SimpleNamespace(mup_enabled=True, hidden_size=96)
    assert override("afmoe").constants(on) == {"embed_scale": 96**0.5}
    assert override("afmoe").constants(SimpleNamespace(mup_enabled=False, hidden_size=96)) == {}
    granite = SimpleNamespace(embedding_multiplier=4.0, logits_scaling=2.0)
    for model_type in ("granitemoe", "granitemoehybrid"):
        assert override(model_type).constants(granite) == {"embed_scale": 4.0, "logit_divide": 2.0}, model_type
    assert forward_refusals("granitemoehybrid", {"embedding_multiplier": 4.0, "logits_scaling": 2.0}) == []
    assert forward_refusals("afmoe", {"mup_enabled": True}) == []
    assert forward_refusals("llama", {"mup_enabled": True}) == [
        "mup_enabled=True is applied in the model's forward (no entry in backends/transformers/overrides.py OVERRIDES)"
    ]
    assert forward_refusals("llama", {"mup_enabled": False}) == []


def test_a_model_without_a_pp_plan_is_staged_by_the_convention_or_refused_naming_why():
    """No base_model_pp_plan (Nemotron): transformers' convention embed_tokens -> layers -> norm,
    checked against the base model's children; any other module is a named refusal."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_bridge.backends.transformers.backend import model_plan
    from megatron_bridge.runtime.hf_tiny import tiny_config

    cfg = tiny_config("nemotron")
    assert not cfg.base_model_pp_plan
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    plan = model_plan(model)
    assert (plan.embed, plan.pre, plan.layers, plan.post) == ("model.embed_tokens", (), "model.layers", ("model.norm",))
    model.model.add_module("extra_embed", torch.nn.Embedding(4, 4, device="meta"))
    with pytest.raises(UnsupportedFeatures, match="other modules: extra_embed"):
        model_plan(model)


def test_mla_keeps_the_latent_path_whole_and_splits_the_up_projections():
    """`mla_kv_a_proj` (MiniCPM3): the kv down-projection and the latent path beside it (q
    down-projection, latent norms) are whole with whole gradients (`replicated`, not summed:
    the column-parallel up-projections after them already sum their input gradient)."""
    from megatron_bridge.runtime.hf_tiny import tiny_config

    hf = {**tiny_config("minicpm3").to_dict(), "model_type": "minicpm3"}
    k = meta(describe_hf(hf, make_vocab_size_divisible_by=8, backend="transformers")).kinds
    a = "model.layers.1.self_attn"
    latent = ("kv_a_proj_with_mqa", "q_a_proj", "q_a_layernorm", "kv_a_layernorm")
    assert {k[f"{a}.{m}.weight"] for m in latent} == {REPLICATED}
    assert k[f"{a}.q_b_proj.weight"] == k[f"{a}.kv_b_proj.weight"] == COLUMN
    assert k[f"{a}.o_proj.weight"] == ROW


def test_linear_attention_runs_whole_its_projections_gathered_its_state_tensors_replicated(tmp_path):
    """Qwen3.5's gated DeltaNet: transformers' plan gathers every projection's output
    (`colwise_gather_output`), so the mixer runs whole on every TP rank; its conv1d, A_log,
    dt_bias and gated norm (per-value-head sized, but unplanned and beside no split linear) stay
    whole (`replicated`), never split by head. Under CP the recurrent layers are refused by kind."""
    from megatron_bridge.parallel.dims import ParallelDims
    from megatron_bridge.parallel.rules.registry import validate
    from megatron_bridge.runtime.hf_tiny import tiny_config

    hf = {**tiny_config("qwen3_5_text").to_dict(), "model_type": "qwen3_5_text"}
    k = meta(describe_hf(hf, make_vocab_size_divisible_by=8, backend="transformers")).kinds
    a = "model.layers.0.linear_attn"
    assert {k[f"{a}.{m}.weight"] for m in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")} == {
        COLUMN
    }
    assert {k[f"{a}.{t}"] for t in ("conv1d.weight", "A_log", "dt_bias", "norm.weight")} == {REPLICATED}
    assert k["model.layers.3.self_attn.q_proj.weight"] == COLUMN  # the full-attention layer splits by head

    (tmp_path / "config.json").write_text(json.dumps({**hf, "architectures": ["Qwen3_5ForCausalLM"]}))
    cfg, _ = compose(
        ["recipe=tiny_llama", f"model.hf_path={tmp_path}", "train.seq_length=32", "model.backend=transformers"]
    )
    with pytest.raises(LayoutError) as e:
        validate(cfg, describe(cfg.model), dims=ParallelDims.parse("cp2").with_world(2), layout_only=True)
    assert "layer kind 'linear_attention' (layers 0, 2) cannot run under context parallelism" in str(e.value)
    assert "it carries a state along the sequence" in str(e.value)


def test_llama4_composite_config_runs_its_text_model_with_chunked_attention_layers():
    """llama4's composite config (text_config inside) describes the text causal LM, as
    AutoModelForCausalLM.from_config builds it; Llama4ForCausalLM's base model is `model`
    (its class says `language_model`); its chunked-attention layers have a mask function."""
    from megatron_bridge.backends.transformers.plan import LAYER_KINDS
    from megatron_bridge.runtime.hf_tiny import tiny_config
    from megatron_bridge.runtime.transformers.chunk import MASKS

    assert set(MASKS) == set(LAYER_KINDS)
    composite = {**tiny_config("llama4").to_dict(), "model_type": "llama4"}
    spec = describe_hf(composite, make_vocab_size_divisible_by=8, backend="transformers")
    text = describe_hf({**tiny_config("llama4_text").to_dict(), "model_type": "llama4_text"}, backend="transformers")
    assert (spec.architecture, spec.num_layers, spec.hidden_size) == ("Llama4ForCausalLM", 4, text.hidden_size)
    assert spec.num_moe_experts == text.num_moe_experts and spec.num_moe_experts
    m = meta(spec)
    assert (m.plan.embed, m.plan.layers) == ("model.embed_tokens", "model.layers")
    assert any(n.endswith("feed_forward.experts.gate_up_proj") for n in m.shapes)


def test_sequence_parallelism_runs_every_plan_inside_the_layers():
    """colwise/rowwise plans run with the sequence split; a gathered output or a split input
    (OLMo-3's attention) is no longer refused under SP: that attention runs whole
    (plan.sp_whole, tests/unit/backends/test_transformers_sp.py); verify's gradient check of an MoE
    model at tp > 1 turns SP on where the backend runs it."""
    from megatron_bridge.parallel.dims import ParallelDims
    from megatron_bridge.runtime.parity import training_layout

    sp = ParallelDims.parse("tp2sp")
    qwen3 = describe_hf(_config("qwen3"), make_vocab_size_divisible_by=8, backend="transformers")
    assert backend_of(qwen3).layout_limits(qwen3, sp) == []
    assert sp_whole(meta(qwen3).plan, "full_attention") is None
    olmo3 = describe_hf(_config("olmo3"), make_vocab_size_divisible_by=8, backend="transformers")
    assert backend_of(olmo3).layout_limits(olmo3, sp) == []
    assert sp_whole(meta(olmo3).plan, "full_attention") == WHOLE_ATTENTION
    moe = describe_hf(_config("qwen3_moe"), make_vocab_size_divisible_by=8, backend="transformers")
    assert training_layout(moe, ParallelDims.parse("ep2tp2")).sequence_parallel


def test_every_catalogue_architecture_is_described_or_refused_by_name():
    """describe() of every tiny config of the matrix's catalogue gives a description or an
    UnsupportedFeatures naming what is missing, never another exception (a per-layer config
    refuses a global read of a per-layer key: such a key is not one of the description's)."""
    from megatron_bridge.runtime.hf_tiny import architectures, tiny_config

    described = 0
    for arch in architectures():
        try:
            spec = describe_hf(tiny_config(arch).to_dict(), make_vocab_size_divisible_by=8, backend="transformers")
        except UnsupportedFeatures:
            continue
        assert spec.backend == "transformers" and spec.num_layers > 0, arch
        described += 1
    assert described >= 90


def test_layer_kinds_are_derived_once_from_the_config_and_what_the_base_model_builds():
    """Each layer's kind: `layer_types` where the config has them; else sliding or full attention
    from `sliding_window`, only where the base model's source builds sliding masks at all (Qwen3-Omni's
    thinker keeps a `sliding_window` its forward never reads); the refusals and the stages read them."""
    from transformers import MistralConfig
    from transformers.models.mistral.modeling_mistral import MistralModel
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextModel

    from megatron_bridge.backends.transformers.kinds import builds_windows, layer_kinds
    from megatron_bridge.runtime.hf_tiny import tiny_config

    assert builds_windows(MistralModel) and not builds_windows(Qwen3OmniMoeThinkerTextModel)
    windowed = MistralConfig(sliding_window=16, num_hidden_layers=3)
    assert layer_kinds(windowed, 3, True) == ("sliding_attention",) * 3
    assert layer_kinds(windowed, 3, False) == ("full_attention",) * 3
    assert layer_kinds(MistralConfig(sliding_window=None), 2, True) == ("full_attention",) * 2
    spec = describe_hf(
        {**tiny_config("gemma3_text").to_dict(), "model_type": "gemma3_text"},
        make_vocab_size_divisible_by=8,
        backend="transformers",
    )
    m = meta(spec)
    assert m.layer_kinds == tuple(tiny_config("gemma3_text").layer_types) and "sliding_attention" in m.layer_kinds
