"""Where a parameter lives in Megatron's per-rank ("torch") checkpoint layout.

Megatron-LM's classic checkpoint is one `torch.save` file per (tp, pp, ep) rank:
`release/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt` (PPP only when pp > 1, EEE only when
ep > 1, exactly as `megatron.training.checkpointing.get_checkpoint_name` builds it), holding
`model` (or `model0`, `model1`, ... per virtual pipeline chunk) = that rank's
`state_dict()`, plus `checkpoint_version`, `iteration` and `args`.

`release` rather than `iter_0000000`: Megatron-LM's tracker reader asserts
`iteration > 0 or release`, and a release checkpoint is what it loads for fine-tuning
(iteration reset to 0, no optimizer or RNG state expected).

Which parameter a rank holds is the bridge's decision (`loader.owned`: embedding on the first
chunk, output layer and final norm on the last, experts by EP rank) and each (pp, vp)
chunk's layers are the layout's (`ParallelDims.stage_layers`: megatron-core's split as
arithmetic, so the converter does not import megatron-core); this module names the files
and chunks they go to.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from megatron_bridge.bridge.layout import Layout
from megatron_bridge.bridge.loader import Coords, owned
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.table import Resolved
from megatron_bridge.convert.formats.dtypes import BFLOAT16, FLOAT16, DType

RELEASE = "release"
TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0
# megatron linears (an `_extra_state` each); MLA's too, except its kv down-projection, which
# the bridge keeps whole on every TP rank in a plain module (features/mla.py: no extra state)
LINEAR_MODULES = (
    "linear_qkv",
    "linear_proj",
    "linear_fc1",
    "linear_fc2",
    "linear_q_proj",
    "linear_q_down_proj",
    "linear_q_up_proj",
    "linear_kv_up_proj",
)


@dataclass(frozen=True, order=True)
class RankFile:
    tp: int
    pp: int
    ep: int

    def relpath(self, layout: Layout) -> str:
        name = f"mp_rank_{self.tp:02d}"
        if layout.pp > 1:
            name += f"_{self.pp:03d}"
        if layout.ep > 1:
            name += f"_{self.ep:03d}"
        return f"{RELEASE}/{name}/model_optim_rng.pt"


def chunk_key(layout: Layout, vp_stage: int | None) -> str:
    return "model" if vp_stage is None else f"model{vp_stage}"


@dataclass(frozen=True)
class Target:
    """One rank-local copy of a parameter: file, state-dict chunk, local name, coordinates."""

    file: RankFile
    chunk: str
    local: str
    coords: Coords


def stage_coords(layout: Layout, pp_rank: int) -> Iterator[Coords]:
    """Coordinates of every chunk stored in pipeline stage `pp_rank`'s files (etp = tp)."""
    for vp in range(layout.vpp) if layout.vpp else [None]:
        for ep in range(layout.ep):
            for tp in range(layout.tp):
                yield Coords(tp_rank=tp, pp_rank=pp_rank, ep_rank=ep, etp_rank=tp, vp_stage=vp)


def stage_targets(spec: BridgeSpec, layout: Layout, rows: Sequence[Resolved], pp_rank: int) -> dict[str, list[Target]]:
    """{global megatron name: its copies in stage `pp_rank`'s rank files}, in row order."""
    out: dict[str, list[Target]] = {}
    for coords in stage_coords(layout, pp_rank):
        layers = layout.stage_layers(spec.num_layers, pp_rank, coords.vp_stage)
        f = RankFile(coords.tp_rank, pp_rank, coords.ep_rank)
        for r in rows:
            local = owned(r, spec, layout, coords, layers)
            if local is not None:
                out.setdefault(r.megatron, []).append(Target(f, chunk_key(layout, coords.vp_stage), local, coords))
    return {r.megatron: out[r.megatron] for r in rows if r.megatron in out}


def all_targets(spec: BridgeSpec, layout: Layout, rows: Sequence[Resolved]) -> dict[str, list[Target]]:
    out: dict[str, list[Target]] = {}
    for pp in range(layout.pp):
        for name, targets in stage_targets(spec, layout, rows, pp).items():
            out.setdefault(name, []).extend(targets)
    return out


def _order(name: str, position: int):
    if name.startswith("embedding."):
        return (0, 0, position)
    if name.startswith("decoder.layers."):
        return (1, int(name.split(".")[2]), position)
    return (2 if name.startswith("decoder.") else 3, 0, position)


def chunk_state_dict(entries: dict[str, tuple[int, object]], post_process: bool) -> dict[str, object]:
    """A chunk's state dict in module order (entries: local name -> (position of its row in
    table order, value)), with the `_extra_state` entries (value None) that megatron's
    local-spec linear layers put into `state_dict()` (strict loading expects them)."""
    out: dict[str, object] = {}
    for name in sorted(entries, key=lambda n: _order(n, entries[n][0])):
        out[name] = entries[name][1]
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rsplit(".", 1)[-1] in LINEAR_MODULES:
            out[f"{module}._extra_state"] = None
    if post_process:
        out["output_layer._extra_state"] = None
    return out


def megatron_args(spec: BridgeSpec, layout: Layout, dtype: DType, ckpt_format: str) -> argparse.Namespace:
    """The `args` Megatron-LM stores with a checkpoint (it reads the model-parallel sizes
    from a torch_dist checkpoint's args; other fields document the model). `params_dtype` is a
    DType, which the converter's pickler writes as the torch dtype of that name."""
    return argparse.Namespace(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        group_query_attention=spec.num_query_groups != spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        vocab_size=spec.vocab_size,
        padded_vocab_size=spec.padded_vocab_size(layout.tp),
        make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by,
        position_embedding_type="rope",
        add_position_embedding=False,
        rotary_base=spec.rotary_base,
        normalization="RMSNorm",
        norm_epsilon=spec.norm_epsilon,
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=spec.add_qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        untie_embeddings_and_output_weights=not spec.tie_word_embeddings,
        num_experts=spec.num_moe_experts,
        moe_router_topk=spec.moe_router_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
        params_dtype=dtype,
        bf16=dtype == BFLOAT16,
        fp16=dtype == FLOAT16,
        ckpt_format=ckpt_format,
        iteration=0,
        consumed_train_samples=0,
        consumed_valid_samples=0,
        no_save_optim=True,
        no_save_rng=True,
    )


def common_state(args: argparse.Namespace) -> dict[str, object]:
    return {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0}


__all__ = [
    "RankFile",
    "Target",
    "stage_coords",
    "stage_targets",
    "all_targets",
    "chunk_key",
    "chunk_state_dict",
    "megatron_args",
    "common_state",
    "RELEASE",
    "TRACKER",
    "LINEAR_MODULES",
]
