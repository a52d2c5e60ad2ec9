"""The logit arithmetic a model's forward applies outside its modules (overrides.OVERRIDES), in one
process: Gemma 4's final logit softcap (on in the tiny configs, as in a released one) is read off the
config and applied by the last of two chunks cut by the builder, which give transformers' logits; the
test's cap bites on the tiny model (its logits without it are far off), so a dropped softcap fails. The TP/PP layouts
are `mbr verify --matrix model.backend=transformers 'verify.families=[gemma4_text,gemma4_unified_text]'` rows."""

from __future__ import annotations

import pytest
import torch

from megatron_bridge.backends.describe import describe_hf
from megatron_bridge.backends.transformers.backend import meta, model_plan
from megatron_bridge.backends.transformers.plan import override
from megatron_bridge.parallel.dims import ParallelDims


def _two_stages(ref, model_type: str):
    """The builder's two chunks (layers 0-1 with the embedding, 2-3 with the norm and the head) of
    `ref`'s config, holding `ref`'s weights."""
    from megatron_bridge.runtime.transformers.build import Stage, transformer_config

    cfg = ref.config
    spec = describe_hf(
        {**cfg.to_dict(), "model_type": model_type}, make_vocab_size_divisible_by=1, backend="transformers"
    )
    with torch.device("meta"):
        full = type(ref)(cfg)
    tconfig = transformer_config(spec, ParallelDims())
    stage = Stage(spec, full, model_plan(full), meta(spec).kinds, tconfig, torch.device("cpu"), False)
    half = cfg.num_hidden_layers // 2
    chunks = stage.chunk(range(half), True, False), stage.chunk(range(half, cfg.num_hidden_layers), False, True)
    weights = ref.state_dict()
    with torch.no_grad():
        for chunk in chunks:
            for name, t in chunk.state_dict().items():
                if isinstance(t, torch.Tensor):  # megatron layers' `_extra_state` entries are None
                    t.copy_(weights[name])
    return chunks


@pytest.mark.parametrize("model_type", ["gemma4_text", "gemma4_unified_text"])
def test_gemma4_softcaps_its_logits_as_transformers_does(groups1, model_type):
    from megatron_bridge.runtime.hf_tiny import build_tiny

    ref = build_tiny(model_type).eval()
    assert ref.config.final_logit_softcapping == 30.0  # on in the tiny config, as in a released one
    ref.config.final_logit_softcapping = cap = 1.0  # a cap the tiny logits feel far above tolerance
    assert override(model_type).constants(ref.config) == {"logit_softcap": cap}
    first, last = _two_stages(ref, model_type)
    ids = torch.randint(0, ref.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        last.eval().set_input_tensor(first.eval()(ids))
        got = last(ids)
        want = ref(ids).logits
        ref.config.final_logit_softcapping = None
        uncapped = ref(ids).logits
    assert (got - want).abs().max() < 1e-5
    assert (uncapped - want).abs().max() > 1e-2  # dropping the cap (or reading another value) fails by far
