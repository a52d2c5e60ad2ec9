"""`mbr convert`'s byte-level non-finite check (convert/formats/finite.py), every float dtype."""

import math

import pytest
import torch

from megatron_bridge.convert.formats.dtypes import BY_NAME
from megatron_bridge.convert.formats.finite import all_finite


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16", "float64", "float8_e4m3fn"])
def test_byte_level_check_finds_nan_and_inf_in_every_float_dtype(name):
    dtype = getattr(torch, name)
    t = (torch.randn(1000) * 10).to(dtype)
    raw = lambda x: x.view(torch.uint8).numpy().tobytes()  # noqa: E731
    assert all_finite(BY_NAME[name], raw(t))
    for bad in [math.nan] + ([] if name == "float8_e4m3fn" else [math.inf, -math.inf]):
        u = t.clone()
        u[517] = bad
        assert not all_finite(BY_NAME[name], raw(u)), (name, bad)


def test_a_bad_value_past_the_first_block_is_found(monkeypatch):
    """The check masks a block at a time into a reused buffer: every block is looked at."""
    from megatron_bridge.convert.formats import finite

    monkeypatch.setattr(finite, "BLOCK", 1000)
    t = torch.randn(5500).to(torch.bfloat16)
    for at in (0, 999, 1000, 5499):
        u = t.clone()
        u[at] = math.inf
        assert not all_finite(BY_NAME["bfloat16"], u.view(torch.uint8).numpy().tobytes()), at
    assert all_finite(BY_NAME["bfloat16"], t.view(torch.uint8).numpy().tobytes())
