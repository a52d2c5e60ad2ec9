"""`Layout`: the parallel degrees the bridge builds for, and where each weight lives.

Pure functions of (spec, layout, rank coordinates): which global layers a pipeline stage
(and virtual chunk) holds, which experts an expert-parallel rank holds, and the rank-local
name (and dist_checkpointing key) of a global megatron parameter. The layer split is
megatron-core's own arithmetic (`get_transformer_layer_offset` / `get_num_layers_to_build`),
evaluated for the given coordinates, so an offline converter places layers exactly where a
live model has them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel; None = tp
    vpp: int | None = None
    sequence_parallel: bool = False
    layers_first_stage: int | None = None
    layers_last_stage: int | None = None

    def __post_init__(self):
        if self.pp == 1 or self.vpp == 1:  # interleaving needs pipeline stages; vpp=1 is none
            object.__setattr__(self, "vpp", None)

    @property
    def etp_or_tp(self) -> int:
        return self.etp if self.etp is not None else self.tp

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def vpp_or_1(self) -> int:
        return self.vpp or 1

    def describe(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        if self.vpp:
            parts.append(f"vpp{self.vpp}")
        parts += [f"cp{self.cp}", f"ep{self.ep}"]
        if self.etp is not None and self.etp != self.tp:
            parts.append(f"etp{self.etp}")
        return "·".join(parts) + (" sp" if self.sequence_parallel else "")

    @classmethod
    def parse(cls, text: str) -> Layout:
        """'tp2pp2vpp2', 'tp2·cp2', 'ep2-tp2-sp' -> Layout (degrees default to 1)."""
        s = text.strip().lower()
        sp = s.endswith("sp") and not s.endswith("vsp")
        s = s[:-2] if sp else s
        kw: dict[str, int] = {}
        for key, val in re.findall(r"(vpp|etp|tp|pp|cp|ep)(\d+)", s):
            kw[key] = int(val)
        rest = re.sub(r"(vpp|etp|tp|pp|cp|ep)\d+|[·.\-_ ]", "", s)
        if rest or not (kw or sp):
            raise ValueError(f"cannot parse layout {text!r} (expected e.g. tp2pp2vpp2, cp2tp2, ep2, tp2sp)")
        return cls(sequence_parallel=sp, **kw)

    @classmethod
    def from_parallel_config(cls, p: Any) -> Layout:
        """From `cfg.parallel` (ParallelConfig) or a ParallelDims."""
        return cls(
            tp=p.tp,
            pp=p.pp,
            cp=p.cp,
            ep=p.ep,
            etp=getattr(p, "etp", None),
            vpp=p.vpp,
            sequence_parallel=p.sequence_parallel,
            layers_first_stage=getattr(p, "layers_first_stage", None),
            layers_last_stage=getattr(p, "layers_last_stage", None),
        )


def stage_layers(tconfig: Any, pp_rank: int, vp_stage: int | None = None) -> range:
    """Global layer indices built on pipeline rank `pp_rank`, virtual chunk `vp_stage`."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if tconfig.virtual_pipeline_model_parallel_size is None:
        vp_stage = None
    elif vp_stage is None:
        vp_stage = 0
    n = get_num_layers_to_build(tconfig, vp_stage=vp_stage, pp_rank=pp_rank)
    off = get_transformer_layer_offset(tconfig, vp_stage=vp_stage, pp_rank=pp_rank)
    return range(off, off + n)


def local_experts(num_experts: int, ep: int, ep_rank: int) -> range:
    """Global expert indices held by expert-parallel rank `ep_rank` (contiguous blocks)."""
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts do not split over ep={ep}")
    k = num_experts // ep
    return range(ep_rank * k, (ep_rank + 1) * k)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def renumber(name: str, layer_offset: int = 0, expert_offset: int = 0) -> str:
    """Shift the layer and local-expert indices in a megatron name by the given offsets
    (local -> global with positive offsets, global -> local with negative ones)."""
    name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name)
    return _EXPERT.sub(lambda m: f".local_experts.{int(m.group(1)) + expert_offset}.", name)


# The local spec stores its norms under fused names in dist_checkpointing (see the spec's
# `sharded_state_dict_keys_map`); an offline writer needs the checkpoint key, not the
# module attribute name.
DIST_CKPT_KEY_MAP: tuple[tuple[str, str], ...] = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
)


def dist_ckpt_key(megatron_name: str) -> str:
    for a, b in DIST_CKPT_KEY_MAP:
        megatron_name = megatron_name.replace("." + a, "." + b)
    return megatron_name


def to_local_name(global_name: str, layers: range, experts: range | None = None) -> str | None:
    """Rank-local parameter name of a global one, or None if it lives elsewhere. Layer and
    expert holes are shifted; non-layer names (embedding, output) pass through."""
    m = _LAYER.match(global_name)
    if m and int(m.group(1)) not in layers:
        return None
    e = _EXPERT.search(global_name)
    if e and experts is not None and int(e.group(1)) not in experts:
        return None
    return renumber(global_name, -layers.start if m else 0, -(experts.start if (e and experts) else 0))


def problems(spec: Any, layout: Layout, world_size: int | None = None, seq_length: int | None = None) -> list:
    """Why `spec` cannot run under `layout` (empty if it can): the divisibility megatron-core
    asserts deep inside model construction, said up front with the numbers."""
    out = []
    if spec.num_attention_heads % layout.tp:
        out.append(f"{layout.describe()}: {spec.num_attention_heads} attention heads do not split over tp={layout.tp}")
    g = spec.num_query_groups
    if g % layout.tp and layout.tp % g:
        out.append(f"{layout.describe()}: {g} KV heads must be a multiple or a divisor of tp={layout.tp}")
    chunks = layout.pp * (layout.vpp_or_1 if layout.pp > 1 else 1)
    if layout.layers_first_stage is None and layout.layers_last_stage is None and spec.num_layers % chunks:
        out.append(f"{layout.describe()}: {spec.num_layers} layers do not split over pp·vpp={chunks}")
    if layout.ep > 1 and not spec.is_moe:
        out.append(f"{layout.describe()}: ep={layout.ep} needs an MoE model")
    if spec.is_moe and spec.num_moe_experts % layout.ep:
        out.append(f"{layout.describe()}: {spec.num_moe_experts} experts do not split over ep={layout.ep}")
    if world_size is not None:
        for name, n in (("tp·pp·cp", layout.model_parallel), ("etp·ep·pp", layout.etp_or_tp * layout.ep * layout.pp)):
            if world_size % n:
                out.append(f"{layout.describe()}: {name}={n} does not divide the {world_size} processes")
    if seq_length is not None:
        if seq_length % (2 * layout.cp) and layout.cp > 1:
            out.append(f"{layout.describe()}: sequence length {seq_length} is not divisible by 2·cp={2 * layout.cp}")
        if layout.sequence_parallel and (seq_length // layout.cp) % layout.tp:
            out.append(f"{layout.describe()}: with sequence parallelism seq/cp must divide by tp={layout.tp}")
    return out


__all__ = ["Layout", "stage_layers", "local_experts", "to_local_name", "renumber", "dist_ckpt_key", "problems"]
