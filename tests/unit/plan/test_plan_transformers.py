"""`mbr plan` for transformers-backend models (text, MoE, vision-language): the planner's counts
against the real transformers model — its total against `parameters()`, each rank's share against
the tensors the loader itself cuts for that rank (the backend's table transforms on the saved
checkpoint, EP's run of experts, the builder's stage pieces) — and the command end to end."""

from __future__ import annotations

import json

import pytest

from megatron_bridge.backends.describe import describe_hf
from megatron_bridge.backends.registry import backend_of
from megatron_bridge.backends.transformers.meta import meta
from megatron_bridge.bridge.hf_config import read_hf_config
from megatron_bridge.bridge.layout import Coords, ep_part
from megatron_bridge.bridge.loader import HFCheckpoint, resolve_checkpoint
from megatron_bridge.bridge.shards import Shard
from megatron_bridge.parallel.dims import ParallelDims
from megatron_bridge.plan import comm as C
from megatron_bridge.plan import memory as M
from megatron_bridge.runtime.hf_tiny import build_tiny

TYPES = {"dense": ("qwen2", False), "moe": ("qwen3_moe", False), "vlm": ("qwen2_5_vl", True)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{case: (directory, model)} of tiny models saved as HF directories."""
    out = {}
    for case, (model_type, image_text) in TYPES.items():
        model = build_tiny(model_type, image_text=image_text)
        d = tmp_path_factory.mktemp(case)
        model.save_pretrained(d)
        out[case] = (d, model)
    return out


def _spec(d):
    return describe_hf(
        read_hf_config(d), backend="transformers", make_vocab_size_divisible_by=48
    )  # 256 rows padded to 288 at tp2


@pytest.mark.parametrize("case", list(TYPES))
def test_the_total_is_the_transformers_models_parameters(saved, case):
    d, model = saved[case]
    spec = _spec(d)
    real = sum(p.numel() for p in model.parameters())
    c, s = backend_of(spec).count(spec), backend_of(spec).shards(spec)
    assert c.total == s.total == real
    if case == "vlm":
        visual = sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.visual."))
        assert s.vision == spec.vision_params == visual > 0
    if case == "moe":  # a token passes top-k of the experts
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        assert c.active == real - experts + experts * spec.moe_router_topk // spec.num_moe_experts
        assert s.moe_layers() == spec.num_layers - 1  # mlp_only_layers=[0]: the first layer is dense
    else:
        assert c.active == c.total


def _loaded(d, spec, dims: ParallelDims, coords: Coords) -> int:
    """Elements the loader puts on the rank at `coords`: each parameter row the chunk owns, cut by
    the table's transform from the saved tensors (this EP rank's run of a stacked experts tensor)."""
    backend, m = backend_of(spec), meta(spec)
    layers = range(*(lambda ids: (ids[0], ids[-1] + 1))(dims.stage_layer_ids(spec.num_layers, coords.pp_rank)))
    shard, shapes = Shard(coords.tp_rank, dims.tp), spec.shapes(dims.tp)
    n = 0
    with HFCheckpoint(d) as ck:
        for row in resolve_checkpoint(spec, ck.keys()):
            if row.megatron in m.buffers or backend.owned(spec, row, dims, coords, layers) is None:
                continue
            t = row.mapping.shard([ck.slice(h) for h in row.hf], shard, shapes)
            if backend.ep_stacked(spec, row):
                t = ep_part(t, dims.ep, coords.ep_rank)
            n += t.numel()
    return n


@pytest.mark.parametrize(
    "case, layout",
    [("dense", "tp2pp2"), ("vlm", "tp2pp2"), ("moe", "pp2ep2"), ("moe", "tp2")],
)
def test_each_ranks_share_is_what_the_loader_gives_it(saved, case, layout):
    d, _ = saved[case]
    spec = _spec(d)
    dims = ParallelDims.parse(layout).with_world(4)
    shards = backend_of(spec).shards(spec)
    for stage in range(dims.pp):
        ids = dims.stage_layer_ids(spec.num_layers, stage)
        rp = shards.rank_params(
            tp=dims.tp, ep=dims.ep, etp=dims.etp, layers=ids, first=stage == 0, last=stage == dims.pp - 1
        )
        for tp_rank in range(dims.tp):
            for ep_rank in range(dims.ep):
                got = _loaded(d, spec, dims, Coords(tp_rank=tp_rank, pp_rank=stage, ep_rank=ep_rank))
                assert rp["dense"] + rp["expert"] == got, (stage, tp_rank, ep_rank)
        if case == "vlm":  # the tower and projector: whole on every TP rank of the first stage only
            other = shards.rank_params(tp=dims.tp, layers=ids, first=False, last=stage == dims.pp - 1)
            assert rp["dense"] - other["dense"] >= (spec.vision_params if stage == 0 else 0)
    if spec.is_moe and dims.ep > 1:
        one = shards.rank_params(tp=1, layers=range(spec.num_layers), first=True, last=True)
        assert (
            one["expert"]
            == 2 * shards.rank_params(tp=1, ep=2, layers=range(spec.num_layers), first=True, last=True)["expert"]
        )


def test_the_vision_tower_costs_flops_and_activations_on_the_first_stage(saved):
    d, _ = saved["vlm"]
    spec = _spec(d)
    m = meta(spec)
    assert spec.vision_patches == 0  # Qwen2.5-VL: dynamic resolution, the plan's image_patches gives them
    v = m.shapes["model.visual.blocks.0.norm1.weight"][0]
    assert spec.vision_width == v * sum(1 for n in m.shapes if n.endswith(".norm1.weight") and "visual" in n)
    count = backend_of(spec).count(spec)
    kw = dict(s=64, global_batch=4, recompute="none")
    extra = C.step_flops(spec, count, images=2, patches=100, **kw) - C.step_flops(spec, count, patches=0, **kw)
    assert extra == 4 * 3 * 2 * (2 * spec.vision_params * 100 + 4 * 100 * 100 * spec.vision_width)
    mem = dict(p=2, tp=1, cp=1, ep=1, etp=1, dp=1, edp=1, zero=0, engine="megatron", precision="bf16")
    mem.update(recompute="none", sp=False, s=64, b=1, num_micro=4, vocab=spec.padded_vocab_size(1))
    for stage in (0, 1):
        ids = (0, 1) if stage == 0 else (2, 3)
        with_images = M.stage_memory(
            spec, stage=stage, layers=ids, first=stage == 0, last=stage == 1, patches=100, **mem
        )
        without = M.stage_memory(spec, stage=stage, layers=ids, first=stage == 0, last=stage == 1, patches=0, **mem)
        tower = M.vision_activations(spec, b=1, images=1, patches=100) * M.in_flight(stage, 2, 4)
        assert with_images.activations - without.activations == (tower if stage == 0 else 0)


def _plan(argv, capsys):
    from megatron_bridge.commands.plan import main

    assert main(argv) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("case", ["dense", "moe", "vlm"])
def test_mbr_plan_runs_for_a_transformers_model(saved, case, capsys):
    d, model = saved[case]
    args = ["model.backend=transformers", f"model.hf_path={d}", "cluster.nodes=1"]
    out = _plan([*args, "image_patches=64"], capsys)
    total = sum(p.numel() for p in model.parameters())
    assert f"{total:,} parameters" in out and "CHOSEN" in out
    vision = [ln for ln in out.splitlines() if ln.startswith("vision ")]
    if case == "vlm":
        assert (
            len(vision) == 1
            and "64 patches" in vision[0]
            and f"{sum(p.numel() for n, p in model.named_parameters() if n.startswith('model.visual.')):,}" in vision[0]
        )
        doc = json.loads(_plan([*args, "format=json"], capsys))
        assert doc["model"]["vision"]["patches_per_image"] == 0  # unknown without image_patches: said so
        assert "give image_patches=N" in _plan(args, capsys)
    else:
        assert not vision


@pytest.mark.parametrize(
    "case, targets", [("dense", ["q_proj", "v_proj", "down_proj"]), ("vlm", ["q_proj", "gate_proj"])]
)
def test_the_lora_adapters_are_what_peft_adds(saved, case, targets):
    """At tp=1 over every layer (and the first stage's vision linears) the planner's adapters are
    the parameters HF PEFT adds for the same targets and rank."""
    import copy

    from peft import LoraConfig, get_peft_model

    from megatron_bridge.config.schema import PeftConfig

    d, model = saved[case]
    spec = _spec(d)
    peft = PeftConfig(method="lora", rank=4, target_modules=targets)
    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=targets))
    real = sum(p.numel() for n, p in lora.named_parameters() if "lora_" in n)
    layers = range(spec.num_layers)
    got = backend_of(spec).adapter_params(spec, peft, tp=1, etp=1, ep=1, layers=layers, first=True)
    assert got == (real, 0.0)
    later = backend_of(spec).adapter_params(spec, peft, tp=1, etp=1, ep=1, layers=layers, first=False)
    vision = sum(p.numel() for n, p in lora.named_parameters() if "lora_" in n and ".visual." in n)
    assert later[0] == real - vision and (vision > 0) == (case == "vlm")
    args = [
        "model.backend=transformers",
        f"model.hf_path={d}",
        "peft=lora",
        f"peft.target_modules=[{','.join(targets)}]",
    ]
    from megatron_bridge.commands.plan import main

    assert main(args) == 0


@pytest.mark.parametrize("case", list(TYPES))
def test_the_built_chunk_has_the_planned_parameters(saved, case):
    """One process, tp=pp=1: the chunk the runtime builds holds exactly what the plan counts
    (the vocabulary padded as the run pads it)."""
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.testing import one_process_groups

    d, _ = saved[case]
    spec = _spec(d)
    with one_process_groups():
        chunks = build_model(spec, ParallelDims(world_size=1, gpus_per_node=1))
        built = sum(p.numel() for c in chunks for p in c.parameters())
    planned = backend_of(spec).shards(spec).rank_params(tp=1, layers=range(spec.num_layers), first=True, last=True)
    assert built == planned["dense"] + planned["expert"] > backend_of(spec).count(spec).total  # 256 rows -> 288
