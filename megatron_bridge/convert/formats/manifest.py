"""`mbr_manifest.json`: what a converted checkpoint holds, so it can be read back exactly.

Written last into every `mbr convert` / `mbr reshard` output (its presence marks a complete
checkpoint, and `train.init_from` recognises the directory by it). It records:

* the source HF `config.json` (also copied next to it, so `model.hf_path=OUT` describes the
  model) and the non-weight files copied along (tokenizer, generation config);
* format (`torch_dist` or `torch`), layout (tp/pp/vpp/ep/etp), dtype,
  `make_vocab_size_divisible_by` (the padded vocab of the stored embedding) and the backend
  whose names and splits the files hold (`auto` in outputs written before it was recorded:
  the backend `model.backend=auto` picks, which is what wrote them);
* every HF tensor: name, shape, dtype, CRC-32 of its bytes. Export and reshard rebuild each
  HF tensor and compare, so a round trip is checked bit for bit, and a corrupted or
  tampered file is reported by tensor name;
* every written file and its size: a truncated file is refused before reading it.

The model and layout fields are stored as they are given (plain JSON: the HF config, tp/pp/...,
the vocabulary divisor); reading them as a model and a layout is `convert.placement.manifest_model`'s.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

from zlib_ng import zlib_ng

from megatron_bridge.convert.formats.dtypes import DType
from megatron_bridge.convert.formats.mapped import crc32_file, crc32_range
from megatron_bridge.convert.formats.paths import confined
from megatron_bridge.convert.formats.safetensors_io import INDEX, ST_DTYPES, raw_header, tensor_bytes
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
    file_crc32: dict[str, str] = field(default_factory=dict)  # relative path -> CRC-32 (absent in older outputs)
    assets: list[str] = field(default_factory=list)
    source: str = ""
    created_by: str = ""
    backend: str = "auto"  # the model's backend (its table names the stored tensors)
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
        if not path.is_file() and ((directory / "manifest.json").is_file() or any(directory.glob("iter_*"))):
            raise UserError(
                f"{directory} is a training checkpoint (what checkpoint.dir= holds), not an `mbr convert` "
                "output, which is what this reads. Its weights as a Hugging Face model: `mbr export src=DIR "
                "dst=HF_DIR model.hf_path=MODEL` (or resume it for no further steps with `checkpoint.resume=true "
                "train.steps=ITS_ITERATION export_to=HF_DIR`); as a converted checkpoint: `mbr reshard src=DIR "
                "dst=OUT format=torch_dist model.hf_path=MODEL`; a LoRA run's adapter: `mbr export src=DIR dst=OUT "
                "adapter=true`."
            )
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
        bad = man._malformed()
        if bad:
            raise UserError(
                f"{path}: malformed manifest ({'; '.join(bad[:4])}). Re-create the checkpoint with "
                "`mbr convert`, or use one from a source you trust."
            )
        for name in man.assets:  # copied by export and reshard: bare names, regular files inside
            confined(directory, name, source=path, what="asset", plain=True)
        for rel in man.files:
            confined(directory, rel, source=path, what="file")
        return man

    def _malformed(self) -> list[str]:
        """What is wrong with the types and values of the fields (a stranger's manifest is
        data to check: a layout degree of 0 would divide by zero deep in a reshard)."""
        bad = []

        def count(v: Any, zero: bool = False) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and (v >= 0 if zero else v > 0)

        if not isinstance(self.hf_config, dict):
            bad.append("hf_config is not an object")
        lay = self.layout if isinstance(self.layout, dict) else {}
        if not isinstance(self.layout, dict) or not all(count(lay.get(k)) for k in ("tp", "pp")):
            bad.append(f"layout {str(self.layout)[:80]}: tp and pp must be positive integers")
        else:
            for k in ("vpp", "ep", "etp", "layers_first_stage", "layers_last_stage"):
                if lay.get(k) is not None and not count(lay[k]):
                    bad.append(f"layout.{k}={lay[k]!r} is not a positive integer")
        if not count(self.make_vocab_size_divisible_by):
            bad.append(f"make_vocab_size_divisible_by={self.make_vocab_size_divisible_by!r} is not a positive integer")
        if not isinstance(self.tensors, dict) or not all(
            isinstance(v, dict)
            and isinstance(v.get("shape"), list)
            and all(count(x, zero=True) for x in v["shape"])
            and v.get("dtype") in ST_DTYPES
            and isinstance(v.get("crc32"), str)
            for v in self.tensors.values()
        ):
            bad.append("tensors: each needs a shape (a list of sizes), a safetensors dtype and a crc32")
        if not isinstance(self.files, dict) or not all(count(v, zero=True) for v in self.files.values()):
            bad.append("files: expected an object of relative path -> size in bytes")
        if not isinstance(self.assets, list):
            bad.append("assets: expected a list of file names")
        if not isinstance(self.backend, str):
            bad.append(f"backend={self.backend!r} is not a name")
        return bad

    def check_files(self, directory: Path, checksums: bool = False) -> None:
        """Every recorded file is there with its recorded size (truncation, deletion), each a
        regular file inside `directory` (`Manifest.read` refused any other name); with
        `checksums`, also its recorded CRC-32 (a changed byte; the paths that do not verify
        every tensor's CRC as they read it: `train.init_from`)."""
        bad = []
        for rel, size in self.files.items():
            p = confined(directory, rel, source=directory / MANIFEST, what="file")
            if not p.is_file():
                bad.append(f"{rel} is missing")
            elif p.stat().st_size != size:
                bad.append(f"{rel} has {p.stat().st_size} bytes, {size} were written (truncated or modified)")
            elif checksums and rel in self.file_crc32 and file_crc32(p) != self.file_crc32[rel]:
                bad.append(
                    f"{rel} has CRC-32 {file_crc32(p)}, {self.file_crc32[rel]} was written: its bytes changed "
                    "since conversion (disk corruption or tampering); re-convert or restore it"
                )
        if bad:
            raise UserError(f"{directory}: the checkpoint is damaged:\n" + "\n".join(f"  - {b}" for b in bad[:8]))


def dtype_name(dtypes) -> str:
    names = {str(d).replace("torch.", "") for d in dtypes}
    return names.pop() if len(names) == 1 else "mixed"


def file_crc32(path: Path) -> str:
    """CRC-32 of a file's bytes (zlib-ng over memory-mapped windows: formats/mapped.py)."""
    return crc_hex(crc32_file(path))


def list_crc32(directory: Path, files: Iterable[str], workers: int = 2) -> dict[str, str]:
    """Every file's CRC-32, on `workers` threads (zlib-ng releases the GIL)."""
    names = list(files)
    with ThreadPoolExecutor(max(1, workers)) as ex:
        return dict(zip(names, ex.map(lambda rel: file_crc32(directory / rel), names)))


# An HF directory we write (`mbr export`, `export_to`, interval exports) records each weight
# file's CRC-32 in its index's metadata under this key (transformers reads only `weight_map`),
# so that loading it later (`train.init_from`, `mbr convert src=`) notices a changed byte.
INDEX_CRC32 = "file_crc32"


def check_index_crc32(directory: Path) -> int:
    """The CRC-32 of every weight file an HF directory's index records (none recorded: nothing
    to check, e.g. a directory from the Hub); a mismatch is a UserError naming the file.
    Returns the number of files checked. Names were confined by `scan_dir` before this runs."""
    index = directory / INDEX
    if not index.is_file():
        return 0
    try:
        recorded = json.loads(index.read_text()).get("metadata", {}).get(INDEX_CRC32, {})
    except (ValueError, AttributeError):
        return 0  # scan_dir reports a corrupt index
    if not isinstance(recorded, dict):
        raise UserError(f"{index}: metadata.{INDEX_CRC32} is not an object of file name -> CRC-32")
    bad = []
    for rel, want in sorted(recorded.items()):
        got = file_crc32(confined(directory, rel, source=index, what="shard"))
        if got != want:
            bad.append(f"{rel} has CRC-32 {got}, {want} was written")
    if bad:
        raise UserError(
            f"{directory}: the HF directory's weights changed since they were written (disk corruption or "
            "tampering): " + "; ".join(bad[:4]) + ". Export it again or restore the files."
        )
    return len(recorded)


# A single safetensors file we write outside an indexed directory (a LoRA adapter) records the
# CRC-32 of its data section (the bytes after the header) in its own header's `__metadata__`:
# PEFT reads only `format`; the header cannot hold the whole file's checksum, which covers it.
DATA_CRC32 = "mbr_data_crc32"


def safetensors_data_crc32(path: Path) -> tuple[str | None, str]:
    """(the CRC-32 its header records under DATA_CRC32 or None, the CRC-32 of its data section)."""
    header, base = raw_header(path)
    meta = header.get("__metadata__") or {}
    with open(path, "rb") as f:
        value = crc32_range(f.fileno(), base, os.fstat(f.fileno()).st_size, path)
    recorded = meta.get(DATA_CRC32) if isinstance(meta, dict) else None
    return (recorded if isinstance(recorded, str) else None), crc_hex(value)


def check_data_crc32(path: Path, what: str) -> bool:
    """A file that records its data's CRC-32 must still have it (False: none recorded, e.g. an
    adapter saved by PEFT itself). Call after `read_header` validated the file."""
    recorded, got = safetensors_data_crc32(path)
    if recorded is not None and recorded != got:
        raise UserError(
            f"{what}: {path.name}'s weights changed since they were written (CRC-32 {got}, {recorded} was "
            "written: disk corruption or tampering). Export it again or restore the file."
        )
    return recorded is not None


def list_files(directory: Path) -> dict[str, int]:
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


__all__ = [
    "Manifest",
    "LayoutRecord",
    "MANIFEST",
    "crc32",
    "crc_hex",
    "dtype_name",
    "file_crc32",
    "check_index_crc32",
    "INDEX_CRC32",
    "list_crc32",
    "list_files",
    "FORMATS",
]
