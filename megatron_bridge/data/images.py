"""The images of image chats: where each one comes from, decoding it, storing embedded bytes,
and the processor that turns images into a vision-language model's inputs.

An image is a content part of a message, in the form transformers' chat templates and
processors use: `{"type": "image", "image": "PATH"}` (a file, relative to the data file or
absolute) or `{"type": "image"}`, which takes the conversation's next entry of its `images`
column (image bytes, or `{"bytes": ..., "path": ...}` as datasets' Image feature stores them, or
a path). Nothing is fetched: a URL is refused where it is read, so a data build never depends
on a network and every image it records can be opened again at training time.

Images are decoded with Pillow only, to RGB; an image whose header says it has more than
`max_image_pixels` pixels is refused before it is decoded, so one oversized file cannot exhaust
memory. Embedded bytes are written once into PREFIX.images/, named by their content hash, so
the stored references are plain paths whatever the input format was.

`load_images` is the training-time half: the processor's image inputs (pixel_values,
image_grid_thw, image_sizes, ... whatever that processor returns) for stored paths, checked
against the placeholder token counts recorded when the data was made.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from megatron_bridge.data._fs import publish_mode, remove, temp_path_for
from megatron_bridge.errors import UserError

PathLike = str | os.PathLike
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
IMAGES_COLUMN = "images"  # a row's (jsonl line's) images, taken in order by parts without a file
VIDEOS_COLUMN = "videos"  # refused when non-empty: video inputs are not fed (refuse_videos)
PART_TYPES = ("text", "image")
FILE_KEYS = ("image", "path")  # an image part's file, either key
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
# what a processor returns for the text: not image inputs of the model
TEXT_OUTPUTS = ("offset_mapping", "text_replacement_offsets", "mm_token_type_ids", "token_type_ids")
_URL = re.compile(r"^(?:[A-Za-z][A-Za-z0-9+.-]*://|data:)")


class ImageRef(NamedTuple):
    """A stored image of a conversation: its file, how many placeholder tokens the processor
    gave it, and the position of its first one in the conversation's tokens."""

    path: str
    tokens: int
    start: int


@dataclass(frozen=True)
class ImageSource:
    """One image of a conversation as the input gives it: a file, or embedded bytes."""

    where: str  # "file:line" (and which image) for messages
    path: Path | None = None
    data: bytes | None = None


def _url_error(value: str, where: str) -> UserError:
    return UserError(
        f"{where}: image {value[:120]!r} is a URL; images are read from local files only (nothing is "
        "fetched from a network). Download it and give its path (relative to the data file, or absolute)."
    )


def refuse_url(value: str, where: str) -> None:
    if _URL.match(value):
        raise _url_error(value, where)


VIDEO_FIX = (
    "video inputs are not supported (image chats only: the model's video inputs are never fed); "
    "extract frames and give them as image parts, or drop the videos"
)


def refuse_videos(row: Any, where: str) -> None:
    """A row with a non-empty `videos` column is refused: its videos would be dropped silently."""
    if isinstance(row, dict) and row.get(VIDEOS_COLUMN):
        raise UserError(f"{where}: the row has a {VIDEOS_COLUMN!r} column; {VIDEO_FIX}")


def check_parts(content: list[Any], where: str) -> list[dict[str, Any]]:
    """A message's content parts, validated: text parts with a string `text`, image parts with a
    local file (`image` or `path`) or nothing (the row's images column). Keys holding None are
    dropped: a datasets struct column gives every part every key, and templates test for them."""
    out = []
    for j, part in enumerate(content):
        p = {k: v for k, v in part.items() if v is not None} if isinstance(part, dict) else part
        if isinstance(p, dict) and p.get("type") == "video":
            raise UserError(f"{where}: content part {j} is a video part; {VIDEO_FIX}")
        if not isinstance(p, dict) or p.get("type") not in PART_TYPES:
            raise UserError(
                f"{where}: content part {j} is not a text or image part ({str(part)[:80]}); parts are "
                '{"type": "text", "text": "..."} or {"type": "image", "image": "PATH"} (or {"type": "image"} for '
                f"the row's {IMAGES_COLUMN!r} column, in order)"
            )
        if p["type"] == "text" and not isinstance(p.get("text"), str):
            raise UserError(f'{where}: content part {j} is a text part without a "text" string')
        if p["type"] == "image":
            if "url" in p:
                raise _url_error(str(p["url"]), f"{where}, part {j}")
            files = [p[k] for k in FILE_KEYS if k in p]
            if any(not isinstance(f, str) for f in files):
                raise UserError(f"{where}: content part {j}: an image part's file is a path string")
            for f in files:
                refuse_url(f, f"{where}, part {j}")
        out.append(p)
    return out


def part_file(part: dict[str, Any]) -> str | None:
    return next((part[k] for k in FILE_KEYS if k in part), None)


def conversation_images(messages: list[dict[str, Any]], column: Any, base: Path, where: str) -> list[ImageSource]:
    """The images of a conversation, in the order its image parts appear: a part's own file,
    else the next entry of `column` (the row's images; every entry must be used)."""
    entries = [] if column is None else column
    if not isinstance(entries, list):
        raise UserError(f"{where}: {IMAGES_COLUMN!r} is a {type(entries).__name__}, not a list of images")
    out: list[ImageSource] = []
    taken = 0
    for m in messages:
        for part in m["content"] if isinstance(m["content"], list) else ():
            if part["type"] != "image":
                continue
            k = len(out) + 1
            f = part_file(part)
            if f is not None:
                out.append(ImageSource(f"{where} (image {k}: {f})", path=_resolve(f, base)))
            elif taken < len(entries):
                out.append(_column_image(entries[taken], base, f"{where} (image {k}: {IMAGES_COLUMN}[{taken}])"))
                taken += 1
            else:
                taken += 1  # counted for the message below
    if taken != len(entries):
        raise UserError(
            f"{where}: {taken} image part(s) without a file take their images from the {IMAGES_COLUMN!r} "
            f"column, which holds {len(entries)}: each such part takes the next one, so the two counts must agree"
        )
    return out


def _resolve(f: str, base: Path) -> Path:
    p = Path(f).expanduser()
    return p if p.is_absolute() else base / p


def _column_image(entry: Any, base: Path, where: str) -> ImageSource:
    if isinstance(entry, dict):  # datasets' Image feature: {"bytes": ..., "path": ...}
        data, path = entry.get("bytes"), entry.get("path")
    elif isinstance(entry, (bytes, bytearray)):
        data, path = entry, None
    else:
        data, path = None, entry
    if data is not None:
        return ImageSource(where, data=bytes(data))
    if not isinstance(path, str):
        raise UserError(
            f"{where}: an image entry is bytes, a path, or {{'bytes': ..., 'path': ...}}; got {entry!r:.80}"
        )
    refuse_url(path, where)
    return ImageSource(where, path=_resolve(path, base))


def open_image(src: ImageSource, max_pixels: int | None) -> tuple[Any, str]:
    """(RGB PIL image, its format name) for `src`; UserError naming it when the file is missing,
    Pillow cannot decode it, or it has more than `max_pixels` pixels (checked on the header)."""
    import warnings

    from PIL import Image

    if src.path is not None and not src.path.is_file():
        raise UserError(
            f"{src.where}: image file {src.path} not found (relative paths are read from the data file's directory)"
        )
    try:
        with warnings.catch_warnings():  # the size limit below is ours, not Pillow's bomb heuristic
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(src.path if src.path is not None else io.BytesIO(src.data or b"")) as img:
                w, h = img.size
                if max_pixels is not None and w * h > max_pixels:
                    raise UserError(
                        f"{src.where}: image is {w}x{h} = {w * h} pixels, more than max_image_pixels={max_pixels}; "
                        "resize it, or raise max_image_pixels=N"
                    )
                return img.convert("RGB"), (img.format or "png").lower()
    except UserError:
        raise
    except Image.DecompressionBombError as e:
        raise UserError(f"{src.where}: image is larger than Pillow decodes ({e}); resize it") from e
    except Exception as e:  # Pillow raises UnidentifiedImageError, OSError, SyntaxError, ValueError...
        raise UserError(
            f"{src.where}: Pillow cannot read this image ({type(e).__name__}: {e}); replace or drop it"
        ) from e


class ImageStore:
    """Embedded image bytes written once each, named by their sha256, into a temporary directory
    that `publish` renames to `final` (PREFIX.images); the paths handed out are the final ones."""

    def __init__(self, final: Path):
        self.final = final.absolute()
        self.tmp: Path | None = None
        self.count = 0

    def put(self, data: bytes, fmt: str) -> str:
        if self.tmp is None:
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.final.name}.tmp-", dir=self.final.parent))
        name = f"{hashlib.sha256(data).hexdigest()}.{fmt}"
        if not (self.tmp / name).exists():
            (self.tmp / name).write_bytes(data)
            self.count += 1
        return str(self.final / name)

    def publish(self) -> None:
        """Replace `final` by this build's directory (or remove a previous build's when none)."""
        trash = temp_path_for(self.final) if os.path.lexists(self.final) else None
        if trash:
            os.replace(self.final, trash)
        if self.tmp is not None:
            publish_mode(self.tmp, directory=True)
            os.replace(self.tmp, self.final)
        if trash:
            remove(trash)

    def discard(self) -> None:
        if self.tmp is not None:
            remove(self.tmp)


def load_processor(tok_dir: PathLike) -> tuple[Any, str]:
    """(processor, "") when `tok_dir` holds one with an image processor, else (None, why not)."""
    d = Path(tok_dir)
    if not any((d / f).is_file() for f in PROCESSOR_FILES):
        return None, f"{d} holds no image processor ({' or '.join(PROCESSOR_FILES)})"
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its load-time notes about its own classes are not the user's to act on
    try:
        proc = transformers.AutoProcessor.from_pretrained(str(d), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ImportError...
        raise UserError(f"cannot load the processor in {d}: {type(e).__name__}: {e}") from e
    finally:
        transformers.logging.set_verbosity(level)
    if getattr(proc, "image_processor", None) is None or getattr(proc, "image_token", None) is None:
        return None, f"the processor in {d} ({type(proc).__name__}) has no image processor and image token"
    return proc, ""


def image_runs(enc: Any, row: int = 0) -> list[list[int]]:
    """Per image of row `row` of a processor's output, the indices of the tokens its placeholder
    was expanded into (the tokens overlapping the replacement's characters)."""
    import numpy as np

    try:
        reps = [r["new_span"] for r in enc["text_replacement_offsets"][row] if r["type"] == "image"]
        off = np.asarray(enc["offset_mapping"][row], dtype=np.int64).reshape(-1, 2)
    except KeyError as e:
        raise UserError(
            f"the processor does not report where it expanded the image placeholders ({e.args[0]} missing from "
            "its output); mode=chat needs a processor built on transformers' placeholder replacement"
        ) from e
    return [np.flatnonzero((off[:, 0] < e) & (off[:, 1] > s)).tolist() for s, e in reps]


def load_images(images: Sequence[str | ImageRef], processor: Any) -> dict[str, Any]:
    """The model's image inputs for `images` (stored paths, or `ImageRef`s whose recorded token
    counts are checked): the processor's image outputs as torch tensors, e.g. pixel_values and
    image_grid_thw. A count that differs means the processor is not the one the data was made
    with, and the token sequence no longer fits the pixels: UserError."""
    if not images:
        return {}
    paths = [r.path if isinstance(r, ImageRef) else str(r) for r in images]
    pil = [open_image(ImageSource(p, path=Path(p)), None)[0] for p in paths]
    enc = processor(
        text=[processor.image_token * len(pil)],
        images=pil,
        return_tensors="pt",
        return_offsets_mapping=True,
        return_text_replacement_offsets=True,
        add_special_tokens=False,
    )
    for r, run in zip(images, image_runs(enc)):
        if isinstance(r, ImageRef) and len(run) != r.tokens:
            raise UserError(
                f"image {r.path}: the processor ({type(processor).__name__}) gives it {len(run)} placeholder tokens, "
                f"the data was made with {r.tokens}: the processor changed since. Use the processor the data was made "
                "with, or re-make the data with this one (`mbr data mode=chat ... overwrite=true`)."
            )
    drop = {*getattr(processor.tokenizer, "model_input_names", ()), *TEXT_OUTPUTS}
    return {k: v for k, v in enc.items() if k not in drop}
