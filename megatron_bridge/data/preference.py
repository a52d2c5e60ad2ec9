"""Preference pairs for DPO (`mbr data mode=preference`): rows of a prompt and a chosen and a
rejected completion → two aligned chat datasets plus a manifest.

    PREFIX.chosen.*         a text chat dataset (format megatron_bridge.chat/1): row i is pair i's
    PREFIX.rejected.*       prompt + chosen (resp. rejected) tokens, loss mask 1 on the completion only
    PREFIX.preference.json  format megatron_bridge.preference/1: the pair count, the tokenizer (its
                            fingerprint), truncation counts, and the build ids of the two halves

Two ordinary chat datasets rather than a new container, so each half is read (and checked against
the model) like any chat data; the manifest ties them together: a reader refuses halves from
different builds. Rows are tokenized as TRL's DPOTrainer does (data/preference_rows.py).

`max_length` follows TRL's defaults: with `truncation="keep_start"` a row longer than max_length
keeps its first max_length tokens (prompt first, the completion cut), and a pair whose prompt
alone fills max_length (a completion cut to nothing) is dropped; with `"drop"` a pair whose
longer row exceeds max_length is left out. Everything is written under temporary names and
renamed at the end (the manifest last): a refused row anywhere leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from megatron_bridge.data._fs import atomic_file, new_parent, refuse_existing, remove
from megatron_bridge.data.chat import chat_input_files, chat_paths, resolve_template
from megatron_bridge.data.chat_dataset import ChatDataset
from megatron_bridge.data.chat_writer import ChatWriter
from megatron_bridge.data.indexed import check_indexed_data
from megatron_bridge.data.preference_rows import EXAMPLE, TEXT_KEYS, TOKEN_KEYS, PairEncoder
from megatron_bridge.data.preprocess import check_output_prefix
from megatron_bridge.data.token_rows import first_record, iter_records, vocab_of
from megatron_bridge.data.tokenizer import NO_EOS, TOKENIZER_FILES
from megatron_bridge.errors import UserError

PathLike = str | os.PathLike
PREFERENCE_FORMAT = "megatron_bridge.preference/1"
MANIFEST_SUFFIX = ".preference.json"
HALVES = ("chosen", "rejected")
TRUNCATION = ("keep_start", "drop")


def preference_paths(prefix: PathLike) -> dict[str, str]:
    """The manifest and the two halves' prefixes of the preference dataset `prefix`."""
    p = str(prefix)
    return {"manifest": p + MANIFEST_SUFFIX, **{h: f"{p}.{h}" for h in HALVES}}


def tokenizer_fingerprint(tok_dir: Path, template: str | None) -> str:
    """sha256 over the tokenizer directory's tokenizer files and the chat template used."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            h.update(name.encode() + b"\0" + (tok_dir / name).read_bytes())
    h.update(b"\0template\0" + (template or "").encode())
    return h.hexdigest()


@dataclass
class PreferenceStats:
    prefix: str
    pairs: int  # written
    tokens: int  # both halves
    loss_tokens: int  # completion tokens, both halves
    truncated: int  # pairs with a row cut to max_length
    dropped: int  # pairs left out: longer than max_length (truncation=drop) or a completion cut to nothing
    vocab_size: int
    eos_id: int  # NO_EOS (-1) for token-id rows made without a tokenizer
    form: str  # strings | conversations | token ids (the first row's)
    tokenizer: str | None
    tokenizer_sha256: str | None
    chat_template: str | None  # where the template came from (conversations)
    max_length: int | None
    truncation: str
    seconds: float

    def describe(self) -> str:
        lines = [
            f"{self.prefix}.{{chosen,rejected}}: {self.pairs} pairs ({self.form}), {self.tokens} tokens, "
            f"{self.loss_tokens} of them completion tokens (vocab {self.vocab_size})"
        ]
        if self.max_length is not None:
            lines.append(
                f"max_length={self.max_length} (truncation={self.truncation}): "
                f"truncated {self.truncated} pairs, dropped {self.dropped}"
            )
        return "\n".join(lines)


def preprocess_preference(
    inputs: PathLike | Sequence[PathLike],
    output_prefix: PathLike,
    tokenizer: PathLike | None = None,
    *,
    vocab_size: int | None = None,
    chat_template: PathLike | None = None,
    max_length: int | None = None,
    truncation: str = "keep_start",
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
) -> PreferenceStats:
    """Tokenize the preference rows of `inputs` (jsonl/parquet/arrow files, directories of them,
    or a save_to_disk directory) into the preference dataset `output_prefix` (module docstring).
    Text rows need `tokenizer`; pre-tokenized rows take `tokenizer` or `vocab_size` (the range
    their ids must lie in)."""
    prefix = check_output_prefix(output_prefix, overwrite)
    paths = preference_paths(prefix)
    refuse_existing(
        [paths["manifest"], *(f for h in HALVES for f in chat_paths(paths[h]).values())],
        overwrite,
        "preference dataset",
    )
    files = chat_input_files(inputs)
    if truncation not in TRUNCATION:
        raise UserError(f"truncation={truncation!r}: expected {' or '.join(TRUNCATION)} (what to do past max_length)")
    if max_length is not None and int(max_length) <= 0:
        raise UserError(f"max_length={max_length} must be a positive number of tokens (or unset: no limit)")
    if chat_template and not Path(chat_template).expanduser().is_file():
        raise UserError(f"chat_template={chat_template} does not exist (it takes a file holding a Jinja chat template)")
    first = first_record(files, TEXT_KEYS + TOKEN_KEYS, EXAMPLE)
    form = (
        "token ids"
        if any(k in first for k in TOKEN_KEYS)
        else "conversations"
        if isinstance(first.get("chosen"), list)
        else "strings"
    )
    if form != "token ids" and not tokenizer:
        raise UserError(
            f"{files[0]}: preference rows of {form} need tokenizer=DIR (a local Hugging Face tokenizer"
            f"{' with a chat template, or chat_template=FILE' if form == 'conversations' else ''})"
        )
    vocab, tok, tok_dir = vocab_of(tokenizer, vocab_size, "preference rows")
    template = source = None
    if form == "conversations":
        template, source = resolve_template(tok, str(tok_dir), chat_template)
    encoder = PairEncoder(tok, vocab, template, source or "")
    with new_parent(prefix):
        return _write(encoder, files, paths, tok_dir, form, source, max_length, truncation, log)


def _write(encoder, files, paths, tok_dir, form, source, max_length, truncation, log) -> PreferenceStats:
    t0 = time.time()
    writers: list[Any] = []
    published: list[Any] = []
    c = {"truncated": 0, "dropped": 0}
    try:
        writers = [ChatWriter(paths[h], encoder.vocab) for h in HALVES]
        for where, rec in iter_records(
            files, TEXT_KEYS + TOKEN_KEYS, '{"prompt": ..., "chosen": ..., "rejected": ...}'
        ):
            pair = encoder.encode(rec, where)
            rows = [(pair.prompt + comp, [0] * len(pair.prompt) + [1] * len(comp)) for comp in pair[1:]]
            if max_length is not None and max(len(ids) for ids, _ in rows) > max_length:
                if truncation == "drop" or len(pair.prompt) >= max_length:
                    c["dropped"] += 1
                    continue
                rows = [(ids[:max_length], mask[:max_length]) for ids, mask in rows]
                c["truncated"] += 1
            for w, (ids, mask) in zip(writers, rows):
                w.add(ids, mask)
            if log and writers[0].rows % 100_000 == 0:
                log(f"  {writers[0].rows} pairs")
        n = writers[0].rows
        if n == 0:
            raise UserError(
                f"no preference pair to train on in {', '.join(map(str, files))}: {c['dropped']} dropped "
                f"(longer than max_length={max_length})"
            )
        tok = encoder.tok
        eos = None if tok is None else int(tok.eos_token_id)
        tok_name = None if tok_dir is None else str(tok_dir.absolute())
        stats = PreferenceStats(
            prefix=str(paths["manifest"][: -len(MANIFEST_SUFFIX)]),
            pairs=n,
            tokens=sum(w.tokens for w in writers),
            loss_tokens=sum(w.loss_tokens for w in writers),
            truncated=c["truncated"],
            dropped=c["dropped"],
            vocab_size=encoder.vocab,
            eos_id=NO_EOS if eos is None else eos,
            form=form,
            tokenizer=tok_name,
            tokenizer_sha256=None if tok_dir is None else tokenizer_fingerprint(tok_dir, encoder.template),
            chat_template=source,
            max_length=max_length,
            truncation=truncation,
            seconds=time.time() - t0,
        )
        manifest = {
            "format": PREFERENCE_FORMAT,
            **{k: v for k, v in asdict(stats).items() if k != "prefix"},
            "halves": {h: {"suffix": f".{h}", "build_id": w.build_id} for h, w in zip(HALVES, writers)},
            "files": [str(f) for f in files],
        }
        for h, w in zip(HALVES, writers):
            published.append(w)
            w.publish(w.meta(tokenizer=tok_name, eos_id=eos, preference={"half": h, "manifest": paths["manifest"]}))
        with atomic_file(paths["manifest"], encoding="utf-8") as f:
            json.dump(manifest, f, indent=2)
    except BaseException:
        for w in writers:
            w.discard()
        for w in published:  # a half renamed before the failure: no dataset without its manifest
            for p in w.paths.values():
                remove(p)
        raise
    return stats


def read_manifest(prefix: PathLike) -> dict[str, Any]:
    """The manifest of the preference dataset `prefix`, checked to be one."""
    path = preference_paths(prefix)["manifest"]
    if not os.path.isfile(path):
        raise UserError(
            f"{prefix} is not a preference dataset: {path} is missing (make it with `mbr data mode=preference "
            f"input=FILE.jsonl output={prefix} tokenizer=DIR`)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != PREFERENCE_FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise UserError(
            f"{path} says format {got!r}, not {PREFERENCE_FORMAT}: re-make it with `mbr data mode=preference`"
        )
    return manifest


class PreferencePairs:
    """Random access to a preference dataset: `pairs[i]` is ((chosen tokens, mask), (rejected
    tokens, mask)), numpy arrays as `ChatDataset` gives them; `pairs.chosen`/`pairs.rejected` are
    the halves. The halves must be the ones the manifest names (same build, same pair count)."""

    def __init__(self, prefix: PathLike):
        self.prefix = str(prefix)
        self.manifest = read_manifest(self.prefix)
        paths = preference_paths(self.prefix)
        self.chosen, self.rejected = (ChatDataset(paths[h]) for h in HALVES)
        for h, ds in zip(HALVES, (self.chosen, self.rejected)):
            want = self.manifest["halves"][h]["build_id"]
            if ds.meta.get("build_id") != want or len(ds) != self.manifest["pairs"]:
                raise UserError(
                    f"{paths[h]} is not the {h} half {paths['manifest']} names (another build, or files mixed from "
                    "two runs): re-make the dataset with `mbr data mode=preference ... overwrite=true`"
                )

    def __len__(self) -> int:
        return len(self.chosen)

    def __getitem__(self, i: int):
        return self.chosen[i], self.rejected[i]


def check_preference_data(data, model_vocab_size: int | None = None) -> tuple[str, int | None, int | None]:
    """Validate `data` (kind=preference) without building anything: one prefix whose manifest
    and halves exist, the halves checked as chat data (vocab against the tokenizer and the model,
    every weighted split non-empty; data/indexed.py). Returns (prefix, vocab_size, eod)."""
    if len(list(data.paths)) != 1:
        raise UserError(
            f"data=preference takes one preference dataset, data.paths=[PREFIX] (got {list(data.paths)}): made by "
            "`mbr data mode=preference input=FILE.jsonl output=PREFIX tokenizer=DIR`"
        )
    prefix = str(data.paths[0])
    read_manifest(prefix)
    halves = preference_paths(prefix)
    _, _, vocab, eod = check_indexed_data(
        replace(data, kind="sft", paths=[halves[h] for h in HALVES]), model_vocab_size
    )
    return prefix, vocab, eod


__all__ = [
    "MANIFEST_SUFFIX",
    "PREFERENCE_FORMAT",
    "PreferencePairs",
    "PreferenceStats",
    "check_preference_data",
    "preference_paths",
    "preprocess_preference",
    "read_manifest",
]
