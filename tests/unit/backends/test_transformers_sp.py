"""Sequence parallelism in the transformers backend: which unit of a decoder layer runs whole
(`plan.sp_whole`), what is still refused (`sp_refusals`), and the wrapper that runs a unit
whole (`whole_under_sp`) against the unsharded module at TP 2 in this process (threads on
torch's threaded process group: real collectives, no launch)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_transformers_embed import _threads  # the threaded TP group (same folder)

from megatron_bridge.backends.transformers.plan import WHOLE_ATTENTION, WHOLE_LAYER, plan_of, sp_refusals, sp_whole

SPLIT = {  # Qwen3-MoE-like: every module of the layer splits the sequence
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.experts": "moe_tp_experts",
}
PLANS = {
    "split": (SPLIT, "full_attention", None),
    "sliding": (SPLIT, "sliding_attention", None),
    # DeepSeek-V3 / PhiMoE: only the MLPs planned, the attention whole on every rank
    "attention unplanned": ({"layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}, "full_attention", WHOLE_ATTENTION),
    # OLMoE: q/k/v gathered over TP, o_proj splitting its replicated input
    "attention gathered": (
        {"layers.*.self_attn.q_proj": "colwise_gather_output", "layers.*.self_attn.o_proj": "rowwise_split_input", "layers.*.mlp.experts": "moe_tp_experts"},
        "full_attention",
        WHOLE_ATTENTION,
    ),
    # DeepSeek-V2 / GLM-4-MoE-Lite: MLA's whole kv down-projection
    "mla": ({**SPLIT, "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj"}, "full_attention", WHOLE_ATTENTION),
    # Qwen3-Next / MiniMax: a token mixer of its own kind
    "linear attention": (SPLIT, "linear_attention", WHOLE_LAYER),
    "conv": (SPLIT, "conv", WHOLE_LAYER),
    # LongCat-Flash: a style outside SP_STYLES next to the attention
    "other style in the mlp": ({**SPLIT, "layers.*.mlp.experts.identity_expert": "moe_identity_expert"}, "full_attention", WHOLE_LAYER),
}  # fmt: skip


@pytest.mark.parametrize("case", list(PLANS))
def test_the_unit_run_whole_under_sp_is_the_smallest_that_cannot_split(case):
    tp, kind, unit = PLANS[case]
    plan = plan_of("x", "model", tp, None, ["lm_head"])
    assert sp_whole(plan, kind) == unit
    assert sp_refusals(plan) == []  # inside the layers nothing is refused any more


def test_a_style_outside_sp_styles_outside_the_layers_is_still_refused_naming_it():
    tp = {**SPLIT, "embed_tokens": "replicate", "per_layer_projection": "colwise_gather_output"}
    (why,) = sp_refusals(plan_of("x", "model", tp, None, ["lm_head"]))
    assert "'colwise_gather_output' (per_layer_projection) outside the decoder layers" in why  # not the embedding


def test_a_stage_piece_holding_a_style_outside_sp_styles_runs_whole_instead_of_refusing():
    """Qwen4-Exp's fold of its streams before the head (no pp plan; Override.streams) holds a
    `rowwise_split_input` linear: the piece runs whole under SP (gathered in, sliced out), the
    decoder layers' own `rowwise_split_input` hyper-connections run whole with their layer."""
    from megatron_bridge.backends.transformers.plan import sp_whole_piece

    tp = {"hyper_connection_mixer.input_mix_weight_down": "rowwise_split_input", "layers.*.mlp.up_proj": "colwise"}
    plan = plan_of("qwen4_exp_text", "model", tp, None, ["lm_head"])
    assert plan.post == ("model.hyper_connection_mixer",)
    assert sp_whole_piece(plan, "model.hyper_connection_mixer") and sp_refusals(plan) == []
    assert not sp_whole_piece(plan, "model.layers.0") and not sp_whole_piece(plan, "model.embed_tokens")
    norm = plan_of("x", "model", {"layers.*.mlp.up_proj": "colwise"}, None, ["lm_head"])
    assert not sp_whole_piece(norm, "model.norm")  # nothing planned in it: it runs on the slice


class Mixer(torch.nn.Module):
    """A token mixer as an unsplittable attention is: a causal sum over the sequence, then a
    column/row-parallel pair (plain TP) and a replicated linear; a tuple out, as HF attention's."""

    def __init__(self, col: torch.nn.Module, row: torch.nn.Module, rep: torch.nn.Linear) -> None:
        super().__init__()
        self.col, self.row, self.rep = col, row, rep

    def forward(self, hidden_states: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, None]:
        h = hidden_states.cumsum(dim=1) * scale
        return self.row(torch.nn.functional.gelu(self.col(h))) + self.rep(h), None


def test_a_unit_run_whole_under_sp_equals_the_unsharded_module_and_its_gradients():
    from megatron.core.transformer import TransformerConfig

    from megatron_bridge.runtime.transformers.layers import ColumnLinear, RowLinear, whole_under_sp

    torch.manual_seed(0)
    b, s, h, f = 2, 6, 4, 8
    col, row, rep = torch.nn.Linear(h, f), torch.nn.Linear(f, h), torch.nn.Linear(h, h)
    full = Mixer(col, row, rep)
    x = torch.randn(b, s, h, requires_grad=True)
    target = torch.randn(b, s, h)
    (full(x, scale=0.5)[0] * target).sum().backward()
    # the units run whole hold plain TP's layers (sequence_parallel off: build.py `tp_config`)
    cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=1, use_cpu_initialization=True)

    def rank_run(rank: int, group: Any) -> tuple[torch.Tensor, ...]:
        kw = dict(config=cfg, init_method=torch.nn.init.zeros_, tp_group=group, bias=True)
        c = ColumnLinear(h, f, gather_output=False, **kw)
        r = RowLinear(f, h, input_is_parallel=True, skip_bias_add=False, **kw)
        mine = slice(rank * f // 2, (rank + 1) * f // 2)
        with torch.no_grad():
            c.weight.copy_(col.weight[mine]), c.bias.copy_(col.bias[mine])
            r.weight.copy_(row.weight[:, mine]), r.bias.copy_(row.bias)
        local_rep = torch.nn.Linear(h, h)
        local_rep.load_state_dict(rep.state_dict())
        unit = Mixer(c, r, local_rep)
        whole_under_sp(unit, group)
        xs = x.detach()[:, rank * s // 2 : (rank + 1) * s // 2].clone().requires_grad_()
        out, _ = unit(hidden_states=xs, scale=0.5)  # by keyword too, as decoder layers call attention
        (out * target[:, rank * s // 2 : (rank + 1) * s // 2]).sum().backward()
        return out.detach(), xs.grad, c.weight.grad, r.weight.grad, r.bias.grad, local_rep.weight.grad

    results = _threads(2, rank_run)
    exact = dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat([o for o, *_ in results], dim=1), full(x, scale=0.5)[0].detach(), **exact)
    # the input gradient: this rank's slice of the whole one, not summed over TP
    torch.testing.assert_close(torch.cat([r[1] for r in results], dim=1), x.grad, **exact)
    torch.testing.assert_close(torch.cat([r[2] for r in results]), col.weight.grad, **exact)
    torch.testing.assert_close(torch.cat([r[3] for r in results], dim=1), row.weight.grad, **exact)
    for *_, row_bias, rep_grad in results:  # replicated: the whole gradient on every rank, never halved
        torch.testing.assert_close(row_bias, row.bias.grad, **exact)
        torch.testing.assert_close(rep_grad, rep.weight.grad, **exact)
