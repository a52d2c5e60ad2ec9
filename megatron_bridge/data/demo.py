"""A complete local dataset from nothing but this machine: stdlib corpus → BPE tokenizer →
indexed dataset, in one directory (what `mbr data demo=true` runs; tests use it small)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from megatron_bridge.data._fs import atomic_dir, refuse_existing
from megatron_bridge.errors import UserError

DEMO_PREFIX = "stdlib_text_document"


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
    from megatron_bridge.data.corpus import build_stdlib_corpus, train_tokenizer
    from megatron_bridge.data.preprocess import preprocess

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
