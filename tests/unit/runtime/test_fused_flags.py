"""`train.fused=true` asks for megatron-core's fused kernels only where they compute what they
replace: SwiGLU without a clamp or offset (its GeLU kernels are the tanh approximation), the
fused cross entropy in bf16 runs alone (its logits gradient is bf16)."""

import torch.nn.functional as F

from megatron_bridge.config.compose import compose
from megatron_bridge.runtime.tconfig import fusable_activation, gelu_tanh
from megatron_bridge.train.job import model_overrides


def test_only_an_exact_swiglu_is_fused():
    assert fusable_activation({"activation_func": F.silu, "gated_linear_unit": True})
    assert not fusable_activation({"activation_func": F.silu, "gated_linear_unit": False})
    assert not fusable_activation({"activation_func": F.gelu, "gated_linear_unit": True})  # tanh kernel
    assert not fusable_activation({"activation_func": gelu_tanh, "gated_linear_unit": True})
    clamped = {"activation_func": F.silu, "gated_linear_unit": True, "activation_func_clamp_value": 7.0}
    assert not fusable_activation(clamped)
    assert not fusable_activation({"activation_func": F.silu, "gated_linear_unit": True, "glu_linear_offset": 1.0})


def test_fused_cross_entropy_in_bf16_runs_only():
    def flags(*overrides):
        cfg, _ = compose(["recipe=default", *overrides])
        return model_overrides(cfg)

    assert "bias_activation_fusion" not in flags("train.precision=bf16")
    bf16 = flags("train.fused=true", "train.precision=bf16")
    assert bf16["bias_activation_fusion"] and bf16["bias_dropout_fusion"]
    assert bf16["cross_entropy_loss_fusion"] and bf16["cross_entropy_fusion_impl"] == "native"
    fp32 = flags("train.fused=true", "train.precision=fp32")
    assert fp32["bias_activation_fusion"] and "cross_entropy_loss_fusion" not in fp32
