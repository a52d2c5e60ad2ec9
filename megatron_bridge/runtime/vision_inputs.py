"""Image batches for a vision-language model, and transformers' own fp32 answer for them.

The parity checks of the text-only models (runtime/parity.py) feed random token ids; a VLM's forward
also takes an image per sample, in the format its processor would have made, and placeholder tokens in
the text that the image features replace, exactly as many as the vision tower gives rows. Nothing
here runs a processor (they need tokenizer files and image libraries): the image tensors are random
pixels shaped from the config by one *input maker* per family of formats (runtime/vision_formats.py
`FORMATS`, keyed by model type; square pixel_values by default), and the placeholder count is learned by running the model's
own `get_image_features` on that image, so it is right for whatever pooling, merging or newline
tokens the model adds.

`image_batch` lays out each sample as random text, the image's begin token (where the config
declares one), its placeholders, its end token, more random text; the text never uses a special or
image token id. `images[i]` holds exactly the forward's extra keyword arguments for sample i: the
pixel tensors and, where the forward takes them, the token types (`token_type_ids`: Gemma 3's
bidirectional attention over image tokens; `mm_token_type_ids`: Qwen-style 3-D M-RoPE positions,
which Qwen2.5-VL's forward only computes when they are given).

`reference` runs the model sample by sample (image tensors of different samples need not batch) and
returns the logits, the mean over samples of each sample's mean token cross-entropy, and the
gradient of every tensor save_pretrained writes, keyed by its checkpoint name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

from megatron_bridge.runtime.parity import saved_grads
from megatron_bridge.runtime.transformers.vision import IMAGE_TOKEN, TOKEN_TYPES  # where ids and token types are
from megatron_bridge.runtime.vision_formats import FORMATS, Images, maker

# Begin/end-of-image tokens around the placeholders: the first pair the config has both of.
BRACKETS = (
    ("vision_start_token_id", "vision_end_token_id"),
    ("image_start_token_id", "image_end_token_id"),
    ("boi_token_id", "eoi_token_id"),
    ("boi_token_index", "eoi_token_index"),
)


def special_ids(cfg: Any, out: set[int] | None = None) -> set[int]:
    """Every token id a config (and its sub-configs) names: the text never draws them."""
    out = set() if out is None else out
    items = cfg.to_dict().items() if isinstance(cfg, PretrainedConfig) else cfg.items()
    for k, v in items:
        if isinstance(v, dict):
            special_ids(v, out)
        elif str(k).endswith(("_token_id", "_token_index", "_token_ids")):
            out.update(x for x in (v if isinstance(v, list) else [v]) if isinstance(x, int))
    return out


def image_token_id(cfg: PretrainedConfig) -> int:
    return next(int(v) for n in IMAGE_TOKEN if isinstance(v := getattr(cfg, n, None), int))


def brackets(cfg: PretrainedConfig) -> list[int]:
    pair = next(
        ((a, b) for a, b in BRACKETS if getattr(cfg, a, None) is not None and getattr(cfg, b, None) is not None), None
    )
    return [int(getattr(cfg, a)) for a in pair] if pair else []


def _accepts(fn: Callable[..., Any], names: Any) -> list[str]:
    """The `names` `fn` takes: those its signature names, or all where it takes **kwargs (which a
    ForConditionalGeneration's get_image_features hands on to its model's)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return list(names)
    return [n for n in names if n in params]


# Where a model's get_image_features output keeps the features, for one that keeps them elsewhere than
# pooler_output / last_hidden_state (Granite 4 Vision: per deepstack layer, the first injected at the placeholders).
FEATURES_OF: dict[str, Callable[[Any], Any]] = {"granite4_vision": lambda out: out.deepstack_features[0][1]}


def _rows(out: Any) -> int:
    """How many feature rows `get_image_features` gave (a tensor, a tuple of per-image tensors, or an output
    holding them as pooler_output, else last_hidden_state)."""
    for attr in ("pooler_output", "last_hidden_state"):
        if not isinstance(out, (torch.Tensor, tuple, list)) and getattr(out, attr, None) is not None:
            out = getattr(out, attr)
            break
    if isinstance(out, (tuple, list)):
        return sum(_rows(o) for o in out)
    return out.numel() // out.shape[-1]


def placeholder_count(model: PreTrainedModel, images: Images) -> int:
    """The number of image placeholder tokens one sample's `images` needs: the rows the model's own
    `get_image_features` gives for them."""
    fn = getattr(model, "get_image_features", None) or model.model.get_image_features
    with torch.no_grad():
        out = fn(**{k: images[k] for k in _accepts(fn, images) if k not in TOKEN_TYPES})
    return _rows(FEATURES_OF.get(model.config.model_type, lambda o: o)(out))


def image_batch(
    model: PreTrainedModel, batch: int, seq: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, list[Images]]:
    """`batch` samples of `seq` tokens (more where an image's placeholders need them: a multiple of 8
    with 16 text tokens besides), one random image each: (input_ids [b, s], labels [b, s] (random text
    ids at every position), images: per sample, the forward's extra keyword arguments)."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    vocab = cfg.get_text_config().vocab_size
    special = special_ids(cfg)
    text = torch.tensor([i for i in range(vocab) if i not in special])
    pair: list[int | None] = list(brackets(cfg)) or [None, None]
    image, (begin, end) = image_token_id(cfg), pair
    token_types = [n for n in TOKEN_TYPES if n in inspect.signature(model.forward).parameters]
    ids, labels, images = [], [], []
    for _ in range(batch):
        sample = maker(cfg.model_type)(cfg, g)
        n = placeholder_count(model, sample)
        block = [x for x in (begin, *[image] * n, end) if x is not None]
        if len(block) + 2 > seq:
            seq = -(-(len(block) + 16) // 8) * 8
        row = text[torch.randint(0, len(text), (seq,), generator=g)]
        at = int(torch.randint(1, seq - len(block), (1,), generator=g))
        row[at : at + len(block)] = torch.tensor(block)
        ids.append(row)
        labels.append(text[torch.randint(0, len(text), (seq,), generator=g)])
        kinds = (row == image).long()[None]
        images.append({**sample, **dict.fromkeys(token_types, kinds)})
    return torch.stack(ids), torch.stack(labels), images


def _aux_coef(model: PreTrainedModel) -> float:
    coef = getattr(model, "router_aux_loss_coef", None)
    return float(coef if coef is not None else getattr(model.config.get_text_config(), "router_aux_loss_coef", 0.0))


def reference(
    model: PreTrainedModel, input_ids: torch.Tensor, labels: torch.Tensor, images: list[Images]
) -> dict[str, Any]:
    """transformers' fp32 forward of each sample alone (`model(input_ids=ids[i:i+1], **images[i])`, eval
    mode): logits [b, s, V] fp32, loss (the mean over samples of each sample's mean token cross-entropy
    against `labels` at every position, no shift; plus the router's load-balancing term where the config
    switches it on, as runtime/parity.py `hf_reference` adds it) and the gradient of that loss for every
    tensor save_pretrained writes, by checkpoint name (parity.py's way: the grads copied into the
    parameters, saved, read back). The model's weights, grads and mode are as they were afterwards."""
    was_training, state = model.training, {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.eval()
    model.zero_grad(set_to_none=True)
    logits, losses = [], []
    for i in range(input_ids.shape[0]):
        res = model(input_ids=input_ids[i : i + 1], **images[i])
        lg = res.logits.float()
        loss = torch.nn.functional.cross_entropy(lg[0], labels[i])
        if getattr(res, "aux_loss", None) is not None:
            loss = loss + _aux_coef(model) * res.aux_loss
        logits.append(lg.detach())
        losses.append(loss)
    loss = torch.stack(losses).mean()
    loss.backward()
    out: dict[str, Any] = {"logits": torch.cat(logits), "loss": float(loss.detach())}
    try:
        out["grads"] = saved_grads(model)
    finally:
        model.load_state_dict(state)
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return out


__all__ = [
    "BRACKETS",
    "FEATURES_OF",
    "FORMATS",
    "IMAGE_TOKEN",
    "TOKEN_TYPES",
    "brackets",
    "image_batch",
    "image_token_id",
    "maker",
    "placeholder_count",
    "reference",
    "special_ids",
]
