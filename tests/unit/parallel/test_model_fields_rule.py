"""`model-fields`: a family trained from its model-group fields (no model.hf_path) must be one
whose exported config.json describes the trained model; transformers is the oracle for what a
config means (the exported config of an accepted family builds the same spec back and loads)."""

from __future__ import annotations

import pytest

from megatron_bridge.backends.describe import describe
from megatron_bridge.config.compose import compose
from megatron_bridge.errors import LayoutError
from megatron_bridge.parallel.rules.registry import validate


def _rules(*overrides):
    cfg, _ = compose(["recipe=default", *overrides])
    try:
        validate(cfg, describe(cfg.model))
    except LayoutError as e:
        return {v.rule: str(e) for v in e.violations}
    return {}


@pytest.mark.parametrize(
    "family, says",
    [
        ("gemma2", "embedding_multiplier=1.0 would read back as 8.0"),  # HF Gemma scales embeddings by sqrt(hidden)
        ("gemma3_text", "embedding_multiplier"),
        ("gpt_oss", "cannot be written"),  # biased experts with unbiased attention: not a model-group model
    ],
)
def test_families_the_model_group_cannot_describe_are_refused(family, says):
    got = _rules(f"model.family={family}")
    assert set(got) == {"model-fields"} and says in got["model-fields"] and "model.hf_path=DIR" in got["model-fields"]


@pytest.mark.parametrize("family", ["llama", "mixtral", "qwen3", "granite", "olmo2"])
def test_families_described_by_their_fields_are_accepted(family):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_bridge.bridge.hf_config import spec_from_hf, spec_to_hf_config
    from megatron_bridge.parallel.rules.model import _scaled

    assert _rules(f"model.family={family}") == {}
    cfg, _ = compose(["recipe=default", f"model.family={family}", "model.num_layers=1", "model.vocab_size=256"])
    spec = describe(cfg.model)
    hf = spec_to_hf_config(spec)
    assert _scaled(spec_from_hf(hf, make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by)) == _scaled(spec)
    conf = AutoConfig.for_model(**hf)
    model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)  # the exported config builds
    assert model.config.hidden_size == spec.hidden_size


def test_a_config_json_lifts_the_refusal(tmp_path):
    from megatron_bridge.runtime.tiny import make_tiny

    hf = make_tiny("gemma2", tmp_path / "gemma2")
    assert _rules(f"model.hf_path={hf}") == {}
