"""`VisionFront`: a VLM's own forward up to its language model, run by the first pipeline stage.

A VLM's base model (`Qwen2_5_VLModel.forward`, `Gemma3Model.forward`, ...) embeds the tokens, runs
the vision tower and projector on the images, merges the features into the embeddings at the image
placeholder tokens, derives positions (Qwen's 3-row M-RoPE from the image grids) and masks
(Gemma 3's bidirectional attention within an image), then calls its language model. The stages run
that language model themselves, so the front calls the base model's forward with the language
model swapped for `_Capture`, which hands the base model this rank's vocab-parallel embedding and
stops the forward at the language model's call, keeping what it was given: every step before it is
transformers' own code.

Later pipeline stages run the same forward without pixels (`positions`): positions and masks come
from the token ids and the image grids alone, so every stage derives the same ones. What only the
first stage can make travels behind the hidden states: Gemma 4's per-layer inputs (per_layer.py),
the features a VLM adds before decoder layers of later stages (`Carried`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

from megatron_bridge.backends.transformers.vision import (
    AFTER_LAYER,
    BEFORE_LAYER,
    IGNORED,
    IMAGE_TOKEN,
    PER_LAYER_TOKENS,
    TAKEN,
    TOKEN_TYPES,
    text_config_of,
)
from megatron_bridge.errors import UserError


class _Captured(Exception):
    def __init__(self, kwargs: dict[str, Any]) -> None:
        super().__init__("language model input captured")
        self.kwargs = kwargs


class _Capture(torch.nn.Module):
    """Stands in for the language model during the base model's forward: its embedding is the
    stage's (not registered here: the chunk owns it), its call raises with the inputs."""

    def __init__(self, text: torch.nn.Module, embed: Any, embed_name: str) -> None:
        super().__init__()
        self.__dict__.update(config=text.config, _embed=embed, _text=text, dtype=getattr(text, "dtype", None))
        self.__dict__[embed_name] = embed

    def __getattr__(self, name: str) -> Any:
        """Anything else the base model's forward reads of its language model (a flag such as
        `gradient_checkpointing`): the language model's own."""
        return getattr(self.__dict__["_text"], name)

    def get_input_embeddings(self) -> Any:
        return self._embed

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(kwargs)


class _Zeros(torch.nn.Module):
    """The embedding of a stage that holds none: zeros of the right shape (positions and masks
    read only the embeddings' shape, dtype and device; Gemma 4's forward reads the padding
    token's row of the weight, for per-layer inputs only the first stage uses)."""

    def __init__(self, hidden: int, dtype: torch.dtype, rows: int, device: torch.device) -> None:
        super().__init__()
        self.hidden, self.dtype, self.rows, self.device = hidden, dtype, rows, device

    @property
    def weight(self) -> torch.Tensor:
        return torch.zeros((), dtype=self.dtype, device=self.device).expand(self.rows, self.hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros((), dtype=self.dtype, device=ids.device).expand(*ids.shape, self.hidden)


@dataclass
class Front:
    """What the VLM's forward handed its language model."""

    embeddings: torch.Tensor
    position_ids: torch.Tensor | None
    masks: dict[str, Any] | None  # {layer kind: mask} where the VLM built its own
    after_layer: dict[int, tuple[Any, torch.Tensor, torch.Tensor]]  # layer -> (AFTER_LAYER method, mask, rows)
    every: torch.Tensor | None = None  # the one 4-D mask a VLM built for every layer
    passed: dict[str, torch.Tensor] | None = None  # layer inputs the VLM's forward gave (VisionFront.passes)
    per_layer: torch.Tensor | None = None  # the token part of the per-layer inputs (PER_LAYER_TOKENS), first stage
    before_layer: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # layer -> (BEFORE_LAYER mask, rows)

    def mask(self, kind: str) -> Any:
        """The VLM's own mask for layers of `kind`, None where it built none (the stage makes it)."""
        return self.every if self.every is not None else (self.masks or {}).get(kind)

    def after(self, i: int, h: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
        """`h` after decoder layer `i`'s AFTER_LAYER step (none: unchanged). Under sequence
        parallelism `h` is this rank's slice of the sequence: the step gets the slice of the
        mask and the rows at it; the rows pass an all-reduce in backward first, so every rank's
        vision tower gets the whole gradient, as through the embeddings."""
        if i not in self.after_layer:
            return h
        fn, mask, rows = self.after_layer[i]
        if sequence_parallel:
            n, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
            width = mask.shape[1] // n
            keep = torch.zeros_like(mask)
            keep[:, rank * width : (rank + 1) * width] = True
            index = (mask.flatten().cumsum(0) - 1)[(mask & keep).flatten()]
            rows = copy_to_tensor_model_parallel_region(rows, group=ps.get_tensor_model_parallel_group())[index]
            mask = mask[:, rank * width : (rank + 1) * width]
        return fn(h, mask, rows)

    def added(self, h: torch.Tensor, sequence_parallel: bool) -> dict[int, torch.Tensor]:
        """{layer: the BEFORE_LAYER rows at their tokens, zeros elsewhere, [b, s, h] like `h`}: a
        dense tensor, so that it can travel to the stage holding the layer (`Carried`). Under
        sequence parallelism this rank's slice; the rows pass an all-reduce in backward first,
        so every rank's vision tower gets the whole gradient, as through the embeddings."""
        out = {}
        for i, (mask, rows) in (self.before_layer or {}).items():
            if sequence_parallel:
                rows = copy_to_tensor_model_parallel_region(rows, group=ps.get_tensor_model_parallel_group())
            dense = add_at(h.new_zeros(*mask.shape, h.shape[-1]), mask, rows)
            if sequence_parallel:
                width, rank = h.shape[1], ps.get_tensor_model_parallel_rank()
                dense = dense[:, rank * width : (rank + 1) * width]
            out[i] = dense
        return out


class Carried:
    """The BEFORE_LAYER features of `layers` (`vision.before_layers`) at pp > 1: only the first
    stage runs the vision tower, so each travels dense ([b, s, h], zeros where no image is)
    behind megatron's [s, b, ...] tensor, which is `len(layers) * hidden` wider (build.py); their
    gradient comes back the same way."""

    def __init__(self, layers: tuple[int, ...], hidden: int) -> None:
        self.layers, self.hidden = layers, hidden

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """megatron's [s, b, w + L*h] -> its [s, b, w] and {layer: [b, s, h]}."""
        n = len(self.layers) * self.hidden
        rest, packed = x[..., : x.shape[-1] - n], x[..., x.shape[-1] - n :].transpose(0, 1)
        return rest, {k: packed[..., j * self.hidden : (j + 1) * self.hidden] for j, k in enumerate(self.layers)}

    def join(self, out: torch.Tensor, added: dict[int, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        """`out` ([s, b, w]) with every layer's features behind it (zeros for none: a text batch)."""
        zeros = h.new_zeros(*h.shape[:2], self.hidden)
        feats = [added.get(k, zeros) for k in self.layers]
        return torch.cat([out, torch.cat(feats, dim=-1).transpose(0, 1)], dim=-1).contiguous()


def add_at(h: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`rows` added to `h` at `mask` ([b, s]): Qwen3VLTextModel._deepstack_process's arithmetic,
    which Granite4VisionTextModel.forward writes inline (BEFORE_LAYER)."""
    h = h.clone()
    h[mask, :] = h[mask, :] + rows.to(h.device, h.dtype)
    return h


class VisionFront:
    """The base model (`plan.front`) of a VLM, its language model at `text` (a child name)."""

    def __init__(
        self,
        base: torch.nn.Module,
        text: str,
        embed_name: str,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
        passes: tuple[str, ...] = (),
    ) -> None:
        """`passes`: keywords the language model's layers take from its inputs (the override's
        `layer_inputs`: Qwen4-Exp's `ple_input_ids`), which a VLM's forward may hand it itself."""
        self.base, self.text, self.embed_name, self.passes = base, text, embed_name, passes
        self.language = getattr(base, text)
        self.zeros = _Zeros(hidden, dtype, int(text_config_of(base.config).vocab_size), device)
        takes = inspect.signature(base.forward).parameters
        self.token_types = [n for n in TOKEN_TYPES if n in takes]
        cfg = base.config
        self.image_token = next((getattr(cfg, k) for k in IMAGE_TOKEN if getattr(cfg, k, None) is not None), None)

    def _inputs(self, input_ids: torch.Tensor, images: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`images` with the token types the forward takes and the batch lacks (a processor's
        image outputs have none): 1 at the image placeholders, as processors mark them."""
        out = dict(images)
        for name in self.token_types:
            if name not in out and self.image_token is not None:
                out[name] = (input_ids == self.image_token).long()
        return out

    def __call__(
        self, input_ids: torch.Tensor, embed: Any, images: dict[str, torch.Tensor], position_ids: Any = None
    ) -> Front:
        """The first stage: the embeddings with the image features merged, positions and masks
        (`position_ids`: a packed row's, handed to the forward; None: the forward's own)."""
        return self._run(input_ids, embed, images, position_ids, first=True)

    def positions(self, input_ids: torch.Tensor, images: dict[str, torch.Tensor], position_ids: Any = None) -> Front:
        """A later stage: the same positions and masks, from the ids and the image grids (no pixels)."""
        kept = {k: v for k, v in images.items() if not k.startswith("pixel_values")}
        return self._run(input_ids, self.zeros, kept, position_ids, first=False)

    def _run(
        self, input_ids: torch.Tensor, embed: Any, images: dict[str, torch.Tensor], position_ids: Any, first: bool
    ) -> Front:
        capture = _Capture(self.language, embed, self.embed_name)
        self.base._modules[self.text] = capture
        given = {} if position_ids is None else {"position_ids": position_ids}
        try:
            self.base(input_ids=input_ids, **given, **self._inputs(input_ids, images))
        except _Captured as got:
            kwargs = got.kwargs
        else:
            raise UserError(f"{type(self.base).__name__}.forward did not call its language model")
        finally:
            self.base._modules[self.text] = self.language
        return self._front(kwargs, first)

    def _front(self, kwargs: dict[str, Any], first: bool) -> Front:
        """`first`: the first stage's run, whose per-layer inputs are kept (a later stage is sent
        them; its run looks the ids up in the meta model's table, a meta tensor left unused)."""
        partners = {p for p, _ in AFTER_LAYER.values()}
        known = (*TAKEN, *IGNORED, *AFTER_LAYER, *partners, *BEFORE_LAYER, *BEFORE_LAYER.values())
        known = (*known, *self.passes, *PER_LAYER_TOKENS)
        unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in known)
        if unknown:
            raise UserError(
                f"{type(self.base).__name__}.forward hands its language model {', '.join(unknown)}, which the "
                "transformers backend's stages do not pass on (backends/transformers/vision.py AFTER_LAYER)"
            )
        after: dict[int, tuple[Any, ...]] = {}
        for key, (partner, method) in AFTER_LAYER.items():
            for i, value in enumerate(kwargs.get(key) or ()):
                after[i] = (getattr(self.language, method), kwargs[partner], value)
        before: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, partner in BEFORE_LAYER.items():
            for i, value in (kwargs.get(key) or {}).items():
                mask = kwargs[partner]
                before[int(i)] = (mask[..., 0] if mask.ndim == 3 else mask, value)  # Granite's is [b, s, 1]
        mask = kwargs.get("attention_mask")
        masks = mask if isinstance(mask, dict) else None
        every = mask if torch.is_tensor(mask) and mask.ndim == 4 else None  # PaliGemma's one prefix-LM mask
        passed = {k: kwargs[k] for k in self.passes if kwargs.get(k) is not None}
        tokens = next((kwargs[k] for k in PER_LAYER_TOKENS if kwargs.get(k) is not None), None) if first else None
        return Front(kwargs["inputs_embeds"], kwargs.get("position_ids"), masks, after, every, passed, tokens, before)


def text_positions(position_ids: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(positions for masks and layers, positions for the rotary embedding), as a VLM's language
    model splits them (Qwen2_5_VLTextModel.forward): 3-row M-RoPE positions rotate and give the
    masks none; 4 rows are the text positions and the 3 M-RoPE rows; plain positions do both."""
    if position_ids.ndim == 3 and position_ids.shape[0] == 4:
        return position_ids[0], position_ids[1:]
    if position_ids.ndim == 3:
        return None, position_ids
    return position_ids, position_ids


__all__ = ["Carried", "Front", "VisionFront", "add_at", "text_positions"]
