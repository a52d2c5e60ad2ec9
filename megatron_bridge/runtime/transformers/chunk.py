"""`HFChunk`: one pipeline chunk of a transformers causal LM, shaped for megatron's schedules.

To megatron it is a GPTModel: `.config` is a TransformerConfig, `set_input_tensor` takes the
previous stage's activations, `pre_process` / `post_process` say which end it is, forward
(input_ids, position_ids, attention_mask, labels=None) returns vocab-parallel logits
[b, s, V/tp] (or the per-token loss [b, s] with labels) on the last stage and [s, b, h]
activations elsewhere ([s/tp, b, h] under sequence parallelism: runtime/transformers/layers.py); a tied embedding is shared with the last stage through megatron's
embedding group (`shared_embedding_or_output_weight`).

Inside, it is the model's own modules under transformers' names (`model.layers.7.mlp...`,
global layer indices), so a checkpoint's names are the chunk's. Its forward is the base
model's, rebuilt per stage: the embedding (first stage), then each decoder layer called with
the rotary embeddings and mask of its own layer kind (`config.layer_types[i]` by the *global*
index i), made with the model's own rotary module and transformers' mask functions; the final
norm and the head (last stage), with the model type's forward arithmetic (`overrides.OVERRIDES`),
and transformers' router load-balancing loss where the config asks for it (aux_loss.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
import torch.utils.checkpoint
from megatron.core import parallel_state as ps
from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from transformers.masking_utils import (
    create_causal_mask,
    create_chunked_causal_mask,
    create_recurrent_attention_mask,
    create_sliding_window_causal_mask,
)

from megatron_bridge.backends.transformers.kinds import SHARED_STATE
from megatron_bridge.backends.transformers.plan import CARRY, Plan, override
from megatron_bridge.runtime import chunked_loss
from megatron_bridge.runtime.transformers.aux_loss import RouterAuxLoss
from megatron_bridge.runtime.transformers.cp import CP_MASKS, calls, check_attended
from megatron_bridge.runtime.transformers.layers import scatter_sequence
from megatron_bridge.runtime.transformers.per_layer import PerLayerInputs
from megatron_bridge.runtime.transformers.vision import Carried, Front, VisionFront, text_positions

# layer kind -> the mask function the model's own forward calls for it (kinds.LAYER_KINDS);
# an indexed layer slices its mask (`mask[:, 0]`) for its indexer, so it must exist even where
# sdpa could skip a plain causal mask (DeepseekV32Model.forward: allow_is_causal_skip=False);
# linear-attention and conv mixers take the 2-D padding mask (`create_recurrent_attention_mask`),
# None for unpadded batches
MASKS: dict[str, Callable[..., Any]] = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
    "indexed_attention": partial(create_causal_mask, allow_is_causal_skip=False),
    "minimax_m3_sparse": create_causal_mask,  # MiniMaxM3VLTextModel.forward: one causal mask for every layer
    "linear_attention": create_recurrent_attention_mask,
    "conv": create_recurrent_attention_mask,
    "chunked_attention": create_chunked_causal_mask,  # Llama 4's local attention
    # DeepseekV4Model.forward: one sliding-window mask for every layer (extended inside the layer)
    "compressed_sparse_attention": create_sliding_window_causal_mask,
    "heavily_compressed_attention": create_sliding_window_causal_mask,
    "mlp": lambda **_: None,  # blocks without a token mixer (Nemotron-H): no mask
    "moe": lambda **_: None,
}


def _all_true(inputs_embeds: torch.Tensor, **_: Any) -> torch.Tensor:
    """The boolean [b, s] padding mask of an unpadded batch (overrides.Override.padding_masks)."""
    return torch.ones(inputs_embeds.shape[:2], dtype=torch.bool, device=inputs_embeds.device)


class Pieces(torch.nn.Module):
    """A container that gives the kept modules their transformers paths."""


class HFChunk(MegatronModule):
    def __init__(
        self,
        config: Any,
        hf_config: Any,
        plan: Plan,
        modules: dict[str, torch.nn.Module | torch.nn.Parameter],
        layers: dict[int, torch.nn.Module],
        rotary: tuple[str, torch.nn.Module] | None,
        *,
        pre_process: bool,
        post_process: bool,
        vocab_size: int,
        tied: bool,
        forward_math: dict[str, float],
        aux: RouterAuxLoss | None = None,
        nope_kwargs: dict[str, Any] | None = None,
        kind_masks: dict[str, Any] | None = None,
        streams: int = 1,
        per_layer: PerLayerInputs | None = None,
        kinds: Mapping[int, str],
        front: VisionFront | None = None,
        carried: Carried | None = None,
    ) -> None:
        """`kinds`: each of `layers`' kind (backends/transformers/kinds.py `layer_kinds`);
        `carried`: the vision features sent to later stages behind the hidden states (pp > 1)."""
        super().__init__(config=config)
        self.hf_config = hf_config
        self.plan = plan
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings_and_output_weights = tied
        self.model_type = ModelType.encoder_or_decoder
        self.vocab_size = vocab_size
        self.forward_math = forward_math  # overrides.OVERRIDES constants: embed_scale, logit_scale, ...
        self.nope_kwargs = nope_kwargs or {}  # overrides.Override.nope_kwargs: {kwarg: fn(position_ids)}
        # hyper-connection streams (overrides.Override.streams): the layers run on [b, s, n, h], which
        # travels between stages as [s, b, n*h] (the schedule's hidden size is n*h: build.py)
        self.streams = streams
        ov = override(hf_config.model_type)
        self.rotary_types, self.layer_inputs = ov.rotary_types, ov.layer_inputs  # overrides.Override
        self.flat_streams, self.layer_masks = ov.flat_streams, ov.layer_masks
        self.layer_kwargs = dict(ov.layer_kwargs)  # Falcon's alibi=None
        # pre pieces kept but not run for a text-only batch (Override.text_identity: the embeddings unchanged)
        self.text_identity = {f"{plan.prefix}.{n}" for n in ov.text_identity}
        self.input_tensor: torch.Tensor | None = None
        self.loss_chunk = 0  # train.loss_chunk (runtime/chunked_loss.py install_hf)
        # train.recompute=full: each decoder layer under torch.utils.checkpoint (non-reentrant: the
        # router logits an aux loss records inside a layer keep their gradient path)
        self.recompute = config.recompute_granularity == "full"
        for path, module in modules.items():
            self._place(path, module)
        self._place(plan.layers, torch.nn.ModuleDict({str(i): layer for i, layer in layers.items()}))
        self.aux = aux  # transformers' load-balancing loss, added to the token losses (aux_loss.py)
        if aux is not None:
            aux.attach(self.get_submodule(plan.layers))
        self.rotary_path = None
        if rotary is not None:
            self.rotary_path = rotary[0]
            self._place(*rotary)
        fwd = inspect.signature(rotary[1].forward).parameters if rotary is not None else {}
        self.rotary_by_kind = "layer_type" in fwd
        self.kinds = {i: kinds[i] for i in layers}
        # what each layer hands the next (kinds.CARRY), where the layers take it
        takes = inspect.signature(next(iter(layers.values())).forward).parameters if layers else {}
        self.carry = {kw: index for kw, (index, *_) in CARRY.items() if kw in takes}
        # one container per forward, shared by the stage's layers (kinds.SHARED_STATE)
        self.shared_state = tuple(kw for kw in SHARED_STATE if kw in takes)
        self.per_layer = per_layer  # per-layer inputs (runtime/transformers/per_layer.py), sent between stages
        # a VLM's base model (runtime/transformers/vision.py): not a submodule (its language model is
        # the meta model's); its vision pieces are, under their paths, on the first stage
        self.front = front
        self.carried = carried
        window = ov.window_full_attention
        # the mask function per layer kind (MASKS, or the sliding-window one where the override says so)
        self.masks: dict[str, Any] = dict(MASKS)
        if window and getattr(hf_config, window, None) is not None:
            self.masks["full_attention"] = create_sliding_window_causal_mask
        self.masks.update(dict.fromkeys(ov.padding_masks, _all_true))  # overrides.Override.padding_masks
        self.masks.update(kind_masks or {})  # overrides.Override.kind_masks: the modeling module's own
        rope = getattr(hf_config, "rope_parameters", None)
        # layer kinds whose rope_parameters entry is None take no rotary embedding (Cohere-Compass'
        # NoPE full-attention layers), as the model's own forward decides
        self.nope = {k for k in self.kinds.values() if isinstance(rope, dict) and k in rope and rope[k] is None}
        # layer -> its index in a per-layer rotary list (overrides.Override.layer_rotary), None: no rotary
        self.rotary_of: dict[int, int | None] = {}
        if layer_rotary := ov.layer_rotary:
            values = getattr(hf_config, layer_rotary[1])
            distinct = sorted({v for v in values if v})
            self.rotary_of = {i: distinct.index(values[i]) if values[i] else None for i in layers}
        # layers that take no rotary embedding, by a per-layer config list's zeros (overrides.Override.nope_layers)
        zeros = getattr(hf_config, ov.nope_layers) if ov.nope_layers else None
        self.nope_layers = {i for i in layers if zeros is not None and not zeros[i]}

    def _place(self, path: str, module: torch.nn.Module | torch.nn.Parameter) -> None:
        parent: torch.nn.Module = self
        *outer, leaf = path.split(".")
        for part in outer:
            if not hasattr(parent, part):
                parent.add_module(part, Pieces())
            parent = getattr(parent, part)
        if isinstance(module, torch.nn.Parameter):  # a VLM front's own parameter (vision.VisionParts.pieces)
            parent.register_parameter(leaf, module)
        else:
            parent.add_module(leaf, module)

    # -- what megatron's schedules and finalize_model_grads call --------------------------------
    def set_input_tensor(self, input_tensor: Any) -> None:
        if isinstance(input_tensor, list):
            assert len(input_tensor) == 1, "one input tensor per chunk"
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        if self.pre_process:
            return self.get_submodule(self.plan.embed).weight
        return self.get_submodule(self.plan.head).weight

    # -- forward ------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: Any = None,
        labels: torch.Tensor | None = None,
        images: dict[str, torch.Tensor] | None = None,
        packed_seq_params: Any = None,
        **_: Any,
    ) -> torch.Tensor:
        """`images`: the micro-batch's image inputs for a VLM (the keyword arguments its forward
        takes besides the ids: pixel_values, image_grid_thw, ...). A packed micro-batch
        (`packed_seq_params`: one row of several conversations, runtime/packing.py) needs nothing
        more: its position ids restart at each conversation, and transformers' mask functions read
        those restarts as the boundaries of a block-diagonal causal mask (masking_utils
        find_packed_sequence_indices); a VLM's forward gets them too, for the masks it builds."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        if self.aux is not None:
            self.aux.start()
        front = None
        if self.front is not None:  # a VLM: its own forward up to the language model
            images = images or {}
            given = position_ids if packed_seq_params is not None else None
            if self.pre_process:
                front = self.front(input_ids, self.get_submodule(self.plan.embed), images, given)
            else:
                front = self.front.positions(input_ids, images, given)
            if front.position_ids is not None:
                position_ids = front.position_ids
        if self.pre_process:
            if front is not None:  # the embeddings with the image features merged, whole: this rank's slice
                h = front.embeddings
                if self.config.sequence_parallel:
                    h = scatter_sequence(h)
            else:
                h = self.get_submodule(self.plan.embed)(input_ids)
            if "embed_scale" in self.forward_math:
                h = h * self.forward_math["embed_scale"]
            tokens = front.per_layer if front is not None else None  # a VLM's (vision.PER_LAYER_TOKENS)
            added = front.added(h, bool(self.config.sequence_parallel)) if front is not None else {}
            per_layer = self.per_layer.compute(input_ids, h, tokens) if self.per_layer else None
            for path in self.plan.pre:
                if path not in self.text_identity:
                    h = self.get_submodule(path)(h)
            if self.streams > 1 and self.flat_streams:  # every stream starts as the embeddings
                h = h.repeat(1, 1, self.streams)
            elif self.streams > 1:
                h = h.unsqueeze(2).expand(-1, -1, self.streams, -1).contiguous()
        else:
            assert self.input_tensor is not None, "a later pipeline stage runs on the previous stage's output"
            x, added = self.carried.split(self.input_tensor) if self.carried else (self.input_tensor, {})
            if self.per_layer:
                h, per_layer = self.per_layer.unpack(x)
            else:  # megatron's [s, b, h] -> transformers' [b, s, h]
                h, per_layer = x.transpose(0, 1), None
            if self.streams > 1 and not self.flat_streams:
                h = h.unflatten(-1, (self.streams, -1))
        h = self._layers(h, position_ids, {"input_ids": input_ids}, per_layer, front, added)
        if not self.post_process:
            if self.per_layer and per_layer is not None:
                out = self.per_layer.pack(h, per_layer)
            else:
                stacked = self.streams > 1 and not self.flat_streams
                out = (h.flatten(2) if stacked else h).transpose(0, 1).contiguous()
            return self.carried.join(out, added, h) if self.carried else out
        for path in self.plan.post:
            h = self.get_submodule(path)(h)
        return self._head(h, labels)

    def _layers(
        self,
        h: torch.Tensor,
        position_ids: torch.Tensor,
        inputs: dict[str, Any],
        per_layer: torch.Tensor | None,
        front: Front | None = None,
        added: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`added`: {layer: what is added to the hidden states before it} (vision.BEFORE_LAYER)."""
        layers = self.get_submodule(self.plan.layers)
        if not len(layers):
            return h
        # a VLM's positions (M-RoPE rows, runtime/transformers/vision.py), and its own masks where it built them
        layer_positions, rope_positions = text_positions(position_ids)
        rotary = self.get_submodule(self.rotary_path) if self.rotary_path else None
        masks: dict[str, Any] = {}
        make_mask = CP_MASKS if ps.get_context_parallel_world_size() > 1 else self.masks  # runtime/transformers/cp.py
        before = calls()
        embeddings: dict[str | None, Any] = {}
        carried: dict[str, Any] = {}
        given = {kw: inputs[name] for kw, name in self.layer_inputs}  # overrides.Override.layer_inputs
        if front is not None and front.passed:  # a VLM's forward gave them itself (vision.VisionFront.passes)
            given.update(front.passed)
        states: dict[str, dict[str, Any]] = {kw: {} for kw in self.shared_state}
        # masks and rotary embeddings are the whole sequence's, also where h is this rank's slice
        # of it (sequence parallelism): they read only its batch, length, dtype and device
        whole = h.new_zeros(()).expand(h.shape[0], rope_positions.shape[-1], h.shape[-1])
        # every layer takes the one {rope type: embedding} dict where the override names the types
        typed = {t: rotary(whole, rope_positions, t) for t in self.rotary_types} if rotary is not None else {}
        for i, layer in layers.items():
            kind = self.kinds[int(i)]
            for k in (kind, *(k for _, k in self.layer_masks)):
                if k not in masks and front is not None and front.mask(k) is not None:  # the VLM's own
                    masks[k] = front.mask(k)
                if k not in masks:
                    masks[k] = make_mask[k](
                        config=self.hf_config,
                        inputs_embeds=whole,
                        attention_mask=None,
                        past_key_values=None,
                        position_ids=layer_positions,
                    )
            extra = {kw: masks[k] for kw, k in self.layer_masks}  # overrides.Override.layer_masks
            key: Any = kind if self.rotary_by_kind else None  # a kind, or a rotary_of index
            if self.rotary_of:  # the layer's own rotary module, or none
                key = self.rotary_of[int(i)]
                if key is not None and key not in embeddings:
                    embeddings[key] = rotary[key](whole, rope_positions)  # type: ignore[index]
            elif rotary is not None and not typed and key not in embeddings and kind not in self.nope:
                embeddings[key] = (
                    rotary(whole, rope_positions, kind) if self.rotary_by_kind else rotary(whole, rope_positions)
                )
            if kind in self.nope:
                extra.update({k: fn(layer_positions) for k, fn in self.nope_kwargs.items()})
            if per_layer is not None and self.per_layer is not None:
                extra[self.per_layer.keyword] = per_layer[:, :, int(i)]
            if added and int(i) in added:  # vision.BEFORE_LAYER (Granite-4-Vision's deepstack)
                h = h + added[int(i)]
            kwargs = dict(
                attention_mask=masks[kind],
                position_ids=layer_positions,
                position_embeddings=None if int(i) in self.nope_layers else typed or embeddings.get(key),
                **carried,
                **states,
                **extra,
                **given,
                **self.layer_kwargs,
            )
            if self.recompute and self.training:  # train.recompute=full: the layer re-run in backward
                out = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False, **kwargs)
            else:
                out = layer(h, **kwargs)
            h = out[0] if isinstance(out, tuple) else out
            carried = {kw: out[index] for kw, index in self.carry.items()}
            if front is not None:  # vision.AFTER_LAYER (Qwen3-VL's deepstack)
                h = front.after(int(i), h, bool(self.config.sequence_parallel))
        if make_mask is CP_MASKS:
            check_attended(before, len(layers))
        return h

    def _head(self, h: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        if labels is None:
            return self._logits(h)
        fused = bool(self.config.cross_entropy_loss_fusion)  # train.fused: megatron's fused cross entropy
        if self.loss_chunk:  # train.loss_chunk: the head and its loss a piece of the sequence at a time

            def piece(x: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
                return _cross_entropy(self._logits(x), lab, seq_first=False, fused=fused)

            loss = chunked_loss.pieces(piece, h, labels, self.loss_chunk, self.get_submodule(self.plan.head), seq_dim=1)
        else:
            seq_first = self.get_submodule(self.plan.head).sequence_parallel
            loss = _cross_entropy(self._logits(h), labels, seq_first=seq_first, fused=fused)
        return self.aux.add(loss) if self.aux is not None else loss

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """This rank's vocab slice of the logits of `h` [b, s, h], with the model's head arithmetic."""
        head = self.get_submodule(self.plan.head)
        tied_here = self.share_embeddings_and_output_weights and self.pre_process
        logits = head(h, weight=self.shared_embedding_or_output_weight() if tied_here else None)
        math = self.forward_math  # in transformers' order (overrides.OVERRIDES)
        if "logit_scale" in math:
            logits = logits * math["logit_scale"]
        if "logit_divide" in math:
            logits = logits / math["logit_divide"]
        if "logit_softcap" in math:
            logits = torch.tanh(logits / math["logit_softcap"]) * math["logit_softcap"]
        first_pad = self.vocab_size - head.output_size_per_partition * ps.get_tensor_model_parallel_rank()
        if first_pad < logits.shape[-1]:  # padded vocab rows (megatron pads to a multiple of tp): logit -inf
            pad = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            pad[max(first_pad, 0) :] = True
            logits = logits.masked_fill(pad, float("-inf"))
        return logits


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, seq_first: bool, fused: bool) -> torch.Tensor:
    """megatron's vocab-parallel cross entropy of [b, s, V/tp] logits (`fused`: its fused kernel,
    as `cross_entropy_loss_fusion` picks for GPTModel): [b, s] per-token losses. It views the
    logits flat and combines the TP ranks' rows elementwise, so every rank must flatten them in
    one order. Under sequence parallelism (`seq_first`) the head returns a [b, s] view of [s, b]
    memory (LMHead): the loss is taken in [s, b] order on every rank (a copy only where a rank's
    layout differs)."""
    tp_group = ps.get_tensor_model_parallel_group()
    loss_of = partial(fused_vocab_parallel_cross_entropy, tp_group=tp_group) if fused else vocab_parallel_cross_entropy
    if seq_first:
        loss = loss_of(logits.transpose(0, 1).contiguous(), labels.t().contiguous())
        return loss.t().contiguous()
    return loss_of(logits.contiguous(), labels)


__all__ = ["HFChunk", "MASKS", "Pieces"]
