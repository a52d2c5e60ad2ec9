"""Rows that are already token ids: reading records of any input format, checking id lists, and
`mbr data mode=chat` on pre-tokenized rows.

A pre-tokenized chat row is `{"input_ids": [...], "labels": [...]}` in Hugging Face's convention:
`labels` is aligned with `input_ids` (the model shifts), -100 where there is no loss, else equal
to the id at that position. It is stored exactly as given, with loss mask `labels != -100`, as a
text chat dataset (data/chat_writer.py) that `data=sft` trains on. No tokenizer is needed: the
vocabulary the ids must fit is the tokenizer's when one is given, else `vocab_size=` (then the
data records no eos id, data/tokenizer.py NO_EOS).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from megatron_bridge.data._fs import new_parent, refuse_existing
from megatron_bridge.data.chat import OVERLONG, chat_input_files, chat_paths
from megatron_bridge.data.chat_dataset import ChatStats
from megatron_bridge.data.chat_writer import ChatWriter
from megatron_bridge.data.columnar import COLUMNAR_SUFFIXES, iter_rows
from megatron_bridge.data.corpus import iter_jsonl
from megatron_bridge.data.preprocess import check_output_prefix
from megatron_bridge.data.tokenizer import NO_EOS, load_tokenizer, validate_tokenizer_dir
from megatron_bridge.errors import UserError

PathLike = str | os.PathLike
IGNORE_INDEX = -100  # Hugging Face's "no loss here" label
TOKEN_CHAT_KEYS = ("input_ids", "labels")
TOKEN_CHAT_EXAMPLE = '{"input_ids": [1, 22, 333, 2], "labels": [-100, -100, 333, 2]}'


def iter_records(files: Sequence[Path], keys: tuple[str, ...], example: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """("file:line" / "file:row N", record) per row of jsonl or columnar `files`: the jsonl
    line's object (refused when not an object), or the row's `keys` columns that the file has."""
    for f in files:
        if f.suffix in COLUMNAR_SUFFIXES:
            yield from iter_rows(f, None, keys)
            continue
        for lineno, obj in iter_jsonl(f, example):
            where = f"{f}:{lineno}"
            if not isinstance(obj, dict):
                raise UserError(f"{where}: expected a JSON object per line, e.g. {example}")
            yield where, obj


def first_record(files: Sequence[Path], keys: tuple[str, ...], example: str) -> dict[str, Any]:
    """The first row of `files` (an empty dict when there is none): what decides their form."""
    return next((rec for _, rec in iter_records(files, keys, example)), {})


def vocab_of(tokenizer: PathLike | None, vocab_size: int | None, what: str) -> tuple[int, Any, Path | None]:
    """(vocab, loaded tokenizer or None, its directory) for rows of token ids: the tokenizer's
    size, else `vocab_size=`; both, or neither, is refused (the ids' range is one fact)."""
    if tokenizer and vocab_size is not None:
        raise UserError(
            f"{what}: pass tokenizer=DIR or vocab_size=N, not both (with a tokenizer the ids must fit its own size)"
        )
    if tokenizer:
        tok_dir = validate_tokenizer_dir(tokenizer)
        tok = load_tokenizer(tok_dir)
        return len(tok), tok, tok_dir
    if vocab_size is None or int(vocab_size) <= 0:
        raise UserError(
            f"{what} are token ids: pass tokenizer=DIR (the tokenizer that made them) or vocab_size=N (the number "
            "of token ids, every id in [0, N)) so they can be checked against the model's vocabulary"
        )
    return int(vocab_size), None, None


def check_ids(value: Any, where: str, key: str, vocab: int, allow_empty: bool = False) -> list[int]:
    """`value` as a list of token ids in [0, vocab), or a UserError naming `where` and `key`."""
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise UserError(f"{where}: {key!r} must be a list of integer token ids (got {str(value)[:60]})")
    if not value and not allow_empty:
        raise UserError(f"{where}: {key!r} is empty; give it at least one token id, or leave the row out")
    bad = next((v for v in value if not 0 <= v < vocab), None)
    if bad is not None:
        raise UserError(
            f"{where}: {key!r} holds token id {bad}, outside [0, {vocab}) (the vocabulary of the tokenizer or "
            "vocab_size=): the ids were made with another tokenizer; use that one, or a larger vocab_size="
        )
    return value


def token_chat_row(rec: dict[str, Any], where: str, vocab: int) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of one pre-tokenized chat row, checked (module docstring)."""
    missing = [k for k in TOKEN_CHAT_KEYS if k not in rec]
    if missing:
        raise UserError(
            f"{where}: no {' or '.join(map(repr, missing))} (found: {', '.join(map(repr, rec))}); pre-tokenized chat "
            f"rows hold both, e.g. {TOKEN_CHAT_EXAMPLE}"
        )
    ids = check_ids(rec["input_ids"], where, "input_ids", vocab)
    labels = rec["labels"]
    if not isinstance(labels, list) or len(labels) != len(ids):
        n = len(labels) if isinstance(labels, list) else type(labels).__name__
        raise UserError(
            f"{where}: 'labels' has {n} entries and 'input_ids' {len(ids)}: labels are aligned with input_ids "
            f"(one per token, {IGNORE_INDEX} where there is no loss; the model shifts them)"
        )
    for i, (t, lab) in enumerate(zip(ids, labels)):
        if lab != IGNORE_INDEX and lab != t:
            raise UserError(
                f"{where}: labels[{i}] = {lab!r} is neither {IGNORE_INDEX} nor input_ids[{i}] = {t}: labels here are "
                f"input_ids with {IGNORE_INDEX} where there is no loss (not shifted); fix the row's labels"
            )
    return ids, [int(lab != IGNORE_INDEX) for lab in labels]


def is_token_chat(inputs: PathLike | Sequence[PathLike]) -> bool:
    """Whether chat inputs hold pre-tokenized rows (their first row has `input_ids`)."""
    return "input_ids" in first_record(chat_input_files(inputs), TOKEN_CHAT_KEYS, TOKEN_CHAT_EXAMPLE)


def preprocess_token_chat(
    inputs: PathLike | Sequence[PathLike],
    output_prefix: PathLike,
    tokenizer: PathLike | None = None,
    *,
    vocab_size: int | None = None,
    max_length: int | None = None,
    overlong: str = "truncate",
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
) -> ChatStats:
    """Pre-tokenized chat rows of `inputs` → the chat dataset `output_prefix`, rows as given (longer
    than `max_length`: cut to it, or dropped with `overlong="drop"`; a row left without a loss
    token is dropped). Nothing is written when any row is refused."""
    prefix = check_output_prefix(output_prefix, overwrite)
    paths = chat_paths(prefix)
    refuse_existing([paths["mask_bin"], paths["mask_idx"]], overwrite, "loss-mask dataset")
    files = chat_input_files(inputs)
    if overlong not in OVERLONG:
        raise UserError(f"overlong={overlong!r}: expected {' or '.join(OVERLONG)} (what to do past max_length)")
    if max_length is not None and int(max_length) <= 0:
        raise UserError(f"max_length={max_length} must be a positive number of tokens (or unset: no limit)")
    vocab, tok, tok_dir = vocab_of(tokenizer, vocab_size, "pre-tokenized chat rows")
    t0 = time.time()
    c = dict.fromkeys(("no_loss", "truncated", "dropped"), 0)
    with new_parent(prefix):
        writer = ChatWriter(prefix, vocab)
        try:
            for where, rec in iter_records(files, TOKEN_CHAT_KEYS, TOKEN_CHAT_EXAMPLE):
                ids, mask = token_chat_row(rec, where, vocab)
                if max_length is not None and len(ids) > max_length:
                    if overlong == "drop":
                        c["dropped"] += 1
                        continue
                    ids, mask = ids[:max_length], mask[:max_length]
                    c["truncated"] += 1
                if not any(mask):
                    c["no_loss"] += 1
                    continue
                writer.add(ids, mask)
            if writer.rows == 0:
                raise UserError(
                    f"no row to train on in {', '.join(map(str, files))}: {c['no_loss']} without a label, "
                    f"{c['dropped']} longer than max_length={max_length}"
                )
            eos = None if tok is None else int(tok.eos_token_id)
            tok_name = None if tok_dir is None else str(tok_dir.absolute())
            stats = ChatStats(
                prefix=str(prefix),
                conversations=writer.rows,
                tokens=writer.tokens,
                loss_tokens=writer.loss_tokens,
                skipped_empty=0,
                skipped_no_assistant=c["no_loss"],
                truncated=c["truncated"],
                dropped_overlong=c["dropped"],
                dtype="",
                vocab_size=vocab,
                eos_id=NO_EOS if eos is None else eos,
                max_token_id=writer.max_id,
                mask_method="labels",
                chat_template="none (pre-tokenized rows)",
                max_length=max_length,
                overlong=overlong,
                seconds=time.time() - t0,
            )
            meta = writer.meta(tokenizer=tok_name, eos_id=eos, files=[str(f) for f in files], **_extra(stats))
            stats.dtype = meta["dtype"]
            writer.publish(meta)
        except BaseException:
            writer.discard()
            raise
    return stats


def _extra(stats: ChatStats) -> dict[str, Any]:
    keep = ("skipped_no_assistant", "truncated", "dropped_overlong", "mask_method", "chat_template", "max_length")
    return {k: getattr(stats, k) for k in keep} | {"overlong": stats.overlong}
