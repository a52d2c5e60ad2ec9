"""What a directory to start training from is, checked before any process group: an HF
directory (its index and headers; where our export recorded them, its files' CRC-32) or a
converted checkpoint (its manifest, every file's CRC-32, and every pickle in it naming only data).
Reads no tensor: the trainer's preflight (`train.init_from`, `model.hf_path`) and `mbr verify`'s.
"""

from __future__ import annotations

from pathlib import Path

from megatron_bridge.convert.formats.dist_read import DistReader
from megatron_bridge.convert.formats.manifest import Manifest, check_index_crc32
from megatron_bridge.convert.formats.safetensors_io import PositionedReader, scan_dir
from megatron_bridge.convert.placement.rank_files import RELEASE
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
    """What a directory to start training from is: "hf_dir" (config.json + safetensors) or
    "converted" (an `mbr convert` / `mbr reshard` output); UserError for anything else (a
    directory of pickled `.bin` weights included: those are never loaded)."""
    p = Path(path)
    if (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        return "hf_dir"
    if (p / "mbr_manifest.json").is_file():
        return "converted"
    raise UserError(
        f"{arg}={path} is neither a Hugging Face model directory (config.json + "
        "*.safetensors) nor a `mbr convert` output (mbr_manifest.json)."
    )


def check_init_source(path: str | Path, arg: str = "train.init_from") -> None:
    """The trainer's preflight of the weights it will start from, before any process group:
    an HF directory's index and headers (names confined, no FIFO: `scan_dir`) and, where its
    index records them (our exports), its files' CRC-32; a converted checkpoint's manifest and
    pickles (`check_data_only`). Reads no tensor (the checksums read the files' bytes)."""
    if init_kind(path, arg) == "hf_dir":
        scan_dir(Path(path))
        check_index_crc32(Path(path))  # a directory we exported records its files' CRC-32
    else:
        check_data_only(Path(path))


__all__ = ["check_data_only", "check_init_source", "init_kind"]
