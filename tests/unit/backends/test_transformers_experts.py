"""The transformers backend's MoE pieces in one process: transformers' per-expert checkpoint tensors <->
its stacked experts (backends/transformers/experts.py), the all-to-all experts module against
transformers' own (runtime/transformers/experts.py), and what MoE layouts are refused. The EP layouts
themselves run in tests/dist/test_transformers_backend_parity.py's launch."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_bridge.backends.describe import describe, describe_hf
from megatron_bridge.backends.transformers.backend import meta
from megatron_bridge.backends.transformers.experts import StackedExperts, WholeStackedExperts, ep_part
from megatron_bridge.bridge.shards import Shard
from megatron_bridge.config.compose import compose
from megatron_bridge.errors import LayoutError

MOE = ["qwen3_moe", "mixtral"]  # experts saved as gate/up/down per expert; Mixtral's w1/w3/w2 under block_sparse_moe


def _perturb(module: torch.nn.Module, std: float) -> None:
    """Random weights (transformers' experts start at zero or constant): outputs that differ."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, std)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from megatron_bridge.runtime.tiny import make_tiny

    root = tmp_path_factory.mktemp("hf_moe")
    return {f: make_tiny(f, root / f) for f in MOE}


@pytest.mark.parametrize("family", MOE)
def test_stacked_experts_are_the_checkpoints_per_expert_tensors_both_ways(family, saved):
    """The table names every checkpoint tensor; each stacked row rebuilds transformers' own
    in-memory tensor from the saved per-expert ones, an EP rank's run of experts is its slice
    of it, and merge gives the saved tensors back bit-exactly, from whole or TP-split shards."""
    from transformers import AutoModelForCausalLM

    from megatron_bridge.bridge.hf_config import read_hf_config
    from megatron_bridge.bridge.loader import HFCheckpoint, resolve_checkpoint

    spec = describe_hf(read_hf_config(saved[family]), backend="transformers")
    model = AutoModelForCausalLM.from_pretrained(saved[family], dtype=torch.float32)
    params = dict(model.named_parameters())
    shapes = spec.shapes(1)
    with HFCheckpoint(saved[family]) as ck:
        rows = resolve_checkpoint(spec, ck.keys())
        assert {h for r in rows for h in r.hf} == set(ck.keys())
        stacked = [r for r in rows if isinstance(r.mapping.transform, StackedExperts)]
        moe_layers = {"qwen3_moe": 3, "mixtral": 4}[family]  # Qwen3-MoE's layer 1 is dense
        assert len(stacked) == len(meta(spec).experts) == 2 * moe_layers
        for r in stacked:
            want = params[r.megatron].detach()
            got = r.mapping.shard([ck.slice(h) for h in r.hf], Shard(0, 1), shapes)
            assert torch.equal(got, want), r.megatron
            half = r.mapping.shard([ck.slice(h) for h in ep_part(r.hf, 2, 1)], Shard(0, 1), shapes)
            assert torch.equal(half, ep_part(want, 2, 1))
            back = r.mapping.merge([got], shapes)
            assert len(back) == len(r.hf) and all(torch.equal(t, ck.tensor(h)) for t, h in zip(back, r.hf))
            # over TP (moe_tp_experts): gate/up rows or down columns; the shards merge back
            assert r.mapping.transform.split == ("column" if "gate_up" in r.megatron else "row")
            halves = [r.mapping.shard([ck.slice(h) for h in r.hf], Shard(i, 2), shapes) for i in range(2)]
            assert halves[0].numel() * 2 == want.numel()
            assert all(torch.equal(t, ck.tensor(h)) for t, h in zip(r.mapping.merge(halves, shapes), r.hf))
    if family == "mixtral":  # the saving-direction rename applies to each expert's name
        assert stacked[0].hf[0] == "model.layers.0.block_sparse_moe.experts.0.w1.weight"


def test_the_all_to_all_experts_module_computes_what_transformers_does():
    """ExpertsAllToAll (here over a one-rank EP group: every exchange is the identity, the
    reordering and the weighting are not) against the HF experts module it is mixed into:
    output, the experts' and the routing weights' gradients."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from megatron_bridge.runtime.tiny import tiny_config
    from megatron_bridge.runtime.transformers.experts import experts_class
    from megatron_bridge.testing import one_process_groups

    torch.manual_seed(0)
    cfg = tiny_config("qwen3_moe")
    ref = Qwen3MoeExperts(cfg)
    _perturb(ref, 0.2)
    mine = Qwen3MoeExperts(cfg)
    mine.load_state_dict(ref.state_dict())
    mine.__class__ = experts_class(Qwen3MoeExperts, ep=True, tp=False)
    x = torch.randn(12, cfg.hidden_size)
    idx = torch.stack([torch.randperm(cfg.num_experts)[:2] for _ in range(12)])
    w = torch.rand(12, 2)
    outs = []
    with one_process_groups():
        for m in (ref, mine):
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = m(xi, idx, wi)
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
            outs.append((y.detach(), xi.grad, wi.grad, m.gate_up_proj.grad, m.down_proj.grad))
    for a, b in zip(*outs):
        assert (a - b).abs().max() < 1e-6


def test_moe_layouts_the_hf_backend_cannot_run_yet_are_refused_by_the_layout_rule(tmp_path, saved):
    """Experts split over TP as transformers' `moe_tp_experts` says, so expert-TP is tp: another
    etp is refused by `backend-layout`, naming it; so is an ep that does not divide the experts.
    ep2, tp2 and ep2·tp2 pass, with sequence parallelism too."""
    from megatron_bridge.parallel.dims import ParallelDims
    from megatron_bridge.parallel.rules.registry import validate

    cfg, _ = compose(["recipe=tiny_llama", f"model.hf_path={saved['qwen3_moe']}", "model.backend=transformers"])
    spec = describe(cfg.model)
    assert spec.num_moe_experts == 4 and spec.moe_router_topk == 2
    for text in ("ep2", "tp2", "ep2tp2", "tp2sp", "ep2tp2sp"):
        validate(cfg, spec, dims=ParallelDims.parse(text).with_world(4), layout_only=True)
    for text, needle in (("ep2tp2etp1", "moe_tp_experts"),):
        with pytest.raises(LayoutError) as e:
            validate(cfg, spec, dims=ParallelDims.parse(text).with_world(4), layout_only=True)
        assert needle in str(e.value) and any(v.rule == "backend-layout" for v in e.value.violations)
    odd = tmp_path / "odd"
    odd.mkdir()
    hf = json.loads((saved["qwen3_moe"] / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**hf, "num_local_experts": 6}))  # as transformers saves num_experts
    cfg, _ = compose(["recipe=tiny_llama", f"model.hf_path={odd}", "model.backend=transformers"])
    with pytest.raises(LayoutError) as e:
        validate(cfg, describe(cfg.model), dims=ParallelDims.parse("ep4").with_world(4), layout_only=True)
    assert "6 experts do not split over ep=4" in str(e.value)


def test_a_router_expert_bias_buffer_is_a_checkpoint_row():
    """DeepSeek-V3's `e_score_correction_bias` is a persistent buffer, not a parameter: it is
    in the checkpoint, so the transformers backend's table reads and exports it like a weight (persistent
    buffers are exported since the 0-dim xIELU buffers of Apertus)."""
    from megatron_bridge.backends.transformers.backend import TransformersBackend
    from megatron_bridge.runtime.hf_tiny import tiny_config

    spec = describe_hf(tiny_config("deepseek_v3").to_dict(), backend="transformers")
    rows = {r.megatron: r for r in TransformersBackend().table(spec)}
    assert "model.layers.{layer}.mlp.gate.e_score_correction_bias" in rows, sorted(rows)[:20]


def test_experts_stacked_in_the_checkpoint_split_over_tp_as_the_builder_splits_them():
    """Granite-MoE saves its experts stacked (`input_linear.weight` [E, 2I, H], a rename): a TP
    rank takes its rows of the gate half and of the up half (what `chunk(2)` in its forward
    needs), or its columns of down_proj; merging the shards gives the tensor back bit-exactly."""
    e, i, h = 4, 6, 5
    gate_up, down = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    col, row = WholeStackedExperts("column", 2), WholeStackedExperts("row", 1)
    shards = [col.shard([gate_up], Shard(r, 2), None) for r in range(2)]
    gate, up = gate_up.chunk(2, 1)
    assert torch.equal(shards[1], torch.cat([gate[:, 3:], up[:, 3:]], 1))
    assert torch.equal(col.merge(shards, None)[0], gate_up)
    downs = [row.shard([down], Shard(r, 2), None) for r in range(2)]
    assert torch.equal(downs[0], down[:, :, :3]) and torch.equal(row.merge(downs, None)[0], down)


def test_granite_moe_experts_stacked_in_the_checkpoint_are_rows_that_split_over_tp():
    """The table gives Granite-MoE's renamed stacked experts a TP split (not replicated, which
    loaded whole into a split expert and was refused at tp2)."""
    from megatron_bridge.backends.transformers.backend import TransformersBackend
    from megatron_bridge.runtime.hf_tiny import tiny_config

    hf = {**tiny_config("granitemoe").to_dict(), "model_type": "granitemoe"}
    rows = {
        r.megatron: r
        for r in TransformersBackend().table(describe_hf(hf, make_vocab_size_divisible_by=8, backend="transformers"))
    }
    t = rows["model.layers.{layer}.block_sparse_moe.experts.gate_up_proj"]
    assert t.hf == ("model.layers.{layer}.block_sparse_moe.input_linear.weight",)
    assert repr(t.transform) == "WholeStackedExperts(column, packs=2)"


def test_identity_experts_split_over_tp_count_once(monkeypatch):
    """LongCat-Flash's zero-compute experts (`moe_identity_expert`) return their input whole on
    every TP rank: with its input divided by tp (`divide_input_by_tp`), two TP ranks' modules
    (each with its shards of the computing experts) sum to transformers' whole module, and the
    layout rules let tp2 run. The TP collectives run in the transformers matrix's tp2 rows."""
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashExperts

    from megatron_bridge.backends.transformers.backend import TransformersBackend
    from megatron_bridge.backends.transformers.experts import expert_split
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.hf_tiny import tiny_config
    from megatron_bridge.runtime.transformers import experts as experts_mod

    hf = {**tiny_config("longcat_flash").to_dict(), "model_type": "longcat_flash"}
    spec = describe_hf(hf, make_vocab_size_divisible_by=8, backend="transformers")
    assert TransformersBackend().layout_limits(spec, Layout.parse("tp2")) == []
    torch.manual_seed(0)
    cfg = tiny_config("longcat_flash")
    ref = LongcatFlashExperts(cfg)
    _perturb(ref, 0.05)
    total, h = ref.total_experts, ref.hidden_size
    tokens = 8
    args = (
        torch.randn(tokens, h),
        torch.stack([torch.randperm(total)[:2] for _ in range(tokens)]),
        torch.rand(tokens, 2),
    )
    assert (args[1] >= ref.num_routed_experts).any()  # some tokens pick an identity expert
    splits = {
        n: WholeStackedExperts(*expert_split(n, st))
        for n, st in (("gate_up_proj", "packed_colwise"), ("down_proj", "rowwise"))
    }
    monkeypatch.setattr(experts_mod.ps, "get_tensor_model_parallel_world_size", lambda: 2)
    parts = []
    for r in range(2):
        rank = LongcatFlashExperts(cfg)
        for n, t in splits.items():
            setattr(rank, n, torch.nn.Parameter(t.shard([getattr(ref, n).detach()], Shard(r, 2), None)))
        experts_mod.divide_input_by_tp(rank.identity_expert)
        parts.append(rank(*args))
    with torch.no_grad():
        assert (parts[0] + parts[1] - ref(*args)).abs().max() < 1e-5


def test_transposed_experts_split_over_tp_sum_to_transformers_experts():
    """Llama 4's and Aria's experts are stored transposed (`gate_up_proj [E, H, 2·I]` planned
    `packed_rowwise`, `down_proj [E, I, H]` planned `colwise`): the table (EXPERT_TP_SPLITS)
    splits each along the intermediate dim, gate and up halves on their own, so two TP ranks'
    modules (each with its shards, the mixin transformers' call convention picks) sum to the
    whole module's output and the shards merge back bit-exactly. The split is checked against
    transformers' own forward here; the TP collectives (with sequence parallelism) run in
    tests/dist/test_transformers_backend_parity.py's launch."""
    from transformers.models.aria.modeling_aria import AriaExperts
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    from megatron_bridge.backends.transformers.experts import expert_split
    from megatron_bridge.runtime.hf_tiny import tiny_config
    from megatron_bridge.runtime.transformers.experts import PrescaledExpertsSequenceTP, experts_class

    torch.manual_seed(0)
    for cls, model_type in ((Llama4TextExperts, "llama4_text"), (AriaExperts, "aria_text")):
        ref = cls(tiny_config(model_type))
        _perturb(ref, 0.05)
        e, h = ref.gate_up_proj.shape[:2]
        splits = {
            n: WholeStackedExperts(*expert_split(n, s))
            for n, s in (("gate_up_proj", "packed_rowwise"), ("down_proj", "colwise"))
        }
        shards = {
            n: [t.shard([getattr(ref, n).detach()], Shard(r, 2), None) for r in range(2)] for n, t in splits.items()
        }
        assert (
            2 * shards["gate_up_proj"][0].shape[2] == ref.gate_up_proj.shape[2] == 4 * shards["down_proj"][1].shape[1]
        )
        for n, t in splits.items():
            assert torch.equal(t.merge(shards[n], None)[0], getattr(ref, n))
        tokens = 6
        if cls is Llama4TextExperts:  # every token for every expert, pre-scaled: [E·T, h]
            args: tuple = (torch.randn(e * tokens, h),)
        else:
            args = (
                torch.randn(tokens, h),
                torch.stack([torch.randperm(e)[:2] for _ in range(tokens)]),
                torch.rand(tokens, 2),
            )
        parts = []
        for r in range(2):
            rank = cls(tiny_config(model_type))
            rank.gate_up_proj, rank.down_proj = (
                torch.nn.Parameter(shards[n][r]) for n in ("gate_up_proj", "down_proj")
            )
            parts.append(rank(*args))
        with torch.no_grad():
            assert (parts[0] + parts[1] - ref(*args)).abs().max() < 1e-5
    assert experts_class(Llama4TextExperts, ep=False, tp=True, sp=True).__mro__[1] is PrescaledExpertsSequenceTP
    assert experts_class(AriaExperts, ep=False, tp=True, sp=True).__mro__[1].__name__ == "ExpertsSequenceTP"


def test_prescaled_experts_exchange_over_ep_gives_transformers_experts_output(monkeypatch):
    """PrescaledExpertsEP's fixed exchange (Llama 4: `experts(hidden [E·T, h])`, every expert
    on every token) on two EP ranks, each a thread holding its half of the experts, the
    all-to-all an equal-split swap between them: each rank gets back, in its own [E·T, h]
    order, what the whole HF module computes on its input. The real collectives (and the
    gradients through them) run in the transformers matrix's ep2 layout."""
    import threading

    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    from megatron_bridge.runtime.hf_tiny import tiny_config
    from megatron_bridge.runtime.transformers import experts as ep_mod

    torch.manual_seed(0)
    cfg, ep, tokens = tiny_config("llama4_text"), 2, 5
    ref = Llama4TextExperts(cfg)
    _perturb(ref, 0.05)
    e, h = ref.gate_up_proj.shape[:2]
    local = e // ep
    xs = [torch.randn(e * tokens, h) for _ in range(ep)]
    sent: dict[int, torch.Tensor] = {}
    barrier, me = threading.Barrier(ep), threading.local()

    class Group:
        def size(self) -> int:
            return ep

    def swap(group, x):  # equal-split all-to-all: block d of rank s lands as block s on rank d
        barrier.wait()
        sent[me.rank] = x
        barrier.wait()
        got = torch.cat([sent[s].chunk(ep)[me.rank] for s in range(ep)])
        barrier.wait()
        return got

    monkeypatch.setattr(ep_mod, "all_to_all", swap)
    monkeypatch.setattr(ep_mod.ps, "get_expert_model_parallel_group", Group)
    outs: dict[int, torch.Tensor] = {}

    def run(r: int) -> None:
        me.rank = r
        mine = Llama4TextExperts(cfg)
        mine.gate_up_proj = torch.nn.Parameter(ref.gate_up_proj.detach()[r * local : (r + 1) * local].clone())
        mine.down_proj = torch.nn.Parameter(ref.down_proj.detach()[r * local : (r + 1) * local].clone())
        ep_mod.partition(mine, ep, tp=False)
        with torch.no_grad():
            outs[r] = mine(xs[r])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ep)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outs) == list(range(ep))
    with torch.no_grad():
        for r in range(ep):
            assert (outs[r] - ref(xs[r])).abs().max() < 1e-6


def test_llama4_experts_pass_the_layout_rules_at_tp2_and_an_unknown_expert_split_is_refused(tmp_path):
    """Llama 4 at tp2 passes the layout rules now its transposed split has table entries (with
    sequence parallelism too: its chunked-attention layers run whole); a
    (style, tensor) the table lacks —
    Inkling's `colwise` gate_up_proj [E, 2·I, H], which would part gate from up — is refused
    by name, listing what `moe_tp_experts` splits."""
    from megatron_bridge.backends.transformers.experts import expert_limits
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.parallel.dims import ParallelDims
    from megatron_bridge.parallel.rules.registry import validate
    from megatron_bridge.runtime.hf_tiny import tiny_config

    (tmp_path / "config.json").write_text(
        json.dumps({**tiny_config("llama4_text").to_dict(), "model_type": "llama4_text"})
    )
    cfg, _ = compose(["recipe=tiny_llama", f"model.hf_path={tmp_path}", "model.backend=transformers"])
    spec = describe(cfg.model)
    for text in ("pp2", "tp1", "tp2", "ep2", "ep2tp2"):  # ep: the override's ep plan (PrescaledExpertsEP)
        validate(cfg, spec, dims=ParallelDims.parse(text).with_world(4), layout_only=True)
    # with sequence parallelism too: its chunked-attention layers run whole (plan.sp_whole)
    validate(cfg, spec, dims=ParallelDims.parse("tp2sp").with_world(2), layout_only=True)
    plan = [
        ("model.layers.*.mlp.experts", "moe_tp_experts"),
        ("model.layers.*.mlp.experts.gate_up_proj", "colwise"),
        ("model.layers.*.mlp.experts.down_proj", "rowwise"),
    ]
    (what, fix), *_ = expert_limits(spec, Layout.parse("tp2"), (), plan)
    assert "experts.gate_up_proj 'colwise'" in what and "down_proj" not in what.partition(";")[0], what
    assert "gate_up_proj 'packed_rowwise'" in what and fix.startswith("set tp=1")
    assert expert_limits(spec, Layout.parse("pp2"), (), plan) == []


def test_a_converter_written_with_escaped_dots_stacks_the_experts_it_names():
    """DeepSeek-V4's converters spell their patterns as regexes (`\\.experts.*.w1.weight`): its
    per-expert checkpoint tensors (w1 gate, w3 up, w2 down, under `ffn`) are the stacked rows' too."""
    from megatron_bridge.runtime.hf_tiny import tiny_config

    m = meta(describe_hf({**tiny_config("deepseek_v4").to_dict(), "model_type": "deepseek_v4"}, backend="transformers"))
    gate_up, down = (
        m.experts["model.layers.0.mlp.experts.gate_up_proj"],
        m.experts["model.layers.0.mlp.experts.down_proj"],
    )
    assert gate_up[:2] == ("model.layers.0.ffn.experts.0.w1.weight", "model.layers.0.ffn.experts.0.w3.weight")
    assert down[-1] == f"model.layers.0.ffn.experts.{len(down) - 1}.w2.weight" and len(gate_up) == 2 * len(down)


def test_non_gated_experts_split_over_tp_sum_to_transformers_experts():
    """Nemotron-H's experts have no gate (`up_proj [E, I, H]` planned `colwise`, `down_proj
    [E, H, I]` `rowwise`): the table splits both along the intermediate dim, so two TP ranks'
    modules sum to the whole module's output (its activation, relu², acts element-wise)."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    from megatron_bridge.backends.transformers.experts import expert_split
    from megatron_bridge.runtime.hf_tiny import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config("nemotron_h")
    ref = NemotronHExperts(cfg)
    _perturb(ref, 0.05)
    splits = {
        n: WholeStackedExperts(*expert_split(n, s)) for n, s in (("up_proj", "colwise"), ("down_proj", "rowwise"))
    }
    shards = {n: [t.shard([getattr(ref, n).detach()], Shard(r, 2), None) for r in range(2)] for n, t in splits.items()}
    assert 2 * shards["up_proj"][0].shape[1] == ref.up_proj.shape[1] == 2 * shards["down_proj"][1].shape[2]
    e, tokens = ref.up_proj.shape[0], 6
    args = (torch.randn(tokens, ref.up_proj.shape[2]), torch.stack([torch.randperm(e)[:2] for _ in range(tokens)]),
            torch.rand(tokens, 2))  # fmt: skip
    parts = []
    for r in range(2):
        rank = NemotronHExperts(cfg)
        rank.up_proj, rank.down_proj = (torch.nn.Parameter(shards[n][r]) for n in ("up_proj", "down_proj"))
        parts.append(rank(*args))
    with torch.no_grad():
        assert (parts[0] + parts[1] - ref(*args)).abs().max() < 1e-5
