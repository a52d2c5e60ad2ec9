"""What `mbr export` / `mbr reshard` refuse of a training checkpoint before reading a tensor, and
how a shard's optimizer state is put together from its replicas' ranges (train/ckpt_source.py).
The round trips themselves (tp2·pp2 -> tp1·pp2 -> tp2·pp2, ep2 -> ep4, resumed) run in
tests/dist/test_train.py's launch."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest
import torch

from megatron_bridge.cli import main as mbr
from megatron_bridge.errors import UserError
from megatron_bridge.train.ckpt_source import _assemble
from megatron_bridge.train.manifest import LATEST, MANIFEST, is_training_checkpoint

GRID = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "etp": 1, "vpp": None, "layers_first_stage": None,
        "layers_last_stage": None, "world_size": 1, "dp": 1, "zero_stage": 0}  # fmt: skip


def _checkpoint(root: Path, **manifest: object) -> Path:
    """A one-rank checkpoint in the trainer's layout (checkpoint.py) with `manifest`'s fields."""
    d = root / "iter_0000002"
    d.mkdir(parents=True)
    buf = io.BytesIO()
    torch.save({"engine": {"model": [{}], "optimizer": [], "scheduler": {}}, "rng": {}, "step": 2}, buf)
    (d / "rank_00000.pt").write_bytes(buf.getvalue())
    files = [
        {"file": "rank_00000.pt", "sha256": hashlib.sha256(buf.getvalue()).hexdigest(), "bytes": len(buf.getvalue())}
    ]
    (d / MANIFEST).write_text(json.dumps({"iteration": 2, "world_size": 1, "files": files, **manifest}))
    (root / LATEST).write_text("2\n")
    return root


@pytest.mark.parametrize(
    "case,manifest,message",
    [
        ("deepspeed", {"engine": "deepspeed", "grid": GRID}, "trained with the deepspeed engine"),
        ("lora", {"engine": "megatron", "grid": GRID, "peft": "lora r=8"}, "is a LoRA run's checkpoint"),
        ("old", {"engine": "megatron"}, "did not record its layout's grid"),
        ("other_model", {"engine": "megatron", "grid": GRID, "model": "X layers=1"}, "holds X layers=1, but the model"),
    ],
)
def test_what_cannot_be_read_is_refused_naming_the_fix(case, manifest, message, tmp_path, capsys):
    ck = _checkpoint(tmp_path / case, **manifest)
    assert is_training_checkpoint(ck) and is_training_checkpoint(ck / "iter_0000002")
    for argv in (
        ["export", f"src={ck}", f"dst={tmp_path / 'out'}"],
        ["reshard", f"src={ck}", f"dst={tmp_path / 'out'}"],
    ):
        assert mbr([*argv, "recipe=tiny_llama", "progress=off"]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
        assert not (tmp_path / "out").exists()


def test_a_converted_output_is_not_taken_for_a_training_checkpoint(tmp_path):
    """`mbr convert` writes Megatron's tracker (same name as the trainer's pointer) beside its manifest."""
    (tmp_path / LATEST).write_text("release")
    (tmp_path / "mbr_manifest.json").write_text("{}")
    assert not is_training_checkpoint(tmp_path)


def test_a_shard_is_put_together_from_its_replicas_ranges():
    full = torch.arange(12.0)
    e = [{"range": (a, b), "shape": (3, 4), "exp_avg": full[a:b]} for a, b in ((4, 8), (0, 4), (8, 12))]
    assert torch.equal(_assemble(e, "exp_avg", "x"), full.view(3, 4))  # the distributed optimizer's shares
    whole = [{"range": (0, 12), "shape": (3, 4), "exp_avg": full} for _ in range(2)]
    assert torch.equal(_assemble(whole, "exp_avg", "x"), full.view(3, 4))  # a plain optimizer's replicas
    with pytest.raises(UserError, match="leave elements 4..8 out"):
        _assemble([e[1], e[2]], "exp_avg", "x")
    with pytest.raises(UserError, match="cover 8 of 12"):
        _assemble(e[:2], "exp_avg", "x")
