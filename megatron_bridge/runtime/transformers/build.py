"""Build this rank's chunks of a transformers-backend model (`BridgeSpec.backend == "transformers"`).

transformers' causal-LM class is built from the spec's config.json on the meta device (no
memory). Each chunk keeps its stage's pieces (`plan.Plan`: the embedding and what follows
it on the first stage, the decoder layers `ParallelDims.stage_layers` gives it, the final norm
and the head on the last) and the model's rotary module; in each piece (runtime/transformers/pieces.py)
every linear the tp plan names is replaced by megatron's parallel layer holding only its shard
(runtime/transformers/layers.py), the attention modules' head counts are divided by tp, and only then is
what is left on the meta device materialised (per-head tensors at their shard's shape) and initialised by the model's
own `_init_weights` (which also recomputes the rotary frequencies). No rank ever holds the
full model. With `load_weights=True` megatron's layers are allocated without their random
init (`skip_weight_init`) and the loader proves every tensor was written.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.transformer import TransformerConfig

from megatron_bridge.backends.transformers.aux import aux_enabled, aux_seam
from megatron_bridge.backends.transformers.backend import meta, model_plan, transformers_config
from megatron_bridge.backends.transformers.meta import auto_class, embedding_after, embedding_refusal
from megatron_bridge.backends.transformers.overrides import stage_override
from megatron_bridge.backends.transformers.plan import override, sp_refusals
from megatron_bridge.backends.transformers.vision import before_layers, text_config_of
from megatron_bridge.bridge.layout import Layout
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.build_base import check_groups, skip_weight_init
from megatron_bridge.runtime.transformers import attention
from megatron_bridge.runtime.transformers.aux_loss import RouterAuxLoss
from megatron_bridge.runtime.transformers.chunk import HFChunk
from megatron_bridge.runtime.transformers.cp import cp_implementation
from megatron_bridge.runtime.transformers.layers import LMHead, VocabEmbedding
from megatron_bridge.runtime.transformers.per_layer import PerLayerInputs, extra_width, per_layer_modules
from megatron_bridge.runtime.transformers.pieces import Pieces
from megatron_bridge.runtime.transformers.vision import Carried, VisionFront


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


def build_transformers(
    spec: BridgeSpec, layout: Layout, *, load_weights: bool = False, **config_overrides: Any
) -> list[Any]:
    """This rank's `HFChunk`s for `spec` under `layout` (one per virtual pipeline stage)."""
    check_groups(layout)
    cfg = transformers_config(spec)
    hf_cfg = text_config_of(cfg)  # a VLM's language model's
    # what travels between stages: hyper-connection streams folded into the hidden dim
    # (runtime/transformers/chunk.py), per-layer inputs behind the hidden states (runtime/transformers/per_layer.py)
    width = spec.hidden_size * override(spec.family).stream_count(hf_cfg)
    if layout.pp > 1:  # and a VLM's features added before layers of later stages (vision.Carried)
        width += extra_width(hf_cfg) + spec.hidden_size * len(before_layers(cfg))
    tconfig = transformer_config(spec, layout, **{"hidden_size": width, **config_overrides})
    for n, what in ((spec.num_attention_heads, "attention heads"), (spec.num_query_groups, "KV heads")):
        if n % layout.tp:
            raise UserError(f"{spec.architecture}: {n} {what} do not split over tp={layout.tp} (rule backend-layout)")
    with torch.device("meta"):
        full = auto_class(cfg).from_config(cfg, dtype=tconfig.params_dtype)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    text = text_config_of(full.config)
    text._attn_implementation = attention.implementation(text, device)  # head dims over 256
    if layout.cp > 1:  # K/V gathered over the CP group around the model's attention (runtime/transformers/cp.py)
        text._attn_implementation = cp_implementation(text._attn_implementation)
    plan = model_plan(full)
    refused = sp_refusals(plan) if tconfig.sequence_parallel else []
    if refused:  # also where a check turned SP on itself (MoE gradients at tp > 1: runtime/parity.py)
        raise UserError(f"{spec.architecture} (transformers backend): " + "; ".join(refused))
    kinds = meta(spec).kinds
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


class Stage(Pieces):
    """Cuts one chunk out of the meta model: its pieces (`Pieces.keep`), rotary, head, embedding."""

    def chunk(self, layers: range, pre: bool, post: bool) -> HFChunk:
        plan, full = self.plan, self.full
        modules: dict[str, torch.nn.Module | torch.nn.Parameter] = {}
        tied = bool(self.spec.tie_word_embeddings)
        if pre:
            modules[plan.embed] = self._embedding(full.get_submodule(plan.embed))
            for path in (*plan.vision, *plan.pre):
                modules[path] = (
                    self._own(path) if _is_parameter(full, path) else self.keep(path, full.get_submodule(path))
                )
        per_layer = self._per_layer(modules if pre else None)
        layer_list = full.get_submodule(plan.layers)
        kept = {i: self.keep(f"{plan.layers}.{i}", layer_list[i]) for i in layers}
        if post:
            for path in plan.post:
                modules[path] = self.keep(path, full.get_submodule(path))
            modules[plan.head] = self._head(full.get_submodule(plan.head), tied and pre)
        rotary = self._rotary()
        # a VLM's head arithmetic is its own class's (overrides.stage_override)
        ov = stage_override(self.spec.family, full.config.model_type if plan.front is not None else None)
        const = ov.constants(self.text)
        chunk = HFChunk(
            self.tconfig,
            self.text,
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
            kind_masks={k: getattr(sys.modules[type(full).__module__], fn) for k, fn in ov.kind_masks},
            streams=ov.stream_count(self.text),
            per_layer=per_layer,
            front=self._front(),
            kinds={i: self.layer_kinds[i] for i in kept},
            carried=self._carried(),
        )
        if tied and self.tconfig.pipeline_model_parallel_size > 1 and (pre or post):
            # megatron's distributed optimizer buckets the shared copy apart (param_and_grad_buffer)
            chunk.shared_embedding_or_output_weight().shared_embedding = True  # type: ignore[attr-defined]
        return chunk.to(self.device)

    def _aux(self) -> RouterAuxLoss | None:
        """transformers' load-balancing loss, where the config switches it on and one chunk holds
        every layer (training at pp > 1 is refused by `aux.aux_limits`)."""
        if not aux_enabled(self.text):
            return None
        seam = aux_seam(self.text)
        if isinstance(seam, str):
            raise UserError(f"{self.spec.architecture}: output_router_logits=true, but {seam}")
        return RouterAuxLoss(seam, self.full)

    def _front(self) -> VisionFront | None:
        """A VLM's base model, whose forward runs the vision pieces and merges their features
        (runtime/transformers/vision.py): every stage calls it, for positions and masks."""
        plan = self.plan
        if plan.front is None:
            return None
        embed = plan.embed.rpartition(".")[2]
        base = self.full.get_submodule(plan.front)
        passes = tuple(kw for kw, _ in override(self.spec.family).layer_inputs)
        hidden, dtype = self.spec.hidden_size, self.tconfig.params_dtype
        return VisionFront(base, plan.language, embed, hidden, dtype, self.device, passes)

    def _carried(self) -> Carried | None:
        """A VLM's features added before decoder layers (vision.BEFORE_LAYER), sent at pp > 1."""
        layers = before_layers(self.full.config)
        if not layers or self.tconfig.pipeline_model_parallel_size == 1:
            return None
        return Carried(layers, self.spec.hidden_size)

    def _own(self, path: str) -> torch.nn.Parameter:
        """A VLM front's own parameter (LLaVA-OneVision's image_newline), materialised in place
        and initialised by the front's model (`_init_weights` of the module holding it)."""
        module_path, _, leaf = path.rpartition(".")
        holder = self.full.get_submodule(module_path)
        p = holder._parameters[leaf]
        assert p is not None
        new = torch.nn.Parameter(torch.empty(tuple(p.shape), dtype=p.dtype, device=self.device), p.requires_grad)
        holder._parameters[leaf] = new
        with torch.no_grad():
            self.full._init_weights(holder)
        return new

    # -- the pieces --------------------------------------------------------------------------
    def _embedding(self, emb: Any) -> VocabEmbedding:
        why = embedding_refusal(emb)  # a ScaledWordEmbedding's scale is kept as the megatron embedding's own
        if why:
            raise UserError(f"{self.spec.architecture}: {why}")
        after = embedding_after(emb)  # the module its forward runs on the lookup, kept as the model's own
        scaled = type(emb) is not torch.nn.Embedding and after is None
        kept = (after, self.keep(f"{self.plan.embed}.{after}", getattr(emb, after))) if after else None
        with skip_weight_init(self.load_weights):
            return VocabEmbedding(
                self.spec.padded_vocab_size(self.tp),
                emb.embedding_dim,
                init_method=self.init,
                config=self.tconfig,
                padding_idx=emb.padding_idx,
                tp_group=self.tp_group,
                embed_scale=float(emb.scalar_embed_scale) if scaled else None,
                after=kept,
                # a VLM merges image features into the whole sequence's embeddings, then scatters
                reduce_scatter_embeddings=self.sp and self.plan.front is None,
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

    def _per_layer(self, modules: dict[str, torch.nn.Module | torch.nn.Parameter] | None) -> PerLayerInputs | None:
        """Per-layer inputs (runtime/transformers/per_layer.py), where the config has them: their modules,
        whole on every TP rank, kept (into `modules`) on the first stage, which computes them."""
        names = per_layer_modules(self.text)
        if not names:
            return None
        base = self.full.get_submodule(self.plan.prefix)
        kept = {}
        if modules is not None:
            for name in names:
                path = f"{self.plan.prefix}.{name}"
                kept[name] = modules[path] = self.keep(path, base.get_submodule(name))
        return PerLayerInputs(base, kept)

    def _rotary(self) -> tuple[str, torch.nn.Module] | None:
        base = self.full.get_submodule(self.plan.prefix)
        planned = {p.rpartition(".")[2] for p in (self.plan.embed, *self.plan.pre, self.plan.layers, *self.plan.post)}
        planned |= set(per_layer_modules(self.text))
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
        if per_layer:  # one rotary module per layer's value (overrides.Override.layer_rotary)
            found = [per_layer[0]]
        if not found:
            return None
        path = f"{self.plan.prefix}.{found[0]}"
        return path, self.keep(path, self.full.get_submodule(path))


def _is_parameter(model: torch.nn.Module, path: str) -> bool:
    module_path, _, leaf = path.rpartition(".")
    return leaf in model.get_submodule(module_path)._parameters


__all__ = ["Stage", "build_transformers", "transformer_config"]
