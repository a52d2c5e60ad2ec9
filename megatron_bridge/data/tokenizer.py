"""Load a local Hugging Face tokenizer directory, and check it against a model's vocabulary.

Only local directories are accepted (nothing is downloaded). Every problem a user can cause
(missing directory, no tokenizer files, no end-of-document token, a tokenizer larger than the
model's embedding table) is a `UserError` raised before any heavy work.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from megatron_bridge.errors import UserError

NO_EOS = -1  # the meta eos_id of data made without a tokenizer (pre-tokenized rows with vocab_size=)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# tokenizer_config.json alone holds settings, not a vocabulary: one of these must sit beside it
VOCAB_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def validate_tokenizer_dir(path: str | os.PathLike | None, what: str = "tokenizer") -> Path:
    """The tokenizer directory as a Path, or a UserError saying what is wrong with it."""
    if path is None or str(path) == "":
        raise UserError(
            f"no {what} given: pass a local Hugging Face tokenizer directory (tokenizer=DIR or "
            "data.tokenizer=DIR), e.g. the one `mbr data demo=true output_dir=DIR` writes to DIR/tokenizer."
        )
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(
            f"{what} directory {p} does not exist (only local directories are supported; nothing is downloaded)"
        )
    if not p.is_dir():
        raise UserError(
            f"{what} {p} is a file; expected a Hugging Face tokenizer directory "
            f"(holding {' or '.join(TOKENIZER_FILES[:2])})"
        )
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(f"{what} directory {p} holds no tokenizer files (looked for {', '.join(TOKENIZER_FILES)})")
    if not any((p / f).is_file() for f in VOCAB_FILES):
        raise UserError(
            f"{what} directory {p} holds tokenizer_config.json but no vocabulary (looked for "
            f"{', '.join(VOCAB_FILES)}): the settings alone cannot tokenize. Copy the tokenizer's other files "
            "(e.g. tokenizer.json) from the model's Hugging Face directory into it."
        )
    return p


def load_tokenizer(path: str | os.PathLike | None) -> Any:
    """`transformers.AutoTokenizer.from_pretrained(path)` for a local directory, requiring an
    end-of-sequence token (it separates documents in the indexed dataset)."""
    p = validate_tokenizer_dir(path)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise UserError(f"cannot load the tokenizer in {p}: {e}") from e
    if tok.eos_token_id is None:
        raise UserError(
            f"the tokenizer in {p} has no eos_token: documents are separated by it in the indexed "
            "dataset. Set eos_token in its tokenizer_config.json."
        )
    return tok


def tokenizer_vocab_size(tokenizer: Any) -> int:
    """Number of token ids the tokenizer can emit (base vocab + added tokens)."""
    if isinstance(tokenizer, int):
        return tokenizer
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    return len(tokenizer)


def _describe(tokenizer: Any) -> str:
    if isinstance(tokenizer, (str, os.PathLike)):
        return f"the tokenizer in {tokenizer}"
    name = getattr(tokenizer, "name_or_path", None)
    return f"the tokenizer {name}" if name else "the tokenizer"


def check_vocab(tokenizer: Any, model_vocab_size: int) -> int:
    """Refuse a tokenizer whose ids do not fit the model's embedding table.

    `tokenizer` is a directory, a loaded HF tokenizer, or a vocab size. Returns the
    tokenizer's vocab size. Raises `UserError` when it exceeds `model_vocab_size` (token ids
    ≥ the model's vocab would index past the embedding table; megatron-core would fail deep
    inside the first forward, or silently train on padding rows)."""
    n = tokenizer_vocab_size(tokenizer)
    if n > model_vocab_size:
        raise UserError(
            f"{_describe(tokenizer)} has {n} tokens (ids 0..{n - 1}) but the model's vocab_size is "
            f"{model_vocab_size}: ids ≥ {model_vocab_size} would index past the embedding table. "
            f"Use a tokenizer with at most {model_vocab_size} tokens, or set model.vocab_size={n} "
            "(or larger)."
        )
    return n
