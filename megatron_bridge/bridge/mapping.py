"""Weight-mapping primitives: pure tensor functions between HF tensors and megatron shards.

A family's table is a list of `Mapping`s. Each one names a megatron parameter (a template
with `{layer}` / `{expert}` holes, global indices) and the HF tensor(s) it is made of, plus a
`Transform` that knows how the tensor is laid out and split:

    shard(hf_tensors, Shard(rank, size), shapes) -> the rank-local megatron tensor
    merge([shard_0, ..., shard_{n-1}], shapes)   -> the HF tensors again (bit-exact)

Nothing here touches a model, a process group or a file, so the same table serves online
loading (`loader.py`), the offline converter and export. The megatron *global* tensor (the
dist_checkpointing layout, e.g. fused QKV per query group, SwiGLU fc1 = cat([gate, up]),
padded vocab) is `shard(hf, Shard(0, 1))`, and `merge([global])` gives the HF tensors back.

Inputs to `shard` may be lazy (`LazySlice`, wrapping safetensors' `get_slice`): transforms
only index contiguous row/column ranges, so a rank reads just its part of the file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

Sliceable = Any  # torch.Tensor or LazySlice: has .shape and supports [a:b] / [:, a:b]


@dataclass(frozen=True)
class Shard:
    """Coordinates of one rank's piece along the split axis (TP, or expert-TP for experts)."""

    rank: int = 0
    size: int = 1


FULL = Shard(0, 1)


@dataclass(frozen=True)
class Shapes:
    """The few model facts the transforms need (all global, i.e. before TP splitting)."""

    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int  # rows in the HF embedding / lm_head
    padded_vocab_size: int  # rows in megatron's (TP-padded) vocab tables


_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class LazySlice:
    """A tensor on disk: `.shape` plus row/column slicing that reads only that range."""

    def __init__(self, safe_slice):
        self._s = safe_slice
        self.shape = torch.Size(safe_slice.get_shape())
        self.dtype = _ST_DTYPES.get(safe_slice.get_dtype())

    def __getitem__(self, idx):
        return self._s[idx]

    def full(self) -> torch.Tensor:
        return self._s[:]


def _rows(t: Sliceable, a: int, b: int) -> torch.Tensor:
    return t[a:b]


def _cols(t: Sliceable, a: int, b: int) -> torch.Tensor:
    return t[:, a:b]


def _split(n: int, s: Shard, what: str) -> Tuple[int, int]:
    if n % s.size:
        raise ValueError(f"{what}: size {n} is not divisible by {s.size} shards")
    k = n // s.size
    return s.rank * k, (s.rank + 1) * k


# --------------------------------------------------------------------------------------
# Transforms. Each is stateless; the table gives it its tensors and the Shapes.
# --------------------------------------------------------------------------------------


class Transform:
    """How one megatron tensor is built from HF tensors and split across ranks."""

    n_hf = 1  # how many HF tensors it consumes

    def shard(self, hf: Sequence[Sliceable], s: Shard, shapes: Shapes) -> torch.Tensor:
        raise NotImplementedError

    def merge(self, shards: Sequence[torch.Tensor], shapes: Shapes) -> Tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return type(self).__name__


class Replicated(Transform):
    """Same tensor on every rank (norms, router, biases of row-parallel layers)."""

    def shard(self, hf, s, shapes):
        t = hf[0]
        return t if isinstance(t, torch.Tensor) else t[:]

    def merge(self, shards, shapes):
        return (shards[0],)


class Column(Transform):
    """Column-parallel: output features (dim 0) split across ranks."""

    def shard(self, hf, s, shapes):
        a, b = _split(hf[0].shape[0], s, "column-parallel rows")
        return _rows(hf[0], a, b)

    def merge(self, shards, shapes):
        return (torch.cat(list(shards), dim=0),)


class Row(Transform):
    """Row-parallel: input features (dim 1) split across ranks."""

    def shard(self, hf, s, shapes):
        a, b = _split(hf[0].shape[1], s, "row-parallel columns")
        return _cols(hf[0], a, b)

    def merge(self, shards, shapes):
        return (torch.cat(list(shards), dim=1),)


class VocabParallel(Transform):
    """Vocab rows split across ranks after zero-padding to `padded_vocab_size` rows."""

    def shard(self, hf, s, shapes):
        t = hf[0]
        if t.shape[0] != shapes.vocab_size:
            raise ValueError(f"vocab table has {t.shape[0]} rows, config says {shapes.vocab_size}")
        a, b = _split(shapes.padded_vocab_size, s, "padded vocab")
        real = _rows(t, a, min(b, shapes.vocab_size)) if a < shapes.vocab_size else None
        dtype = real.dtype if real is not None else getattr(t, "dtype", None) or torch.float32
        out = torch.zeros((b - a,) + tuple(t.shape[1:]), dtype=dtype)
        if real is not None:
            out[: real.shape[0]] = real
        return out

    def merge(self, shards, shapes):
        return (torch.cat(list(shards), dim=0)[: shapes.vocab_size].clone(),)


class FusedQKV(Transform):
    """q, k, v projections (weights or biases) fused per query group: [q_g..., k_g, v_g].

    Megatron's linear_qkv stores, for each KV group g, that group's query heads, then its
    key head, then its value head, and TP splits those rows evenly. When TP divides the
    group count a rank holds whole groups; when there are fewer KV groups than TP ranks
    (megatron-core >= 0.16 gathers the activations and picks its heads) a rank holds a
    fraction of one group. Either way a shard is a contiguous row range of the fused
    layout, built from contiguous row ranges of q, k and v.
    """

    n_hf = 3

    @staticmethod
    def _geometry(q, k, v, shapes):
        g, d = shapes.num_query_groups, shapes.head_dim
        hpg = shapes.num_attention_heads // g
        if q.shape[0] != g * hpg * d or k.shape[0] != g * d or v.shape[0] != g * d:
            raise ValueError(
                f"q/k/v rows {q.shape[0]}/{k.shape[0]}/{v.shape[0]} do not match heads="
                f"{shapes.num_attention_heads}, kv groups={g}, head_dim={d}"
            )
        return g, d, hpg

    def shard(self, hf, s, shapes):
        q, k, v = hf
        g, d, hpg = self._geometry(q, k, v, shapes)
        blk = (hpg + 2) * d
        a, b = _split(g * blk, s, "fused QKV rows")
        g0, g1 = a // blk, -(-b // blk)
        n = g1 - g0
        rest = tuple(q.shape[1:])
        qs = _rows(q, g0 * hpg * d, g1 * hpg * d).reshape((n, hpg * d) + rest)
        ks = _rows(k, g0 * d, g1 * d).reshape((n, d) + rest)
        vs = _rows(v, g0 * d, g1 * d).reshape((n, d) + rest)
        fused = torch.cat([qs, ks, vs], dim=1).reshape((n * blk,) + rest)
        return fused[a - g0 * blk : b - g0 * blk]

    def merge(self, shards, shapes):
        full = torch.cat(list(shards), dim=0)
        g, d = shapes.num_query_groups, shapes.head_dim
        hpg = shapes.num_attention_heads // g
        rest = tuple(full.shape[1:])
        grouped = full.reshape((g, (hpg + 2) * d) + rest)
        q, k, v = torch.split(grouped, [hpg * d, d, d], dim=1)
        return tuple(x.reshape((-1,) + rest).clone() for x in (q, k, v))


class FusedGateUp(Transform):
    """SwiGLU fc1: each rank holds cat([gate_shard, up_shard]); global is cat([gate, up])."""

    n_hf = 2

    def shard(self, hf, s, shapes):
        gate, up = hf
        a, b = _split(gate.shape[0], s, "gate/up rows")
        return torch.cat([_rows(gate, a, b), _rows(up, a, b)], dim=0)

    def merge(self, shards, shapes):
        gates, ups = zip(*(torch.chunk(x, 2, dim=0) for x in shards))
        return torch.cat(gates, dim=0), torch.cat(ups, dim=0)


REPLICATED, COLUMN, ROW, VOCAB = Replicated(), Column(), Row(), VocabParallel()
QKV, GATE_UP = FusedQKV(), FusedGateUp()


# --------------------------------------------------------------------------------------
# Table entries
# --------------------------------------------------------------------------------------

_HOLE = re.compile(r"\{(layer|expert)\}")


def _pattern(template: str) -> "re.Pattern[str]":
    parts, pos = [], 0
    for m in _HOLE.finditer(template):
        parts.append(re.escape(template[pos : m.start()]))
        parts.append(f"(?P<{m.group(1)}>\\d+)")
        pos = m.end()
    parts.append(re.escape(template[pos:]))
    return re.compile("^" + "".join(parts) + "$")


@dataclass(frozen=True)
class Mapping:
    """One table row: megatron parameter <- HF tensor(s) through a transform.

    `when` names a boolean attribute of the bridge spec (prefix `!` negates) that must hold
    for the row to apply (tied vs untied output layer, qkv bias, ...). `export=False` rows
    feed megatron on load but are not written back (the tied output layer, whose HF tensor
    is the embedding). A megatron name with `{expert}` is an expert weight: it is split over
    expert-parallel ranks by expert index and over the expert-TP group by the transform.
    """

    megatron: str
    hf: Tuple[str, ...]
    transform: Transform = REPLICATED
    when: Optional[str] = None
    export: bool = True
    _mpat: Any = field(default=None, compare=False, repr=False)
    _hpats: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        hf = (self.hf,) if isinstance(self.hf, str) else tuple(self.hf)
        object.__setattr__(self, "hf", hf)
        if len(hf) != self.transform.n_hf:
            raise ValueError(f"{self.megatron}: {self.transform!r} takes {self.transform.n_hf} HF tensors, got {len(hf)}")
        object.__setattr__(self, "_mpat", _pattern(self.megatron))
        object.__setattr__(self, "_hpats", tuple(_pattern(h) for h in hf))

    @property
    def is_expert(self) -> bool:
        return "{expert}" in self.megatron

    def active(self, spec: Any) -> bool:
        if self.when is None:
            return True
        neg = self.when.startswith("!")
        value = bool(getattr(spec, self.when.lstrip("!")))
        return value != neg

    def match_megatron(self, name: str) -> Optional[Dict[str, int]]:
        m = self._mpat.match(name)
        return {k: int(v) for k, v in m.groupdict().items()} if m else None

    def match_hf(self, name: str) -> Optional[Tuple[int, Dict[str, int]]]:
        """(which HF input, holes) if `name` is one of this row's HF tensors."""
        for i, p in enumerate(self._hpats):
            m = p.match(name)
            if m:
                return i, {k: int(v) for k, v in m.groupdict().items()}
        return None

    def megatron_name(self, **holes: int) -> str:
        return self.megatron.format(**holes)

    def hf_names(self, **holes: int) -> Tuple[str, ...]:
        return tuple(h.format(**holes) for h in self.hf)

    # pure tensor API --------------------------------------------------------------------
    def shard(self, hf: Sequence[Sliceable], s: Shard, shapes: Shapes) -> torch.Tensor:
        return self.transform.shard(hf, s, shapes)

    def to_global(self, hf: Sequence[Sliceable], shapes: Shapes) -> torch.Tensor:
        return self.transform.shard(hf, FULL, shapes)

    def merge(self, shards: Sequence[torch.Tensor], shapes: Shapes) -> Tuple[torch.Tensor, ...]:
        return self.transform.merge(shards, shapes)


@dataclass(frozen=True)
class Resolved:
    """A table row with its holes filled: one megatron tensor and its HF tensors."""

    mapping: Mapping
    megatron: str  # global name (global layer and expert indices)
    hf: Tuple[str, ...]
    holes: Tuple[Tuple[str, int], ...] = ()

    @property
    def layer(self) -> Optional[int]:
        return dict(self.holes).get("layer")

    @property
    def expert(self) -> Optional[int]:
        return dict(self.holes).get("expert")


def resolve_megatron(table: Sequence[Mapping], name: str) -> Optional[Resolved]:
    """The row producing global megatron parameter `name` (first match wins)."""
    for m in table:
        holes = m.match_megatron(name)
        if holes is not None:
            return Resolved(m, name, m.hf_names(**holes), tuple(sorted(holes.items())))
    return None


def resolve_hf(table: Sequence[Mapping], hf_keys: Iterable[str]) -> Tuple[List[Resolved], List[str]]:
    """Group a checkpoint's HF tensor names into table rows.

    Returns (rows whose HF inputs are all present, HF names no row consumes). A row with
    only some inputs present is an error: the checkpoint is inconsistent with the table.
    """
    keys = list(hf_keys)
    present = set(keys)
    out: Dict[Tuple[int, str], Resolved] = {}
    used = set()
    for key in keys:
        for ti, m in enumerate(table):
            hit = m.match_hf(key)
            if hit is None:
                continue
            _, holes = hit
            names = m.hf_names(**holes)
            missing = [n for n in names if n not in present]
            if missing:
                raise KeyError(f"{key} maps to {m.megatron} which also needs {missing}, absent from the checkpoint")
            used.add(key)
            mname = m.megatron_name(**holes)
            out.setdefault((ti, mname), Resolved(m, mname, names, tuple(sorted(holes.items()))))
    order = {id(m): i for i, m in enumerate(table)}
    resolved = sorted(out.values(), key=lambda r: (r.layer if r.layer is not None else -1, order[id(r.mapping)], r.expert or 0))
    return resolved, [k for k in keys if k not in used]


# --------------------------------------------------------------------------------------
# Global <-> rank-local names (pipeline stage and expert-parallel offsets)
# --------------------------------------------------------------------------------------

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
DIST_CKPT_KEY_MAP: Tuple[Tuple[str, str], ...] = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
)


def dist_ckpt_key(megatron_name: str) -> str:
    for a, b in DIST_CKPT_KEY_MAP:
        megatron_name = megatron_name.replace("." + a, "." + b)
    return megatron_name


__all__ = [
    "Shard", "FULL", "Shapes", "LazySlice", "Transform", "Replicated", "Column", "Row",
    "VocabParallel", "FusedQKV", "FusedGateUp", "REPLICATED", "COLUMN", "ROW", "VOCAB", "QKV",
    "GATE_UP", "Mapping", "Resolved", "resolve_megatron", "resolve_hf", "renumber", "dist_ckpt_key",
]
