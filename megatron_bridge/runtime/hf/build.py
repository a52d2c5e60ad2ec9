"""Build this rank's chunks of an hf-backend model (`BridgeSpec.backend == "hf"`).

transformers' causal-LM class is built from the spec's config.json on the meta device (no
memory). Each chunk keeps its stage's pieces (`hf_plan.Plan`: the embedding and what follows
it on the first stage, the decoder layers `ParallelDims.stage_layers` gives it, the final norm
and the head on the last) and the model's rotary module; every linear the tp plan names is
replaced by megatron's parallel layer holding only its shard (runtime/hf/layers.py), the
attention modules' head counts are divided by tp, and only then is what is left on the meta
device materialised (per-head tensors at their shard's shape) and initialised by the model's
own `_init_weights` (which also recomputes the rotary frequencies). No rank ever holds the
full model. With `load_weights=True` megatron's layers are allocated without their random
init (`skip_weight_init`) and the loader proves every tensor was written.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer import TransformerConfig
from megatron.core.utils import init_method_normal
from transformers import AutoModelForCausalLM

from megatron_bridge.backends.hf import meta, model_plan, transformers_config
from megatron_bridge.backends.hf_aux import aux_enabled, aux_seam
from megatron_bridge.backends.hf_experts import SPLIT_DIMS, expert_split
from megatron_bridge.backends.hf_plan import (
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
    override,
    sp_refusals,
    sp_whole,
)
from megatron_bridge.bridge.layout import Layout
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.build_base import check_groups, skip_weight_init
from megatron_bridge.runtime.hf.aux_loss import RouterAuxLoss
from megatron_bridge.runtime.hf.chunk import HFChunk, layer_kind
from megatron_bridge.runtime.hf.cp import cp_implementation
from megatron_bridge.runtime.hf.experts import divide_input_by_tp, mark_expert, partition
from megatron_bridge.runtime.hf.layers import (
    MEGATRON_LAYERS,
    ColumnEmbedding,
    ColumnLinear,
    LMHead,
    RowLinear,
    VocabEmbedding,
    gather_sequence,
    mla_kv_a_hook,
    mqa_qkv_hooks,
    sum_grad_over_tp,
    whole_under_sp,
)
from megatron_bridge.runtime.hf.per_layer import PerLayerInputs, extra_width, per_layer_modules

# attention-module attributes that count heads (divided by tp where the q/k/v linears are split)
HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_heads", "n_kv_heads")
# those that count query heads alone (`mqa_fused_qkv`: the one K/V head stays whole on every rank)
QUERY_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads")
# nn.Linear subclasses whose forward is the linear's own arithmetic, x @ W.T + b (FalconLinear
# adds the bias after the matmul, for bf16 rounding as trained): megatron's linears replace them
PLAIN_LINEARS = ("Linear", "FalconLinear")
# modules that hold others but are never called themselves: not a unit `whole_under_sp` can wrap
CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)


def transformer_config(spec: BridgeSpec, layout: Layout, **overrides: Any) -> TransformerConfig:
    """The TransformerConfig megatron's layers and schedules read: degrees and the stage split
    from the layout, the sizes megatron checks from the spec (the architecture is the HF model)."""
    on_gpu = torch.cuda.is_available()
    kw: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        hidden_dropout=0.0,
        attention_dropout=spec.attention_dropout,
        init_method_std=spec.initializer_range,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.pp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        num_moe_experts=spec.num_moe_experts,  # megatron's groups and DDP read it; the MoE itself is HF's
        moe_router_topk=spec.moe_router_topk,
        # what megatron's config checks of its own MoE layers (unused here: HF's router and
        # experts run; biases are each module's own): top-1 needs pre-softmax, expert-TP no bias
        moe_router_pre_softmax=True,
        add_bias_linear=not spec.is_moe,
        sequence_parallel=layout.sequence_parallel and layout.tp > 1,
        num_layers_in_first_pipeline_stage=layout.layers_first_stage,
        num_layers_in_last_pipeline_stage=layout.layers_last_stage,
        use_cpu_initialization=not on_gpu,
        gradient_accumulation_fusion=False,
        batch_p2p_comm=on_gpu,  # gloo: batched p2p is wrong with interleaved schedules (runtime/tconfig.py)
    )
    kw.update(overrides)
    if kw.get("bf16") and "params_dtype" not in overrides:
        kw["params_dtype"] = torch.bfloat16
    kw.setdefault("pipeline_dtype", kw.get("params_dtype", torch.float32))
    return TransformerConfig(**kw)


def build_hf(spec: BridgeSpec, layout: Layout, *, load_weights: bool = False, **config_overrides: Any) -> list[Any]:
    """This rank's `HFChunk`s for `spec` under `layout` (one per virtual pipeline stage)."""
    check_groups(layout)
    hf_cfg = transformers_config(spec)
    # what travels between stages: hyper-connection streams folded into the hidden dim
    # (runtime/hf/chunk.py), per-layer inputs behind the hidden states (runtime/hf/per_layer.py)
    width = spec.hidden_size * override(spec.family).stream_count(hf_cfg)
    if layout.pp > 1:
        width += extra_width(hf_cfg)
    tconfig = transformer_config(spec, layout, **{"hidden_size": width, **config_overrides})
    for n, what in ((spec.num_attention_heads, "attention heads"), (spec.num_query_groups, "KV heads")):
        if n % layout.tp:
            raise UserError(f"{spec.architecture}: {n} {what} do not split over tp={layout.tp} (rule backend-layout)")
    with torch.device("meta"):
        full = AutoModelForCausalLM.from_config(hf_cfg, dtype=tconfig.params_dtype)
    if layout.cp > 1:  # K/V gathered over the CP group around the model's attention (runtime/hf/cp.py)
        full.config._attn_implementation = cp_implementation(full.config._attn_implementation)
    plan = model_plan(full)
    refused = sp_refusals(plan) if tconfig.sequence_parallel else []
    if refused:  # also where a check turned SP on itself (MoE gradients at tp > 1: runtime/parity.py)
        raise UserError(f"{spec.architecture} (hf backend): " + "; ".join(refused))
    kinds = meta(spec).kinds
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    pp_rank, vpp = ps.get_pipeline_model_parallel_rank(), tconfig.virtual_pipeline_model_parallel_size
    chunks = []
    for vp in range(vpp) if vpp else [None]:
        stage = Stage(spec, full, plan, kinds, tconfig, device, load_weights)
        chunks.append(
            stage.chunk(
                layout.stage_layers(spec.num_layers, pp_rank, vp),
                ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            )
        )
    return chunks


class Stage:
    """Cuts one chunk out of the meta model: swaps, divides, materialises."""

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
        self.tconfig, self.device, self.load_weights = tconfig, device, load_weights
        self.tp, self.ep = tconfig.tensor_model_parallel_size, tconfig.expert_model_parallel_size
        self.sp = bool(tconfig.sequence_parallel)
        # the config of the modules a unit run whole under SP holds (`_whole`): plain TP's
        self.tp_config = copy.copy(tconfig)
        self.tp_config.sequence_parallel = False
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.init = init_method_normal(spec.initializer_range)

    def chunk(self, layers: range, pre: bool, post: bool) -> HFChunk:
        plan, full = self.plan, self.full
        modules: dict[str, torch.nn.Module] = {}
        tied = bool(self.spec.tie_word_embeddings)
        if pre:
            modules[plan.embed] = self._embedding(full.get_submodule(plan.embed))
            for path in plan.pre:
                modules[path] = self._keep(path, full.get_submodule(path))
        per_layer = self._per_layer(modules if pre else None)
        layer_list = full.get_submodule(plan.layers)
        kept = {i: self._keep(f"{plan.layers}.{i}", layer_list[i]) for i in layers}
        if post:
            for path in plan.post:
                modules[path] = self._keep(path, full.get_submodule(path))
            modules[plan.head] = self._head(full.get_submodule(plan.head), tied and pre)
        rotary = self._rotary()
        ov = override(self.spec.family)
        const = ov.constants(full.config)
        chunk = HFChunk(
            self.tconfig,
            full.config,
            plan,
            modules,
            kept,
            rotary,
            pre_process=pre,
            post_process=post,
            vocab_size=self.spec.vocab_size,
            tied=tied,
            forward_math=const,
            aux=self._aux() if pre and post and self.spec.is_moe else None,
            nope_kwargs={k: getattr(sys.modules[type(full).__module__], fn) for k, fn in ov.nope_kwargs},
            streams=ov.stream_count(full.config),
            per_layer=per_layer,
        )
        if tied and self.tconfig.pipeline_model_parallel_size > 1 and (pre or post):
            # megatron's distributed optimizer buckets the shared copy apart (param_and_grad_buffer)
            chunk.shared_embedding_or_output_weight().shared_embedding = True  # type: ignore[attr-defined]
        return chunk.to(self.device)

    def _aux(self) -> RouterAuxLoss | None:
        """transformers' load-balancing loss, where the config switches it on and one chunk holds
        every layer (training at pp > 1 is refused by `hf_aux.aux_limits`)."""
        if not aux_enabled(self.full.config):
            return None
        seam = aux_seam(self.full.config)
        if isinstance(seam, str):
            raise UserError(f"{self.spec.architecture}: output_router_logits=true, but {seam}")
        return RouterAuxLoss(seam, self.full)

    # -- the pieces --------------------------------------------------------------------------
    def _embedding(self, emb: Any) -> VocabEmbedding:
        # a ScaledWordEmbedding (Gemma's family) is an nn.Embedding whose output is multiplied by
        # its `embed_scale` buffer: kept, as the megatron embedding's own scale
        scaled = isinstance(emb, torch.nn.Embedding) and type(emb).__name__.endswith("ScaledWordEmbedding")
        if type(emb) is not torch.nn.Embedding and not (scaled and hasattr(emb, "scalar_embed_scale")):
            raise UserError(f"{self.spec.architecture}: its embedding is a {type(emb).__name__}, not nn.Embedding")
        with skip_weight_init(self.load_weights):
            return VocabEmbedding(
                self.spec.padded_vocab_size(self.tp),
                emb.embedding_dim,
                init_method=self.init,
                config=self.tconfig,
                padding_idx=emb.padding_idx,
                tp_group=self.tp_group,
                embed_scale=float(emb.scalar_embed_scale) if scaled else None,
                reduce_scatter_embeddings=self.sp,
            )

    def _head(self, head: Any, tied_here: bool) -> LMHead:
        if type(head) is not torch.nn.Linear:
            raise UserError(f"{self.spec.architecture}: its LM head is a {type(head).__name__}, not nn.Linear")
        with skip_weight_init(self.load_weights):
            return LMHead(
                head.in_features,
                self.spec.padded_vocab_size(self.tp),
                config=self.tconfig,
                init_method=self.init,
                bias=head.bias is not None,
                gather_output=False,
                skip_weight_param_allocation=tied_here,
                tp_group=self.tp_group,
            )

    def _per_layer(self, modules: dict[str, torch.nn.Module] | None) -> PerLayerInputs | None:
        """Per-layer inputs (runtime/hf/per_layer.py), where the config has them: their modules,
        whole on every TP rank, kept (into `modules`) on the first stage, which computes them."""
        names = per_layer_modules(self.full.config)
        if not names:
            return None
        base = self.full.get_submodule(self.plan.prefix)
        kept = {}
        if modules is not None:
            for name in names:
                path = f"{self.plan.prefix}.{name}"
                kept[name] = modules[path] = self._keep(path, base.get_submodule(name))
        return PerLayerInputs(base, kept)

    def _rotary(self) -> tuple[str, torch.nn.Module] | None:
        base = self.full.get_submodule(self.plan.prefix)
        planned = {p.rpartition(".")[2] for p in (self.plan.embed, *self.plan.pre, self.plan.layers, *self.plan.post)}
        planned |= set(per_layer_modules(self.full.config))
        found = []
        for name, child in base.named_children():
            if name in planned:
                continue
            if any(True for _ in child.parameters()):
                raise UserError(
                    f"{self.spec.architecture}: {self.plan.prefix}.{name} has weights but is not in the pp plan"
                )
            if "Rotary" in type(child).__name__:
                found.append(name)
        if len(found) > 1:
            raise UserError(f"{self.spec.architecture}: several rotary modules ({', '.join(found)}) need an override")
        per_layer = override(self.spec.family).layer_rotary
        if per_layer:  # one rotary module per layer's value (hf_overrides.Override.layer_rotary)
            found = [per_layer[0]]
        if not found:
            return None
        path = f"{self.plan.prefix}.{found[0]}"
        return path, self._keep(path, self.full.get_submodule(path))

    def _keep(self, path: str, module: torch.nn.Module) -> torch.nn.Module:
        """`module` (at `path` in the causal LM) with its planned linears swapped, its heads
        divided and the rest materialised on this rank's device. Under SP the unit of a decoder
        layer that runs whole (`_whole`) is built as in plain TP and wrapped (`whole_under_sp`)."""
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
                mla_kv_a_hook(child, int(self.full.config.qk_rope_head_dim))
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
        """Under SP, the path of what of decoder layer `path` runs whole (`hf_plan.sp_whole`):
        its attention module (the first of `ATTENTION_NAMES` it has, called as a module: not a
        container), else the layer; None where everything splits or `path` is no decoder layer."""
        i = self.plan.layer_index(path + ".")
        if not self.sp or i is None or path != f"{self.plan.layers}.{i}":
            return None
        unit = sp_whole(self.plan, layer_kind(self.full.config, i))
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
            for mod in reversed(list(module.modules())):
                if not isinstance(mod, MEGATRON_LAYERS):
                    self.full._init_weights(mod)


def _within(path: str, unit: str | None) -> bool:
    return unit is not None and (path == unit or path.startswith(unit + "."))


__all__ = ["HEAD_ATTRS", "Stage", "build_hf", "transformer_config"]
