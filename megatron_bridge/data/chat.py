"""Chat / instruction data: jsonl conversations → the tokenizer's chat template → token ids and a
per-token loss mask, stored as two aligned megatron-core indexed datasets.

    PREFIX.bin/.idx             token ids, one sequence per conversation (megatron's format, so the
                                 vocab checks and tooling of pre-training data apply unchanged)
    PREFIX.loss_mask.bin/.idx   uint8, the same sequence lengths: 1 where the token belongs to an
                                 assistant turn (its content and its end-of-turn token(s))
    PREFIX.meta.json            format `megatron_bridge.chat/1`, tokenizer facts, counts

A message's content is a string, or content parts as transformers' chat templates and processors
take them (text parts and image parts; data/images.py, data/chat_images.py for image chats).

The mask is per *token*, not per label: a loader that predicts token i+1 from tokens ..i uses
`loss_mask[1:]` with `labels = tokens[1:]` (`chat_dataset.ChatDataset` reads both back).

Where the assistant tokens are is found in the rendered text, then mapped to tokens through the
fast tokenizer's character offsets (a token counts when it overlaps an assistant span, the rule of
transformers' `return_assistant_tokens_mask`), so a BPE merge across a turn boundary cannot shift
the mask. The spans come from the template itself when it marks them (`{% generation %}` blocks:
transformers' `return_assistant_tokens_mask`), else from incremental rendering: the text of the
turns before assistant turn k with the generation prompt, and the text through turn k, must both
be prefixes of the whole conversation's text, and turn k is what lies between them. A template
that re-renders earlier turns when one is appended (e.g. drops past reasoning) fails that check
and is refused by name: its assistant tokens cannot be located without markers.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from megatron_bridge.data.columnar import COLUMNAR_SUFFIXES, iter_rows
from megatron_bridge.data.corpus import input_files, iter_jsonl
from megatron_bridge.data.images import IMAGES_COLUMN, VIDEOS_COLUMN, check_parts, refuse_videos
from megatron_bridge.data.preprocess import output_paths
from megatron_bridge.errors import UserError

PathLike = str | os.PathLike
CHAT_FORMAT = "megatron_bridge.chat/1"
MASK_SUFFIX = ".loss_mask"  # the loss-mask dataset's prefix is PREFIX + MASK_SUFFIX
ROLES = ("system", "user", "assistant", "tool")
TRAINED_ROLE = "assistant"
OVERLONG = ("truncate", "drop")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' own test for the markers
EXAMPLE_LINE = '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'


def chat_paths(prefix: PathLike) -> dict[str, str]:
    """Every file of a chat dataset: tokens (bin, idx, meta) and the loss mask (mask_bin, mask_idx)."""
    mask = output_paths(str(prefix) + MASK_SUFFIX)
    return {**output_paths(prefix), "mask_bin": mask["bin"], "mask_idx": mask["idx"]}


# -- reading conversations ---------------------------------------------------------------------
def _messages(obj: Any, where: str) -> list[dict[str, Any]]:
    """The conversation of one jsonl line: `messages`, or `prompt`+`completion` (strings, or
    message lists as in TRL's conversational prompt-completion format), validated."""
    if isinstance(obj, dict) and "messages" in obj:
        msgs = obj["messages"]
    elif isinstance(obj, dict) and "prompt" in obj and "completion" in obj:
        p, c = obj["prompt"], obj["completion"]
        msgs = (p if isinstance(p, list) else [{"role": "user", "content": p}]) + (
            c if isinstance(c, list) else [{"role": TRAINED_ROLE, "content": c}]
        )
    else:
        keys = ", ".join(map(repr, obj)) if isinstance(obj, dict) else type(obj).__name__
        raise UserError(
            f'{where}: expected a "messages" list or "prompt" and "completion" (found: {keys}), e.g. {EXAMPLE_LINE}'
        )
    if not isinstance(msgs, list):
        raise UserError(f'{where}: "messages" is a {type(msgs).__name__}, not a list of {{"role", "content"}} objects')
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise UserError(f'{where}: message {i} is not a {{"role": ..., "content": ...}} object: {str(m)[:80]}')
        if m["role"] not in ROLES:
            raise UserError(
                f"{where}: message {i} has unknown role {m['role']!r}; the allowed roles are "
                f"{', '.join(ROLES)} (only {TRAINED_ROLE} turns are trained on)"
            )
        if isinstance(m["content"], list):
            msgs[i] = {**m, "content": check_parts(m["content"], f"{where}: message {i} ({m['role']})")}
        elif not isinstance(m["content"], str):
            raise UserError(
                f"{where}: message {i} ({m['role']}) content is a {type(m['content']).__name__}, not a string "
                "or a list of content parts"
            )
    return msgs


def has_content(msgs: list[dict[str, Any]]) -> bool:
    """Whether any message holds non-blank text or an image."""
    return any(
        m["content"].strip()
        if isinstance(m["content"], str)
        else any(p["type"] == "image" or p["text"].strip() for p in m["content"])
        for m in msgs
    )


class Conversation(NamedTuple):
    where: str  # "file:line" / "file:row N"
    messages: list[dict[str, Any]]
    images: Any  # the row's images column (the line's "images" key), or None
    base: Path  # the directory relative image paths are read from: the data file's


def chat_input_files(inputs: PathLike | Sequence[PathLike]) -> list[Path]:
    """The jsonl and columnar files of `inputs` (files or directories); .txt is refused (no roles in it)."""
    files = input_files(inputs)
    for f in files:
        if f.suffix not in (".jsonl", ".json", *COLUMNAR_SUFFIXES):
            raise UserError(f"input {f}: chat data is jsonl (one conversation per line, e.g. {EXAMPLE_LINE})")
    return files


def iter_conversations(inputs: PathLike | Sequence[PathLike], messages_key: str = "messages") -> Iterator[Conversation]:
    """Stream the conversations of jsonl or columnar files (or directories of them), validated.
    Columnar rows (data/columnar.py) give their `messages_key` column and their `images` column
    when they have one; a jsonl line its `messages_key` key when that is not "messages" (else
    `messages` or prompt/completion), and its `images` key."""
    for f in chat_input_files(inputs):
        base = f.absolute().parent
        if f.suffix in COLUMNAR_SUFFIXES:
            for where, row in iter_rows(f, messages_key, (IMAGES_COLUMN, VIDEOS_COLUMN)):
                refuse_videos(row, where)
                msgs = _messages({"messages": row[messages_key]}, where)
                yield Conversation(where, msgs, row.get(IMAGES_COLUMN), base)
            continue
        for lineno, obj in iter_jsonl(f, EXAMPLE_LINE):
            refuse_videos(obj, f"{f}:{lineno}")
            images = obj.get(IMAGES_COLUMN) if isinstance(obj, dict) else None
            if messages_key != "messages" and isinstance(obj, dict) and messages_key in obj:
                obj = {"messages": obj[messages_key]}
            yield Conversation(f"{f}:{lineno}", _messages(obj, f"{f}:{lineno}"), images, base)


# -- the template --------------------------------------------------------------------------------
def resolve_template(
    tok: Any, tok_dir: PathLike, chat_template: PathLike | None, processor: Any = None
) -> tuple[str, str]:
    """(template text, where it came from): `chat_template=FILE`, else the processor's (image
    chats), else the tokenizer's own. A tokenizer without one is refused with the fix."""
    if chat_template:
        p = Path(chat_template).expanduser()
        if not p.is_file():
            raise UserError(f"chat_template={p} does not exist (it takes a file holding a Jinja chat template)")
        text = p.read_text(encoding="utf-8")
        if not text.strip():
            raise UserError(f"chat_template={p} is empty")
        return text, str(p.absolute())
    own = getattr(processor, "chat_template", None) or getattr(tok, "chat_template", None)
    if isinstance(own, dict):  # named templates: the default one renders plain conversations
        own = own.get("default")
    if not own:
        raise UserError(
            f"the tokenizer in {tok_dir} has no chat template, so conversations cannot be rendered the way "
            "the model will see them. Pass chat_template=FILE (a Jinja chat template, e.g. the instruct "
            "model's chat_template.jinja), or use the instruct model's tokenizer."
        )
    return own, f"the {'processor' if processor is not None else 'tokenizer'} in {Path(tok_dir).absolute()}"


class ChatRenderer:
    """Renders conversations with one template and finds their assistant character spans."""

    def __init__(self, tok: Any, template: str, source: str):
        if not getattr(tok, "is_fast", False):
            raise UserError(
                f"{source}: mode=chat needs a fast tokenizer (a tokenizer.json) to map assistant text to tokens; "
                "save one with transformers (AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))"
            )
        self.tok, self.template, self.source = tok, template, source
        self.method = "generation" if _GENERATION.search(template) else "incremental"

    def render(self, msgs: list[dict[str, Any]], where: str, generation_prompt: bool = False) -> str:
        try:
            return self.tok.apply_chat_template(
                msgs, chat_template=self.template, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as e:  # jinja raises whatever the template does (raise_exception(...))
            raise UserError(f"{where}: the chat template of {self.source} failed on this conversation: {e}") from e

    def spans(self, msgs: list[dict[str, Any]], where: str) -> tuple[str, list[tuple[int, int]]]:
        """The whole conversation's text and the [start, end) character spans of its assistant
        turns (incremental rendering; UserError naming the template when it is not prefix-consistent)."""
        text = self.render(msgs, where)
        out = []
        for k, m in enumerate(msgs):
            if m["role"] != TRAINED_ROLE:
                continue
            before = self.render(msgs[:k], where, generation_prompt=True)
            through = self.render(msgs[: k + 1], where)
            if not through.startswith(before):
                broken = f"messages 0..{k - 1} with the generation prompt do not render as the start of messages 0..{k}"
            elif not text.startswith(through):
                broken = f"messages 0..{k} do not render as the start of the whole conversation"
            else:
                out.append((len(before), len(through)))
                continue
            raise UserError(
                f"{where}: the chat template of {self.source} is not prefix-consistent: {broken} (at "
                f"assistant message {k}: the template renders a turn differently once more follow), so the assistant "
                "tokens cannot be located. Pass chat_template=FILE with a template that marks assistant content with "
                "{% generation %}...{% endgeneration %}, or one that renders every turn the same way."
            )
        return text, out

    def char_spans(self, msgs: list[dict[str, Any]], where: str) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and its assistant character spans, by the template's markers
        or by incremental rendering (`spans`): what a processor's expanded text is mapped from."""
        if self.method != "generation":
            return self.spans(msgs, where)
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            texts, indices = render_jinja_template(
                conversations=[msgs],
                chat_template=self.template,
                return_assistant_tokens_mask=True,
                **self.tok.special_tokens_map,
            )
        except Exception as e:  # jinja raises whatever the template does
            raise UserError(f"{where}: the chat template of {self.source} failed on this conversation: {e}") from e
        return texts[0], [(int(s), int(e)) for s, e in indices[0]]

    def encode(self, convs: list[tuple[str, list[dict[str, Any]]]]) -> list[tuple[list[int], list[int]]]:
        """(token ids, loss mask) per conversation of a batch."""
        if self.method == "generation":
            try:
                enc = self.tok.apply_chat_template(
                    [m for _, m in convs],
                    chat_template=self.template,
                    tokenize=True,
                    return_dict=True,
                    return_assistant_tokens_mask=True,
                )
            except Exception:
                for where, m in convs:  # name the conversation the template fails on
                    self.render(m, where)
                raise
            return [(list(ids), list(mask)) for ids, mask in zip(enc["input_ids"], enc["assistant_masks"])]
        rendered = [self.spans(m, where) for where, m in convs]
        enc = self.tok([t for t, _ in rendered], add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        return [
            (list(ids), span_mask(offsets, spans))
            for ids, offsets, (_, spans) in zip(enc["input_ids"], enc["offset_mapping"], rendered)
        ]


def span_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for each token whose character range overlaps a span (transformers' rule for
    `return_assistant_tokens_mask`: the token holding a span's first character through the one
    holding its last)."""
    import numpy as np

    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(off), dtype=bool)
    for s, e in spans:
        mask |= (off[:, 0] < e) & (off[:, 1] > s)
    return mask.astype(np.uint8).tolist()
