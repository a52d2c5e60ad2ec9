"""The model description is backend-neutral, each backend's own part behind it (bridge/spec.py):
a part's fields read as the description's own, another backend's are an error naming them, and
every way of making or changing a description keeps the two apart."""

from __future__ import annotations

import pytest

from megatron_bridge.bridge.spec import NATIVE_FIELDS, BridgeSpec, NativeArch, TransformersArch, field_names

DIMS = dict(family="x", architecture="X", num_layers=2, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
            num_query_groups=1, head_dim=4, vocab_size=32)  # fmt: skip


def test_a_native_models_part_reads_as_its_own_and_changes_through_replace():
    spec = BridgeSpec.make(**DIMS, qk_layernorm=True)
    assert isinstance(spec.part, NativeArch) and spec.qk_layernorm and not spec.attention_sinks
    changed = spec.replace(attention_sinks=True, num_layers=4)
    assert changed.attention_sinks and changed.num_layers == 4 and changed.qk_layernorm
    assert changed != spec and spec.replace() == spec and hash(spec.replace()) == hash(spec)
    with pytest.raises(AttributeError, match="hf_json: a backend's part of a model description; this native model"):
        spec.hf_json  # noqa: B018


def test_a_transformers_model_has_no_native_building_blocks():
    spec = BridgeSpec.make(**DIMS, backend="transformers", hf_json='{"model_type": "x"}')
    assert isinstance(spec.part, TransformersArch) and spec.hf_json == '{"model_type": "x"}'
    with pytest.raises(AttributeError, match="qk_layernorm: the native backend's part .* this transformers model"):
        spec.qk_layernorm  # noqa: B018
    with pytest.raises(TypeError, match="has no native fields"):
        BridgeSpec.make(**DIMS, hf_json="{}", qk_layernorm=True)


def test_field_names_are_the_descriptions_and_its_parts():
    names = field_names()
    assert NATIVE_FIELDS <= names and "hf_json" in names and {"num_layers", "backend"} <= names
    assert not names & {"part", "name", "source", "described_from"}  # where it came from is not what it is
