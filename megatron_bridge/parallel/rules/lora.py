"""`peft=lora`: the adapter settings, a base model to adapt, and targets the tables resolve."""

from __future__ import annotations

from megatron_bridge.backends.registry import backend_of
from megatron_bridge.bridge.lora import base_of
from megatron_bridge.errors import UserError
from megatron_bridge.parallel.rules.base import Facts, RuleSet, Violation
from megatron_bridge.parallel.rules.base import violation as _v

RULES = RuleSet()


@RULES.run(reads=("model", "run"))
def lora_settings(f: Facts) -> list[Violation]:
    m, cfg = f.model, f.run
    p = getattr(cfg, "peft", None)
    if p is None or p.method == "none":
        return []
    if p.method != "lora":
        return _v("peft-method", f"peft={p.method!r} is not a method", "use peft=lora or peft=none")
    out = []
    if p.rank <= 0:
        out += _v("lora-rank", f"peft.rank={p.rank} must be >= 1", "set peft.rank to a positive rank, e.g. 8 or 16")
    if p.alpha <= 0:
        out += _v("lora-alpha", f"peft.alpha={p.alpha} must be > 0", "set peft.alpha (usually 2 * peft.rank)")
    if not 0.0 <= p.dropout < 1.0:
        out += _v("lora-dropout", f"peft.dropout={p.dropout} must be in [0, 1)", "set peft.dropout=0.05 or 0")
    if not base_of(cfg, m):
        out += _v(
            "lora-base",
            "peft=lora adapts a pre-trained model but neither model.hf_path nor train.init_from names one",
            "set model.hf_path=DIR (a Hugging Face model directory)",
        )
    return out


@RULES.run(reads=("layout", "model", "run"))
def lora_targets(f: Facts) -> list[Violation]:
    d, m, cfg = f.layout, f.model, f.run
    p = getattr(cfg, "peft", None)
    if p is None or p.method != "lora":
        return []
    backend = backend_of(m)
    try:
        targets = backend.lora_targets(m, p.target_modules)  # by PEFT's module names
    except UserError as e:
        return _v("lora-targets", str(e).split(". Use ")[0], "use " + str(e).split(". Use ", 1)[1].rstrip("."))
    refused = backend.lora_refusals(m, list(p.target_modules))
    if refused:
        more = f" (+{len(refused) - 3} more)" if len(refused) > 3 else ""
        return _v(
            "lora-targets",
            f"peft.target_modules={list(p.target_modules)} also names {', '.join(refused[:3])}{more}, which PEFT "
            "would adapt and LoRA here does not (only linear layers are adapted)",
            "name the linear modules by a longer suffix (e.g. self_attn.q_proj) so the others are left out",
        )
    if any(t.mapping.is_expert for t in targets) and d.etp > 1:
        return _v(
            "lora-experts-etp",
            f"LoRA on expert linears with expert tensor parallelism etp={d.etp} is not supported",
            "set parallel.etp=1 (experts whole on each rank), or leave the expert modules out of peft.target_modules",
        )
    return []
