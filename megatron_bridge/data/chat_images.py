"""Image chats: a conversation with images is rendered with the processor's chat template, then
the processor itself expands each image placeholder into the tokens its image processor gives
that image, and the loss mask is found as for text (data/chat.py) and mapped into the expanded
text; image tokens are never trained on.

    PREFIX.images.jsonl   line i: conversation i's images, {"paths": [...], "tokens": [...],
                          "starts": [...]}: each image's file, its placeholder token count, and
                          the position of its first placeholder token in the conversation
    PREFIX.images/        embedded image bytes, one file per distinct image (sha256.FORMAT)

The mask comes from the unexpanded text (where the template's markers or incremental rendering
place the assistant turns) and the processor's own record of each replacement (transformers'
`return_text_replacement_offsets`): a character after a placeholder moves by the growth of the
replacements before it. The tokens an image occupies are those overlapping its replacement, so a
processor that wraps an image in row or break tokens is counted the same way at training time
(`images.load_images`).

A conversation longer than `max_length` is never cut inside an image's tokens: the cut moves back
to the image's first token, and the images past it are left out with their tokens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

from megatron_bridge.data._fs import remove, temp_path_for
from megatron_bridge.data.chat import ChatRenderer, Conversation, span_mask
from megatron_bridge.data.images import (
    ImageRef,
    ImageSource,
    ImageStore,
    conversation_images,
    image_runs,
    open_image,
)
from megatron_bridge.errors import UserError

IMAGE_CHAT_FORMAT = "megatron_bridge.chat/2"  # chat/1 plus PREFIX.images.jsonl
SIDECAR_SUFFIX = ".images.jsonl"
STORE_SUFFIX = ".images"


class EncodedImage(NamedTuple):
    source: ImageSource
    fmt: str  # Pillow's format name: the stored file's suffix
    tokens: int
    start: int


class ImageEncoder:
    """Tokens, loss mask and images of the conversations that have images (`processor` is None
    when the tokenizer directory has none: `why` says so, and an image is refused with it)."""

    def __init__(self, renderer: ChatRenderer, processor: Any, why: str, max_pixels: int):
        self.renderer, self.processor, self.why, self.max_pixels = renderer, processor, why, max_pixels

    def sources(self, conv: Conversation) -> list[ImageSource]:
        return conversation_images(conv.messages, conv.images, conv.base, conv.where)

    def encode(self, conv: Conversation, sources: list[ImageSource]) -> tuple[list[int], list[int], list[EncodedImage]]:
        proc = self.processor
        if proc is None:
            raise UserError(
                f"{sources[0].where}: this conversation has images, but {self.why}. Pass tokenizer=DIR of the "
                "vision-language model (its processor_config.json / preprocessor_config.json beside the tokenizer), "
                "or drop the image parts."
            )
        decoded = [open_image(s, self.max_pixels) for s in sources]
        text, spans = self.renderer.char_spans(conv.messages, conv.where)
        placed = text.count(proc.image_token)
        if placed != len(sources):
            raise UserError(
                f"{conv.where}: the conversation has {len(sources)} image(s) but the chat template of "
                f"{self.renderer.source} rendered {placed} image placeholder(s) {proc.image_token!r}: each image needs "
                "exactly one. Use the processor's chat template (one that renders image parts), or fix the parts."
            )
        try:
            enc = proc(
                text=[text],
                images=[img for img, _ in decoded],
                return_offsets_mapping=True,
                return_text_replacement_offsets=True,
                add_special_tokens=False,
            )
        except UserError:
            raise
        except Exception as e:  # the processor's own checks (ValueError, ...) on this input
            raise UserError(
                f"{conv.where}: the processor ({type(proc).__name__}) failed: {type(e).__name__}: {e}"
            ) from e
        ids = [int(t) for t in enc["input_ids"][0]]
        runs = image_runs(enc)
        if len(runs) != len(sources) or any(not r for r in runs):
            raise UserError(
                f"{conv.where}: the processor placed {sum(map(bool, runs))} of {len(sources)} images into the tokens; "
                "the template or the processor drops image placeholders"
            )
        reps = [(r["span"], r["new_span"]) for r in enc["text_replacement_offsets"][0] if r["type"] == "image"]
        mask = span_mask(enc["offset_mapping"][0], [(_moved(s, reps), _moved(e, reps)) for s, e in spans])
        for run in runs:
            for t in run:
                mask[t] = 0
        images = [EncodedImage(s, fmt, len(run), run[0]) for s, (_, fmt), run in zip(sources, decoded, runs)]
        return ids, mask, images


def _moved(x: int, reps: list[tuple[tuple[int, int], tuple[int, int]]]) -> int:
    """Character `x` of the unexpanded text in the expanded one."""
    return x + sum((ne - ns) - (e - s) for (s, e), (ns, ne) in reps if e <= x)


def truncate(ids: list[int], mask: list[int], images: list[EncodedImage], n: int):
    """The first `n` tokens, cut earlier where that would split an image's tokens or end on one:
    a conversation's last token is only a label (inputs tokens[:-1]), so an image ending there
    would lose a placeholder from the model's inputs. Only the images wholly before it are kept."""
    for im in images:
        if im.start < n <= im.start + im.tokens:
            n = im.start
    return ids[:n], mask[:n], [im for im in images if im.start + im.tokens < n]


class SidecarWriter:
    """Writes PREFIX.images.jsonl (and PREFIX.images/ for embedded bytes) under temporary names;
    `publish` renames them into place, or removes a previous build's when this one has no image."""

    def __init__(self, prefix: str):
        self.path = prefix + SIDECAR_SUFFIX
        self.tmp = temp_path_for(self.path)
        self.store = ImageStore(Path(prefix + STORE_SUFFIX))
        self.fh = open(self.tmp, "w", encoding="utf-8")
        self.images = self.image_tokens = self.conversations = 0

    def add(self, images: list[EncodedImage]) -> None:
        paths = [
            str(im.source.path.resolve())
            if im.source.path is not None
            else self.store.put(im.source.data or b"", im.fmt)
            for im in images
        ]
        line = {"paths": paths, "tokens": [im.tokens for im in images], "starts": [im.start for im in images]}
        self.fh.write(json.dumps(line, ensure_ascii=False) + "\n")
        self.images += len(images)
        self.image_tokens += sum(im.tokens for im in images)
        self.conversations += bool(images)

    def publish(self) -> None:
        self.fh.close()
        if self.images:
            os.replace(self.tmp, self.path)
        else:
            remove(self.tmp)
            remove(self.path)
        self.store.publish()

    def discard(self) -> None:
        self.fh.close()
        remove(self.tmp)
        self.store.discard()


class Sidecar:
    """Random access to PREFIX.images.jsonl: line offsets found once over the memory-mapped file."""

    def __init__(self, prefix: str, n: int):
        import numpy as np

        self.path = prefix + SIDECAR_SUFFIX
        if not os.path.isfile(self.path):
            raise UserError(
                f"{prefix} holds image chats but {self.path} is missing: re-make it with `mbr data mode=chat`"
            )
        self._buf = (
            np.memmap(self.path, dtype=np.uint8, mode="r") if os.path.getsize(self.path) else np.zeros(0, np.uint8)
        )
        self._ends = np.flatnonzero(self._buf == ord("\n"))
        if len(self._ends) != n:
            raise UserError(
                f"{self.path} has {len(self._ends)} lines for {n} conversations (files from two different builds?): "
                "re-make it with `mbr data mode=chat ... overwrite=true`"
            )

    def __getitem__(self, i: int) -> list[ImageRef]:
        start = 0 if i == 0 else int(self._ends[i - 1]) + 1
        line = json.loads(bytes(self._buf[start : int(self._ends[i])]))
        return [ImageRef(p, int(t), int(s)) for p, t, s in zip(line["paths"], line["tokens"], line["starts"])]
