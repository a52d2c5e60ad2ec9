"""Vision-language models on the transformers backend, in one process: which class a config runs
as, the layout of its pieces, what `mbr check` refuses and why, `model.freeze`, the planner's count,
and the experts a checkpoint may hold transposed. (Numbers against transformers: the VLM matrix,
docs/vlm.md, and tests/dist/test_vlm_*.py.)"""

import pytest
import torch

from megatron_bridge.backends.describe import describe, describe_hf
from megatron_bridge.backends.registry import backend_of
from megatron_bridge.backends.transformers.checkpoint import PRE
from megatron_bridge.backends.transformers.meta import class_name, meta
from megatron_bridge.backends.transformers.vision import freeze_group
from megatron_bridge.bridge.mapping import REPLICATED, WholeLinear
from megatron_bridge.parallel.dims import ParallelDims
from megatron_bridge.runtime.hf_tiny import tiny_config


def _hf(model_type: str, **extra) -> dict:
    return {**tiny_config(model_type).to_dict(), "model_type": model_type, **extra}


def _spec(model_type: str, **extra):
    return describe_hf(_hf(model_type, **extra), make_vocab_size_divisible_by=8, backend="transformers")


def test_a_vlm_is_its_language_model_with_vision_pieces_on_the_first_stage():
    spec = _spec("qwen2_5_vl")
    m = meta(spec)
    assert (spec.architecture, spec.family) == ("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl_text")
    assert (m.plan.front, m.plan.language, m.plan.prefix) == ("model", "language_model", "model.language_model")
    assert (m.plan.embed, m.plan.head, m.plan.vision) == (
        "model.language_model.embed_tokens",
        "lm_head",
        ("model.visual",),
    )
    assert m.plan.projectors == ("model.visual.merger",)
    vision = [n for n in m.shapes if n.startswith("model.visual.")]
    assert vision and {m.kinds[n] for n in vision} == {"replicated"}
    assert spec.vision_params == sum(m.numel(n) for n in vision) > 0
    table = {r.megatron: r for r in backend_of(spec).table(spec)}
    linears = [n for n in vision if n in m.whole_linears]
    assert linears and all(isinstance(table[n].transform, WholeLinear) for n in linears)
    assert table["model.visual.blocks.0.norm1.weight"].transform is REPLICATED
    pieces = backend_of(spec).expected(spec, spec.padded_vocab_size(1))
    from megatron_bridge.backends.transformers.backend import stage_pieces

    assert all(stage_pieces(spec)[n] == PRE for n in pieces if n.startswith("model.visual."))


def test_the_config_names_the_class_it_runs_as():
    """A composite config runs its VLM class where the config names it (save_pretrained writes
    `architectures`) or no causal LM exists; llama4's without a name stays the text causal LM."""
    assert class_name(_hf("llama4")) == "Llama4ForCausalLM"
    vlm = _hf("llama4", architectures=["Llama4ForConditionalGeneration"])
    assert class_name(vlm) == "Llama4ForConditionalGeneration"
    m = meta(describe_hf(vlm, make_vocab_size_divisible_by=8, backend="transformers"))
    assert (m.plan.front, m.plan.language, m.plan.prefix, m.plan.head) == (
        "",
        "language_model",
        "language_model.model",
        "language_model.lm_head",
    )
    assert set(m.plan.vision) == {"vision_model", "multi_modal_projector"}
    assert class_name(_hf("gemma3")) == "Gemma3ForConditionalGeneration"  # the causal map's own class


def test_what_check_refuses_of_a_vlm_names_the_piece():
    spec = _spec("gemma3")
    limits = backend_of(spec).layout_limits(spec, ParallelDims.parse("cp2"))
    assert any("vision tower" in what and "model.vision_tower" in what for what, _ in limits)
    hf = _hf("qwen3_vl")
    hf["vision_config"] = {**hf["vision_config"], "deepstack_visual_indexes": [0, 1, 2]}  # after layers 0..2
    deep = describe_hf(hf, make_vocab_size_divisible_by=8, backend="transformers")
    limits = backend_of(deep).layout_limits(deep, ParallelDims.parse("pp2"))  # layers 0-1 | 2-3
    assert any("deepstack" in w and "layers 0..1" in w for w, _ in limits)
    assert not backend_of(deep).layout_limits(deep, ParallelDims.parse("tp2"))


def test_features_added_before_layers_of_later_stages_travel_behind_the_hidden_states():
    """Granite-4-Vision adds vision features before decoder layers its config lists
    (vision.BEFORE_LAYER_LISTS); at pp > 1 each travels dense behind megatron's tensor
    (runtime/transformers/vision.py `Carried`), so no pipeline split is refused for them.
    (Numbers against transformers at tp2, pp2, tp2·pp2: the VLM matrix, docs/vlm.md.)"""
    from megatron_bridge.backends.transformers.vision import before_layers
    from megatron_bridge.runtime.transformers.vision import Carried

    granite = _spec("granite4_vision")
    assert before_layers(tiny_config("granite4_vision")) == (0, 1, 2, 3)  # deepstack 0, 1; spatial 0..3
    assert not meta(granite).refused
    assert not backend_of(granite).layout_limits(granite, ParallelDims.parse("pp2"))
    carried, h = Carried((1, 3), 4), torch.randn(2, 5, 4)
    out = torch.randn(5, 2, 6)
    added = {3: torch.randn(2, 5, 4)}
    rest, got = carried.split(carried.join(out, added, h))
    assert torch.equal(rest, out) and torch.equal(got[3], added[3]) and not got[1].any()


def test_packing_a_vlm_is_refused_where_its_forward_derives_positions_from_the_images():
    """Qwen's M-RoPE (get_rope_index) gives a packed row's text positions past each image's extent
    over the whole row; Gemma 3's positions are the row's own, which restart per conversation."""
    from megatron_bridge.config.compose import compose

    cfg, _ = compose(["recipe=default", "data=sft", "data.packing=true"])
    qwen, gemma = _spec("qwen2_5_vl"), _spec("gemma3")
    assert (meta(qwen).plan.image_positions, meta(gemma).plan.image_positions) == ("get_rope_index", "")
    limits = backend_of(qwen).run_limits(qwen, cfg)
    assert any("packed SFT samples" in w and "get_rope_index" in w and "packing=false" in f for w, f in limits)
    assert not any("packed" in w for w, _ in backend_of(gemma).run_limits(gemma, cfg))


@pytest.mark.parametrize(
    "name, group",
    [
        ("model.visual.blocks.0.attn.qkv.weight", "vision"),
        ("model.visual.merger.mlp.0.weight", "projector"),
        ("model.language_model.layers.1.mlp.up_proj.weight", "language"),
        ("lm_head.weight", "language"),
    ],
)
def test_freeze_groups_follow_the_pieces(name, group):
    assert freeze_group(meta(_spec("qwen2_5_vl")).plan, name) == group


def test_the_freeze_rule(tmp_path):
    from megatron_bridge.config.compose import compose
    from megatron_bridge.errors import LayoutError
    from megatron_bridge.parallel.rules.registry import validate

    def refusals(hf_dir, freeze, peft="none"):
        cfg, _ = compose(["recipe=default", f"model.hf_path={hf_dir}", "model.backend=transformers", f"peft={peft}",
                       f"model.freeze={freeze}"])  # fmt: skip
        from megatron_bridge.backends.describe import describe

        try:
            validate(cfg, describe(cfg.model), dims=ParallelDims().with_world(1))
        except LayoutError as e:
            return [v for v in e.violations if "model-freeze" in str(v)]
        return []

    import json

    d = tmp_path / "vlm"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_hf("qwen2_5_vl")))
    assert refusals(d, "[vision]") == [] and refusals(d, "[vision,projector]") == []
    assert any("no part 'vision_tower'" in str(v) for v in refusals(d, "[vision_tower]"))
    assert any("nothing would train" in str(v) for v in refusals(d, "[vision,projector,language]"))
    assert refusals(d, "[vision,projector,language]", peft="lora") == []
    t = tmp_path / "text"
    t.mkdir()
    (t / "config.json").write_text(json.dumps(_hf("qwen3")))
    assert any("no parts to freeze" in str(v) for v in refusals(t, "[vision]"))


def test_the_planner_holds_the_vision_pieces_on_the_first_stage():
    """The per-rank count (native arithmetic: the planner's) adds a VLM's vision pieces whole to
    the first stage's ranks, and a step's FLOPs their per-patch work."""
    from megatron_bridge.plan.comm import step_flops
    from megatron_bridge.plan.params import count, rank_params

    text = describe_hf(_hf("llama"), make_vocab_size_divisible_by=8, backend="native")
    vlm = text.replace(vision_params=1000, vision_patches=16)
    for first, last in ((True, False), (False, True)):
        a = rank_params(vlm, tp=2, layers=2, first=first, last=last)["dense"]
        b = rank_params(text, tp=2, layers=2, first=first, last=last)["dense"]
        assert a - b == (1000 if first else 0)
    extra = step_flops(vlm, count(text), s=64, global_batch=4, recompute="none")
    extra -= step_flops(text, count(text), s=64, global_batch=4, recompute="none")
    assert extra == 4 * (6 * 1000 * 16 - 64 * 3 * 2 * 1000)  # per-patch work in, per-token work of those params out
    assert _spec("qwen2_5_vl").vision_patches == (32 // 8) ** 2 or _spec("qwen2_5_vl").vision_patches == 0


def test_transposed_experts_read_either_layout_and_write_the_model_s():
    from megatron_bridge.backends.transformers.experts import TransposedExperts
    from megatron_bridge.bridge.shards import Shard

    held = torch.randn(4, 6, 8)
    either = TransposedExperts(REPLICATED, (1, 2), tuple(held.shape))
    shapes = None
    for stored in (held, held.transpose(1, 2).contiguous()):
        assert torch.equal(either.shard([stored], Shard(0, 1), shapes), held)
    assert torch.equal(either.merge([held], shapes)[0], held)
    always = TransposedExperts(REPLICATED, (1, 2))
    assert torch.equal(always.merge([held], shapes)[0], held.transpose(1, 2))


def test_what_only_the_first_stage_would_meet_is_refused_by_describe(monkeypatch):
    """A refusal met while building or running the first stage alone would leave the other
    stages waiting on it: an embedding the stages do not take is found when the model is
    described, on every rank (Muse Glimmer's, with its EMBEDDING_AFTER entry taken away)."""
    from megatron_bridge.backends.transformers.meta import EMBEDDING_AFTER
    from megatron_bridge.bridge.hf_config import UnsupportedFeatures

    monkeypatch.delitem(EMBEDDING_AFTER, "MuseGlimmerTextNormedEmbedding")
    meta.cache_clear()  # the meta model's answers are cached per description
    try:
        with pytest.raises(
            UnsupportedFeatures, match="its embedding is a MuseGlimmerTextNormedEmbedding, not nn.Embed"
        ):
            _spec("muse_glimmer")
    finally:
        monkeypatch.undo()
        meta.cache_clear()
    assert not meta(_spec("muse_glimmer")).refused  # declared: described


def test_each_sub_model_s_experts_are_stacked_by_its_own_converters():
    """Dots3-Note's language model and vision tower both stack their experts as `mlp.experts.gate_up_proj`,
    from per-expert tensors its two converters name apart (`gate_proj`/`up_proj`, the vision tower's
    `fc1`/`fc3`), each scoped to its own sub-model: each stack's rows are its own converter's names."""
    m = meta(_spec("dots3_note", architectures=["Dots3NoteForConditionalGeneration"]))
    text = m.experts["model.language_model.layers.1.mlp.experts.gate_up_proj"]
    vision = m.experts["model.vision_tower.blocks.1.mlp.experts.gate_up_proj"]
    assert text[:2] == ("model.layers.1.mlp.experts.0.gate_proj.weight", "model.layers.1.mlp.experts.0.up_proj.weight")
    assert vision[:2] == (
        "vision_encoder.blocks.1.mlp.experts.0.fc1.weight",
        "vision_encoder.blocks.1.mlp.experts.0.fc3.weight",
    )
    assert m.experts["model.language_model.layers.1.mlp.experts.down_proj"][-1].endswith("experts.3.down_proj.weight")


def test_a_vision_tower_s_unsplit_experts_are_whole_on_every_tp_rank():
    from megatron_bridge.backends.transformers.experts import StackedExperts
    from megatron_bridge.bridge.shards import Shard

    per_expert = [torch.randn(6, 8) for _ in range(4)]
    whole = StackedExperts(2, 2)  # 2 experts, gate and up each
    held = [whole.shard(per_expert, Shard(r, 2), None) for r in range(2)]
    assert torch.equal(held[0], held[1]) and torch.equal(held[0][1], torch.cat(per_expert[2:]))
    assert all(torch.equal(a, b) for a, b in zip(whole.merge(held, None), per_expert))


@pytest.mark.parametrize(
    "model_type, why",
    [
        ("diffusion_gemma", "block-diffusion LM, not a next-token one"),
        # its text and vision experts: one checkpoint tensor split into two stacks, the gate transposed
        ("ernie4_5_vl_moe", "transformers converts .*text_moe.experts.gate_up_proj.* between the checkpoint"),
    ],
)
def test_a_vlm_the_stages_cannot_run_is_refused_by_describe_naming_why(model_type, why):
    from megatron_bridge.bridge.hf_config import UnsupportedFeatures

    with pytest.raises(UnsupportedFeatures, match=why):
        _spec(model_type)


def test_a_vlm_handing_its_language_model_the_per_layer_token_part_is_described():
    """Gemma4Model.forward hands its language model `per_layer_inputs` (its ids looked up, image
    tokens as padding): a declared keyword (kinds.PER_LAYER_INPUTS), which the first stage projects
    its merged embeddings onto (runtime/transformers/per_layer.py; numbers: the VLM matrix)."""
    from megatron_bridge.backends.transformers.vision import PER_LAYER_TOKENS, language_refusals

    assert PER_LAYER_TOKENS == ("per_layer_inputs",)
    assert not meta(_spec("gemma4")).refused
    assert language_refusals(["inputs_embeds", "per_layer_inputs", "ple_input_ids"], ()) == [
        "its language model's forward takes ple_input_ids, which the transformers backend's stages do not pass on"
    ]


def test_an_expert_width_given_per_expert_group_is_the_widest_for_the_planner():
    from megatron_bridge.backends.transformers.experts import expert_width

    assert expert_width([56, 40]) == 56 and expert_width((8, 24)) == 24 and expert_width(56) == 56


def test_a_plan_entry_for_one_layer_kind_splits_only_those_layers_and_the_table_rows_follow():
    """GLM-5.3-Flash: o_proj is rowwise after the split MLA attention (layers 1, 3), whole after the KDA linear
    attention (layers 0, 2) whose q/k/v its plan does not split; the checkpoint table reads each layer's as it is split."""
    spec = _spec("glm5_next")
    m = meta(spec)
    o = "model.language_model.layers.{}.self_attn.o_proj"
    assert [m.plan.style(o.format(i)) for i in range(4)] == ["replicate", "rowwise", "replicate", "rowwise"]
    rows = {r.megatron: r for r in backend_of(spec).table(spec)}
    assert o.format("{layer}") + ".weight" not in rows
    assert rows[o.format(0) + ".weight"].transform == REPLICATED
    assert rows[o.format(1) + ".weight"].transform != REPLICATED
    assert m.plan.style("model.language_model.layers.0.mlp.gate_proj") == "colwise"  # the kind's other entries stay


def test_a_model_transformers_does_not_load_back_is_refused_naming_the_tensor():
    """ShieldGemma 2's conversion mapping adds a `model.` prefix on load (a PrefixChange, which
    saving drops): the saved `model.language_model.model.*` is read as
    `model.model.language_model.model.*`, so from_pretrained would initialise its language
    model at random. Gemma 3, its language model's own class, reads back what it saves."""
    from transformers import AutoModelForImageTextToText

    from megatron_bridge.backends.transformers.loading import read_back_misses
    from megatron_bridge.bridge.hf_config import UnsupportedFeatures

    saved, read = "model.language_model.model.embed_tokens.weight", "model.model.language_model.model.embed_tokens"
    with pytest.raises(
        UnsupportedFeatures, match=f"does not load back the checkpoint it saves: it reads {saved} as {read}"
    ):
        _spec("shieldgemma2")
    spec = _spec("gemma3")
    assert backend_of(spec).table(spec)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(tiny_config("gemma3"))
    names = {n: n for n in model.state_dict()}  # each module name reads back onto itself
    assert not read_back_misses(model, names)
    assert read_back_misses(model, {"model.language_model.norm.weight": "model.language_model.nrm.weight"}) == {
        "model.language_model.norm.weight": ("model.language_model.nrm.weight", "model.language_model.nrm.weight")
    }


def test_a_package_the_model_s_classes_need_is_one_error_naming_its_install(tmp_path, monkeypatch, capsys):
    """FastVLM's vision tower is timm's (TimmWrapperModel): without timm, transformers' own
    requires_backends raises while the meta model is built; `mbr check` gives its install."""
    import json

    from transformers.utils import import_utils

    from megatron_bridge.backends.transformers.loading import needs_package
    from megatron_bridge.cli import main

    monkeypatch.setitem(import_utils.BACKENDS_MAPPING, "timm", (lambda: False, import_utils.TIMM_IMPORT_ERROR))
    hf = {**tiny_config("fast_vlm").to_dict(), "architectures": ["FastVlmForConditionalGeneration"]}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert main(["check", "model.backend=transformers", f"model.hf_path={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "[hf-package]" in err and "needs the timm package (TimmWrapperModel)" in err, err
    assert "Fix: pip install timm" in err and "Traceback" not in err, err
    scipy = needs_package(
        "InklingForConditionalGeneration", ModuleNotFoundError("No module named 'scipy'", name="scipy")
    )
    assert (str(scipy), scipy.fix) == ("InklingForConditionalGeneration needs the scipy package, not installed",
                                       "pip install scipy")  # fmt: skip


@pytest.mark.parametrize("model_type", ["kimi_k25", "mistral_large4", "qwen2_5_vl"])
def test_lora_targets_adapt_the_modules_peft_adapts_or_are_refused(model_type, tmp_path):
    """A LoRA target names the model's own modules as PEFT does: a vision tower's q/k/v cut from
    its saved qkv (Kimi-K2.5's MoonViT), an attention the plan leaves whole (Mistral Large 4's
    language layers), any unplanned linear; a module PEFT would wrap that the stages do not
    adapt (a patch embedding's convolution) is refused by name, never dropped. PEFT is the oracle."""
    import functools

    from peft import LoraConfig, get_peft_model

    from megatron_bridge.bridge.lora import hf_module, resolve_targets
    from megatron_bridge.bridge.table import resolve_megatron
    from megatron_bridge.runtime.hf_tiny import build_tiny

    model = build_tiny(model_type, image_text=True)
    model.save_pretrained(tmp_path)  # before PEFT wraps its modules
    spec = describe_hf(
        {**model.config.to_dict(), "model_type": model_type}, make_vocab_size_divisible_by=8, backend="transformers"
    )
    backend, plan = backend_of(spec), meta(spec).plan
    leaves = {n.rsplit(".", 1)[-1] for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    targets = sorted(t for t in leaves if not t.isdigit() and t != "lm_head")
    table = backend.table(spec)
    hit = {
        id(t.mapping): t
        for t in resolve_targets(table, targets, spec.family, functools.partial(backend.adapter_names, spec))
    }
    ours = set()
    for name in backend.expected(spec, spec.padded_vocab_size(1)):
        row = resolve_megatron(table, name)
        if row is not None and id(row.mapping) in hit:
            ours |= {hf_module(backend.adapter_names(spec, row)[i]) for i in hit[id(row.mapping)].srcs}
    peft = get_peft_model(model, LoraConfig(target_modules=targets, r=2))
    theirs = {
        n.removeprefix("base_model.model.").removesuffix(".lora_A")
        for n, _ in peft.named_modules()
        if n.endswith(".lora_A")
    }
    refused = backend.lora_refusals(spec, targets)
    assert ours <= theirs and sorted(f"{n} (" for n in theirs - ours) == sorted(r.split("(")[0] + "(" for r in refused)
    assert any(n.startswith(plan.vision) for n in ours) and any(n.startswith(plan.prefix) for n in ours)
    if model_type == "kimi_k25":
        assert refused == ["model.vision_tower.patch_embed.proj (Conv2d)"]
        from megatron_bridge.config.compose import compose
        from megatron_bridge.errors import LayoutError
        from megatron_bridge.parallel.rules.registry import validate

        base = ["recipe=tiny_llama", f"model.hf_path={tmp_path}", "parallel.tp=1", "parallel.pp=1", "peft=lora"]
        cfg, _ = compose([*base, "peft.target_modules=[proj,q_proj]"])  # mbr check's rules
        with pytest.raises(LayoutError) as e:
            validate(cfg, describe(cfg.model), world_size=1)
        assert [v.rule for v in e.value.violations] == ["lora-targets"] and "patch_embed.proj (Conv2d)" in str(e.value)
        assert {"model.vision_tower.layers.0.attn.q_proj", "model.vision_tower.layers.0.attn.v_proj"} <= ours
    if model_type == "mistral_large4":
        assert "model.language_model.layers.0.self_attn.q_proj" in ours and not refused
