"""`mbr_manifest.json`: what a converted checkpoint holds, so it can be read back exactly.

Written last into every `mbr convert` / `mbr reshard` output (its presence marks a complete
checkpoint, and `train.init_from` recognises the directory by it). It records:

* the source HF `config.json` (also copied next to it, so `model.hf_path=OUT` describes the
  model) and the non-weight files copied along (tokenizer, generation config);
* format (`torch_dist` or `torch`), layout (tp/pp/vpp/ep/etp), dtype and
  `make_vocab_size_divisible_by` (the padded vocab of the stored embedding);
* every HF tensor: name, shape, dtype, CRC-32 of its bytes. Export and reshard rebuild each
  HF tensor and compare, so a round trip is checked bit for bit, and a corrupted or
  tampered file is reported by tensor name;
* every written file and its size: a truncated file is refused before reading it.

The model and layout fields are stored as they are given (plain JSON: the HF config, tp/pp/...,
the vocabulary divisor); reading them as a model and a layout is `convert.placement.manifest_model`'s.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

from zlib_ng import zlib_ng

from megatron_bridge.convert.formats.dtypes import DType
from megatron_bridge.convert.formats.safetensors_io import ST_DTYPES, tensor_bytes
from megatron_bridge.errors import UserError

if TYPE_CHECKING:  # torch is imported where it is used: the byte paths never import it
    import torch

MANIFEST = "mbr_manifest.json"
VERSION = 1
FORMATS = ("torch_dist", "torch")


def crc32(t: torch.Tensor) -> str:
    """zlib's CRC-32 of the tensor's bytes, computed by zlib-ng (same value, several times
    faster; docs/benchmarks.md): every byte a conversion moves is checksummed."""
    return crc_hex(zlib_ng.crc32(tensor_bytes(t)))


def crc_hex(value: int) -> str:
    return f"{value & 0xFFFFFFFF:08x}"


class LayoutRecord(TypedDict):
    """The layout as a manifest stores it (`vpp` None without virtual stages; manifests of
    dense models written before EP support have no `ep` / `etp`, older ones no stage split)."""

    tp: int
    pp: int
    vpp: NotRequired[int | None]
    ep: NotRequired[int]
    etp: NotRequired[int | None]
    layers_first_stage: NotRequired[int | None]
    layers_last_stage: NotRequired[int | None]


@dataclass
class Manifest:
    format: str
    hf_config: dict[str, Any]
    layout: LayoutRecord
    dtype: str  # "bfloat16", "float32", ... or "mixed"
    make_vocab_size_divisible_by: int
    tensors: dict[str, dict[str, Any]]  # HF name -> {"shape": [...], "dtype": "BF16", "crc32": "..."}
    files: dict[str, int] = field(default_factory=dict)  # relative path -> bytes
    assets: list[str] = field(default_factory=list)
    source: str = ""
    created_by: str = ""
    version: int = VERSION

    # -- views ------------------------------------------------------------------------
    def tensor_table(self) -> dict[str, tuple[tuple[int, ...], DType]]:
        return {k: (tuple(v["shape"]), ST_DTYPES[v["dtype"]]) for k, v in self.tensors.items()}

    # -- io ---------------------------------------------------------------------------
    def write(self, directory: Path) -> None:
        (directory / MANIFEST).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def read(cls, directory: Path) -> Manifest:
        path = directory / MANIFEST
        if not path.is_file():
            raise UserError(
                f"{directory} is not an `mbr convert` output (no {MANIFEST}); "
                "convert an HF model with `mbr convert src=HF_DIR dst=OUT` first"
            )
        try:
            data = json.loads(path.read_text())
            man = cls(**data)
        except (ValueError, TypeError) as e:
            raise UserError(f"{path}: corrupt manifest ({e})") from None
        if man.version != VERSION or man.format not in FORMATS:
            raise UserError(
                f"{path}: manifest version {man.version} / format {man.format!r} is not one this "
                f"mbr reads (version {VERSION}, formats {', '.join(FORMATS)})"
            )
        return man

    def check_files(self, directory: Path) -> None:
        """Every recorded file is there with its recorded size (truncation, deletion)."""
        bad = []
        for rel, size in self.files.items():
            p = directory / rel
            if not p.is_file():
                bad.append(f"{rel} is missing")
            elif p.stat().st_size != size:
                bad.append(f"{rel} has {p.stat().st_size} bytes, {size} were written (truncated or modified)")
        if bad:
            raise UserError(f"{directory}: the checkpoint is damaged:\n" + "\n".join(f"  - {b}" for b in bad[:8]))


def dtype_name(dtypes) -> str:
    names = {str(d).replace("torch.", "") for d in dtypes}
    return names.pop() if len(names) == 1 else "mixed"


def list_files(directory: Path) -> dict[str, int]:
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


__all__ = ["Manifest", "LayoutRecord", "MANIFEST", "crc32", "crc_hex", "dtype_name", "list_files", "FORMATS"]
