"""Sharding one stage piece of a transformers-backend model (runtime/transformers/build.py cuts the stage into
pieces): every linear / embedding the tp plan names swapped for megatron's parallel layer holding
only its shard, the attention modules' head counts divided by tp, experts partitioned, the hooks
of the plan strings that need one (MLA's kv_a, MQA's fused qkv, identity experts), and then
what is left on the meta device materialised at its shard's shape and initialised by the
model's own `_init_weights`. Under sequence parallelism a decoder layer's unit that cannot split
the sequence (`plan.sp_whole`) is built as in plain TP and wrapped (`whole_under_sp`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import init_method_normal
from transformers import PreTrainedModel

from megatron_bridge.backends.transformers.experts import SPLIT_DIMS, expert_split
from megatron_bridge.backends.transformers.kinds import PLAIN_LINEARS
from megatron_bridge.backends.transformers.meta import meta
from megatron_bridge.backends.transformers.plan import (
    ATTENTION_NAMES,
    COLUMN_STYLES,
    EMBED_COLS,
    EMBED_ROWS,
    EP_MODULE,
    EP_TENSOR,
    GRAD_ALLREDUCE,
    HEAD,
    MLA,
    MOE_IDENTITY,
    MOE_TP,
    MQA_QKV,
    REPLICATED,
    ROW_STYLES,
    WHOLE_ATTENTION,
    Plan,
    sp_whole,
    sp_whole_piece,
)
from megatron_bridge.backends.transformers.vision import text_config_of
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.build_base import skip_weight_init
from megatron_bridge.runtime.transformers.experts import divide_input_by_tp, mark_expert, partition
from megatron_bridge.runtime.transformers.layers import (
    MEGATRON_LAYERS,
    ColumnEmbedding,
    ColumnLinear,
    RowLinear,
    VocabEmbedding,
    gather_sequence,
    mla_kv_a_hook,
    mqa_qkv_hooks,
    sum_grad_over_tp,
    whole_under_sp,
)

# attention-module attributes that count heads (divided by tp where the q/k/v linears are split)
HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_heads", "n_kv_heads")
# those that count query heads alone (`mqa_fused_qkv`: the one K/V head stays whole on every rank)
QUERY_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads")
# modules that hold others but are never called themselves: not a unit `whole_under_sp` can wrap
CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)


class Pieces:
    """Shards stage pieces of the meta model (`keep`): swaps, divides, materialises."""

    def __init__(
        self,
        spec: BridgeSpec,
        full: Any,
        plan: Plan,
        kinds: dict[str, str],
        tconfig: TransformerConfig,
        device: torch.device,
        load_weights: bool,
    ) -> None:
        self.spec, self.full, self.plan, self.kinds = spec, full, plan, kinds
        self.text = text_config_of(full.config)  # a VLM's language model's config
        self.layer_kinds = meta(spec).layer_kinds  # each layer's kind, derived once (kinds.layer_kinds)
        self.tconfig, self.device, self.load_weights = tconfig, device, load_weights
        self.tp, self.ep = tconfig.tensor_model_parallel_size, tconfig.expert_model_parallel_size
        self.sp = bool(tconfig.sequence_parallel)
        # the config of the modules a unit run whole under SP holds (`_whole`): plain TP's
        self.tp_config = copy.copy(tconfig)
        self.tp_config.sequence_parallel = False
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.init = init_method_normal(spec.initializer_range)

    def keep(self, path: str, module: torch.nn.Module) -> torch.nn.Module:
        """`module` (at `path` in the causal LM) with its planned linears swapped, its heads
        divided and the rest materialised on this rank's device. Under SP the unit of a decoder
        layer that runs whole (`_whole`) is built as in plain TP and wrapped (`whole_under_sp`)."""
        if path in self.plan.vision:  # whole on every TP rank, on the whole sequence (backends/transformers/vision.py)
            self._materialise(path, module, path)
            return module
        split_parents: dict[torch.nn.Module, bool] = {}  # module holding colwise linears -> splits under SP
        whole = self._whole(path, module)
        for name, child in list(module.named_modules()):
            full = f"{path}.{name}" if name else path
            sp = self.sp and not _within(full, whole)
            style = self.plan.style(full)
            if style in COLUMN_STYLES or style in ROW_STYLES or style in (EMBED_ROWS, EMBED_COLS):
                if name == "":
                    raise UserError(f"tp plan entry {full} is a stage piece, not a linear inside one")
                parent_name, _, leaf = name.rpartition(".")
                parent = module.get_submodule(parent_name)
                swap = self._linear if style in COLUMN_STYLES or style in ROW_STYLES else self._embedding_in
                parent.add_module(leaf, swap(full, child, style, sp))
                if style == "colwise":
                    split_parents[parent] = sp
            elif style == MLA and self.tp > 1:
                mla_kv_a_hook(child, int(self.text.qk_rope_head_dim))
            elif style == MOE_IDENTITY and self.tp > 1:
                divide_input_by_tp(child)
            elif style == MQA_QKV and self.tp > 1:
                parent = module.get_submodule(name.rpartition(".")[0])
                mqa_qkv_hooks(child, self.spec.num_attention_heads, self.spec.head_dim)
                self._divide_heads(parent, QUERY_HEAD_ATTRS)
            ep = self.ep > 1 and self.plan.ep_style(full) == EP_MODULE
            tp = self.tp > 1 and style == MOE_TP
            if ep or tp:
                partition(child, self.ep if ep else 1, tp, sp)
        for parent, sp in split_parents.items():
            self._divide_heads(parent)
            if sp:
                if parent is module and path.startswith(f"{self.plan.layers}."):
                    raise UserError(
                        f"{path}: its colwise linears sit in the decoder layer itself, so sequence parallelism "
                        "would gather its norms' input too (set parallel.sequence_parallel=false)"
                    )
                gather_sequence(parent)
        if whole is not None:
            whole_under_sp(self.full.get_submodule(whole))
        self._materialise(path, module, whole)
        return module

    def _whole(self, path: str, module: torch.nn.Module) -> str | None:
        """Under SP, the path of what of decoder layer `path` runs whole (`plan.sp_whole`):
        its attention module (the first of `ATTENTION_NAMES` it has, called as a module: not a
        container), else the layer; None where everything splits or `path` is no decoder layer.
        A stage piece runs whole where `plan.sp_whole_piece` says so."""
        if self.sp and sp_whole_piece(self.plan, path):
            return path
        i = self.plan.layer_index(path + ".")
        if not self.sp or i is None or path != f"{self.plan.layers}.{i}":
            return None
        unit = sp_whole(self.plan, self.layer_kinds[i])
        if unit == WHOLE_ATTENTION:
            for name in ATTENTION_NAMES:
                child = getattr(module, name, None)
                if isinstance(child, torch.nn.Module) and not isinstance(child, CONTAINERS):
                    return f"{path}.{name}"
        return None if unit is None else path

    def _linear(self, path: str, lin: Any, style: str, sp: bool) -> torch.nn.Module:
        if not isinstance(lin, torch.nn.Linear) or type(lin).__name__ not in PLAIN_LINEARS:
            raise UserError(f"tp plan entry {path} ({style}) is a {type(lin).__name__}, not nn.Linear")
        config = self.tconfig if sp else self.tp_config
        common = dict(config=config, init_method=self.init, bias=lin.bias is not None, tp_group=self.tp_group)
        with skip_weight_init(self.load_weights):
            if style in COLUMN_STYLES:
                return ColumnLinear(
                    lin.in_features, lin.out_features, gather_output=style == "colwise_gather_output", **common
                )
            return RowLinear(
                lin.in_features,
                lin.out_features,
                input_is_parallel=style == "rowwise",
                skip_bias_add=False,
                **common,
            )

    def _embedding_in(self, path: str, emb: Any, style: str, sp: bool) -> torch.nn.Module:
        """An `embedding_rowwise` / `embedding_colwise` embedding inside a stage piece."""
        if type(emb) is not torch.nn.Embedding:
            raise UserError(f"tp plan entry {path} ({style}) is a {type(emb).__name__}, not nn.Embedding")
        size = emb.num_embeddings if style == EMBED_ROWS else emb.embedding_dim
        if size % self.tp:
            what = "rows" if style == EMBED_ROWS else "embedding dim"
            raise UserError(f"tp plan entry {path} ({style}): its {size} {what} do not split over tp={self.tp}")
        config = self.tconfig if sp else self.tp_config  # under SP always in a unit run whole (sp_whole)
        common = dict(config=config, init_method=self.init, padding_idx=emb.padding_idx, tp_group=self.tp_group)
        cls = ColumnEmbedding if style == EMBED_COLS else VocabEmbedding
        with skip_weight_init(self.load_weights):
            return cls(emb.num_embeddings, emb.embedding_dim, **common)

    def _divide_heads(self, attention: torch.nn.Module, attrs: tuple[str, ...] = HEAD_ATTRS) -> None:
        for attr in attrs:
            n = getattr(attention, attr, None)
            if isinstance(n, int) and not isinstance(n, bool):
                if n % self.tp:
                    raise UserError(f"{type(attention).__name__}.{attr}={n} does not split over tp={self.tp}")
                setattr(attention, attr, n // self.tp)

    def _materialise(self, path: str, module: torch.nn.Module, whole: str | None = None) -> None:
        for name, mod in module.named_modules():
            if isinstance(mod, MEGATRON_LAYERS):
                continue
            prefix = f"{path}.{name}" if name else path
            for key, p in list(mod._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                kind = self.kinds.get(f"{prefix}.{key}")
                shape = tuple(p.shape)
                expert = self.ep > 1 and self.plan.ep_style(f"{prefix}.{key}") == EP_TENSOR
                split = expert_split(f"{prefix}.{key}", self.plan.style(f"{prefix}.{key}")) if len(shape) == 3 else None
                if kind == HEAD:
                    shape = (shape[0] // self.tp, *shape[1:])
                if expert:
                    shape = (shape[0] // self.ep, *shape[1:])
                split = split if self.plan.style(prefix) == MOE_TP else None
                if split:  # moe_tp_experts: the intermediate dim (of gate/up and down, either layout)
                    at = SPLIT_DIMS[split.split]
                    shape = tuple(d // self.tp if i == at else d for i, d in enumerate(shape))
                new = torch.nn.Parameter(torch.empty(shape, dtype=p.dtype, device=self.device), p.requires_grad)
                if kind == HEAD:
                    set_tensor_model_parallel_attributes(new, True, 0, 1)
                if kind == GRAD_ALLREDUCE and self.tp > 1:
                    sum_grad_over_tp(new)
                if kind == REPLICATED and self.sp and not split and not _within(prefix, whole):
                    # on the sequence-split hidden states (norms, routers): finalize_model_grads sums it over TP
                    new.sequence_parallel = True  # type: ignore[attr-defined]
                if expert:
                    mark_expert(new)
                mod._parameters[key] = new
            for key, b in list(mod._buffers.items()):
                if b is not None and b.is_meta:
                    mod._buffers[key] = torch.empty(tuple(b.shape), dtype=b.dtype, device=self.device)
        with torch.no_grad():
            top = _owner(self.full, path) if self.plan.front is not None else self.full
            for mod, owner in reversed(_owned(module, top)):
                if not isinstance(mod, MEGATRON_LAYERS):
                    owner._init_weights(mod)


def _owner(model: Any, path: str) -> Any:
    """The innermost transformers model holding the module at `path` in a VLM (its language model
    for its layers: that config has the text sizes `_init_weights` reads), else `model`."""
    parts = path.split(".")
    for n in range(len(parts) - 1, 0, -1):
        mod = model.get_submodule(".".join(parts[:n]))
        if isinstance(mod, PreTrainedModel):
            return mod
    return model


def _owned(module: torch.nn.Module, model: Any) -> list[tuple[torch.nn.Module, Any]]:
    """(module, the model whose `_init_weights` initialises it) for `module` and everything in it:
    the innermost transformers model holding it (a VLM's vision tower is a model of its own,
    whose initialisation sets its position ids), else `model`."""
    out: list[tuple[torch.nn.Module, Any]] = []

    def walk(mod: torch.nn.Module, owner: Any) -> None:
        owner = mod if isinstance(mod, PreTrainedModel) else owner
        out.append((mod, owner))
        for child in mod.children():
            walk(child, owner)

    walk(module, model)
    return out


def _within(path: str, unit: str | None) -> bool:
    return unit is not None and (path == unit or path.startswith(unit + "."))


__all__ = ["HEAD_ATTRS", "Pieces"]
