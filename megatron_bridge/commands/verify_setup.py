"""What `mbr verify` and `mbr verify --matrix` share: the command's fields, the layouts to
check (and the rules that refuse them, before any process starts), the model to verify and
transformers' fp32 reference."""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from math import lcm
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from megatron_bridge.backends.describe import describe
from megatron_bridge.backends.registry import backend_of
from megatron_bridge.backends.transformers.meta import auto_class, config_object
from megatron_bridge.bridge.hf_config import read_hf_config
from megatron_bridge.bridge.tiny import HF_TINY, TINY
from megatron_bridge.config.schema import Config
from megatron_bridge.convert.pipeline.run import export
from megatron_bridge.convert.sources.preflight import check_init_source
from megatron_bridge.convert.sources.readers import HFSource
from megatron_bridge.errors import LayoutError, UserError
from megatron_bridge.parallel.dims import ParallelDims
from megatron_bridge.parallel.rules.registry import validate
from megatron_bridge.runtime.hf_tiny import make_tiny as make_tiny_vlm
from megatron_bridge.runtime.hf_tiny import vlm_architectures
from megatron_bridge.runtime.parity import CHECKS, hf_reference, make_batch
from megatron_bridge.runtime.tiny import make_tiny
from megatron_bridge.runtime.vision_inputs import image_batch
from megatron_bridge.runtime.vision_inputs import reference as image_text_reference


@dataclass
class VerifyOptions:
    layouts: list[str] = field(default_factory=list)  # e.g. [tp1, tp2pp2vpp2, cp2tp2, ep2]; empty = parallel.*
    checks: list[str] = field(default_factory=lambda: ["logits", "roundtrip"])  # + grads
    tol: float = 1e-4  # max-abs logits difference allowed (fp32)
    grad_tol: float = 1e-5  # max-abs gradient / loss difference allowed
    batch_size: int = 2
    seq_length: int = 32
    seed: int = 0
    tiny: str | None = (
        None  # a tiny random model of this family (or transformers-backend architecture) instead of model.hf_path
    )
    families: list[str] = field(default_factory=list)  # --matrix: these families (default: every tiny model)
    nproc: int | None = None  # local processes to start; default: what the layouts need
    out: str | None = None  # keep exports (and the reference) here; default: a temp dir
    vlm: bool = False  # --matrix model.backend=transformers: the vision-language models (image-text-to-text types)
    checkpoint: str | None = None  # a Megatron-LM / NeMo / Megatron-Bridge checkpoint: exported to HF (model.hf_path
    # names its tensors), transformers runs that export, the megatron side loads the checkpoint itself
    timeout_s: float = 1800.0


@dataclass
class VerifyConfig(Config):
    verify: VerifyOptions = field(default_factory=VerifyOptions)


def layouts_of(cfg, spec) -> list[Any]:
    """verify.layouts, or the one layout of parallel.* (resolved as training resolves it)."""
    if cfg.verify.layouts:
        try:
            return [ParallelDims.parse(x) for x in cfg.verify.layouts]
        except ValueError as e:
            raise UserError(str(e)) from e
    return [ParallelDims.from_config(cfg, smallest_world=True, moe=spec.is_moe)]


def check_layouts(cfg, spec, layouts: Sequence[Any], world: int | None) -> None:
    """The layout rules `mbr check` applies, for each layout on `world` processes (default:
    the fewest they all fit), at the verify sequence length; every violation at once."""
    cfg.train.seq_length = cfg.verify.seq_length
    world = world or needed_world(layouts)
    errs: list[str] = []
    for lay in layouts:
        try:
            validate(cfg, spec, dims=lay.with_world(world), layout_only=True)
        except LayoutError as e:
            errs += [f"{lay.describe()}: {v}" for v in e.violations]
    if errs:
        raise UserError("cannot verify these layouts:\n" + "\n".join(f"  - {e}" for e in errs))


def prepare(cfg, out: Path):
    """(hf_dir, spec, layouts) after every check that needs no process."""
    bad = sorted(set(cfg.verify.checks) - set(CHECKS) - {"train"}) or ([] if cfg.verify.checks else ["(none)"])
    if bad:
        raise UserError(f"verify.checks {bad} unknown; choose from logits, roundtrip, grads")
    if cfg.verify.tiny:
        vlms = vlm_architectures()
        if cfg.verify.tiny not in TINY and cfg.verify.tiny not in HF_TINY and cfg.verify.tiny not in vlms:
            raise UserError(
                f"verify.tiny={cfg.verify.tiny!r}: tiny models exist for the families {', '.join(TINY)} and, "
                f"on the transformers backend, {', '.join(HF_TINY)} and the vision-language models "
                f"{', '.join(vlms)}"
            )
        hf_dir = str(out / "tiny" / cfg.verify.tiny)
        if not (Path(hf_dir) / "config.json").is_file():
            (make_tiny if cfg.verify.tiny not in vlms else make_tiny_vlm)(cfg.verify.tiny, hf_dir)
        spec = describe(cfg.model, hf_path=hf_dir)  # the rules see the model being verified
    elif cfg.verify.checkpoint:
        hf_dir = str(export_checkpoint(cfg, out / "checkpoint_hf"))
        spec = describe(cfg.model, hf_path=hf_dir)
    else:
        spec = describe(cfg.model)
        if spec.source is None:
            raise UserError("mbr verify needs model.hf_path=DIR (an HF model directory) or verify.tiny=FAMILY")
        hf_dir = spec.source
    layouts = layouts_of(cfg, spec)
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else cfg.verify.nproc
    check_layouts(cfg, spec, layouts, world)
    check_weights(Path(hf_dir), spec)
    return hf_dir, spec, layouts


def export_checkpoint(cfg, dst: Path) -> Path:
    """`verify.checkpoint`'s HF export (`mbr export`, model.hf_path's names), written once into `dst`."""
    if not (dst / "config.json").is_file():
        opts = SimpleNamespace(
            src=cfg.verify.checkpoint,
            dst=str(dst),
            overwrite=False,
            dtype="source",
            workers=1,
            max_shard_gb=5.0,
            progress="off",
        )
        export(opts, spec=describe(cfg.model))
    return dst


def check_weights(hf_dir: Path, spec) -> None:
    """The directory's weights, checked as `mbr convert` checks them before reading a byte
    (headers and index, only safetensors, every tensor the model has and no other, each of the
    shape the model gives it): both sides of the comparison load them, and transformers' own
    loader would otherwise end in a traceback."""
    check_init_source(hf_dir, arg="model.hf_path")
    HFSource(hf_dir, None, lambda _: spec, arg="model.hf_path").close()


def reference(hf_dir: str, spec, cfg, path: Path) -> dict[str, Any]:
    """transformers' answer for the verify batch, saved to `path` (data only): random ids, or for a
    vision-language model one image per sample with its placeholder tokens (runtime/vision_inputs.py)."""
    if spec.vision_params:
        ref = image_reference(hf_dir, cfg.verify.batch_size, cfg.verify.seq_length, cfg.verify.seed)
    else:
        ids, labels = make_batch(spec.vocab_size, cfg.verify.batch_size, cfg.verify.seq_length, cfg.verify.seed)
        grads = "grads" in cfg.verify.checks
        aux = backend_of(spec).adds_aux_loss(spec)
        ref = dict(input_ids=ids, labels=labels, **hf_reference(hf_dir, ids, labels if grads else None, aux_loss=aux))
    torch.save(ref, path)
    return ref


def image_reference(hf_dir: str | Path, batch: int, seq: int, seed: int) -> dict[str, Any]:
    """A VLM's verify batch (at least `seq` tokens: more where one image's placeholders need them)
    and transformers' fp32 logits, loss and gradients for it."""
    cfg = config_object(read_hf_config(hf_dir))
    model = auto_class(cfg).from_pretrained(str(hf_dir), dtype=torch.float32)
    ids, labels, images = image_batch(model, batch, seq, seed)
    ref = dict(input_ids=ids, labels=labels, images=images, **image_text_reference(model, ids, labels, images))
    ref["grad_floor"] = image_grad_floor(model, ids, labels, images, ref["grads"])
    return ref


def image_grad_floor(model, ids, labels, images, grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor, how far transformers' own fp32 gradient is from its fp64 one on this batch (the
    allowance a split summed in another order gets on top, as the text matrix's `grad_floor`);
    {} where the model does not run in fp64 (a grouped-GEMM kernel)."""
    wide = [{k: v.double() if v.is_floating_point() else v for k, v in im.items()} for im in images]
    try:
        exact = image_text_reference(copy.deepcopy(model).double(), ids, labels, wide)["grads"]
    except Exception:  # an fp32-only kernel: no floor, the plain verdict
        return {}
    return {
        k: float((g.double() - exact[k].double()).abs().max()) for k, g in grads.items() if k in exact and g.numel()
    }


def needed_world(layouts) -> int:
    n = 1
    for lay in layouts:
        n = lcm(n, lay.smallest_world)
    return n


__all__ = ["VerifyOptions", "VerifyConfig", "layouts_of", "check_layouts", "prepare", "reference", "needed_world"]
