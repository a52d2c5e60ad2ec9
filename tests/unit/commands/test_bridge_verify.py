"""`mbr verify` without processes: --list, user errors before any launch, the verdict logic."""

from __future__ import annotations

import torch

from megatron_bridge.cli import main
from megatron_bridge.runtime.parity import summarize


def test_list_prints_supported_families(capsys):
    assert main(["verify", "--list"]) == 0
    out = capsys.readouterr().out
    for arch in (
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "MixtralForCausalLM",
        "Qwen2MoeForCausalLM",
    ):
        assert arch in out


def test_needs_a_model(capsys):
    assert main(["verify"]) == 2
    assert "model.hf_path" in capsys.readouterr().err


def test_bad_layout_is_refused_before_launching(capsys, tmp_path):
    assert main(["verify", "verify.tiny=llama", f"verify.out={tmp_path}", "verify.layouts=[tp3,ep2]"]) == 2
    err = capsys.readouterr().err
    assert "[heads-tp] num_attention_heads=4 is not divisible by tp=3" in err and "[ep-dense]" in err


def test_unknown_check_and_unsupported_model(capsys, tmp_path):
    assert main(["verify", "verify.tiny=llama", f"verify.out={tmp_path}", "verify.checks=[speed]"]) == 2
    assert "speed" in capsys.readouterr().err
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", '
        '"hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2, '
        '"num_hidden_layers": 1, "vocab_size": 10, "hidden_act": "gelu"}'
    )
    assert main(["verify", f"model.hf_path={tmp_path / 'm'}"]) == 2
    assert "SwiGLU" in capsys.readouterr().err


def _rank(max_abs, ok_roundtrip=True, n=3):
    return {
        "L": {
            "logits": {"max_abs": max_abs, "mean_abs": max_abs / 2, "ref_max": 1.0, "padded_vocab": 8},
            "roundtrip": {"ok": ok_roundtrip, "n": n, "bad": [] if ok_roundtrip else ["x: values differ"]},
            "grads": {"n": n, "max_abs": 1e-7, "bad": []},
            "loss": {"value": 2.0},
        }
    }


def test_summarize_verdicts():
    ref = {"loss": 2.0, "grads": {"a": torch.zeros(1), "b": torch.zeros(1), "c": torch.zeros(1)}}
    lines, ok = summarize([{}, _rank(1e-6)], "L", ["logits", "roundtrip", "grads"], ref, tol=1e-4)
    assert ok and any("max-abs 1.000e-06" in x for x in lines)
    assert not summarize([_rank(1e-3)], "L", ["logits"], ref, tol=1e-4)[1]
    assert not summarize([_rank(0.0, ok_roundtrip=False)], "L", ["roundtrip"], ref)[1]
    assert not summarize([_rank(0.0, n=2)], "L", ["grads"], ref)[1]  # a tensor without gradient check
    assert not summarize([{}], "L", ["logits"], ref)[1]


def test_matrix_lists_refused_layouts_with_the_rule(capsys, tmp_path):
    """A layout the rules refuse is a row naming the rule, not a missing row (no launch)."""
    args = ["verify", "--matrix", "verify.families=[qwen2]", "verify.layouts=[ep2]", f"verify.out={tmp_path}"]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| family | layout | logits max-abs")
    assert out[2].startswith("| qwen2 | tp1·pp1·cp1·ep2 |") and "refused: [ep-dense]" in out[2]
    assert main(["verify", "--matrix", "verify.families=[nosuch]"]) == 2


def test_matrix_row_verdict():
    from types import SimpleNamespace

    from megatron_bridge.commands.verify_matrix import _row

    cfg = SimpleNamespace(verify=SimpleNamespace(tol=1e-4, grad_tol=1e-5))
    good = dict(logits_max=1e-6, loss_delta=0.0, grads_n=3, grads_want=3, grads_max=1e-7, grads_bad=[])
    good.update(grad_layout=None, rt_ok=True, rt_n=3)
    assert _row("f", "tp2", good, cfg).endswith("| 3 bit-exact | OK |")
    assert _row("f", "tp2", {**good, "grads_n": 2}, cfg).endswith("| FAIL |")
    assert _row("f", "tp2", {**good, "logits_max": 1e-3}, cfg).endswith("| FAIL |")
    assert _row("f", "tp2", {**good, "rt_ok": False}, cfg).endswith("| FAIL | FAIL |")
    assert "no rank reported" in _row("f", "tp2", None, cfg)
