"""What a directory to start training from is, checked before any process group: an HF
directory (its index and headers; where our export recorded them, its files' CRC-32) or a
converted checkpoint (its manifest, every file's CRC-32, and every pickle in it naming only data).
Reads no tensor: the trainer's preflight (`train.init_from`, `model.hf_path`) and `mbr verify`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_bridge.convert.formats.dist_read import DistReader
from megatron_bridge.convert.formats.manifest import Manifest, check_index_crc32
from megatron_bridge.convert.formats.safetensors_io import PositionedReader, scan_dir
from megatron_bridge.convert.placement.rank_files import RELEASE
from megatron_bridge.convert.sources.megatron import find_megatron
from megatron_bridge.convert.sources.megatron_source import open_for
from megatron_bridge.convert.sources.readers import scan_rank_files
from megatron_bridge.errors import UserError


def check_data_only(path: Path) -> Manifest:
    """A converted checkpoint checked before anything loads it (`train.init_from`'s preflight):
    its manifest (names confined, sizes), and every pickle in it — the rank files of
    format=torch, the stored objects (`_extra_state`, ...) of torch_dist — names only data.
    Reads the pickles and checksums every file against the CRC-32 written at conversion (a
    changed byte, same size); runs nothing."""
    man = Manifest.read(path)
    man.check_files(path, checksums=True)
    if man.format == "torch_dist":
        io = PositionedReader()
        try:
            DistReader(path / RELEASE, io).scan_objects()
        finally:
            io.close()
    else:
        scan_rank_files(path, man)
    return man


def init_kind(path: str | Path, arg: str = "train.init_from") -> str:
    """What a directory to start training from is: "hf_dir" (config.json + safetensors),
    "converted" (an `mbr convert` / `mbr reshard` output) or "megatron" (a checkpoint Megatron-LM,
    NeMo or Megatron-Bridge wrote: `find_megatron`); UserError for anything else (a directory of
    pickled `.bin` weights included: those are never loaded)."""
    p = Path(path)
    if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        return "hf_dir"
    if (p / "mbr_manifest.json").is_file():
        return "converted"
    if find_megatron(p) is not None:
        return "megatron"
    raise UserError(
        f"{arg}={path} is neither a Hugging Face model directory (config.json + *.safetensors), "
        "a `mbr convert` output (mbr_manifest.json), nor a Megatron-LM / NeMo / Megatron-Bridge "
        "checkpoint (latest_checkpointed_iteration.txt beside iter_NNNNNNN/, an iter_NNNNNNN/ or release/ "
        "directory of torch_dist or mp_rank_* files, a NeMo directory of weights/ and context/)."
    )


def check_init_source(path: str | Path, arg: str = "train.init_from", spec: Any = None) -> None:
    """The trainer's preflight of the weights it will start from, before any process group:
    an HF directory's index and headers (names confined, no FIFO: `scan_dir`) and, where its
    index records them (our exports), its files' CRC-32; a converted checkpoint's manifest and
    pickles (`check_data_only`); a Megatron-written checkpoint opened as the source of the run's
    model `spec` (its pickles scanned, the model checked against what it recorded and holds:
    `megatron_source`). Reads no tensor (the checksums read the files' bytes)."""
    kind = init_kind(path, arg)
    if kind == "hf_dir":
        scan_dir(Path(path))
        check_index_crc32(Path(path))  # a directory we exported records its files' CRC-32
    elif kind == "megatron":
        if spec is not None:
            open_for(Path(path), spec, None).close()
    else:
        check_data_only(Path(path))


__all__ = ["check_data_only", "check_init_source", "init_kind"]
