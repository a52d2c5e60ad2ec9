"""What `mbr check` and `mbr plan` report is what training builds, and every command accepts
the same layouts.

For every recipe, and for a generated set of overrides on the tiny recipes (stage splits,
vpp, cp, ep/etp, sequence parallelism on/off/auto, recompute, GPT-style normalization and
MLP), a config the rules accept must: resolve to the same `ParallelDims` under the launcher
as under `mbr check`; give megatron-core TransformerConfig arguments whose degrees, stage
split and architecture are exactly those; be a TransformerConfig megatron-core accepts (its
own assertions run in `__post_init__`: the `layers_first_stage` crash of issue 13 was one);
and be the layout `mbr plan` evaluates when every knob is pinned. A config the check accepts
and training refuses fails here. The parameter count of the built megatron model (one
process, tiny sizes) equals the planner's; tests/dist/test_check_train_agree.py builds a
sample per pipeline rank and trains one step.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from megatron_bridge.backends.describe import describe
from megatron_bridge.config.compose import compose
from megatron_bridge.errors import LayoutError
from megatron_bridge.parallel.dims import ParallelDims
from megatron_bridge.parallel.rules.registry import validate
from megatron_bridge.plan import params as P
from megatron_bridge.plan.evaluation import Context
from megatron_bridge.plan.search import pinned_from_overrides, search
from megatron_bridge.runtime.tconfig import transformer_config_kwargs
from megatron_bridge.train.job import model_overrides
from megatron_bridge.train.runner import validate_for_launch

RECIPES = sorted(p.stem for p in (Path(__file__).parents[3] / "recipes").glob("*.yaml"))
GPT_STYLE = [
    "model.family=gpt",
    "model.normalization=LayerNorm",
    "model.gated_linear_unit=false",
    "model.add_bias_linear=true",
    "model.position_embedding_type=learned_absolute",
]


def generated(n: int = 70, seed: int = 0) -> list[list[str]]:
    """Override sets on the tiny recipes; the rules decide which are layouts."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        recipe = rng.choice(["tiny_llama", "tiny_mixtral", "gpt_tiny"])
        tp, pp, cp = rng.choice([1, 2, 4]), rng.choice([1, 2, 3]), rng.choice([1, 2])
        o = [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.cp={cp}"]
        o.append(f"model.num_layers={rng.choice([4, 5, 6, 8])}")
        o.append(f"parallel.vpp={rng.choice(['null', 2])}")
        first, last = rng.choice([(None, None), (1, None), (None, 2), (1, 1), (2, 2)])
        o += [f"parallel.layers_first_stage={first or 'null'}", f"parallel.layers_last_stage={last or 'null'}"]
        o.append(f"parallel.sequence_parallel={rng.choice(['null', 'true', 'false'])}")
        o.append(f"train.recompute={rng.choice(['none', 'selective', 'full'])}")
        o.append(f"zero.stage={rng.choice([0, 1])}")
        if recipe == "tiny_mixtral":
            o += [f"parallel.ep={rng.choice([1, 2, 4])}", f"parallel.etp={rng.choice(['null', 1])}"]
        base = ["recipe=tiny_llama", *GPT_STYLE] if recipe == "gpt_tiny" else [f"recipe={recipe}"]
        world = tp * pp * cp * 2
        out.append(
            [
                *base,
                *o,
                f"cluster.gpus_per_node={world}",
                f"train.global_batch_size={8 * world}",
                "train.micro_batch_size=1",
                "train.seq_length=64",
            ]
        )
    return out


def _check(overrides):
    cfg, _ = compose(overrides)
    try:
        return cfg, validate(cfg, describe(cfg.model))[0]
    except LayoutError:
        return cfg, None


def _assert_training_builds_what_check_reported(cfg, dims, monkeypatch):
    from megatron.core.transformer.transformer_config import TransformerConfig

    monkeypatch.setenv("WORLD_SIZE", str(dims.world_size))
    spec = describe(cfg.model)
    trained = validate_for_launch(cfg, spec)  # training's own entry check
    assert trained == dims
    kw = transformer_config_kwargs(spec, trained, **model_overrides(cfg))
    m = cfg.model  # what the recipe says is what is built
    want = dict(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp if dims.pp > 1 else None,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.etp,
        sequence_parallel=dims.sequence_parallel and dims.tp > 1,
        num_layers_in_first_pipeline_stage=dims.layers_first_stage,
        num_layers_in_last_pipeline_stage=dims.layers_last_stage,
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.kv_heads,
        kv_channels=m.head_dim,
        normalization=m.normalization,
        gated_linear_unit=m.gated_linear_unit,
        add_bias_linear=m.add_bias_linear,
        qk_layernorm=m.qk_layernorm,
        recompute_granularity=None if cfg.train.recompute == "none" else cfg.train.recompute,
    )
    got = {k: kw.get(k) for k in want}
    assert got == want
    if m.num_moe_experts:
        assert (kw["num_moe_experts"], kw["moe_router_topk"]) == (m.num_moe_experts, m.moe_router_topk)
    TransformerConfig(**kw)  # megatron-core's own validation: it must accept what check accepted


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_builds_what_check_reports(recipe, monkeypatch, tmp_path):
    # the base a LoRA or DPO recipe needs (DPO: its reference, the initial policy); a distillation recipe's teacher
    base = [f"train.init_from={tmp_path}"] if recipe.startswith(("lora_", "dpo_")) else []
    if recipe.startswith("distill_"):
        from megatron_bridge.runtime.tiny import make_tiny

        base = [f"objective.teacher={make_tiny('llama', tmp_path / 'teacher', vocab_size=512, num_hidden_layers=6)}"]
    if recipe.endswith("_vlm"):  # a VLM recipe runs the model.hf_path it is given: the demo's tiny one
        from tests.vlm_processor import make_vlm

        base = [f"model.hf_path={make_vlm(tmp_path / 'vlm')}"]
    cfg, dims = _check([f"recipe={recipe}", *base])
    assert dims is not None, f"recipe {recipe} does not pass mbr check"
    if cfg.model.backend != "transformers":  # the native GPTModel's TransformerConfig (the other: test_vlm_train)
        _assert_training_builds_what_check_reported(cfg, dims, monkeypatch)


def test_issue_13_uneven_first_stage_builds(monkeypatch):
    o = [
        "recipe=tiny_llama",
        "parallel.tp=1",
        "parallel.pp=2",
        "model.num_layers=5",
        "parallel.layers_first_stage=1",
        "cluster.gpus_per_node=2",
    ]
    cfg, dims = _check(o)
    assert dims is not None and dims.layers_first_stage == 1
    _assert_training_builds_what_check_reported(cfg, dims, monkeypatch)


def test_generated_layouts_check_plan_and_training_agree(monkeypatch):
    accepted = refused = 0
    for overrides in generated():
        cfg, dims = _check(overrides)
        if dims is None:
            refused += 1
            continue
        accepted += 1
        _assert_training_builds_what_check_reported(cfg, dims, monkeypatch)
        # mbr plan with every knob pinned evaluates exactly this layout
        pinned = pinned_from_overrides(overrides)
        spec = describe(cfg.model)
        if cfg.parallel.sequence_parallel is None and dims.tp > 1 and not spec.is_moe:
            continue  # auto is off here; the planner is free to recommend SP on
        res = search(Context.from_config(cfg, spec, pinned))
        seen = [e.dims for e in res.ranked + res.ruled_out]
        assert res.valid >= 1 and dims in seen, (overrides, res.examples)
    assert accepted >= 10 and refused >= 10, (accepted, refused)  # the set exercises both sides


# -- the built model's parameters are the planner's ---------------------------------------
MODELS = {
    "tiny_llama": ["recipe=tiny_llama"],
    "tiny_mixtral": ["recipe=tiny_mixtral"],
    "gpt": ["recipe=tiny_llama", *GPT_STYLE, "model.tie_word_embeddings=true"],
    "qwen2_tied": ["recipe=tiny_llama", "model.family=qwen2", "model.tie_word_embeddings=true"],
    "qwen3_qknorm": ["recipe=tiny_llama", "model.family=qwen3", "model.kv_channels=32"],
    "qwen2_moe_shared": [
        "recipe=tiny_mixtral",
        "model.family=qwen2_moe",
        "model.moe_shared_expert_intermediate_size=32",
    ],
}


@pytest.fixture(scope="module")
def one_process_groups():
    """megatron-core's groups for one process (gloo), torn down and env restored after."""
    from megatron_bridge.testing import one_process_groups

    with one_process_groups():
        yield


@pytest.mark.parametrize("name", list(MODELS))
def test_built_parameter_count_equals_plan(name, one_process_groups):
    from megatron_bridge.runtime.build import build_model

    cfg, dims = _check([*MODELS[name], "parallel.tp=1", "parallel.pp=1", "parallel.ep=1", "cluster.gpus_per_node=1"])
    assert dims is not None
    m = describe(cfg.model)
    chunks = build_model(m, dataclasses.replace(dims, world_size=1), **model_overrides(cfg))
    built = sum(p.numel() for c in chunks for p in c.parameters())
    planned = P.rank_params(m, tp=1, ep=1, etp=1, layers=m.num_layers, first=True, last=True)
    assert built == planned["dense"] + planned["expert"]
    padding = P.count(m).padded_vocab - m.vocab_size
    assert built == P.count(m).total + padding * m.hidden_size * (1 if m.tie_word_embeddings else 2)


def test_built_moe_layer_mix_equals_plan(one_process_groups, tmp_path):
    """Qwen2-MoE's tiny model has mlp_only_layers=[1] (one dense layer among MoE layers): the
    megatron model built from its spec has exactly the planner's parameters."""
    from megatron_bridge.bridge.hf_config import load_spec
    from megatron_bridge.parallel.dims import ParallelDims
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.tiny import make_tiny

    spec = load_spec(make_tiny("qwen2_moe", tmp_path / "m"))
    assert spec.moe_layer_pattern and not all(spec.moe_layer_pattern)
    chunks = build_model(spec, ParallelDims(world_size=1, gpus_per_node=1))
    built = sum(p.numel() for c in chunks for p in c.parameters())
    planned = P.rank_params(spec, tp=1, ep=1, etp=1, layers=spec.num_layers, first=True, last=True)
    assert built == planned["dense"] + planned["expert"]
    padding = P.count(spec).padded_vocab - spec.vocab_size
    assert built == P.count(spec).total + padding * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)


# -- every command accepts the same layouts ---------------------------------------------------
def _layout_grid(moe: bool, n: int = 12, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = dict(tp=rng.choice([1, 2, 3]), pp=rng.choice([1, 2, 3]), cp=rng.choice([1, 2]), vpp=rng.choice([None, 2]))
        d["layers_first_stage"] = rng.choice([None, 1, 2])
        if moe:
            d.update(ep=rng.choice([1, 2, 3]), etp=rng.choice([None, 1]))
        out.append(d)
    return out


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_check_plan_train_convert_verify_accept_the_same_layouts(family, tmp_path, monkeypatch, capsys):
    from megatron_bridge.cli import main
    from megatron_bridge.commands.verify_setup import VerifyConfig, check_layouts
    from megatron_bridge.errors import UserError
    from megatron_bridge.runtime.tiny import make_tiny

    hf = make_tiny(family, tmp_path / family)
    verdicts = []
    for i, d in enumerate(_layout_grid(family == "mixtral")):
        par = [f"parallel.{k}={'null' if v is None else v}" for k, v in d.items()]
        world = ParallelDims(**{k: v for k, v in d.items() if k != "layers_first_stage"}).smallest_world
        run = [
            f"cluster.gpus_per_node={world}",
            f"train.global_batch_size={8 * world}",
            "train.micro_batch_size=1",
            "train.seq_length=32",
        ]
        base = ["recipe=default", f"model.hf_path={hf}", *par]
        got = {}
        cfg, dims = _check([*base, *run])  # mbr check
        got["check"] = dims is not None
        monkeypatch.setenv("WORLD_SIZE", str(world))
        try:
            validate_for_launch(cfg, describe(cfg.model))  # training
            got["train"] = True
        except LayoutError:
            got["train"] = False
        monkeypatch.delenv("WORLD_SIZE")
        res = search(
            Context.from_config(
                cfg,
                describe(cfg.model),
                pinned_from_overrides([*par, "zero.stage=0", "train.recompute=none", "train.micro_batch_size=1"]),
            )
        )
        got["plan"] = res.valid >= 1  # mbr plan with every degree pinned
        code = main(["convert", f"src={hf}", f"dst={tmp_path / f'c{i}'}", *base[2:], "train.seq_length=32"])
        got["convert"] = code == 0
        vcfg, _ = compose([*base, "verify.seq_length=32"], schema=VerifyConfig)
        try:
            vspec = describe(vcfg.model)
            check_layouts(vcfg, vspec, [ParallelDims.from_config(vcfg, smallest_world=True, moe=vspec.is_moe)], None)
            got["verify"] = True
        except UserError:
            got["verify"] = False
        assert len(set(got.values())) == 1, (d, got, capsys.readouterr().err[-2000:])
        verdicts.append(got["check"])
    assert any(verdicts) and not all(verdicts), verdicts  # the grid has both kinds


def test_gpt_family_export_is_refused_before_training(tmp_path, capsys, monkeypatch):
    from megatron_bridge.train.runner import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = main(
        [
            "recipe=tiny_llama",
            *GPT_STYLE,
            "parallel.tp=1",
            "parallel.pp=1",
            "cluster.gpus_per_node=1",
            f"export_to={tmp_path / 'hf'}",
            f"run_dir={tmp_path / 'run'}",
        ]
    )
    assert code == 2 and "no Hugging Face counterpart" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
