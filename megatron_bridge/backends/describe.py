"""`describe(cfg.model)`: the recipe's model group -> the one model description.

Called once, right after a recipe is composed; every consumer takes its result. This is the
only function that reads the model group (`config.ModelConfig`, the recipe's input schema):
with `model.hf_path` the description is that directory's config.json (parsed by
`bridge.hf_config.read_hf_config`, the one config.json parser; the group's other fields do not
apply, except `make_vocab_size_divisible_by`, which config.json has no key for); without it,
the group's fields describe a model of `model.family`. A command whose input *is* an HF
directory (`mbr convert src=`, `mbr verify`) passes it as `hf_path=` (and, when it has already
read config.json for its own checks, the parsed dict as `hf=`).

A config the backend cannot reproduce, or a family no backend knows, is refused here as the
violation of a named rule (`hf-model`, `model-family`, `hidden-heads`, `model-backend`), like
every other rule. `model.backend` (auto | native | transformers; `hf` is another spelling of
transformers) picks the backend; `auto` takes the native family where one exists, else
transformers' own modeling code (`transformers`), and says so once.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_bridge.backends.registry import BACKENDS, backend_for, backend_named
from megatron_bridge.bridge.hf_config import MissingPackage, UnsupportedFeatures, read_hf_config
from megatron_bridge.bridge.registry import families
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.errors import LayoutError, UserError
from megatron_bridge.parallel.rules.base import Violation


def describe(
    model: Any,
    *,
    hf_path: str | Path | None = None,
    hf: Mapping[str, Any] | None = None,
    arg: str = "model.hf_path",
) -> BridgeSpec:
    """The description of `model` (a composed `ModelConfig`), or of the HF model `hf_path`
    (`arg` is how the command line names it) when the command's input is one. `model.backend`
    picks the backend (`auto`: the native family where one exists, else `transformers`)."""
    choice = chosen_backend(model)
    if choice not in ("auto", *BACKENDS):
        raise _refused(
            "model-backend", f"model.backend={choice!r} is not a backend", f"use one of auto, {', '.join(BACKENDS)}"
        )
    path = hf_path if hf_path is not None else model.hf_path
    if path is not None or hf is not None:
        config = hf if hf is not None else read_hf_config(path, arg=arg)
        try:
            spec = describe_hf(config, make_vocab_size_divisible_by=model.make_vocab_size_divisible_by, backend=choice)
        except MissingPackage as e:
            raise _refused("hf-package", f"{arg}={path}: {e}", e.fix) from None
        except UnsupportedFeatures as e:
            raise _refused(
                "hf-model",
                f"{arg}={path}: {e}",
                "use a model whose features its backend reproduces, or the other backend (model.backend=native|transformers; "
                "`mbr verify --list`, docs/bridge.md)",
            ) from None
        return dataclasses.replace(spec, source=None if path is None else str(path))
    if choice != "auto" and not BACKENDS[choice].from_fields:
        raise _refused(
            "model-backend",
            f"model.backend={choice} builds transformers' own model class from a config.json, and no model.hf_path "
            "is set",
            "set model.hf_path=DIR (the recipe's model fields describe native families only)",
        )
    known = {f.name for f in families()}
    if model.family not in known:
        raise _refused(
            "model-family",
            f"model.family={model.family!r} is not a family the builder knows",
            f"use one of {', '.join(sorted(known))}",
        )
    if model.kv_channels is None and model.hidden_size % model.num_attention_heads:
        raise _refused(
            "hidden-heads",
            f"hidden_size={model.hidden_size} is not divisible by num_attention_heads={model.num_attention_heads}",
            "set model.kv_channels (head dim) explicitly",
        )
    spec = BACKENDS["native"].describe_fields(dataclasses.asdict(model))
    return dataclasses.replace(spec, name=model.name, described_from="model fields")


def chosen_backend(model: Any) -> str:
    """The backend `model.backend` names ("auto", or a registered name; another spelling resolved):
    what a command that runs per backend (`mbr verify --matrix`) dispatches on, before describing."""
    return backend_named(getattr(model, "backend", "auto"))


def frozen_parts(model: Any) -> tuple[str, ...]:
    """`model.freeze`: the parts of the model training keeps as loaded (a training choice, not
    the description; the rule model-freeze checks them against the backend's parts)."""
    return tuple(getattr(model, "freeze", None) or ())


def describe_hf(hf: Mapping[str, Any], *, make_vocab_size_divisible_by: int = 128, backend: str = "auto") -> BridgeSpec:
    """The description of a parsed config.json by `backend` (`auto`: the first that handles it,
    native before hf, said once on stderr when it is not native). A converted checkpoint's
    manifest records one; export and reshard describe it with this. Raises
    `UnsupportedFeatures` naming what is missing."""
    native = BACKENDS["native"]
    backend = backend_named(backend)
    chosen = backend_for(hf) if backend == "auto" else BACKENDS[backend]
    if chosen is None or not chosen.handles(hf):
        raise UnsupportedFeatures(_unhandled(hf, backend))
    try:
        spec = chosen.describe(hf, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    except UnsupportedFeatures as e:
        if chosen is native and _hf_runs(hf):
            raise UnsupportedFeatures(
                f"{e}\n  model.backend=transformers runs it with transformers' own modeling code"
            ) from None
        if backend == "auto" and chosen is not native:
            raise UnsupportedFeatures(f"{_arch(hf)} has no native family, and {e}") from None
        raise
    if backend == "auto" and chosen is not native:
        _note_once(
            f"note: {_arch(hf)} has no native family; using the {chosen.name} backend "
            "(transformers' own modeling code under megatron's parallel layers; docs/bridge.md)"
        )
    return spec


def _arch(hf: Mapping[str, Any]) -> str:
    archs = hf.get("architectures") or []
    return f"{archs[0] if archs else '(no architectures)'} (model_type {hf.get('model_type', '')!r})"


def _hf_runs(hf: Mapping[str, Any]) -> bool:
    b = BACKENDS["transformers"]
    try:
        return b.handles(hf) and bool(b.describe(hf, make_vocab_size_divisible_by=1))
    except UserError:
        return False


def _unhandled(hf: Mapping[str, Any], backend: str) -> str:
    """Why no backend (or not the one asked for) describes `hf`, naming what is missing."""
    lines = []
    if backend in ("auto", "native"):
        lines.append(
            f"{_arch(hf)} has no native family: the native backend has no weight table or building blocks "
            "for it (bridge/families/)"
        )
    hf_backend = BACKENDS["transformers"]
    if backend in ("auto", "transformers") or hf_backend.handles(hf):
        if not hf_backend.handles(hf):
            lines.append(f"transformers has no causal-LM class for model_type {hf.get('model_type', '')!r}")
        elif _hf_runs(hf):
            lines.append("model.backend=transformers runs it with transformers' own modeling code")
        else:
            try:
                hf_backend.describe(hf, make_vocab_size_divisible_by=1)
            except UserError as e:
                lines.append(f"model.backend=transformers cannot run it either: {e}")
    return "\n  ".join(lines)


_NOTED: set[str] = set()


def _note_once(message: str) -> None:
    """A note on stderr, once per process (rank 0 only under a launcher)."""
    if message in _NOTED or os.environ.get("RANK", "0") != "0":
        return
    _NOTED.add(message)
    print(message, file=sys.stderr, flush=True)


def _refused(rule: str, detail: str, fix: str) -> LayoutError:
    return LayoutError([Violation(rule, detail, fix)], header="The model breaks 1 rule:")


__all__ = ["chosen_backend", "describe", "describe_hf", "frozen_parts"]
