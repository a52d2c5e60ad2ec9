"""LoRA targets and adapter placement, without process groups.

* HF module names resolve through the family tables (and only through them): q/k/v land on
  linear_qkv with their input indices, gate/up on linear_fc1, experts on the expert rows;
  a name the family lacks is refused naming the family's linears.
* The merged update each TP rank adds to its weight shard is exactly the bridge's
  transform applied to HF PEFT's per-module deltas (B_m A_m · alpha/r), for GQA, for
  fewer KV groups than TP ranks, and for SwiGLU fc1 — the placement is derived, not re-coded.
* The rules (`mbr check`): rank, targets, experts under etp > 1, a base model to adapt.
"""

import types

import pytest
import torch

from megatron_bridge.backends.describe import describe
from megatron_bridge.bridge.lora import Target, resolve_targets
from megatron_bridge.bridge.registry import get_family
from megatron_bridge.bridge.shards import Shapes, Shard
from megatron_bridge.bridge.table import Resolved
from megatron_bridge.config.compose import compose
from megatron_bridge.config.schema import PeftConfig
from megatron_bridge.errors import LayoutError, UserError
from megatron_bridge.parallel.rules.registry import validate


def _targets(family, names):
    return {
        t.mapping.megatron.split(".", 3)[-1]: t.srcs for t in resolve_targets(get_family(family).table, names, family)
    }


def test_hf_names_resolve_onto_fused_megatron_linears():
    got = _targets("llama", ["q_proj", "v_proj", "up_proj", "self_attn.o_proj"])
    assert got == {
        "self_attention.linear_qkv.weight": (0, 2),
        "mlp.linear_fc1.weight": (1,),
        "self_attention.linear_proj.weight": (0,),
    }
    moe = _targets("mixtral", ["w1", "w2"])
    assert moe == {
        "mlp.experts.local_experts.{expert}.linear_fc1.weight": (0,),
        "mlp.experts.local_experts.{expert}.linear_fc2.weight": (0,),
    }
    # qwen2_moe: gate_proj is in the dense MLP, the routed experts and the shared expert (as in HF PEFT)
    assert len(_targets("qwen2_moe", ["gate_proj"])) == 3


@pytest.mark.parametrize("names", [["q_proj", "w1"], ["lm_head"], ["proj"], []])
def test_unknown_targets_are_refused_with_the_family_names(names):
    with pytest.raises(UserError) as e:
        resolve_targets(get_family("llama").table, names, "llama")
    assert "q_proj" in str(e.value) and "gate_proj" in str(e.value)


def _adapter(family, hf_name_part, shapes, tp, rank, srcs, hf_shapes, r=3):
    from megatron_bridge.runtime.lora_modules import LoraAdapter

    row_map = next(m for m in get_family(family).table if m.megatron.endswith(hf_name_part))
    row = Resolved(row_map, row_map.megatron.format(layer=0), row_map.hf_names(layer=0))
    g = torch.Generator().manual_seed(7)
    full = {
        row.hf[i]: (torch.randn(r, s[1], generator=g), torch.randn(s[0], r, generator=g))
        for i, s in enumerate(hf_shapes)
        if i in srcs
    }
    global_w = row_map.transform.shard([torch.zeros(s) for s in hf_shapes], Shard(0, 1), shapes)
    local = row_map.transform.shard([torch.zeros(s) for s in hf_shapes], Shard(rank, tp), shapes)
    assert global_w.shape[0] == local.shape[0] * tp or global_w.shape[1] == local.shape[1] * tp
    linear = types.SimpleNamespace(weight=torch.nn.Parameter(local))
    peft = PeftConfig(method="lora", rank=r, alpha=6.0)
    ad = LoraAdapter(row, Target(row_map, srcs), linear, Shard(rank, tp), shapes, peft, lambda name, shape: full[name])
    deltas = [full[h][1] @ full[h][0] * 2.0 if h in full else torch.zeros(s) for h, s in zip(row.hf, hf_shapes)]
    return ad, row_map.transform.shard(deltas, Shard(rank, tp), shapes)


@pytest.mark.parametrize("tp,heads,groups", [(1, 4, 2), (2, 4, 2), (2, 8, 4), (4, 4, 2), (2, 4, 1)])
@pytest.mark.parametrize("srcs", [(0, 1, 2), (0, 2), (1,)])
def test_merged_qkv_update_is_the_bridge_transform_of_hf_deltas(tp, heads, groups, srcs):
    d, hidden = 4, 16
    shapes = Shapes(heads, groups, d, 10, 10)
    hf_shapes = [(heads * d, hidden), (groups * d, hidden), (groups * d, hidden)]
    for rank in range(tp):
        ad, want = _adapter("llama", "linear_qkv.weight", shapes, tp, rank, srcs, hf_shapes)
        assert torch.allclose(ad.delta_weight(), want, atol=1e-6)


@pytest.mark.parametrize("tp", [1, 2])
def test_merged_fc1_and_row_parallel_updates(tp):
    shapes = Shapes(4, 2, 4, 10, 10)
    for rank in range(tp):
        ad, want = _adapter("llama", "linear_fc1.weight", shapes, tp, rank, (0, 1), [(24, 16), (24, 16)])
        assert torch.allclose(ad.delta_weight(), want, atol=1e-6)
        ad, want = _adapter("llama", "linear_fc2.weight", shapes, tp, rank, (0,), [(16, 24)])
        assert torch.allclose(ad.delta_weight(), want, atol=1e-6)
        assert ad.A["0"].tensor_model_parallel and not ad.B.tensor_model_parallel


def _rules(*overrides):
    cfg, _ = compose(["recipe=tiny_llama", "train.init_from=/base", "peft=lora", *overrides])
    try:
        validate(cfg, describe(cfg.model))
    except LayoutError as e:
        return {v.rule for v in e.violations}
    return set()


def test_rules():
    assert _rules() == set()
    assert _rules("peft.rank=0") == {"lora-rank"}
    assert _rules("peft.alpha=0") == {"lora-alpha"}
    assert _rules("peft.dropout=1.0") == {"lora-dropout"}
    assert _rules("peft.target_modules=[q_proj,w1]") == {"lora-targets"}
    assert _rules("train.init_from=null") == {"lora-base"}
    assert _rules("peft=none", "train.init_from=null") == set()


def test_expert_adapters_need_whole_experts():
    base = [
        "recipe=tiny_mixtral",
        "train.init_from=/base",
        "peft=lora",
        "parallel.tp=2",
        "parallel.ep=2",
        "parallel.sequence_parallel=true",
        "cluster.gpus_per_node=8",
    ]
    cfg, _ = compose([*base, "peft.target_modules=[w1,q_proj]"])
    with pytest.raises(LayoutError, match="lora-experts-etp"):
        validate(cfg, describe(cfg.model))
    cfg, _ = compose([*base, "peft.target_modules=[w1,q_proj]", "parallel.etp=1"])
    validate(cfg, describe(cfg.model))


@pytest.mark.parametrize(
    "family,targets",
    [("llama", ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]), ("qwen3", ["q_proj", "k_proj", "gate_proj"])],
)
def test_planner_adapter_count_equals_hf_peft(tmp_path, family, targets):
    """`mbr plan peft=lora` counts exactly the parameters HF PEFT adds (tp=1), and its TP
    split is what the adapters hold per rank (column: B split; row: A split)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from megatron_bridge.bridge.lora import layer_adapter_params
    from megatron_bridge.runtime.lora_files import check_adapter_dir
    from megatron_bridge.runtime.tiny import make_tiny

    hf = make_tiny(family, tmp_path / family)
    cfg, _ = compose(["recipe=tiny_llama", f"model.hf_path={hf}"])
    peft = PeftConfig(method="lora", rank=4, target_modules=targets)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(hf)), LoraConfig(r=4, target_modules=targets))
    trainable, _ = model.get_nb_trainable_parameters()
    spec = describe(cfg.model)
    dense, expert = layer_adapter_params(spec, peft)
    assert (dense, expert) != (0, 0) and expert == 0
    assert dense * spec.num_layers == trainable
    d2, _ = layer_adapter_params(spec, peft, tp=2)
    assert dense / 2 < d2 < dense
    # an adapter HF PEFT saved for this base passes the peft.init_from preflight; another rank does not
    model.save_pretrained(str(tmp_path / "adapter"))
    assert check_adapter_dir(tmp_path / "adapter", hf, peft)["r"] == 4
    with pytest.raises(UserError, match="peft.rank=4"):
        check_adapter_dir(tmp_path / "adapter", hf, PeftConfig(method="lora", rank=8, target_modules=targets))


def test_plan_counts_gradients_and_optimizer_of_adapters_only():
    from megatron_bridge.plan import memory as M

    cfg, _ = compose(["recipe=llama3_8b", "train.init_from=/base", "peft=lora"])
    kw = dict(
        stage=0,
        p=1,
        layers=32,
        first=True,
        last=True,
        tp=8,
        cp=1,
        ep=1,
        etp=8,
        dp=1,
        edp=1,
        zero=0,
        engine="megatron",
        precision="bf16",
        recompute="full",
        sp=True,
        s=8192,
        b=1,
        num_micro=8,
    )
    full = M.stage_memory(describe(cfg.model), **kw)
    lora = M.stage_memory(describe(cfg.model), peft=cfg.peft, **kw)
    assert lora.weights > full.weights  # base + adapters
    assert lora.grads + lora.optimizer < 0.01 * (full.grads + full.optimizer)


def test_adapter_we_write_records_its_data_crc_and_peft_init_from_checks_it(tmp_path):
    """`adapter_model.safetensors` as export_adapter writes it: the data section's CRC-32 in the
    header's metadata (safetensors and PEFT load it as usual); a changed byte of a weight is
    refused by `peft.init_from`'s check, naming the file; a PEFT-saved adapter records none."""
    import json

    from safetensors.torch import load_file, save_file

    from megatron_bridge.runtime.lora_files import check_adapter_dir
    from megatron_bridge.runtime.lora_modules import save_adapter_weights

    tensors = {
        "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight": torch.randn(8, 64),
        "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight": torch.randn(32, 8),
    }
    conf = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["down_proj"]}
    peft = PeftConfig(rank=8, target_modules=["down_proj"])
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for d in (ours, theirs):
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps(conf))
    save_adapter_weights(tensors, ours / "adapter_model.safetensors")
    for i in range(4):  # the same adapter, the same bytes (the header's key order is ours, fixed)
        save_adapter_weights(tensors, tmp_path / f"again{i}.safetensors")
        assert (tmp_path / f"again{i}.safetensors").read_bytes() == (ours / "adapter_model.safetensors").read_bytes()
    save_file(tensors, str(theirs / "adapter_model.safetensors"), metadata={"format": "pt"})
    got = load_file(str(ours / "adapter_model.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    assert check_adapter_dir(theirs, None, peft)["r"] == 8  # nothing recorded: nothing to check
    assert check_adapter_dir(ours, None, peft)["r"] == 8
    f = ours / "adapter_model.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01  # one bit of the last weight
    f.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"adapter_model.safetensors's weights changed since they were written"):
        check_adapter_dir(ours, None, peft)
