"""Indexed datasets (`.bin`/`.idx` made by `mbr data`), checked before megatron-core sees them.

megatron-core reports a bad `data.paths`, a tokenizer that does not match the data, or a split
with no documents late and obscurely (an empty split makes it loop forever), so these checks
run first, with no torch or megatron-core import: `mbr train`'s preflight calls
`check_indexed_data` on its own, and `loader.build_datasets` calls it before building.
`parse_blend`/`parse_split` read megatron's `--data-path`/`--split` syntax; `idx_lengths`
reads a dataset's per-document token counts straight from its `.idx`.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence

from megatron_bridge.data.chat import CHAT_FORMAT
from megatron_bridge.data.chat_images import IMAGE_CHAT_FORMAT
from megatron_bridge.data.preprocess import output_paths, read_meta
from megatron_bridge.data.tokenizer import NO_EOS, check_vocab, load_tokenizer, validate_tokenizer_dir
from megatron_bridge.errors import UserError

SPLITS = ("train", "valid", "test")


def parse_blend(paths: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """`data.paths`: prefixes [p1, p2, ...] or weighted [w1, p1, w2, p2, ...] (megatron's
    --data-path syntax). Returns (prefixes, weights or None)."""
    paths = [str(p).strip() for p in paths]
    if not paths:
        raise UserError(
            "data.kind=indexed needs data.paths: the prefix(es) of datasets made by `mbr data` "
            "(e.g. data.paths=[/data/stdlib_text_document]), optionally weighted: [0.3,A,0.7,B]"
        )

    def num(s: str) -> float | None:
        try:
            return float(s)
        except ValueError:
            return None

    if len(paths) % 2 == 0 and all(num(w) is not None for w in paths[0::2]):
        weights = [float(w) for w in paths[0::2]]
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise UserError(f"data.paths weights {weights} must be >= 0 and not all 0")
        return paths[1::2], weights
    bad = [p for p in paths if num(p) is not None]
    if bad:
        raise UserError(
            f"data.paths={paths} mixes weights and prefixes; use [w1,prefix1,w2,prefix2,...] "
            "with a weight before every prefix, or only prefixes"
        )
    return paths, None


def parse_split(split: str) -> list[float]:
    """'98,2,0' → normalized [0.98, 0.02, 0.0]; UserError for anything else."""
    parts = [s.strip() for s in str(split).replace("/", ",").split(",")]
    try:
        vals = [float(s) for s in parts if s != ""]
    except ValueError:
        vals = []
    if not 1 <= len(vals) <= 3 or any(v < 0 for v in vals) or sum(vals) <= 0:
        raise UserError(
            f"data.split={split!r}: expected up to three non-negative train,valid,test weights "
            "that are not all zero, e.g. data.split=98/2/0 (or, quoted for the shell, "
            "'data.split=\"98,2,0\"')"
        )
    vals += [0.0] * (3 - len(vals))
    return [v / sum(vals) for v in vals]


def idx_lengths(prefix: str):
    """The per-document token counts of an indexed dataset, read from its .idx (memmap)."""
    import numpy as np

    path = output_paths(prefix)["idx"]
    try:
        with open(path, "rb") as f:
            head = f.read(34)
        if len(head) < 34 or head[:9] != b"MMIDIDX\x00\x00":
            raise UserError(f"{path} is not a megatron-core index file (bad header)")
        n_seq = struct.unpack("<Q", head[18:26])[0]
        return np.memmap(path, dtype=np.int32, mode="r", offset=34, shape=(n_seq,)) if n_seq else np.zeros(0, np.int32)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e}") from e


# megatron-core's `.idx` dtype codes (indexed_dataset.DType)
_IDX_DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32", 8: "uint16"}
_LARGEST: dict[tuple[str, int, int], int] = {}  # (bin path, size, mtime_ns) -> largest id: the loader checks again


def largest_token_id(prefix: str) -> int:
    """The largest token id in `prefix`.bin, read from the file itself (not its .meta.json, which a
    hand-made or edited dataset may lack or misstate): a vectorised max over the memory-mapped
    tokens, 64 Mi tokens at a time — about 1 GB/s from the page cache (docs/train.md)."""
    import numpy as np

    paths = output_paths(prefix)
    try:
        with open(paths["idx"], "rb") as f:
            head = f.read(34)
        st = os.stat(paths["bin"])
    except OSError as e:
        raise UserError(f"cannot read {prefix}: {e}") from e
    if len(head) < 34 or head[:9] != b"MMIDIDX\x00\x00" or head[17] not in _IDX_DTYPES:
        raise UserError(f"{paths['idx']} is not a megatron-core index file (bad header)")
    key = (paths["bin"], st.st_size, st.st_mtime_ns)
    if key not in _LARGEST:
        dtype = np.dtype(_IDX_DTYPES[head[17]])
        n = st.st_size // dtype.itemsize
        top = -1
        if n:
            tokens = np.memmap(paths["bin"], dtype=dtype, mode="r", shape=(n,))
            step = 1 << 26
            top = max(int(tokens[i : i + step].max()) for i in range(0, n, step))
            del tokens
        _LARGEST[key] = top
    return _LARGEST[key]


def check_bin_size(prefix: str) -> None:
    """Refuse a `.bin` shorter than its `.idx` says (a copy cut off, a full disk): megatron-core
    would fail deep in numpy naming neither file. The last document's end (its pointer plus its
    size in tokens) must lie within the `.bin`; reads two numbers, not the data."""
    paths = output_paths(prefix)
    try:
        with open(paths["idx"], "rb") as f:
            head = f.read(34)
            if len(head) < 34 or head[:9] != b"MMIDIDX\x00\x00" or head[17] not in _IDX_DTYPES:
                raise UserError(f"{paths['idx']} is not a megatron-core index file (bad header)")
            n_seq = struct.unpack("<Q", head[18:26])[0]
            if not n_seq:
                return
            f.seek(34 + 4 * (n_seq - 1))
            size = f.read(4)
            f.seek(34 + 4 * n_seq + 8 * (n_seq - 1))
            ptr = f.read(8)
        have = os.stat(paths["bin"]).st_size
    except OSError as e:
        raise UserError(f"cannot read {prefix}: {e}") from e
    if len(size) < 4 or len(ptr) < 8:
        raise UserError(
            f"{paths['idx']} is truncated (it announces {n_seq} documents): re-run `mbr data` to make "
            f"{prefix}.bin/.idx again"
        )
    import numpy as np

    itemsize = np.dtype(_IDX_DTYPES[head[17]]).itemsize
    need = struct.unpack("<q", ptr)[0] + struct.unpack("<i", size)[0] * itemsize
    if have < need:
        raise UserError(
            f"{paths['bin']} is truncated: {paths['idx']} says its documents end at byte {need}, but the file "
            f"has {have} bytes (an interrupted copy or a full disk). Copy it again, or re-run `mbr data` to "
            f"make {prefix}.bin/.idx again."
        )


def check_indexed_data(
    data, model_vocab_size: int | None = None
) -> tuple[list[str], list[float] | None, int | None, int | None]:
    """Validate `data` (a DataConfig with kind=indexed) without building anything: every prefix
    exists, the data's token ids fit the tokenizer and the model, the tokenizer matches the
    one the data was made with, every split with a weight has documents. Returns
    (prefixes, weights, vocab_size, eod)."""
    if data.kind == "sft" and not list(data.paths):
        raise UserError(
            "data=sft needs data.paths=[PREFIX]: a chat dataset made by `mbr data mode=chat input=FILE.jsonl "
            "output=PREFIX tokenizer=DIR` (e.g. data.paths=[/data/stdlib_chat])"
        )
    prefixes, weights = parse_blend(data.paths)
    missing = [p for p in prefixes for f in ("bin", "idx") if not os.path.isfile(output_paths(p)[f])]
    if missing:
        raise UserError(
            "data.paths: indexed dataset(s) not found: "
            + ", ".join(sorted({p for p in missing}))
            + " (each prefix P needs P.bin and P.idx; make them with `mbr data input=... output=P tokenizer=DIR`)"
        )
    for p in prefixes:
        check_bin_size(p)
    split = parse_split(data.split)
    metas = {p: read_meta(p) for p in prefixes}
    _check_format(data.kind, metas)

    # Tokenizer facts: from data.tokenizer if given, else from the datasets' metadata.
    vocab = eod = None
    tok_desc = None
    if data.tokenizer:
        tok = load_tokenizer(validate_tokenizer_dir(data.tokenizer, "data.tokenizer"))
        vocab, eod, tok_desc = len(tok), int(tok.eos_token_id), f"data.tokenizer={data.tokenizer}"
    for p, m in metas.items():
        if not m:
            continue
        if vocab is None:
            vocab, eod, tok_desc = (
                int(m["vocab_size"]),
                int(m["eos_id"]),
                f"the tokenizer {m.get('tokenizer')} ({p}{'.meta.json'})",
            )
            continue
        # NO_EOS: made from token ids without a tokenizer (vocab_size=), any tokenizer's eos agrees
        eos_agrees = int(m["eos_id"]) in (eod, NO_EOS)
        if int(m["max_token_id"]) >= vocab or not eos_agrees or int(m["vocab_size"]) != vocab:
            raise UserError(
                f"{p} was tokenized with {m.get('tokenizer')} (vocab {m['vocab_size']}, eos {m['eos_id']}, largest id "
                f"{m['max_token_id']}) but {tok_desc} has vocab {vocab}, eos {eod}: the data and the tokenizer do "
                "not match. Re-run `mbr data` with this tokenizer, or point data.tokenizer at the one used."
            )
    if vocab is None:
        raise UserError(
            f"cannot tell which tokenizer made {', '.join(prefixes)} (no .meta.json next to it): set "
            "data.tokenizer=DIR to the tokenizer directory it was made with"
        )
    if model_vocab_size is not None:
        check_vocab(vocab, model_vocab_size)
        for p in prefixes:  # the tokens themselves: an id past the embedding trains garbage at tp > 1
            top = largest_token_id(p)
            if top >= model_vocab_size:
                raise UserError(
                    f"{output_paths(p)['bin']} holds token id {top}, but the model's vocabulary has "
                    f"{model_vocab_size} ids (0..{model_vocab_size - 1}): the data was made with another tokenizer "
                    "or is damaged. Re-run `mbr data` with the model's tokenizer, or train a model whose "
                    "vocab_size exceeds the largest id."
                )

    # Every split with a weight needs tokens: megatron-core builds it (even when no samples are
    # requested from it) and loops forever on an empty one.
    bounds, acc = [], 0.0
    for w in split:
        bounds.append((acc, acc + w) if w > 0 else None)
        acc += w
    for p in prefixes:
        lengths = idx_lengths(p)
        n = lengths.shape[0]
        for name, b in zip(SPLITS, bounds):
            if b is None:  # megatron-core builds every split with weight > 0, wanted or not
                continue
            beg, end = int(round(b[0] * n)), int(round(b[1] * n))
            if end <= beg or int(lengths[beg:end].sum()) == 0:
                raise UserError(
                    f"{p} has {n} documents, and data.split={data.split!r} leaves its {name} split "
                    f"{end - beg} of them{' (no tokens)' if end > beg else ''}. Use more data, or change data.split "
                    f"(e.g. data.split=90/10/0), or drop the {name} split (weight 0)."
                )
    return prefixes, weights, vocab, eod


def _check_format(kind: str, metas: dict) -> None:
    """Chat data (`mbr data mode=chat`) trains only with data=sft, and data=sft only on chat data:
    pre-training on it would drop the loss mask and learn the prompts too."""

    for p, m in metas.items():
        is_chat = bool(m) and m.get("format") in (CHAT_FORMAT, IMAGE_CHAT_FORMAT)
        if kind == "sft" and not is_chat:
            raise UserError(
                f"data=sft needs chat data (format {CHAT_FORMAT}), but {p} is "
                f"{'plain indexed data' if m else 'a dataset without a .meta.json'}. Make it with "
                f"`mbr data mode=chat input=FILE.jsonl output={p} tokenizer=DIR`, or pre-train on it with data=indexed."
            )
        if kind != "sft" and is_chat:
            raise UserError(
                f"{p} is chat data (format {m['format']}: tokens plus an assistant loss mask), which "
                f"data={kind} would pre-train on prompts and all: use data=sft data.paths=[{p}] to fine-tune on it."
            )


__all__ = ["SPLITS", "check_bin_size", "check_indexed_data", "idx_lengths", "parse_blend", "parse_split"]
