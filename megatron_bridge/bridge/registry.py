"""Family registry: HF `architectures` / `model_type` -> the family's bridge class.

A family is a small declarative class (see `families/`): the HF names it answers to, the
settings HF leaves implicit, and its weight table. Shared code never branches on a family
name; it asks the registry for the class and reads those attributes.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping as TMapping
from typing import Any, ClassVar

from megatron_bridge.bridge.table import Mapping
from megatron_bridge.errors import UserError

_FAMILIES: dict[str, type[FamilyBridge]] = {}
_LOADED: list[bool] = []  # set once every module under bridge/families is imported


class FamilyBridge:
    """Base of a family table. Subclasses set the class attributes; no methods to write.

    - `name`: registry key (also ModelConfig.family).
    - `model_types`, `architectures`: the HF `config.json` values it accepts.
    - `implicit`: BridgeSpec fields HF does not write into config.json (Qwen2's qkv bias).
    - `table`: the weight rows (`Mapping`), conditional rows carry `when=`.
    - `notes`: one line for `mbr verify --list`.
    - `hf_names`: BridgeSpec field -> HF config key where the family's name differs from the
      common one (Mixtral's `num_local_experts`), used when writing a config.json.
    - `window_key`: how the family's config.json spells a sliding window: "sliding_window"
      (Mistral, Mixtral) or "layer_types" (Qwen: use_sliding_window + per-layer types).
    - `fixed`: model fields the HF architecture (and so the weight table) fixes; a config
      that sets another value is refused by the `model-architecture` rule instead of
      building a model whose weights cannot be loaded or exported.
    - `hf_weights`: False for a family with no HF counterpart (trains from scratch only).
    - `tiny`: its tiny random model (config class, overrides of `tiny.COMMON`) with every
      feature of the family switched on; that entry puts the family into every generic test.
    """

    name: ClassVar[str] = ""
    model_types: ClassVar[tuple[str, ...]] = ()
    architectures: ClassVar[tuple[str, ...]] = ()
    implicit: ClassVar[TMapping[str, Any]] = {}
    table: ClassVar[tuple[Mapping, ...]] = ()
    notes: ClassVar[str] = ""
    hf_names: ClassVar[TMapping[str, str]] = {}
    window_key: ClassVar[str] = "sliding_window"
    fixed: ClassVar[TMapping[str, Any]] = {
        "normalization": "RMSNorm",
        "gated_linear_unit": True,
        "add_bias_linear": False,
        "position_embedding_type": "rope",
    }
    hf_weights: ClassVar[bool] = True
    # the tiny random model tests and `mbr verify verify.tiny=NAME` build (bridge/tiny.py):
    # (transformers config class, overrides of tiny.COMMON), every feature of the family on
    tiny: ClassVar[tuple[str, dict[str, Any]] | None] = None

    @classmethod
    def read_hf(cls, hf: TMapping[str, Any], fields: dict[str, Any], problems: list[str]) -> None:
        """Family-specific config.json keys -> BridgeSpec fields (runs before the features'
        readers). Override only where the family's config names something its own way."""

    @classmethod
    def complete_hf(cls, hf: TMapping[str, Any]) -> TMapping[str, Any]:
        """config.json with the keys the family's transformers config class derives when they
        are absent (Gemma 2's default layer_types), before anything reads it."""
        return hf

    @classmethod
    def write_hf(cls, spec: Any, cfg: dict[str, Any]) -> None:
        """BridgeSpec -> the family's own config.json keys (runs after the features' writers);
        the inverse of `read_hf`."""

    @classmethod
    def mappings(cls, spec: Any) -> tuple[Mapping, ...]:
        """The rows that apply to this model (conditional rows filtered by the spec)."""
        return tuple(m for m in cls.table if m.active(spec))


def register(cls: type[FamilyBridge]) -> type[FamilyBridge]:
    if not cls.name or (cls.hf_weights and not (cls.architectures and cls.table)):
        raise TypeError(f"{cls.__name__}: a family needs a name, and architectures and a table for HF weights")
    _FAMILIES[cls.name] = cls
    return cls


def _load_all() -> None:
    """Import every module under bridge/families (each registers its classes): a new family
    is a new file there, with no list to edit. A flag, not `if not _FAMILIES`: importing one
    family module directly must not stop the others from loading."""
    if not _LOADED:
        import pkgutil

        package = importlib.import_module("megatron_bridge.bridge.families")
        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
            importlib.import_module(f"{package.__name__}.{info.name}")
        _LOADED.append(True)


def families() -> list[type[FamilyBridge]]:
    _load_all()
    return list(_FAMILIES.values())


def get_family(name: str) -> type[FamilyBridge]:
    _load_all()
    if name not in _FAMILIES:
        raise UserError(f"no bridge family {name!r}; supported: {', '.join(sorted(_FAMILIES))}")
    return _FAMILIES[name]


def family_for(hf_config: TMapping[str, Any]) -> type[FamilyBridge]:
    """The family of an HF config dict: by `architectures` first, then `model_type`."""
    _load_all()
    archs = list(hf_config.get("architectures") or [])
    model_type = hf_config.get("model_type", "")
    for cls in _FAMILIES.values():
        if any(a in cls.architectures for a in archs):
            return cls
    supported = ", ".join(sorted(a for c in _FAMILIES.values() for a in c.architectures))
    if archs:
        raise UserError(
            f"unsupported architecture {', '.join(archs)} (model_type {model_type!r}): the bridge "
            f"supports {supported}. Add a family table under megatron_bridge/bridge/families/ "
            "(docs/bridge.md) to support it."
        )
    for cls in _FAMILIES.values():
        if model_type in cls.model_types:
            return cls
    raise UserError(
        f"unsupported model_type {model_type!r} and no `architectures` in config.json: the bridge supports {supported}."
    )


def describe() -> str:
    """The table `mbr verify --list` prints."""
    rows = [("family", "HF architectures", "model_type", "notes")]
    for cls in families():
        rows.append((cls.name, ", ".join(cls.architectures) or "-", ", ".join(cls.model_types) or "-", cls.notes))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]}".rstrip() for r in rows)


def weight_family(name: str) -> type[FamilyBridge]:
    """The family of `name` for reading or writing HF weights; refuses one without them."""
    fam = get_family(name)
    if not fam.hf_weights:
        raise UserError(
            f"model.family={name} has no Hugging Face counterpart: it trains from scratch, but its "
            "weights cannot be loaded from or exported to an HF model. Drop train.init_from/export_to, "
            f"or use a family with HF weights ({', '.join(sorted(f.name for f in families() if f.hf_weights))})."
        )
    return fam


__all__ = ["FamilyBridge", "weight_family", "register", "families", "get_family", "family_for", "describe"]
