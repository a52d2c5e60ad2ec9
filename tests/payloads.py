"""Checkpoints with a pickle payload in them, for the tests of "a checkpoint is data, never code".

The payload is a marker: unpickling it *creates a file* (`builtins.open(path, "w")`), so a
test proves that no load ran it by the marker's absence afterwards. Each helper plants it
where a stranger could: a training checkpoint's rank file (its manifest's sha256 recomputed,
as an attacker would), a DeepSpeed file, a torch_dist checkpoint's stored object
(`_extra_state`), a per-rank converted file, a `pytorch_model.bin` or `adapter_model.bin`.
Building them loads the project's own, trusted files; nothing here loads a payload.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from pathlib import Path


class MarkerPayload:
    """Unpickled, it calls `open(path, "w")`: the file appearing is the proof of execution."""

    def __init__(self, path: str | Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def torch_bytes(obj) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def rehash_training_manifest(iter_dir: Path) -> None:
    """Recompute every file's sha256 and size in a training checkpoint's manifest.json."""
    mf = iter_dir / "manifest.json"
    m = json.loads(mf.read_text())
    for e in m["files"]:
        data = (iter_dir / e["file"]).read_bytes()
        e.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    mf.write_text(json.dumps(m))


def training_checkpoint(root: Path, marker: Path, *, layout: str, engine: str = "megatron") -> Path:
    """A one-rank training checkpoint (iteration 2) whose `.pt` file carries the payload next
    to real tensors: `rank_00000.pt` (megatron engine) or DeepSpeed's model-states file (deepspeed
    engine, whose rank file holds the scheduler only). Manifest checksums recomputed."""
    import torch

    d = root / "iter_0000002"
    d.mkdir(parents=True)
    files = ["rank_00000.pt"]
    if engine == "deepspeed":
        (d / "rank_00000.pt").write_bytes(torch_bytes({"engine": {"scheduler": {"num_steps": 2}}, "step": 2}))
        (d / "deepspeed").mkdir()
        model = {"module": {"w": torch.zeros(4)}, "optimizer": MarkerPayload(marker)}
        (d / "deepspeed" / "mp_rank_00_model_states.pt").write_bytes(torch_bytes(model))
        files.append("deepspeed/mp_rank_00_model_states.pt")
    else:
        state = {"engine": {"model": [{"w": torch.zeros(4)}]}, "rng": MarkerPayload(marker), "step": 2}
        (d / "rank_00000.pt").write_bytes(torch_bytes(state))
    manifest = {
        "iteration": 2,
        "world_size": 1,
        "files": [{"file": f, "sha256": "", "bytes": 0} for f in files],
        "layout": layout,
        "engine": engine,
    }
    (d / "manifest.json").write_text(json.dumps(manifest))
    rehash_training_manifest(d)
    (root / "latest_checkpointed_iteration.txt").write_text("2\n")
    return root


def resize_converted_manifest(out: Path) -> None:
    """Record the current size and CRC-32 of every file in a converted checkpoint's
    mbr_manifest.json (as an attacker who edits files would: the checksums catch accidents and
    naive tampering, not a forger, so the pickle guard must hold on its own; the per-tensor
    CRCs are untouched)."""
    from megatron_bridge.convert.formats.manifest import file_crc32

    mf = out / "mbr_manifest.json"
    m = json.loads(mf.read_text())
    m["files"] = {rel: (out / rel).stat().st_size for rel in m["files"]}
    if "file_crc32" in m:
        m["file_crc32"] = {rel: file_crc32(out / rel) for rel in m["file_crc32"]}
    mf.write_text(json.dumps(m))


def payload_in_extra_state(out: Path, marker: Path) -> str:
    """Point one stored object of a torch_dist `mbr convert` output (a linear's `_extra_state`,
    which torch's DCP would `torch.load(weights_only=False)`) at a payload appended to its
    `.distcp` file. Returns the object's key."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    rel = out / "release"
    md = pickle.loads((rel / ".metadata").read_bytes())  # our own file: trusted
    key = next(k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    index = next(i for i in md.storage_data if i.fqn == key)
    info = md.storage_data[index]
    item = torch_bytes([MarkerPayload(marker)])
    f = rel / info.relative_path
    offset = f.stat().st_size
    with open(f, "ab") as h:
        h.write(item)
    md.storage_data[index] = _StorageInfo(info.relative_path, offset, len(item))
    (rel / ".metadata").write_bytes(pickle.dumps(md))
    resize_converted_manifest(out)
    return key


def payload_in_rank_file(out: Path, marker: Path) -> Path:
    """Add the payload to the first rank file of a per-rank (format=torch) `mbr convert` output."""
    import torch

    f = sorted((out / "release").rglob("model_optim_rng.pt"))[0]
    state = torch.load(f, weights_only=False)  # our own file: trusted
    state["payload"] = MarkerPayload(marker)
    f.write_bytes(torch_bytes(state))
    resize_converted_manifest(out)
    return f


def pickle_file(path: Path, marker: Path) -> Path:
    """A `torch.save` file holding only the payload (a `pytorch_model.bin`, `adapter_model.bin`)."""
    path.write_bytes(torch_bytes({"model.embed_tokens.weight": MarkerPayload(marker)}))
    return path
