"""config.json with NaN or infinity is refused where it is read (issue 23: `rms_norm_eps: NaN`)."""

import json

import pytest

from megatron_bridge.bridge.hf_config import read_hf_config
from megatron_bridge.errors import UserError


def test_config_json_with_nan_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"rms_norm_eps": float("nan"), "rope": {"factor": [1e999]}}))
    with pytest.raises(UserError, match=r"non-finite numbers: rms_norm_eps: nan, rope.factor\[0\]: inf"):
        read_hf_config(tmp_path)
