"""`convert`, `export`, `reshard`: source -> writer, into a directory that appears whole or not at all.

Order is the promise: every check that can fail on bad input (paths, config, headers,
index, shapes, layout) runs before the first byte is written. Output goes to a temporary
sibling of `dst` (same filesystem) and is renamed into place only after the manifest — the
last file — is written; on any failure (or Ctrl-C) the temporary directory is removed, so
`dst` never holds half a checkpoint. With `overwrite=true` an existing `dst` is moved aside
and deleted only once the new one is in place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from megatron_bridge.backends.describe import describe as describe_model
from megatron_bridge.bridge.features.mtp import note_skipped
from megatron_bridge.bridge.loader import _write_config_and_assets, hf_assets
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.convert.formats.manifest import MANIFEST, Manifest, dtype_name, list_crc32, list_files
from megatron_bridge.convert.formats.safetensors_io import st_name
from megatron_bridge.convert.pipeline.dst import check_replaceable, dst_lease, publish_mode
from megatron_bridge.convert.pipeline.options import check_format, check_workers, checked_layout, describe
from megatron_bridge.convert.pipeline.progress import Progress
from megatron_bridge.convert.pipeline.writers import DistOut, HFOut, TorchOut
from megatron_bridge.convert.placement.manifest_model import layout_record, manifest_layout
from megatron_bridge.convert.placement.rank_files import RELEASE, TRACKER
from megatron_bridge.convert.sources.megatron import find_megatron
from megatron_bridge.convert.sources.megatron_source import open_megatron
from megatron_bridge.convert.sources.readers import CheckpointSource, HFSource, Source, open_checkpoint, parse_dtype
from megatron_bridge.errors import UserError

RESERVED = {MANIFEST, TRACKER, RELEASE, "config.json"}


def check_paths(src: str | None, dst: str | None, overwrite: bool) -> tuple:
    if not src or not dst:
        raise UserError("both src=DIR and dst=DIR are required")
    s, d = Path(src).absolute(), Path(dst).absolute()
    if not s.is_dir():
        raise UserError(f"src={src} does not exist or is not a directory")
    check_replaceable(d, overwrite)
    rs, rd = s.resolve(), d.resolve()
    if rs == rd or rs in rd.parents or rd in rs.parents:
        raise UserError(f"src={src} and dst={dst} overlap; write to a separate directory")
    return s, d


@contextmanager
def atomic_output(dst: Path, overwrite: bool = False) -> Iterator[Path]:
    """A temporary sibling of `dst`, renamed into place when the block ends normally; removed on
    any failure. `dst` is leased for the whole block (dst.py); an existing `dst` is replaced
    only under check_replaceable's terms, checked again right before the rename. Parent
    directories it created are removed again on failure (a refusal mid-write, such as a
    non-finite source tensor, leaves nothing behind)."""
    created = [d for d in (dst.parent, *dst.parent.parents) if not d.exists()]
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the parent directory of dst={dst}: {e}") from None
    try:
        with dst_lease(dst):
            tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
            try:
                yield tmp
                publish_mode(tmp)
                check_replaceable(dst, overwrite)  # again: a directory may have appeared at dst meanwhile
                if os.path.lexists(dst):
                    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
                    os.rename(dst, old / "x")
                    try:
                        os.rename(tmp, dst)
                    except OSError:
                        os.rename(old / "x", dst)  # put the previous checkpoint back
                        raise
                    finally:
                        shutil.rmtree(old, ignore_errors=True)
                else:
                    os.rename(tmp, dst)
            except OSError as e:
                shutil.rmtree(tmp, ignore_errors=True)
                raise UserError(f"{dst}: {e} (stopped; nothing was written)") from None
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    except BaseException:
        _remove_empty(created)  # after the lease: its file sits in dst's parent
        raise


def _remove_empty(dirs: list[Path]) -> None:
    """The parent directories `atomic_output` created, innermost first, while still empty."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            return


def _assets(src: Path) -> list[str]:
    """Non-weight files an HF directory ships next to the weights (tokenizer, generation config).
    A symbolic link leading out of `src` is refused (its target would be copied into `dst`)."""
    return hf_assets(src, skip=RESERVED)


def _copy(src: Path, dst: Path, names: list[str]) -> None:
    for n in names:
        shutil.copy2(src / n, dst / n)


@contextmanager
def _closing_on_error(source: Source) -> Iterator[None]:
    try:
        yield
    except BaseException:
        source.close()
        raise


def _run(
    source: Source, writer: Any, dst: Path, verb: str, mode: str, finish: Callable[[Path], None], overwrite: bool
) -> Progress:
    try:
        tensors, nbytes = writer.total(source)
        with atomic_output(dst, overwrite) as tmp:
            with Progress(verb, tensors, nbytes, mode) as prog:
                writer.write(tmp, source, prog.advance)
            finish(tmp)
    finally:
        source.close()
    return prog


def _manifest(
    fmt: str,
    hf_config: dict,
    layout,
    source: Source,
    tmp: Path,
    assets: list[str],
    src: Path,
    created_by: str,
    workers: int,
) -> None:
    missing = set(source.tensors) - set(source.checksums)
    if missing:
        raise RuntimeError(f"tensors never written: {sorted(missing)[:5]}")
    tensors = {
        n: {"shape": list(source.tensors[n][0]), "dtype": st_name(source.out_dtype(n)), "crc32": source.checksums[n]}
        for n in source.tensors
    }
    Manifest(
        format=fmt,
        hf_config=hf_config,
        layout=layout_record(layout),
        dtype=dtype_name(source.out_dtype(n) for n in source.tensors),
        make_vocab_size_divisible_by=source.spec.make_vocab_size_divisible_by,
        tensors=tensors,
        files=(files := list_files(tmp)),
        file_crc32=list_crc32(tmp, files, workers),
        assets=assets,
        source=str(src),
        created_by=created_by,
        backend=source.spec.backend,
    ).write(tmp)


def convert(cfg: Any) -> int:
    """HF directory -> torch_dist or per-rank torch checkpoint (see docs/convert.md)."""
    src, dst = check_paths(cfg.src, cfg.dst, cfg.overwrite)
    fmt, dtype, workers = check_format(cfg.format), parse_dtype(cfg.dtype), check_workers(cfg.workers)
    source = HFSource(src, dtype, lambda hf: describe_model(cfg.model, hf_path=src, hf=hf, arg="src"))
    hf_config = source.hf_config
    with _closing_on_error(source):
        layout = checked_layout(cfg, source.spec, hf_config, source.rows, source.tensors, fmt)
    writer = (DistOut if fmt == "torch_dist" else TorchOut)(source.spec, layout, workers)
    assets = _assets(src)

    def finish(tmp: Path) -> None:
        if source.nonfinite and not cfg.allow_nonfinite:  # before anything is published
            bad = sorted(source.nonfinite)
            raise UserError(
                f"src={src} holds non-finite weights (NaN or infinity) in {len(bad)} tensor(s): "
                f"{', '.join(bad[:5])}{' …' if len(bad) > 5 else ''}. Nothing was written. A model with such "
                "weights computes NaN; use a good copy of the checkpoint, or pass allow_nonfinite=true to "
                "convert it as it is."
            )
        if source.quant:  # an fp8 source converts to its bf16 dequantisation: no quantization_config
            (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        else:
            shutil.copy2(src / "config.json", tmp / "config.json")
        _copy(src, tmp, assets)
        _manifest(fmt, hf_config, layout, source, tmp, assets, src, "mbr convert", workers)

    prog = _run(source, writer, dst, "converted", cfg.progress, finish, cfg.overwrite)
    print(prog.summary(str(dst), f"{fmt}, {describe(layout, dtype)}"), flush=True)
    return 0


def _open(src: Path, dtype: Any, cfg: Any, spec: BridgeSpec | None) -> CheckpointSource:
    """`src`: a converted checkpoint, or a Megatron-written one of the model `model.hf_path`
    describes (`spec`: already described by the caller)."""
    md = find_megatron(src)
    if md is None:
        return open_checkpoint(src, dtype)
    spec = spec or describe_model(cfg.model)
    return open_megatron(md, spec.source, spec.make_vocab_size_divisible_by, dtype)


def export(cfg: Any, spec: BridgeSpec | None = None) -> int:
    """Converted checkpoint -> HF directory (safetensors + index, config.json, tokenizer files).
    (`adapter=true`, a LoRA training checkpoint's adapter, is `commands/export.py`'s.)"""
    src, dst = check_paths(cfg.src, cfg.dst, cfg.overwrite)
    dtype, workers = parse_dtype(cfg.dtype), check_workers(cfg.workers)
    if not cfg.max_shard_gb > 0:
        raise UserError(f"max_shard_gb={cfg.max_shard_gb} must be > 0")
    source = _open(src, dtype, cfg, spec)
    man: Manifest = source.man
    out_dtypes = {source.out_dtype(n) for n in source.tensors}
    declared = man.hf_config.get("dtype", man.hf_config.get("torch_dtype"))
    retag = next(iter(out_dtypes)) if len(out_dtypes) == 1 else None
    if retag is not None and str(retag).replace("torch.", "") == declared:
        retag = None

    def finish(tmp: Path) -> None:
        _write_config_and_assets(tmp, source.spec, None, man.hf_config, retag)
        _copy(source.assets_dir, tmp, man.assets)

    prog = _run(
        source,
        HFOut(int(cfg.max_shard_gb * 1e9), workers),
        dst,
        "exported",
        cfg.progress,
        finish,
        cfg.overwrite,
    )
    print(
        prog.summary(
            str(dst),
            f"HF safetensors, {dtype_name(out_dtypes)}, "
            + (
                "every tensor checked against the manifest"
                if source.expected
                else f"from a {man.created_by} checkpoint"
            ),
        ),
        flush=True,
    )

    note_skipped(source.spec, None)  # config.json still names MTP layers the bridge never had
    return 0


def reshard(cfg: Any) -> int:
    """Converted checkpoint -> the same weights in another layout (or format), without HF."""
    src, dst = check_paths(cfg.src, cfg.dst, cfg.overwrite)
    fmt, dtype, workers = check_format(cfg.format or "torch"), parse_dtype(cfg.dtype), check_workers(cfg.workers)
    source = _open(src, dtype, cfg, None)
    man: Manifest = source.man
    with _closing_on_error(source):
        layout = checked_layout(cfg, source.spec, man.hf_config, source.rows, source.tensors, fmt)
    writer = (DistOut if fmt == "torch_dist" else TorchOut)(source.spec, layout, workers)

    def finish(tmp: Path) -> None:
        if source.config_file is not None:
            shutil.copy2(source.config_file, tmp / "config.json")
        else:
            (tmp / "config.json").write_text(json.dumps(man.hf_config, indent=2) + "\n")
        _copy(source.assets_dir, tmp, man.assets)
        _manifest(fmt, man.hf_config, layout, source, tmp, man.assets, Path(man.source or src), "mbr reshard", workers)

    prog = _run(source, writer, dst, "resharded", cfg.progress, finish, cfg.overwrite)
    old = manifest_layout(man)
    print(prog.summary(str(dst), f"{man.format} tp{old.tp}·pp{old.pp} -> {fmt}, {describe(layout, dtype)}"), flush=True)
    return 0


__all__ = ["convert", "export", "reshard", "check_paths", "atomic_output"]
