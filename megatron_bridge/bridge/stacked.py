"""Transforms of HF tensors that stack several megatron parts in one tensor on disk.

    StackedQKV      Phi-3's `qkv_proj` = [q; k; v]      -> FusedQKV's per-group layout
    StackedGateUp   Phi-3's `gate_up_proj` = [gate; up] -> FusedGateUp's per-rank layout
    ExpertsStacked  GPT-OSS's experts stacked along dim 0 (transposed, gate/up interleaved)
                    -> one expert's megatron linear, as strided blocks

Each reuses a transform of mapping.py for the megatron side and only maps its blocks onto
the one stacked input (row offsets, or `Block.step` / `transposed` / `lead` views), so the
torch loader and the offline byte copier read the same ranges as for separate tensors.
Kept apart from mapping.py because these are the layouts that are not plain row ranges of
separate HF tensors.
"""

from __future__ import annotations

from megatron_bridge.bridge.mapping import FusedGateUp, FusedQKV, Transform
from megatron_bridge.bridge.shards import Block, joined, split_range


class StackedQKV(Transform):
    """One HF tensor holding [q (all heads); k; v] along its rows (Phi-3 `qkv_proj`) -> the
    per-query-group fused layout of `FusedQKV`: the same blocks, offset into the one input."""

    def _blocks(self, hf_shapes, s, shapes):
        (sh,) = hf_shapes
        q, kv = shapes.num_attention_heads * shapes.head_dim, shapes.num_query_groups * shapes.head_dim
        if sh[0] != q + 2 * kv:
            raise ValueError(f"stacked qkv has {sh[0]} rows, heads/kv groups/head_dim give {q} + 2·{kv}")
        parts = FusedQKV()._blocks([(q, *sh[1:]), (kv, *sh[1:]), (kv, *sh[1:])], s, shapes)
        at = (0, q, q + kv)  # where q, k, v start in the stacked tensor
        return joined([Block(0, (b.rows[0] + at[b.src or 0], b.rows[1] + at[b.src or 0]), b.cols) for b in parts])

    def merge(self, shards, shapes):
        import torch

        return (torch.cat(FusedQKV().merge(shards, shapes), dim=0),)


class StackedGateUp(Transform):
    """One HF tensor [gate; up] (Phi-3 `gate_up_proj`) -> each rank holds [gate_r; up_r], as
    `FusedGateUp`; unsplit it is the tensor itself."""

    def _blocks(self, hf_shapes, s, shapes):
        (sh,) = hf_shapes
        if sh[0] % 2:
            raise ValueError(f"stacked gate/up has an odd number of rows ({sh[0]})")
        half = sh[0] // 2
        a, b = split_range(half, s, "gate/up rows")
        return joined([Block(0, (a, b)), Block(0, (half + a, half + b))])

    def merge(self, shards, shapes):
        import torch

        return (torch.cat(FusedGateUp().merge(shards, shapes), dim=0),)


class ExpertsStacked(Transform):
    """One expert of an HF tensor that stacks all experts along dim 0 (GPT-OSS:
    `gate_up_proj` [E, in, 2·inter] with gate/up interleaved on the last dim, `down_proj`
    [E, inter, out]: stored transposed relative to nn.Linear), as megatron's per-expert
    linear. The table hands it one expert's slab [1, ...] (`Resolved.select`, a LazySlice
    reads just those bytes); `kind` says how the slab x (its unit axis dropped) becomes
    `inner`'s HF inputs:

    * "gate_up": v = x.T (weights) or x (biases); gate = v[0::2], up = v[1::2] -> GATE_UP
    * "linear": x.T (an nn.Linear weight) -> inner (ROW for down_proj)
    * "same": x itself (down_proj_bias) -> inner (REPLICATED)

    `blocks` maps `inner`'s blocks onto the slab as strided views (`Block.step`,
    `transposed`, `lead`), so `shard` (torch) and the offline byte copier share them."""

    stacked = True

    def __init__(self, inner: Transform, kind: str):
        if kind not in ("gate_up", "linear", "same"):
            raise ValueError(f"ExpertsStacked kind {kind!r}: one of gate_up, linear, same")
        self.inner, self.kind, self.whole = inner, kind, inner.whole

    def _blocks(self, hf_shapes, s, shapes):
        (sh,) = hf_shapes
        if sh[0] != 1:
            raise ValueError(f"{self!r} takes one expert's slab [1, ...], got shape {list(sh)}")
        x = sh[1:]
        if self.kind == "same":
            return [Block(b.src, b.rows, b.cols, lead=1) for b in self.inner.blocks([x], s, shapes)]
        t = len(x) == 2  # weights are stored transposed; 1-D biases are not
        if self.kind == "linear" and not t:
            raise ValueError(f"{self!r} needs a 2-D slab [1, in, out], got shape {list(sh)}")
        v = (x[1], x[0]) if t else x
        if self.kind == "linear":
            return [Block(b.src, b.rows, b.cols, transposed=True, lead=1) for b in self.inner.blocks([v], s, shapes)]
        if v[0] % 2:
            raise ValueError(f"{self!r}: interleaved gate/up has an odd size {v[0]}")
        half = (v[0] // 2,) + v[1:]
        out = []
        for b in self.inner.blocks([half, half], s, shapes):  # src 0 = gate (even rows), 1 = up (odd)
            assert b.src is not None  # gate/up blocks never pad
            r0, r1 = b.rows
            out.append(Block(0, (2 * r0 + b.src, 2 * r1 + b.src), b.cols, step=2, transposed=t, lead=1))
        return out

    def shard(self, hf, s, shapes):
        return super().shard(hf, s, shapes).contiguous()

    def merge(self, shards, shapes):
        import torch

        parts = self.inner.merge(shards, shapes)
        if self.kind == "gate_up":
            gate, up = parts
            x = torch.stack([gate, up], dim=1).reshape((-1,) + tuple(gate.shape[1:]))
        else:
            (x,) = parts
        if self.kind != "same" and x.dim() == 2:
            x = x.T
        return (x.contiguous()[None],)

    def __repr__(self) -> str:
        return f"ExpertsStacked({self.inner!r}, {self.kind!r})"


STACKED_QKV, STACKED_GATE_UP = StackedQKV(), StackedGateUp()


__all__ = ["StackedQKV", "StackedGateUp", "ExpertsStacked", "STACKED_QKV", "STACKED_GATE_UP"]
