"""Which attention path the local spec takes by head dim (runtime/cp_attention.py): SDPA where
PyTorch has a fused kernel, explicit matmuls above head dim 256 on a GPU while the scores fit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_bridge.runtime.cp_attention import (
    EAGER_SCORES_MAX_BYTES,
    allowed_mask,
    eager_attention,
    sdpa_is_slow,
)


def test_eager_attention_without_cap_is_sdpa():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 12, 16, dtype=torch.float64)
    k, v = torch.randn(2, 2, 12, 16, dtype=torch.float64), torch.randn(2, 2, 12, 16, dtype=torch.float64)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=True)
    got = eager_attention(q, k, v, allowed_mask(torch.arange(12), torch.arange(12), True, None), 0.25)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # the softmax runs in fp32


def test_explicit_path_only_for_gpu_head_dims_without_a_fused_kernel():
    def q(head_dim, seq=4096, heads=8, cuda=True):
        return SimpleNamespace(is_cuda=cuda, shape=(1, heads, seq, head_dim))

    assert sdpa_is_slow(q(512), 4096)  # the H200 case: 4.4-5.4x faster explicitly
    assert not sdpa_is_slow(q(256), 4096)  # flash / cuDNN take it
    assert not sdpa_is_slow(q(512, cuda=False), 4096)  # the CPU kernel takes any head dim
    # scores over the cap: SDPA's kernels never form them, so long sequences stay there
    seq = int((EAGER_SCORES_MAX_BYTES / (8 * 4)) ** 0.5) + 1
    assert not sdpa_is_slow(q(512, seq=seq), seq)
    assert sdpa_is_slow(q(512, seq=seq - 2), seq - 2)
    assert not sdpa_is_slow(torch.zeros(1, 2, 4, 512), 4)


def test_hf_backend_takes_the_explicit_path_for_wide_heads_on_a_gpu():
    from transformers import Gemma4TextConfig, LlamaConfig

    from megatron_bridge.runtime.transformers.attention import NAME, implementation

    gemma4, llama = Gemma4TextConfig(), LlamaConfig()  # global layers: head dim 512; Llama: 128
    for c in (gemma4, llama):
        c._attn_implementation = "sdpa"
    assert implementation(gemma4, torch.device("cuda")) == NAME
    assert implementation(gemma4, torch.device("cpu")) == "sdpa"
    assert implementation(llama, torch.device("cuda")) == "sdpa"
    gemma4._attn_implementation = "eager"  # a user's choice stays
    assert implementation(gemma4, torch.device("cuda")) == "eager"


@pytest.mark.parametrize("family", ["llama", "gemma3", "gemma4_text"])
def test_hf_explicit_path_gives_sdpas_logits(family, monkeypatch):
    """With the rule forced on the CPU, `mbr_sdpa` (the model's eager function under SDPA's
    masks: causal from None, Gemma 3's sliding-window boolean masks; Gemma 4) gives SDPA's logits."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

    from megatron_bridge.runtime import hf_tiny
    from megatron_bridge.runtime.transformers import attention

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=16)
    small |= dict(num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    if family == "gemma4_text":  # the target: global layers of head dim 512 in the real model
        model = hf_tiny.build_tiny(family).eval()
        model.config._attn_implementation = "sdpa"
    else:
        config = LlamaConfig(**small) if family == "llama" else Gemma3TextConfig(**small, sliding_window=3)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    ids = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        want = model(ids).logits
        model.config._attn_implementation = attention.NAME
        monkeypatch.setattr(attention, "sdpa_is_slow", lambda q, sk: True)
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
