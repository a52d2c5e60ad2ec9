"""jsonl/txt → token ids (HF tokenizer, eos appended per document) → megatron-core `.bin`/`.idx`.

Documents are streamed in batches (the corpus is never held in RAM; megatron-core's
`IndexedDatasetBuilder` keeps one int per document). Token ids are stored as uint16 when the
tokenizer has fewer than 65500 tokens (megatron's `DType.optimal_dtype`), else int32. Next
to `PREFIX.bin`/`PREFIX.idx` goes `PREFIX.meta.json` (tokenizer, vocab size, eos id, largest
id, counts, a build id), which the loader uses to check the data against the model and
tokenizer without loading either.

All three files are written under temporary names and renamed at the end (`.idx` last: a
dataset "exists" for megatron-core once `.bin` and `.idx` do), so a failure leaves nothing
under the output prefix. Every input problem is a `UserError` raised before the tokenizer or
megatron-core is even imported.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from megatron_bridge.data._fs import ensure_parent, refuse_existing, remove, temp_path_for
from megatron_bridge.data.corpus import input_files, iter_documents
from megatron_bridge.data.helpers import quiet_megatron_import
from megatron_bridge.data.tokenizer import load_tokenizer, validate_tokenizer_dir
from megatron_bridge.errors import UserError

PathLike = str | os.PathLike
META_SUFFIX = ".meta.json"
META_FORMAT = "megatron_bridge.indexed/1"


@dataclass
class PreprocessStats:
    prefix: str
    documents: int
    tokens: int
    skipped_empty: int
    dtype: str
    vocab_size: int
    eos_id: int
    max_token_id: int
    seconds: float
    files: list[str] = field(default_factory=list)

    def describe(self) -> str:
        rate = self.tokens / self.seconds if self.seconds > 0 else float("inf")
        skipped = f", {self.skipped_empty} empty skipped" if self.skipped_empty else ""
        return (
            f"{self.prefix}.{{bin,idx}}: {self.documents} documents{skipped}, {self.tokens} tokens "
            f"({self.dtype}, vocab {self.vocab_size}, eos {self.eos_id}) in {self.seconds:.1f}s "
            f"({rate:,.0f} tokens/s)"
        )


def output_paths(prefix: PathLike) -> dict[str, str]:
    p = str(prefix)
    return {"bin": p + ".bin", "idx": p + ".idx", "meta": p + META_SUFFIX}


def read_meta(prefix: PathLike) -> dict[str, Any] | None:
    """The `PREFIX.meta.json` written by `preprocess`, or None (e.g. data made by Megatron-LM's
    own preprocessing tool)."""
    path = output_paths(prefix)["meta"]
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path}: {e}") from e
    return meta if isinstance(meta, dict) else None


def check_output_prefix(prefix: PathLike | None, overwrite: bool) -> Path:
    """Validate the output prefix (a path without .bin/.idx); UserError when it is a directory
    or its files exist (unless overwrite)."""
    if prefix is None or str(prefix) == "":
        raise UserError("no output given: pass output=PREFIX (writes PREFIX.bin and PREFIX.idx)")
    p = Path(prefix).expanduser()
    if p.suffix in (".bin", ".idx"):
        raise UserError(
            f"output={p} should be a prefix without the extension: output={p.with_suffix('')} "
            f"writes {p.with_suffix('')}.bin and {p.with_suffix('')}.idx"
        )
    if p.is_dir() or str(prefix).endswith(os.sep):
        raise UserError(f"output={p} is a directory; pass a file prefix inside it, e.g. output={p / 'text_document'}")
    refuse_existing(list(output_paths(p).values()), overwrite, "indexed dataset")
    return p


def preprocess(
    inputs: PathLike | Sequence[PathLike],
    output_prefix: PathLike | None,
    tokenizer: PathLike | None,
    *,
    text_key: str = "text",
    txt_mode: str = "file",
    append_eos: bool = True,
    overwrite: bool = False,
    batch_size: int = 256,
    parse_special_tokens: bool = False,
    meta_extra: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
) -> PreprocessStats:
    """Tokenize `inputs` (jsonl/txt files or directories) with the HF tokenizer directory
    `tokenizer` into the megatron-core indexed dataset `output_prefix`.{bin,idx}. One
    document per jsonl line / txt file (txt_mode=line: per non-empty line); empty documents
    are skipped; `append_eos` adds the tokenizer's eos after each document. Special-token
    strings inside the text (a literal "</s>") are encoded as plain text unless
    `parse_special_tokens` (so only `append_eos` puts eos ids in the data).
    `meta_extra` overrides keys of the metadata (e.g. final paths, for outputs built in a
    temporary directory that is renamed afterwards)."""
    t0 = time.time()
    # -- validate everything cheap first -------------------------------------------------------
    prefix = check_output_prefix(output_prefix, overwrite)
    files = input_files(inputs)
    tok_dir = validate_tokenizer_dir(tokenizer)
    if txt_mode not in ("file", "line"):
        raise UserError(f"txt_mode={txt_mode!r}: expected 'file' or 'line'")
    ensure_parent(prefix)

    tok = load_tokenizer(tok_dir)
    vocab = len(tok)
    eos = int(tok.eos_token_id)

    import numpy as np

    quiet_megatron_import()
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    dtype = DType.optimal_dtype(vocab)
    t0 = time.time()  # throughput counts tokenizing + writing, not imports
    encode = _encoder(tok, parse_special_tokens)
    final = output_paths(prefix)
    tmp = {k: temp_path_for(v) for k, v in final.items()}
    n_docs = n_tokens = n_empty = 0
    max_id = -1
    builder = None
    try:
        builder = IndexedDatasetBuilder(tmp["bin"], dtype=dtype)

        def flush(batch: list[str]) -> None:
            nonlocal n_docs, n_tokens, max_id
            for ids in encode(batch):
                if append_eos:
                    ids.append(eos)
                if not ids:
                    continue
                arr = np.asarray(ids, dtype=np.int64)
                max_id = max(max_id, int(arr.max()))
                builder.add_document(arr, [arr.size])
                n_docs += 1
                n_tokens += arr.size

        batch: list[str] = []
        for text in iter_documents(files, text_key=text_key, txt_mode=txt_mode):
            if not text.strip():
                n_empty += 1
                continue
            batch.append(text)
            if len(batch) >= batch_size:
                flush(batch)
                batch = []
                if log and n_docs % (batch_size * 64) == 0:
                    log(f"  {n_docs} documents, {n_tokens} tokens")
        if batch:
            flush(batch)
        if n_docs == 0:
            raise UserError(
                f"no documents in {', '.join(map(str, files))} (all empty"
                f"{'' if txt_mode == 'line' else f' or without a {text_key!r} text'})"
            )
        if max_id >= vocab:
            raise UserError(f"the tokenizer in {tok_dir} produced id {max_id} ≥ its own size {vocab}")
        builder.finalize(tmp["idx"])
        stats = PreprocessStats(
            prefix=str(prefix),
            documents=n_docs,
            tokens=n_tokens,
            skipped_empty=n_empty,
            dtype=np.dtype(dtype).name,
            vocab_size=vocab,
            eos_id=eos,
            max_token_id=max_id,
            seconds=time.time() - t0,
            files=[str(f) for f in files],
        )
        meta = {
            "format": META_FORMAT,
            "build_id": uuid.uuid4().hex,
            "tokenizer": str(tok_dir.absolute()),
            "text_key": text_key,
            "append_eos": append_eos,
            **asdict(stats),
            **(meta_extra or {}),
        }
        meta.pop("prefix", None)
        with open(tmp["meta"], "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
        for k in ("bin", "meta", "idx"):
            os.replace(tmp[k], final[k])
    except BaseException:
        if builder is not None and not builder.data_file.closed:
            builder.data_file.close()
        for p in tmp.values():
            remove(p)
        raise
    return stats


def _encoder(tok: Any, parse_special_tokens: bool = False) -> Callable[[list[str]], list[list[int]]]:
    """Batch encoder adding no special tokens: the fast backend directly when there is one (no
    model_max_length warnings, releases the GIL), else the tokenizer's __call__."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        if hasattr(backend, "encode_special_tokens"):
            backend.encode_special_tokens = not parse_special_tokens
        return lambda texts: [list(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False)]
    return lambda texts: [list(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
