"""Rules about the model description: what the builder builds is what the config says.

Layout rules like every other (`rules.layout_rule`), kept apart because they concern the
model, not the degrees: a value the builder cannot build, a family whose HF architecture
(its weight table) the config contradicts, or an HF config the bridge refuses, is refused
here rather than built differently or refused twenty minutes into a launch.
"""

from __future__ import annotations

from functools import lru_cache

from megatron_bridge.parallel.rules import _v, layout_rule, rule

MODEL_CHOICES = {
    "normalization": ("RMSNorm", "LayerNorm"),
    "position_embedding_type": ("rope", "learned_absolute"),
}


@layout_rule
def model_architecture(d, cfg):
    """What the builder builds is what the config says: a value it cannot build, or one the
    family's HF architecture (its weight table) does not have, is refused, never ignored."""
    from megatron_bridge.bridge.registry import families

    m, out = cfg.model, []
    for key, allowed in MODEL_CHOICES.items():
        if getattr(m, key) not in allowed:
            out += _v("choice", f"model.{key}={getattr(m, key)!r} is not one of {allowed}", f"set model.{key} to one")
    known = {f.name: f for f in families()}
    fam = known.get(m.family)
    if fam is None:
        return out + _v(
            "model-family",
            f"model.family={m.family!r} is not a family the builder knows",
            f"use one of {', '.join(sorted(known))}",
        )
    if m.hf_path:
        refusal = _hf_refusal(m.hf_path, m.make_vocab_size_divisible_by)
        if refusal:
            out += _v(
                "hf-model",
                f"model.hf_path={m.hf_path}: {refusal}",
                "use a model whose features the bridge reproduces (`mbr verify --list`)",
            )
    for key, want in fam.fixed.items():
        if getattr(m, key) != want:
            out += _v(
                "model-architecture",
                f"model.{key}={getattr(m, key)!r}, but family {m.family} is the HF architecture "
                f"{fam.architectures[0]} with {key}={want!r} (its weight table maps exactly that)",
                f"drop the override, or use model.family=gpt (megatron GPT without HF weights) for {key}={getattr(m, key)!r}",
            )
    return out


@lru_cache(maxsize=64)
def _hf_refusal(path: str, divisible_by: int) -> str | None:
    """Why the builder would refuse this HF config (None if it builds it); read once per
    path, since the planner runs the rules for thousands of candidates."""
    from megatron_bridge.bridge.hf_config import load_spec
    from megatron_bridge.errors import UserError

    try:
        load_spec(path, make_vocab_size_divisible_by=divisible_by)
    except UserError as e:
        return str(e)
    return None


@rule
def hf_weights(d, cfg):
    from megatron_bridge.bridge.registry import families

    fam = {f.name: f for f in families()}.get(cfg.model.family)
    if cfg.train.init_from and fam is not None and not fam.hf_weights:
        return _v(
            "hf-weights",
            f"train.init_from={cfg.train.init_from} loads HF weights, but model.family={cfg.model.family} has no "
            "HF counterpart to map them from",
            "drop train.init_from (train from scratch), or use a family with HF weights",
        )
    return []


@layout_rule
def moe_bias_etp(d, cfg):
    """megatron-core refuses biased experts (GPT-OSS) under expert-TP > 1."""
    if not cfg.model.num_moe_experts or d.etp == 1 or not _biased_experts(cfg.model):
        return []
    return _v(
        "moe-bias-etp",
        f"the experts of this model have biases, and megatron-core supports biased experts only with "
        f"expert tensor parallelism 1 (etp={d.etp}; etp defaults to tp)",
        "set parallel.etp=1 (experts split by EP only; e.g. layout ep2etp1tp2)",
    )


def _biased_experts(model) -> bool:
    from megatron_bridge.bridge.hf_config import spec_from_model_config
    from megatron_bridge.errors import UserError

    if model.hf_path:
        return _hf_biased(model.hf_path, model.make_vocab_size_divisible_by)
    try:
        return bool(spec_from_model_config(model).mlp_bias)
    except (UserError, TypeError, ValueError):
        return False


def _hf_biased(path: str, divisible_by: int) -> bool:
    spec = _hf_spec(path, divisible_by)
    return bool(spec is not None and spec.mlp_bias)


@lru_cache(maxsize=64)
def _hf_spec(path: str, divisible_by: int):
    from megatron_bridge.bridge.hf_config import load_spec
    from megatron_bridge.errors import UserError

    try:
        return load_spec(path, make_vocab_size_divisible_by=divisible_by)
    except UserError:
        return None  # refused by the hf-model rule


@layout_rule
def latent_attention_tp(d, cfg):
    """MLA's q down-projection (q_a_proj) is column-parallel: tp must divide q_lora_rank."""
    m = cfg.model
    if not m.hf_path or d.tp < 2:
        return []
    spec = _hf_spec(m.hf_path, m.make_vocab_size_divisible_by)
    if spec is None or not spec.multi_latent_attention or not spec.q_lora_rank or spec.q_lora_rank % d.tp == 0:
        return []
    return _v(
        "mla-q-lora-tp",
        f"q_lora_rank={spec.q_lora_rank} (multi-latent attention's q down-projection, split over TP) "
        f"is not divisible by tp={d.tp}",
        f"choose tp dividing {spec.q_lora_rank}",
    )


@rule
def model_fields(d, cfg):
    """A model given by its fields (no `model.hf_path`) trains and exports as the family's HF
    architecture, so the config.json the export writes must describe the very model that was
    trained. Families whose HF defaults carry what the model group has no field for (Gemma's
    attention scale and embedding multiplier, GPT-OSS's biases) would be exported as another
    model: refused, with the fix of giving their config.json."""
    m = cfg.model
    if m.hf_path:
        return []
    from megatron_bridge.bridge.hf_config import spec_from_model_config
    from megatron_bridge.bridge.registry import families
    from megatron_bridge.errors import UserError

    fam = {f.name: f for f in families()}.get(m.family)
    if fam is None or not fam.hf_weights:  # unknown: model-family's; no HF counterpart: nothing to export
        return []
    try:
        problem = _fields_problem(spec_from_model_config(m))
    except (UserError, TypeError, ValueError) as e:
        problem = str(e)
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
    from megatron_bridge.bridge.hf_config import spec_from_hf, spec_to_hf_config
    from megatron_bridge.errors import UserError

    try:
        back = spec_from_hf(spec_to_hf_config(spec), make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by)
    except UserError as e:
        return f"its HF config cannot be written ({' '.join(str(e).split())[:240]})"
    a, b = _scaled(spec), _scaled(back)
    diff = [k for k in spec.__dataclass_fields__ if getattr(a, k) != getattr(b, k)]
    if not diff:
        return None
    shown = ", ".join(f"{k}={getattr(spec, k)!r} would read back as {getattr(back, k)!r}" for k in diff[:3])
    return f"the model group cannot express this architecture: its exported config.json would differ ({shown})"


def _scaled(spec):
    """`spec` with an unset attention scale spelled out (1/sqrt(head_dim), what None means), so
    a config that writes the default explicitly (Granite's attention_multiplier) is the same."""
    import dataclasses

    if spec.softmax_scale is not None or spec.multi_latent_attention:
        return spec
    return dataclasses.replace(spec, softmax_scale=spec.head_dim**-0.5)
