"""The chat dataset on disk: `preprocess_chat` writes it, `ChatDataset` reads it back.

Two megatron-core indexed datasets with identical sequence lengths, one sequence per
conversation: PREFIX (token ids, `uint16`/`int32` as for pre-training data) and
PREFIX.loss_mask (`uint8`, 1 on assistant tokens), plus PREFIX.meta.json with
`format: megatron_bridge.chat/1`. Two files rather than two sequences per document so that each
keeps its own dtype (the mask costs one byte a token) and the token dataset stays an ordinary
indexed dataset (`check_indexed_data`'s vocab checks read its meta unchanged). A reader opens
both memory-mapped and checks that their lengths agree, so conversation i is the same i in both.

Image chats (data/chat_images.py) add PREFIX.images.jsonl, one line per conversation with its
images' paths and placeholder token counts, and PREFIX.images/ for embedded image bytes; their
meta says `format: megatron_bridge.chat/2` and names the processor. `ChatDataset` reads text
chats only (it refuses image chats: training on them without the pixels would learn from image
placeholders that stand for nothing); `ImageChatDataset` reads both and gives each
conversation's images.

Writing streams conversations in batches (constant memory but one int per conversation in
megatron-core's builders); all files go under temporary names and are renamed at the end,
the token `.idx` last: a failure, including bad input found halfway, leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from megatron_bridge.data._fs import new_parent, refuse_existing
from megatron_bridge.data.chat import (
    CHAT_FORMAT,
    MASK_SUFFIX,
    OVERLONG,
    TRAINED_ROLE,
    ChatRenderer,
    Conversation,
    chat_input_files,
    chat_paths,
    has_content,
    iter_conversations,
    resolve_template,
)
from megatron_bridge.data.chat_images import (
    IMAGE_CHAT_FORMAT,
    SIDECAR_SUFFIX,
    STORE_SUFFIX,
    ImageEncoder,
    Sidecar,
    SidecarWriter,
    truncate,
)
from megatron_bridge.data.chat_writer import ChatWriter
from megatron_bridge.data.helpers import quiet_megatron_import
from megatron_bridge.data.images import DEFAULT_MAX_IMAGE_PIXELS, ImageRef, load_images, load_processor
from megatron_bridge.data.preprocess import check_output_prefix, read_meta
from megatron_bridge.data.tokenizer import load_tokenizer, validate_tokenizer_dir
from megatron_bridge.errors import UserError

PathLike = str | os.PathLike


@dataclass
class ChatStats:
    prefix: str
    conversations: int  # written
    tokens: int
    loss_tokens: int  # tokens with mask 1
    skipped_empty: int  # no messages, or nothing but blank content
    skipped_no_assistant: int  # nothing to train on
    truncated: int  # longer than max_length, cut to it (overlong=truncate)
    dropped_overlong: int  # longer than max_length, dropped (overlong=drop, or no assistant token left)
    dtype: str
    vocab_size: int
    eos_id: int
    max_token_id: int
    mask_method: str  # generation ({% generation %} markers) | incremental
    chat_template: str  # where the template came from
    max_length: int | None
    overlong: str
    seconds: float
    images: int = 0  # image chats: images stored (PREFIX.images.jsonl)
    image_tokens: int = 0  # their placeholder tokens (never trained on)
    image_conversations: int = 0
    embedded_images: int = 0  # distinct embedded images written into PREFIX.images/

    def describe(self) -> str:
        pct = 100 * self.loss_tokens / max(self.tokens, 1)
        lines = [
            f"{self.prefix}.{{bin,idx}} + {self.prefix}{MASK_SUFFIX}.{{bin,idx}}: {self.conversations} conversations, "
            f"{self.tokens} tokens, {self.loss_tokens} of them trained ({pct:.1f}%; {self.dtype}, vocab "
            f"{self.vocab_size}; template: {self.chat_template}, assistant tokens by {self.mask_method} rendering)"
        ]
        skipped = [
            f"{n} {what}"
            for n, what in (
                (self.skipped_empty, "empty"),
                (self.skipped_no_assistant, "without an assistant turn"),
            )
            if n
        ]
        if self.images:
            embedded = (
                f", {self.embedded_images} embedded in {self.prefix}{STORE_SUFFIX}/" if self.embedded_images else ""
            )
            lines.append(
                f"{self.images} images in {self.image_conversations} conversations ({self.image_tokens} image tokens; "
                f"recorded in {self.prefix}{SIDECAR_SUFFIX}{embedded})"
            )
        if skipped:
            lines.append(f"skipped: {', '.join(skipped)}")
        if self.max_length is not None:
            lines.append(
                f"longer than max_length={self.max_length} tokens: {self.truncated} truncated, "
                f"{self.dropped_overlong} dropped (overlong={self.overlong})"
            )
        return "\n".join(lines)


def preprocess_chat(
    inputs: PathLike | Sequence[PathLike],
    output_prefix: PathLike,
    tokenizer: PathLike,
    *,
    chat_template: PathLike | None = None,
    max_length: int | None = None,
    overlong: str = "truncate",
    messages_key: str = "messages",
    max_image_pixels: int | None = None,
    overwrite: bool = False,
    batch_size: int = 64,
    meta_extra: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
) -> ChatStats:
    """Render and tokenize the conversations of `inputs` (jsonl files or directories) into the
    chat dataset `output_prefix` (module docstring). Conversations longer than `max_length`
    tokens are cut to it (`overlong="truncate"`) or left out (`"drop"`); every skip is counted.
    Images (data/images.py) need a processor in `tokenizer`; one with more than
    `max_image_pixels` pixels (default 4096x4096) is refused."""
    # -- validate everything cheap first -------------------------------------------------------
    prefix = check_output_prefix(output_prefix, overwrite)
    paths = chat_paths(prefix)
    refuse_existing([paths["mask_bin"], paths["mask_idx"]], overwrite, "loss-mask dataset")
    refuse_existing([f"{prefix}{SIDECAR_SUFFIX}", f"{prefix}{STORE_SUFFIX}"], overwrite, "image chat data")
    files = chat_input_files(inputs)
    tok_dir = validate_tokenizer_dir(tokenizer)
    if overlong not in OVERLONG:
        raise UserError(f"overlong={overlong!r}: expected {' or '.join(OVERLONG)} (what to do past max_length)")
    if max_length is not None and int(max_length) <= 0:
        raise UserError(f"max_length={max_length} must be a positive number of tokens (or unset: no limit)")
    max_pixels = DEFAULT_MAX_IMAGE_PIXELS if max_image_pixels is None else int(max_image_pixels)
    if max_pixels <= 0:
        raise UserError(f"max_image_pixels={max_image_pixels} must be a positive number of pixels (width x height)")
    if chat_template and not Path(chat_template).expanduser().is_file():
        raise UserError(f"chat_template={chat_template} does not exist (it takes a file holding a Jinja chat template)")
    tok = load_tokenizer(tok_dir)
    processor, why = load_processor(tok_dir)
    template, source = resolve_template(tok, tok_dir, chat_template, processor)
    renderer = ChatRenderer(tok, template, source)
    encoder = ImageEncoder(renderer, processor, why, max_pixels)
    with new_parent(prefix):
        return _write(encoder, files, paths, tok_dir, max_length, overlong, batch_size, meta_extra, log, messages_key)


def _write(
    encoder, files, paths, tok_dir, max_length, overlong, batch_size, meta_extra, log, messages_key="messages"
) -> ChatStats:
    renderer = encoder.renderer
    tok, template, source = renderer.tok, renderer.template, renderer.source
    prefix = paths["bin"][: -len(".bin")]
    t0 = time.time()
    c = dict.fromkeys(("empty", "no_assistant", "truncated", "dropped"), 0)
    writer = sidecar = None
    try:
        writer = ChatWriter(prefix, len(tok))
        sidecar = SidecarWriter(prefix)

        def encoded(batch: list[Conversation]) -> list[tuple[list[int], list[int], list[Any]]]:
            """The batch in order: text conversations tokenized together, image ones one by one."""
            sources = [encoder.sources(conv) for conv in batch]
            plain = [(conv.where, conv.messages) for conv, src in zip(batch, sources) if not src]
            text = iter(renderer.encode(plain) if plain else [])
            return [encoder.encode(conv, src) if src else (*next(text), []) for conv, src in zip(batch, sources)]

        def flush(batch: list[Conversation]) -> None:
            for ids, mask, images in encoded(batch):
                if max_length is not None and len(ids) > max_length:
                    if overlong == "drop":
                        c["dropped"] += 1
                        continue
                    ids, mask, images = truncate(ids, mask, images, max_length)
                    if not any(mask):
                        c["dropped"] += 1
                        continue
                    c["truncated"] += 1
                if not any(mask):  # markers that cover nothing here, or an assistant turn that renders empty
                    c["no_assistant"] += 1
                    continue
                writer.add(ids, mask)
                sidecar.add(images)

        batch: list[Conversation] = []
        for conv in iter_conversations(files, messages_key):
            if not has_content(conv.messages):
                c["empty"] += 1
            elif not any(m["role"] == TRAINED_ROLE for m in conv.messages):
                c["no_assistant"] += 1
            else:
                batch.append(conv)
            if len(batch) >= batch_size:
                flush(batch)
                batch = []
                if log and writer.rows % (batch_size * 64) == 0:
                    log(f"  {writer.rows} conversations, {writer.tokens} tokens")
        if batch:
            flush(batch)
        if writer.rows == 0:
            raise UserError(
                f"no conversation to train on in {', '.join(map(str, files))}: {c['empty']} empty, "
                f"{c['no_assistant']} without an assistant turn, {c['dropped']} longer than max_length={max_length}"
            )
        if writer.max_id >= writer.vocab_size:
            raise UserError(
                f"the tokenizer in {tok_dir} produced id {writer.max_id} ≥ its own size {writer.vocab_size}"
            )
        meta = writer.meta(tokenizer=str(tok_dir.absolute()), eos_id=int(tok.eos_token_id))
        stats = ChatStats(
            prefix=str(prefix),
            conversations=writer.rows,
            tokens=writer.tokens,
            loss_tokens=writer.loss_tokens,
            skipped_empty=c["empty"],
            skipped_no_assistant=c["no_assistant"],
            truncated=c["truncated"],
            dropped_overlong=c["dropped"],
            dtype=meta["dtype"],
            vocab_size=writer.vocab_size,
            eos_id=meta["eos_id"],
            max_token_id=writer.max_id,
            mask_method=renderer.method,
            chat_template=source,
            max_length=max_length,
            overlong=overlong,
            seconds=time.time() - t0,
            images=sidecar.images,
            image_tokens=sidecar.image_tokens,
            image_conversations=sidecar.conversations,
            embedded_images=sidecar.store.count,
        )
        proc = encoder.processor
        meta |= {
            "format": IMAGE_CHAT_FORMAT if sidecar.images else CHAT_FORMAT,
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
            **asdict(stats),
            "files": [str(f) for f in files],
            **(meta_extra or {}),
        }
        if sidecar.images:
            meta["images"] = {
                "sidecar_suffix": SIDECAR_SUFFIX,
                "store_suffix": STORE_SUFFIX,
                "processor": type(proc).__name__,
                "image_processor": type(proc.image_processor).__name__,
                "image_token": proc.image_token,
                "max_image_pixels": encoder.max_pixels,
            }
        meta.pop("prefix", None)
        writer.publish(meta, before_index=sidecar.publish)
    except BaseException:
        if writer is not None:
            writer.discard()
        if sidecar is not None:
            sidecar.discard()
        raise
    return stats


class ChatDataset:
    """Random access to a chat dataset's conversations: `ds[i]` is (tokens int64, loss_mask
    uint8), two numpy arrays of the same length; `ds.lengths` holds every conversation's length
    (for packing without reading tokens). Memory-mapped: opening costs the two index files.
    Text chats only: image chats are read by `ImageChatDataset`, which gives their images."""

    FORMATS: tuple[str, ...] = (CHAT_FORMAT,)

    def __init__(self, prefix: PathLike):
        self.prefix = str(prefix)
        paths = chat_paths(self.prefix)
        missing = [paths[k] for k in ("bin", "idx", "mask_bin", "mask_idx") if not os.path.isfile(paths[k])]
        if missing:
            raise UserError(
                f"chat dataset {self.prefix} is incomplete: {', '.join(missing)} missing (make it with "
                f"`mbr data mode=chat input=FILE.jsonl output={self.prefix} tokenizer=DIR`)"
            )
        self.meta = read_meta(self.prefix) or {}
        if self.meta.get("format") == IMAGE_CHAT_FORMAT and IMAGE_CHAT_FORMAT not in self.FORMATS:
            raise UserError(
                f"{self.prefix} holds image chats ({self.meta.get('images', {}).get('processor')} inputs, "
                f"{self.meta.get('image_conversations')} conversations with images), and this reader gives tokens "
                "without their pixels: the model would train on image placeholders that stand for nothing. Read it "
                "with ImageChatDataset (megatron_bridge.data.chat_dataset), or make the data without images."
            )
        if self.meta.get("format") not in self.FORMATS:
            raise UserError(
                f"{self.prefix} is not chat data in the format this version reads ({CHAT_FORMAT}); its "
                f"{paths['meta']} says {self.meta.get('format')!r}. Re-make it with `mbr data mode=chat`."
            )
        import numpy as np

        quiet_megatron_import()
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self._tokens = IndexedDataset(self.prefix)
        self._mask = IndexedDataset(self.prefix + MASK_SUFFIX)
        self.lengths = self._tokens.sequence_lengths
        if not np.array_equal(self.lengths, self._mask.sequence_lengths):
            raise UserError(
                f"{self.prefix}: the token and loss-mask datasets disagree on conversation lengths (files from "
                "two different builds?). Re-make it with `mbr data mode=chat ... overwrite=true`."
            )

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int):
        import numpy as np

        if not -len(self) <= i < len(self):
            raise IndexError(f"conversation {i} of {len(self)} in {self.prefix}")
        i = int(i) % len(self)
        # copies: a view into the memory map would dangle once the dataset is closed
        return np.array(self._tokens[i], dtype=np.int64), np.array(self._mask[i], dtype=np.uint8)

    def __iter__(self) -> Iterator:
        return (self[i] for i in range(len(self)))


class ImageChatDataset(ChatDataset):
    """A chat dataset with its images: `ds[i]` is (tokens, loss_mask, images), images a list of
    `ImageRef(path, tokens, start)` in the order their placeholders appear (empty for a text
    conversation, and for all of a text-only dataset). `images_of(conversations)` gives a packed
    sample's images: its conversations' images, in the order the conversations are packed.
    `load_images(refs)` turns refs into the model's image inputs with the data's processor."""

    FORMATS = (CHAT_FORMAT, IMAGE_CHAT_FORMAT)

    def __init__(self, prefix: PathLike):
        super().__init__(prefix)
        self._images = Sidecar(self.prefix, len(self)) if self.meta["format"] == IMAGE_CHAT_FORMAT else None
        self._processor: Any = None

    def images(self, i: int) -> list[ImageRef]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"conversation {i} of {len(self)} in {self.prefix}")
        return [] if self._images is None else self._images[int(i) % len(self)]

    def images_of(self, conversations: Sequence[int]) -> list[ImageRef]:
        return [im for c in conversations for im in self.images(c)]

    def __getitem__(self, i: int):
        tokens, mask = super().__getitem__(i)
        return tokens, mask, self.images(i)

    def processor(self) -> Any:
        """The processor of the tokenizer directory the data was made with (loaded once), checked
        to be of the class recorded in the meta."""
        if self._processor is None:
            want = self.meta.get("images", {}).get("processor")
            proc, why = load_processor(self.meta["tokenizer"])
            if proc is None or (want and type(proc).__name__ != want):
                raise UserError(
                    f"{self.prefix} was made with a {want} processor, but {why or type(proc).__name__ + ' is there now'}"
                )
            self._processor = proc
        return self._processor

    def load_images(self, images: Sequence[ImageRef], processor: Any = None) -> dict[str, Any]:
        return load_images(images, processor if processor is not None else self.processor())
