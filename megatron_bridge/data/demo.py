"""A complete local dataset from nothing but this machine: stdlib corpus → BPE tokenizer →
indexed dataset, in one directory (what `mbr data demo=true` runs; tests use it small); and its
chat counterpart, questions and answers from the stdlib's docstrings → chat dataset
(`mbr data mode=chat demo=true`), with the same tokenizer so a model pre-trained on the first
can be fine-tuned on the second."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatron_bridge.data._fs import atomic_dir, refuse_existing
from megatron_bridge.data.chat_dataset import preprocess_chat
from megatron_bridge.data.corpus import build_docstring_chat_corpus, build_stdlib_corpus, train_tokenizer
from megatron_bridge.data.preprocess import preprocess
from megatron_bridge.data.tokenizer import validate_tokenizer_dir
from megatron_bridge.errors import UserError

DEMO_PREFIX = "stdlib_text_document"
CHAT_DEMO_PREFIX = "stdlib_chat"


@dataclass
class DemoData:
    dir: Path
    corpus: Path  # DIR/corpus.jsonl
    tokenizer: Path  # DIR/tokenizer (HF tokenizer directory)
    prefix: Path  # DIR/stdlib_text_document (.bin/.idx/.meta.json)
    documents: int
    tokens: int
    vocab_size: int

    def overrides(self) -> str:
        """The CLI overrides that train on this dataset."""
        return f"data=indexed data.paths=[{self.prefix}] data.tokenizer={self.tokenizer}"


def build_demo(
    out_dir: str | os.PathLike,
    vocab_size: int = 512,
    max_bytes: int = 4_000_000,
    *,
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
) -> DemoData:
    """Build DIR/{corpus.jsonl, tokenizer/, stdlib_text_document.*} atomically (the directory
    appears complete or not at all; an existing one is replaced only with overwrite)."""

    out = Path(out_dir).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise UserError(f"output_dir={out} is a file")
    refuse_existing([out], overwrite, "output_dir")
    if max_bytes <= 0:
        raise UserError(f"max_bytes={max_bytes} must be positive")
    log = log or (lambda s: None)
    t0 = time.time()
    with atomic_dir(out, overwrite=overwrite) as tmp:
        corpus = build_stdlib_corpus(tmp / "corpus.jsonl", max_bytes=max_bytes)
        log(
            f"corpus: {corpus.documents} files of the Python standard library ({corpus.root}), "
            f"{corpus.bytes / 1e6:.2f} MB"
        )
        train_tokenizer(corpus.path, tmp / "tokenizer", vocab_size)
        log(f"tokenizer: byte-level BPE, {vocab_size} tokens ({time.time() - t0:.1f}s)")
        stats = preprocess(
            corpus.path,
            tmp / DEMO_PREFIX,
            tmp / "tokenizer",
            append_eos=True,
            meta_extra={"tokenizer": str(out / "tokenizer"), "files": [str(out / "corpus.jsonl")]},
        )
        log(f"dataset: {stats.documents} documents, {stats.tokens} tokens ({stats.dtype})")
    log(f"wrote {out} in {time.time() - t0:.1f}s")
    return DemoData(
        out, out / "corpus.jsonl", out / "tokenizer", out / DEMO_PREFIX, stats.documents, stats.tokens, stats.vocab_size
    )


@dataclass
class ChatDemoData:
    dir: Path
    corpus: Path  # DIR/chat.jsonl
    tokenizer: Path  # DIR/tokenizer, or the tokenizer= given
    prefix: Path  # DIR/stdlib_chat (.bin/.idx, .loss_mask.bin/.idx, .meta.json)
    conversations: int
    tokens: int
    loss_tokens: int


def build_chat_demo(
    out_dir: str | os.PathLike,
    vocab_size: int = 512,
    max_bytes: int = 4_000_000,
    *,
    max_examples: int = 2000,
    tokenizer: str | os.PathLike | None = None,
    max_length: int | None = None,
    overlong: str = "truncate",
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
) -> ChatDemoData:
    """Build DIR/{chat.jsonl, tokenizer/, stdlib_chat.*} atomically. Without `tokenizer` the
    demo tokenizer is trained exactly as `build_demo(vocab_size, max_bytes)` trains it (same
    corpus, same result); with one, DIR has no tokenizer/ and the dataset uses the given one."""

    out = Path(out_dir).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise UserError(f"output_dir={out} is a file")
    refuse_existing([out], overwrite, "output_dir")
    if max_bytes <= 0 or max_examples <= 0:
        raise UserError(f"max_bytes={max_bytes} and max_examples={max_examples} must be positive")
    given = validate_tokenizer_dir(tokenizer).absolute() if tokenizer else None
    log = log or (lambda s: None)
    t0 = time.time()
    with atomic_dir(out, overwrite=overwrite) as tmp:
        n = build_docstring_chat_corpus(tmp / "chat.jsonl", max_examples)
        log(f"corpus: {n} questions on the Python standard library's documented functions")
        if given is None:
            src = build_stdlib_corpus(tmp / "tokenizer_corpus.jsonl", max_bytes=max_bytes)
            train_tokenizer(src.path, tmp / "tokenizer", vocab_size)
            src.path.unlink()
            log(f"tokenizer: byte-level BPE, {vocab_size} tokens, ChatML template ({time.time() - t0:.1f}s)")
        tok = given or out / "tokenizer"
        stats = preprocess_chat(
            tmp / "chat.jsonl",
            tmp / CHAT_DEMO_PREFIX,
            given or tmp / "tokenizer",
            max_length=max_length,
            overlong=overlong,
            meta_extra={
                "tokenizer": str(tok),
                "files": [str(out / "chat.jsonl")],
                "chat_template": f"the tokenizer in {tok}",
            },
        )
        log(stats.describe().replace(str(tmp), str(out)))
    log(f"wrote {out} in {time.time() - t0:.1f}s")
    return ChatDemoData(
        out, out / "chat.jsonl", tok, out / CHAT_DEMO_PREFIX, stats.conversations, stats.tokens, stats.loss_tokens
    )
