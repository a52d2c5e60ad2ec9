"""The model description: what the builder builds is what the recipe says.

A value the builder cannot build, a family whose HF architecture (its weight table) the
model contradicts, or a model whose export would describe another model, is refused here
rather than built differently or refused twenty minutes into a launch. (A config.json the
backend cannot reproduce, or an unknown family, is refused as `hf-model` / `model-family`
where the description is derived: `backends/describe.py`.)
"""

from __future__ import annotations

from functools import lru_cache

from megatron_bridge.backends.describe import frozen_parts
from megatron_bridge.backends.registry import backend_of
from megatron_bridge.bridge.hf_config import spec_from_hf, spec_to_hf_config
from megatron_bridge.bridge.spec import NATIVE_FIELDS, field_names
from megatron_bridge.errors import UserError
from megatron_bridge.parallel.rules.base import Facts, RuleSet, Violation
from megatron_bridge.parallel.rules.base import violation as _v

RULES = RuleSet()

MODEL_CHOICES = {
    "normalization": ("RMSNorm", "LayerNorm"),
    "position_embedding_type": ("rope", "learned_absolute"),
}


@RULES.layout(reads=("model",))
def model_architecture(f: Facts) -> list[Violation]:
    """What the builder builds is what the recipe says: a value it cannot build, or one the
    family's HF architecture (its weight table) does not have, is refused, never ignored."""
    m, out = f.model, []
    for key, allowed in MODEL_CHOICES.items():
        if key in NATIVE_FIELDS and not hasattr(m.part, key):
            continue  # a setting of the native part: a model of another backend is its config.json
        if getattr(m, key) not in allowed:
            out += _v("choice", f"model.{key}={getattr(m, key)!r} is not one of {allowed}", f"set model.{key} to one")
    fam = backend_of(m).family_of(m)
    if fam is None:  # no family declarations (the transformers backend builds what config.json says)
        return out
    for key, want in fam.fixed.items():
        if getattr(m, key) != want:
            out += _v(
                "model-architecture",
                f"model.{key}={getattr(m, key)!r}, but family {m.family} is the HF architecture "
                f"{fam.architectures[0]} with {key}={want!r} (its weight table maps exactly that)",
                f"drop the override, or use model.family=gpt (megatron GPT without HF weights) for {key}={getattr(m, key)!r}",
            )
    return out


@RULES.run(reads=("model", "run"))
def hf_weights(f: Facts) -> list[Violation]:
    m, cfg = f.model, f.run
    fam = backend_of(m).family_of(m)
    if cfg.train.init_from and fam is not None and not fam.hf_weights:
        return _v(
            "hf-weights",
            f"train.init_from={cfg.train.init_from} loads HF weights, but model.family={m.family} has no "
            "HF counterpart to map them from",
            "drop train.init_from (train from scratch), or use a family with HF weights",
        )
    return []


@RULES.layout(reads=("layout", "model"))
def backend_layout(f: Facts) -> list[Violation]:
    """What the model's backend cannot build under this layout (the transformers backend: no context or
    sequence parallelism yet, whole KV heads per TP rank), refused before any process group."""
    out = []
    for what, fix in backend_of(f.model).layout_limits(f.model, f.layout):
        out += _v("backend-layout", f"{f.model.architecture} ({f.model.backend} backend): {what}", fix)
    return out


@RULES.run(reads=("model", "run"))
def backend_run(f: Facts) -> list[Violation]:
    """What the model's backend cannot do in this training run (the transformers backend: packed SFT data,
    recomputation, MoE with transformers' aux loss at pp > 1), refused by `mbr check`, `mbr plan`
    and the trainer before any process group."""
    out = []
    for what, fix in backend_of(f.model).run_limits(f.model, f.run):
        out += _v("backend-run", f"{f.model.architecture} ({f.model.backend} backend): {what}", fix)
    return out


@RULES.run(reads=("model", "run"))
def model_freeze(f: Facts) -> list[Violation]:
    """`model.freeze` names parts the model has (a VLM's vision, projector, language), and
    leaves something to train."""
    named = list(frozen_parts(getattr(f.run, "model", None)))  # the planner's runs hold no model group
    if not named:
        return []
    groups = backend_of(f.model).freeze_groups(f.model)
    unknown = [g for g in named if g not in groups]
    if unknown:
        has = f"its parts are {', '.join(groups)}" if groups else "it is one language model (no parts to freeze)"
        return _v(
            "model-freeze",
            f"model.freeze={named}: {f.model.architecture} has no part {', '.join(map(repr, unknown))}; {has}",
            "drop model.freeze" if not groups else f"name parts among {list(groups)}",
        )
    if set(groups) <= set(named) and f.run.peft.method != "lora":
        return _v(
            "model-freeze",
            f"model.freeze={named} freezes every part of {f.model.architecture}: nothing would train",
            "leave a part out of model.freeze, or train adapters (peft=lora)",
        )
    return []


@RULES.layout(reads=("layout", "model"))
def moe_bias_etp(f: Facts) -> list[Violation]:
    """megatron-core refuses biased experts (GPT-OSS) under expert-TP > 1."""
    d, m = f.layout, f.model
    if not m.num_moe_experts or d.etp == 1 or not getattr(m.part, "mlp_bias", False):  # the native part's setting
        return []
    return _v(
        "moe-bias-etp",
        f"the experts of this model have biases, and megatron-core supports biased experts only with "
        f"expert tensor parallelism 1 (etp={d.etp}; etp defaults to tp)",
        "set parallel.etp=1 (experts split by EP only; e.g. layout ep2etp1tp2)",
    )


@RULES.layout(reads=("layout", "model"))
def latent_attention_tp(f: Facts) -> list[Violation]:
    """MLA's q down-projection (q_a_proj) is column-parallel: tp must divide q_lora_rank."""
    d, m = f.layout, f.model
    if d.tp < 2 or not m.multi_latent_attention or not m.q_lora_rank or m.q_lora_rank % d.tp == 0:
        return []
    if backend_of(m).family_of(m) is None:  # megatron-core's MLA layer; transformers' keeps q_a_proj whole
        return []
    return _v(
        "mla-q-lora-tp",
        f"q_lora_rank={m.q_lora_rank} (multi-latent attention's q down-projection, split over TP) "
        f"is not divisible by tp={d.tp}",
        f"choose tp dividing {m.q_lora_rank}",
    )


@RULES.run(reads=("model",))
def model_fields(f: Facts) -> list[Violation]:
    """A model given by its fields (no `model.hf_path`) trains and exports as the family's HF
    architecture, so the config.json the export writes must describe the very model that was
    trained. Families whose HF defaults carry what the model group has no field for (Gemma's
    attention scale and embedding multiplier, GPT-OSS's biases) would be exported as another
    model: refused, with the fix of giving their config.json."""
    m = f.model
    fam = backend_of(m).family_of(m)
    if m.described_from != "model fields" or fam is None or not fam.hf_weights:  # no HF counterpart: nothing to export
        return []
    problem = _fields_problem(m)
    if not problem:
        return []
    return _v(
        "model-fields",
        f"model.family={m.family} without model.hf_path: {problem}",
        f"set model.hf_path=DIR (a {fam.architectures[0]} config.json; `mbr verify verify.tiny={m.family}` "
        "shows a tiny one), or use model.family=llama / mixtral for a model described by its fields",
    )


@lru_cache(maxsize=64)
def _fields_problem(spec) -> str | None:
    """Why the HF config written for `spec` would describe another model (None if it does not)."""
    try:
        back = spec_from_hf(spec_to_hf_config(spec), make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by)
    except UserError as e:
        return f"its HF config cannot be written ({' '.join(str(e).split())[:240]})"
    a, b = _scaled(spec), _scaled(back)
    diff = [k for k in sorted(field_names()) if getattr(a, k, None) != getattr(b, k, None)]
    if not diff:
        return None
    shown = ", ".join(f"{k}={getattr(spec, k)!r} would read back as {getattr(back, k)!r}" for k in diff[:3])
    return f"the model group cannot express this architecture: its exported config.json would differ ({shown})"


def _scaled(spec):
    """`spec` with an unset attention scale spelled out (1/sqrt(head_dim), what None means), so
    a config that writes the default explicitly (Granite's attention_multiplier) is the same."""
    if spec.softmax_scale is not None or spec.multi_latent_attention:
        return spec
    return spec.replace(softmax_scale=spec.head_dim**-0.5)
