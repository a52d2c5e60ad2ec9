"""Resuming loads a training checkpoint as data, never code; its manifest's names stay inside it.

The payload (`tests/payloads.MarkerPayload`) sits in a rank file or a DeepSpeed file with the
manifest's sha256 recomputed — what an attacker who hands over a checkpoint would do, so the
checksums pass and only the allowlist stands between the file and the unpickler. Each test
also proves that nothing ran: the marker file the payload would create does not exist."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

from megatron_bridge.cli import main as mbr
from megatron_bridge.convert.formats.pickle_guard import TRAINING
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.safe_load import only_weights, torch_load
from megatron_bridge.train import checkpoint as ckpt
from megatron_bridge.train import manifest
from tests.payloads import MarkerPayload, rehash_training_manifest, torch_bytes, training_checkpoint

REFUSED = f"was refused: it holds a `{open.__module__}.open` object"
LAYOUT = "tp1·pp1·cp1·ep1·etp1·dp1 zero0 world=1 mbs=1 gbs=8 accum=8"


@pytest.mark.parametrize("engine", ["megatron", "deepspeed"])
def test_resume_refuses_a_payload_and_runs_nothing(tmp_path, engine, capsys):
    marker = tmp_path / "MARKER"
    root = training_checkpoint(tmp_path / "ck", marker, layout=LAYOUT, engine=engine)
    d = manifest.iter_dir(root, 2)
    written = manifest.read_manifest(d)
    with pytest.raises(UserError, match=REFUSED):  # the trainer's preflight, before any process group
        manifest.scan_pickles(d, written)
    with pytest.raises(UserError, match=REFUSED):  # the load itself (verify, then torch_load)
        ckpt.load(root, {"layout": LAYOUT, "engine": engine})
    assert mbr(["check-ckpt", str(root)]) == 2
    assert REFUSED in capsys.readouterr().err
    assert not marker.exists()


def test_the_load_itself_is_weights_only(tmp_path):
    """Without the scan in front (a file swapped after verification): `torch_load` refuses."""
    marker = tmp_path / "MARKER"
    f = tmp_path / "rank_00000.pt"
    f.write_bytes(torch_bytes({"engine": {}, "rng": MarkerPayload(marker)}))
    with pytest.raises(UserError, match=REFUSED) as e:
        torch_load(f, TRAINING, map_location="cpu")
    assert str(f) in str(e.value) and not marker.exists()


def test_a_real_training_state_loads(tmp_path):
    """What a rank file holds — the NumPy RNG state (an ndarray), python's, torch's, tensors,
    a scheduler's plain values — loads under the allowlist, and resumes bit-exactly."""
    rng = ckpt.rng_state()
    state = {"engine": {"scheduler": {"num_steps": 3, "decay_style": "cosine"}}, "rng": rng, "step": 3}
    ckpt.save(tmp_path, 3, state, {"layout": LAYOUT})
    it, back = ckpt.load(tmp_path, {"layout": LAYOUT})
    assert it == 3 and back["engine"] == state["engine"]
    assert torch.equal(back["rng"]["torch"], rng["torch"]) and back["rng"]["python"] == rng["python"]
    assert (back["rng"]["numpy"][1] == rng["numpy"][1]).all()


def test_deepspeed_loads_are_made_weights_only(tmp_path):
    """DeepSpeed's checkpoint engine asks for `torch.load(weights_only=False)`; inside
    `only_weights` it gets the allowlist: its own records load, a payload is refused."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    marker = tmp_path / "MARKER"
    good, bad = tmp_path / "optim_states.pt", tmp_path / "model_states.pt"
    good.write_bytes(torch_bytes({"loss_scaler": LossScaler(1.0), "zero_stage": ZeroStageEnum(1), "w": torch.ones(2)}))
    bad.write_bytes(torch_bytes({"module": {"w": torch.ones(2)}, "x": MarkerPayload(marker)}))
    engine = TorchCheckpointEngine()
    with only_weights(TRAINING):
        assert engine.load(str(good), map_location="cpu")["zero_stage"] == ZeroStageEnum(1)
        with pytest.raises(UserError, match=REFUSED):
            engine.load(str(bad), map_location="cpu")
    assert torch.load is torch.serialization.load  # put back
    assert not marker.exists()


@pytest.mark.parametrize(
    "name,match",
    [
        ("../../elsewhere.pt", "an absolute path or one with '..'"),
        ("/etc/passwd", "an absolute path"),
        ("sub", "is a directory, not a regular file"),
    ],
)
def test_manifest_names_stay_inside(tmp_path, name, match):
    d = ckpt.save(tmp_path, 1, {"a": 1}, {})
    (d / "sub").mkdir()
    m = json.loads((d / manifest.MANIFEST).read_text())
    m["files"].append({"file": name, "sha256": "0" * 64, "bytes": 1})
    (d / manifest.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(UserError, match=match):
        manifest.peek(tmp_path)
    with pytest.raises(UserError, match=match):
        manifest.verify(d)


def test_a_fifo_in_the_manifest_is_refused_not_opened(tmp_path, capsys):
    d = ckpt.save(tmp_path, 1, {"a": 1}, {})
    os.mkfifo(d / "extra.pt")
    m = json.loads((d / manifest.MANIFEST).read_text())
    m["files"].append({"file": "extra.pt", "sha256": "0" * 64, "bytes": 0})
    (d / manifest.MANIFEST).write_text(json.dumps(m))
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(mbr(["check-ckpt", str(tmp_path)])), daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "check-ckpt opened the FIFO"
    assert rc == [2] and "is a FIFO (named pipe), not a regular file" in capsys.readouterr().err


def test_a_tampered_rank_file_with_its_checksum_fixed_still_fails_the_scan(tmp_path):
    """The sha256 proves the file is the one the manifest lists, not that its author was
    honest: rehashing is free for an attacker, the allowlist is what holds."""
    marker = tmp_path / "MARKER"
    d = ckpt.save(tmp_path, 1, {"w": torch.zeros(2)}, {})
    (d / "rank_00000.pt").write_bytes(torch_bytes({"w": torch.zeros(2), "x": MarkerPayload(marker)}))
    rehash_training_manifest(d)
    with pytest.raises(UserError, match=REFUSED):
        manifest.verify(d)
    assert not marker.exists()


def test_resuming_another_models_state_is_one_message():
    from megatron_bridge.train.engines import model_must_fit

    with pytest.raises(UserError, match="cannot resume ck: it holds the state of another model.*Resume with the model"):
        with model_must_fit(Path("ck")):
            torch.nn.Linear(2, 2).load_state_dict({"weight": torch.zeros(3, 2), "bias": torch.zeros(2)})


def test_the_allowlist_is_exactly_ours_whatever_megatron_registered(tmp_path):
    """megatron-core adds classes to torch's allowlist process-wide at import (BytesIO,
    PosixPath, ...); a checkpoint load admits only torch's own names and pickle_guard's, and
    leaves megatron's registrations as they were."""
    import io

    import megatron.core  # noqa: F401 - registers its safe globals

    before = set(map(repr, torch.serialization.get_safe_globals()))
    assert repr(io.BytesIO) in before
    f = tmp_path / "bytesio.pt"
    f.write_bytes(torch_bytes({"x": io.BytesIO(b"abc")}))
    with pytest.raises(UserError, match="holds a `_io.BytesIO` object"):
        torch_load(f, TRAINING)
    assert set(map(repr, torch.serialization.get_safe_globals())) == before


def test_deepspeed_engine_load_checkpoint_refuses_a_payload(tmp_path):
    """A real DeepSpeed engine (ZeRO-1, one process) saves, a payload is planted in its ZeRO
    file, and `load_checkpoint` inside `only_weights` refuses it; the clean one loads."""
    import deepspeed

    from megatron_bridge.runtime.cpu import deepspeed_without_shm_op
    from megatron_bridge.testing import free_port

    env = dict(os.environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        config = {
            "train_batch_size": 1,
            "zero_optimization": {"stage": 1},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        }
        deepspeed_without_shm_op()  # as the DeepSpeed engine does: no 30 s JIT build of an unused op
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
        engine.save_checkpoint(str(tmp_path), tag="t", save_latest=False)
        with only_weights(TRAINING):
            engine.load_checkpoint(str(tmp_path), tag="t")
        marker = tmp_path / "MARKER"
        (f,) = (tmp_path / "t").glob("*optim_states.pt")
        sd = torch.load(f, weights_only=False)  # our own file: trusted
        f.write_bytes(torch_bytes({**sd, "x": MarkerPayload(marker)}))
        with only_weights(TRAINING), pytest.raises(UserError, match=REFUSED):
            engine.load_checkpoint(str(tmp_path), tag="t")
        assert not marker.exists()
    finally:
        torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)
