"""Training a transformers-backend MoE with transformers' router load-balancing loss: where it can run
and what is refused before anything starts (`backend-run`), naming the missing piece. The loss
itself: tests/unit/runtime/test_transformers_aux_loss.py (tp1), tests/dist/test_train.py (ep2)."""

from __future__ import annotations

import pytest

from megatron_bridge.backends.describe import describe
from megatron_bridge.backends.transformers.aux import aux_limits, aux_seam
from megatron_bridge.config.compose import compose
from megatron_bridge.errors import LayoutError


def test_the_seam_is_read_from_transformers_declarations():
    from transformers import JetMoeConfig, Qwen3MoeConfig
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qm

    seam = aux_seam(Qwen3MoeConfig())
    assert not isinstance(seam, str)
    assert (seam.loss_func, seam.router, seam.index) == (qm.load_balancing_loss_func, qm.Qwen3MoeTopKRouter, 0)
    jet = aux_limits(JetMoeConfig(output_router_logits=True), 1)  # two recorders (attention and MLP routers)
    assert len(jet) == 1 and "JetMoeForCausalLM" in jet[0][0] and "_can_record_outputs" in jet[0][0]
    assert aux_limits(JetMoeConfig(), 1) == []  # off: transformers trains without it, and so does hf


def test_moe_trains_on_hf_at_pp1_and_with_the_aux_loss_at_pp2_is_refused(tmp_path):
    from megatron_bridge.parallel.rules.registry import validate
    from megatron_bridge.runtime.tiny import tiny_config

    for on in (True, False):
        tiny_config("qwen3_moe", output_router_logits=on).save_pretrained(tmp_path / str(on))
    base = ["recipe=tiny_llama", "model.backend=transformers", "parallel.tp=1"]
    cfg, _ = compose([*base, f"model.hf_path={tmp_path / 'True'}", "parallel.pp=1"])
    validate(cfg, describe(cfg.model), world_size=2)  # trains (ep plan and dp as configured)
    cfg, _ = compose([*base, f"model.hf_path={tmp_path / 'True'}", "parallel.pp=2"])
    with pytest.raises(LayoutError) as e:
        validate(cfg, describe(cfg.model), world_size=2)
    assert [v.rule for v in e.value.violations] == ["backend-run"], str(e.value)
    assert "couples every layer's router counts" in str(e.value) and "parallel.pp=1" in str(e.value)
    cfg, _ = compose([*base, f"model.hf_path={tmp_path / 'False'}", "parallel.pp=2"])
    validate(cfg, describe(cfg.model), world_size=2)  # no aux loss: nothing couples the stages
