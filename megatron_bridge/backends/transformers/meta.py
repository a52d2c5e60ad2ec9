"""The transformers backend's meta-device model: transformers' config object for a config.json, the
causal LM built on the meta device (no memory), and what it says once per description — its
stage pieces and tp plan (`plan.Plan`), every checkpoint tensor's shape and TP kind, and the
names `save_pretrained` writes (transformers' own conversion mapping). backends/transformers/backend.py describes,
counts and tables a model from this; the runtime builds the real one from the same plan.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from megatron_bridge.backends.transformers.experts import stacked, transposed
from megatron_bridge.backends.transformers.fused import fused
from megatron_bridge.backends.transformers.kinds import PLAIN_LINEARS, builds_windows, layer_kinds
from megatron_bridge.backends.transformers.loading import needs_package, read_back_misses
from megatron_bridge.backends.transformers.plan import PP_CONVENTION, REPLICATED, Plan, override, plan_of, tensor_kinds
from megatron_bridge.backends.transformers.split import Split, split
from megatron_bridge.backends.transformers.vision import (
    builds_vlm,
    image_text_class_name,
    language_refusals,
    text_config_of,
    vision_parts,
)
from megatron_bridge.bridge.hf_config import HF_KEYS, UnsupportedFeatures
from megatron_bridge.bridge.spec import BridgeSpec

_FIRST_INDEX = re.compile(r"(^|\.)(\d+)\.")  # a name's first index segment


def causal_lm_class_name(model_type: str) -> str | None:
    """transformers' causal-LM class for `model_type`, None if it has none."""
    # transformers imported here: the core imports third-party packages only inside functions
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        return None
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return name if isinstance(name, str) else None


def class_name(hf: Mapping[str, Any]) -> str | None:
    """The transformers class this config.json runs as: its VLM class where `vision.builds_vlm`
    says so, else its causal-LM class; None if it has neither."""
    mt = str(hf.get("model_type", ""))
    causal = causal_lm_class_name(mt)
    return image_text_class_name(mt) if builds_vlm(hf, causal) else causal


def config_object(hf: Mapping[str, Any]) -> Any:
    """transformers' config object of a parsed config.json (its class's defaults filled in): the
    composite config for a VLM, the one the causal LM runs on otherwise (`runs_on`).
    config.json writes non-finite floats as {"__float__": "Infinity"} (Mamba's time_step_limit);
    they are decoded as transformers' own reader does, or the strict config class refuses them."""
    # transformers imported here: the core imports third-party packages only inside functions
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[hf["model_type"]]
    cfg = cls.from_dict(cls._decode_special_floats(dict(hf)))
    return cfg if builds_vlm(hf, causal_lm_class_name(hf["model_type"])) else runs_on(hf["model_type"], cfg)


def auto_class(cfg: Any) -> Any:
    """The Auto class that builds `cfg` (a `config_object`): image-text-to-text for a composite
    (VLM) config, causal LM otherwise."""
    # transformers imported here: the core imports third-party packages only inside functions
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if text_config_of(cfg) is not cfg else AutoModelForCausalLM


def runs_on(model_type: str, cfg: Any) -> Any:
    """The config the causal-LM class runs on: a composite config (llama4's, its text_config
    inside) gives its text config where the causal LM is declared on that class, as
    AutoModelForCausalLM.from_config does; the other sub-configs (vision) build nothing."""
    # transformers imported here: the core imports third-party packages only inside functions
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    text_cls = getattr(cfg, "sub_configs", {}).get("text_config")
    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(cfg), None)
    if text_cls is not None and getattr(model_cls, "config_class", None) == text_cls:
        return cfg.get_text_config()
    return cfg


def declared(cfg: Any) -> dict[str, Any]:
    """The config's values for the fields its class declares (defaults filled in): a key the
    class does not know (`num_key_value_heads` in a GPT-NeoX config.json) is kept by
    transformers but used by nothing, so it must not describe the model. A size the class
    computes (a property: Nemotron-H's num_hidden_layers, from layers_block_type) is never
    serialised, so it is read off the object where no serialised key gives that field
    (LongCat-Flash's num_hidden_layers, 2 x its num_layers, counts sublayers)."""
    cls = type(cfg)
    known = set(getattr(cls, "attribute_map", {}) or {})
    out = {k: v for k, v in cfg.to_dict().items() if hasattr(cls, k) or k in known}
    for keys in HF_KEYS.values():
        computed = [k for k in keys if isinstance(vars(cls).get(k), property)]
        if computed and not any(out.get(k) is not None for k in keys):
            out[computed[0]] = getattr(cfg, computed[0])
    return out


def transformers_config(spec: BridgeSpec) -> Any:
    """The config object the transformers backend builds `spec` from."""
    return config_object(json.loads(spec.hf_json))


def model_plan(model: Any) -> Plan:
    """The plan of a built (meta or real) transformers causal LM or VLM (its language model's
    plans, under the language model's path; its vision pieces: `vision.vision_parts`)."""
    cfg = text_config_of(model.config)
    head = getattr(type(model), "_pp_plan", None) or {}
    if not cfg.base_model_pp_plan and not override(cfg.model_type).pp_plan:
        _check_convention(model)
    parts = vision_parts(model)
    plan = plan_of(
        cfg.model_type,
        base_prefix(model),
        cfg.base_model_tp_plan,
        cfg.base_model_pp_plan,
        head,
        getattr(cfg, "base_model_ep_plan", None),
        cfg,
    )
    if parts is None:
        return plan
    return dataclasses.replace(
        plan,
        head=parts.head,
        front=parts.front,
        language=parts.language,
        vision=parts.pieces,
        projectors=parts.projectors,
        image_positions=parts.image_positions,
    )


def base_prefix(model: Any) -> str:
    """The path of the base model the stages are cut from: a causal LM's `base_model_prefix`, or
    the model type's OVERRIDES `prefix` where that names no attribute (Llama4ForCausalLM says
    `language_model`, its composite parent's name, and holds `model`); a VLM's language model."""
    parts = vision_parts(model)
    if parts is not None:
        return parts.base
    return override(model.config.model_type).prefix or model.base_model_prefix


def _check_convention(model: Any) -> None:
    """A model without a pp plan is staged by transformers' convention (`PP_CONVENTION`) only
    where its base model is exactly that: those children, a ModuleList of layers, and nothing
    else but its rotary module, which the stages rebuild. A base model with other modules (a
    second embedding, a norm before the layers) needs an OVERRIDES entry: its forward is not
    the convention's."""
    base = model.get_submodule(base_prefix(model))
    children = dict(base.named_children())
    missing = [n for n in PP_CONVENTION if n not in children]
    other = [n for n, m in children.items() if n not in PP_CONVENTION and "Rotary" not in type(m).__name__]
    if missing or other or type(children["layers"]).__name__ != "ModuleList":
        raise UnsupportedFeatures(
            f"{type(model).__name__}: no base_model_pp_plan, and its {base_prefix(model)} is not "
            f"{' -> '.join(PP_CONVENTION)} (missing: {', '.join(missing) or '-'}; other modules: "
            f"{', '.join(other) or '-'}): its stage pieces need a pp_plan entry in backends/transformers/overrides.py OVERRIDES"
        )


def checkpoint_tensors(model: Any) -> dict[str, Any]:
    """{name: tensor} of what a checkpoint of `model` holds: its parameters (a tied one once)
    and its persistent buffers."""
    out = dict(model.named_parameters())
    for mod_name, mod in model.named_modules():
        for b_name, b in mod._buffers.items():
            if b is not None and b_name not in mod._non_persistent_buffers_set:
                out.setdefault(f"{mod_name}.{b_name}" if mod_name else b_name, b)
    return out


def checkpoint_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """{name: shape} of `checkpoint_tensors(model)`."""
    return {n: tuple(t.shape) for n, t in checkpoint_tensors(model).items()}


def checkpoint_names(
    model: Any, shapes: Mapping[str, tuple[int, ...]], kinds: Mapping[str, str]
) -> tuple[
    dict[str, str],
    dict[str, tuple[str, ...]],
    dict[str, tuple[tuple[str, ...], int]],
    dict[str, tuple[int, int, bool]],
    dict[str, Split],
]:
    """({module tensor name: its name in a checkpoint}, {stacked experts tensor: its
    per-expert names}, {fused tensor: (its pieces' names, the dim they join on)}, {stacked experts
    tensor a checkpoint may hold with two dims swapped: (those dims, only where the shapes differ)},
    {tensor cut out of one checkpoint tensor or permuted per head: its `Split`, the source renamed}) — what
    `save_pretrained` writes, by transformers' own conversion mapping run in the saving
    direction (GPT-NeoX's `lm_head` is saved as `embed_out`; experts one tensor each:
    backends/transformers/experts.py; a fused q/k/v conv as its pieces: backends/transformers/fused.py; a
    vision tower's q/k/v from its fused qkv: backends/transformers/split.py). A tensor any other converter
    would rewrite is refused, and so is a saved name transformers' loader would not read back onto its
    tensor (backends/transformers/loading.py `read_back_misses`)."""
    # transformers imported here: the core imports third-party packages only inside functions
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        PrefixChange,
        WeightConverter,
        WeightRenaming,
        apply_converters,
        apply_renamings,
    )

    conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    saving = [c.reverse_transform() for c in conversions[::-1]]
    renamings = [c for c in saving if isinstance(c, WeightRenaming)]
    converters = [c for c in saving if isinstance(c, WeightConverter)]
    experts = stacked(conversions, dict(shapes))
    joined = fused(conversions, dict(kinds), model.config)
    swapped = transposed(conversions, dict(shapes))
    cut = split(conversions, kinds, shapes, model.config)
    handled = experts.keys() | joined.keys() | swapped.keys() | cut.keys()
    converted = [n for n in shapes if n not in handled and apply_converters(n, converters)[1] is not None]
    if converted:
        raise UnsupportedFeatures(
            f"{type(model).__name__}: transformers converts {', '.join(converted[:4])} between the checkpoint and "
            "the model (not a rename), which the transformers backend does not do yet"
        )
    saved = {n: apply_renamings(n, renamings) for n in shapes if n not in handled or n in swapped}
    misread = read_back_misses(model, saved)
    if misread:
        name, (held, got) = next(iter(misread.items()))
        raise UnsupportedFeatures(
            f"{type(model).__name__}: transformers does not load back the checkpoint it saves: it reads {held} as "
            f"{got}, not {name} ({len(misread)} tensors so), and from_pretrained would initialise them at random"
        )
    cut = {n: c._replace(source=apply_renamings(c.source, renamings)) for n, c in cut.items()}
    return (
        {**saved, **{n: c.source for n, c in cut.items()}},
        {n: tuple(apply_renamings(h, renamings) for h in hs) for n, hs in experts.items()},
        {n: (tuple(apply_renamings(h, renamings) for h in hs), dim) for n, (hs, dim) in joined.items()},
        swapped,
        cut,
    )


@dataclass(frozen=True)
class Meta:
    """What the meta-device model says about `spec`: its plan and every checkpoint tensor
    (shape, TP kind, name in a checkpoint)."""

    plan: Plan
    shapes: dict[str, tuple[int, ...]]
    kinds: dict[str, str]
    saved_as: dict[str, str]
    experts: dict[str, tuple[str, ...]]  # a stacked experts tensor -> its per-expert checkpoint tensors
    fused: dict[str, tuple[tuple[str, ...], int]]  # a fused tensor -> (its checkpoint pieces, their dim)
    integers: frozenset[str] = frozenset()  # checkpoint names of the tensors the model holds as integers
    transposed: dict[str, tuple[int, int, bool]] = dataclasses.field(default_factory=dict)  # experts.transposed
    # weights of the plain nn.Linear modules the plan leaves whole (a VLM's vision tower, an unplanned
    # attention): LoRA adapts them whole
    whole_linears: frozenset[str] = frozenset()
    refused: tuple[str, ...] = ()  # what of a VLM the stages cannot run (vision.language_refusals)
    split: dict[str, Split] = dataclasses.field(default_factory=dict)  # a tensor cut from one checkpoint tensor
    peft_modules: dict[str, str] = dataclasses.field(default_factory=dict)  # `_peft_modules`
    layer_kinds: tuple[str, ...] = ()  # each decoder layer's kind (kinds.layer_kinds)
    buffers: frozenset[str] = frozenset()  # the persistent buffers among `shapes`: checkpoint tensors, not parameters

    def hf_template(self, name: str, saved: str | None = None) -> str:
        """The checkpoint name of module tensor `name` (or `saved`, one of its checkpoint
        tensors) with `{layer}` where its layer index is (the concrete name when a rename
        moved the index)."""
        saved = self.saved_as[name] if saved is None else saved
        i = self.plan.layer_index(name)
        if i is None:
            return saved
        mine = f"{self.plan.layers}.{i}."
        if saved.startswith(mine):
            return saved.replace(mine, f"{self.plan.layers}.{{layer}}.", 1)
        # a renamed prefix (Nemotron-H saves `backbone.layers.i.` for `model.layers.i.`): the
        # layer list's own name and index, wherever the prefix put them
        leaf = f"{self.plan.layers.rpartition('.')[2]}.{i}."
        at = saved.find(leaf)
        if at < 0 or (at and saved[at - 1] != "."):
            # the layer list renamed too (Kimi-K2.5 saves `layers` as `blocks`): the first index of both names
            first, own = _FIRST_INDEX.search(saved), _FIRST_INDEX.search(name)
            if first is None or own is None or first.group(2) != str(i) or own.group(2) != str(i):
                return saved
            return saved[: first.start(2)] + "{layer}" + saved[first.end(2) :]
        return saved[:at] + leaf.replace(f".{i}.", ".{layer}.") + saved[at + len(leaf) :]

    @property
    def parameters(self) -> list[str]:
        """The checkpoint tensors that are parameters (a tied one once), in the model's order."""
        return [n for n in self.shapes if n not in self.buffers]

    def numel(self, name: str) -> int:
        n = 1
        for d in self.shapes[name]:
            n *= d
        return n


@lru_cache(maxsize=16)
def meta(spec: BridgeSpec) -> Meta:
    """The model built on the meta device (no memory), read once per description."""
    # torch and transformers imported here: the core imports third-party packages only inside functions
    import torch

    cfg = transformers_config(spec)
    try:
        with torch.device("meta"):
            model = auto_class(cfg).from_config(cfg)
    except ImportError as e:  # a package its classes need (transformers' requires_backends, a module import)
        raise needs_package(spec.architecture, e) from None
    plan = model_plan(model)
    tensors = checkpoint_tensors(model)
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    kinds = tensor_kinds(plan, shapes, spec.num_attention_heads, spec.num_query_groups, spec.head_dim)
    saved, experts, fused, swapped, cut = checkpoint_names(model, shapes, kinds)
    integers = frozenset(saved[n] for n, t in tensors.items() if not t.is_floating_point() and n in saved)
    peft = _peft_modules(model)
    whole = frozenset(
        f"{n}.weight"
        for n, kind in peft.items()
        if kind in PLAIN_LINEARS and kinds.get(f"{n}.weight") == REPLICATED and plan.style(n) is None
    )
    refused = _language_refusals(model, plan)
    windows = builds_windows(type(model.get_submodule(plan.prefix)))
    layers = layer_kinds(text_config_of(cfg), spec.num_layers, windows)
    buffers = frozenset(tensors) - {n for n, _ in model.named_parameters()}
    return Meta(
        plan, shapes, kinds, saved, experts, fused, integers, swapped, whole, refused, cut, peft, layers, buffers
    )


def _peft_modules(model: Any) -> dict[str, str]:
    """{module name: its class name} of every module PEFT's LoRA wraps when a target names it
    (its supported layer types), so a target that names one the stages cannot adapt is refused,
    not dropped (`TransformersBackend.lora_refusals`)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    nn = torch.nn
    types = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention, Conv1D)
    return {n: type(mod).__name__ for n, mod in model.named_modules() if n and isinstance(mod, types)}


# nn.Embedding subclasses whose forward is the lookup, then one module of their own, by class:
# {class: that module's attribute}. Muse's `embed_norm(super().forward(input_ids))` (a weight-less
# RMSNorm): the stages look up vocab-parallel, then run that module (runtime/transformers/layers.py VocabEmbedding)
EMBEDDING_AFTER: dict[str, str] = {
    "MuseGlimmerTextNormedEmbedding": "embed_norm",
    "MuseSparkTextNormedEmbedding": "embed_norm",
}


def embedding_after(emb: Any) -> str | None:
    """The attribute of the module `emb`'s forward runs on its lookup (EMBEDDING_AFTER), else None."""
    import torch

    return EMBEDDING_AFTER.get(type(emb).__name__) if isinstance(emb, torch.nn.Embedding) else None


def embedding_refusal(emb: Any) -> str | None:
    """Why the stages cannot take `emb` as the model's embedding (None: they can): an
    nn.Embedding, a ScaledWordEmbedding (Gemma's family: its `embed_scale` becomes the
    megatron embedding's own scale) or a lookup followed by a module of its own (`embedding_after`)."""
    import torch

    scaled = isinstance(emb, torch.nn.Embedding) and type(emb).__name__.endswith("ScaledWordEmbedding")
    if type(emb) is torch.nn.Embedding or (scaled and hasattr(emb, "scalar_embed_scale")) or embedding_after(emb):
        return None
    return f"its embedding is a {type(emb).__name__}, not nn.Embedding"


def _language_refusals(model: Any, plan: Plan) -> tuple[str, ...]:
    """What of a VLM the stages cannot run, found here so that every rank refuses it before any
    process group (a refusal met while building only the first stage's pieces would leave the
    other stages waiting): its language model's forward parameters the stages do not pass on
    (`vision.language_refusals`), an embedding they do not take (`embedding_refusal`)."""
    import inspect

    if plan.front is None:
        return ()
    language = model.get_submodule(plan.front).get_submodule(plan.language)
    params = [n for n in inspect.signature(type(language).forward).parameters if n != "self"]
    passes = tuple(kw for kw, _ in override(text_config_of(model.config).model_type).layer_inputs)
    emb = embedding_refusal(model.get_submodule(plan.embed))
    return (*language_refusals(params, passes), *((emb,) if emb else ()))


__all__ = [
    "Meta",
    "auto_class",
    "EMBEDDING_AFTER",
    "embedding_after",
    "embedding_refusal",
    "base_prefix",
    "causal_lm_class_name",
    "checkpoint_names",
    "checkpoint_shapes",
    "checkpoint_tensors",
    "class_name",
    "config_object",
    "declared",
    "meta",
    "model_plan",
    "runs_on",
    "transformers_config",
]
