"""Local text: read documents from jsonl/txt, build a corpus from the Python standard library,
train a byte-level BPE tokenizer with `tokenizers` and save it as a Hugging Face directory.

Nothing here downloads anything: the demo corpus is the interpreter's own standard library
sources (already on every machine that runs this package), read in sorted path order and
cut at a byte budget, so the same interpreter always yields the same corpus.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from megatron_bridge.data._fs import atomic_dir, atomic_file, refuse_existing
from megatron_bridge.errors import UserError

PathLike = str | os.PathLike

TEXT_SUFFIXES = (".jsonl", ".json", ".txt")
# Special tokens of the tokenizers this module trains (ids 0, 1, 2 in this order).
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]
# Directories of the stdlib tree that are not the standard library's own modules, or whose
# files are deliberately odd (encoding tests, bad syntax samples).
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


# -- reading documents ----------------------------------------------------------------------
def input_files(inputs: PathLike | Sequence[PathLike]) -> list[Path]:
    """Expand files and directories (recursively: *.jsonl, *.json, *.txt, sorted) into the
    list of files to read. UserError for a missing path or a directory without text files."""
    items = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    if not items:
        raise UserError("no input given: pass input=FILE_OR_DIR (a .jsonl/.txt file or a directory of them)")
    files: list[Path] = []
    for item in items:
        p = Path(item).expanduser()
        if not p.exists():
            raise UserError(f"input {p} does not exist")
        if p.is_dir():
            found = sorted(
                f
                for f in p.rglob("*")
                if f.is_file()
                and f.suffix in TEXT_SUFFIXES
                and not any(part.startswith(".") for part in f.relative_to(p).parts)
            )
            if not found:
                raise UserError(f"input directory {p} holds no {'/'.join(TEXT_SUFFIXES)} files")
            files.extend(found)
        elif p.suffix not in TEXT_SUFFIXES:
            raise UserError(
                f"input {p}: unsupported file type {p.suffix or '(none)'}; expected "
                f"{', '.join(TEXT_SUFFIXES)} (jsonl: one JSON object per line with a text key)"
            )
        else:
            files.append(p)
    return files


def iter_documents(
    inputs: PathLike | Sequence[PathLike], text_key: str = "text", txt_mode: str = "file"
) -> Iterator[str]:
    """Stream documents: one per jsonl line (its `text_key`), one per .txt file (`txt_mode=
    file`) or one per non-empty .txt line (`txt_mode=line`). Never holds the corpus in RAM."""
    if txt_mode not in ("file", "line"):
        raise UserError(
            f"txt_mode={txt_mode!r}: expected 'file' (one document per .txt file) or "
            "'line' (one document per non-empty line)"
        )
    for f in input_files(inputs):
        if f.suffix in (".jsonl", ".json"):
            yield from _iter_jsonl(f, text_key)
        elif txt_mode == "line":
            with open(f, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    line = line.rstrip("\n")
                    if line.strip():
                        yield line
        else:
            yield f.read_text(encoding="utf-8", errors="replace")


def _iter_jsonl(path: Path, text_key: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{path}:{lineno}: not valid JSON ({e.msg}); jsonl input needs one "
                    f'JSON object per line, e.g. {{"{text_key}": "..."}}'
                ) from e
            if not isinstance(obj, dict) or text_key not in obj:
                keys = ", ".join(map(repr, obj)) if isinstance(obj, dict) else type(obj).__name__
                raise UserError(
                    f"{path}:{lineno}: no {text_key!r} key (found: {keys}); pass text_key=NAME to read another key"
                )
            text = obj[text_key]
            if not isinstance(text, str):
                raise UserError(f"{path}:{lineno}: {text_key!r} is a {type(text).__name__}, not a string")
            yield text


# -- the standard-library corpus ----------------------------------------------------------------
@dataclass
class CorpusStats:
    path: Path
    documents: int
    bytes: int
    root: Path


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: PathLike | None = None) -> list[Path]:
    """The standard library's .py files in sorted (deterministic) order, without test
    packages and site-packages."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise UserError(f"the Python standard library directory {root} does not exist")
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        out.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(out, key=lambda p: p.relative_to(root).as_posix())


def build_stdlib_corpus(
    out_path: PathLike,
    max_bytes: int = 4_000_000,
    *,
    max_file_bytes: int = 200_000,
    root: PathLike | None = None,
    overwrite: bool = False,
) -> CorpusStats:
    """Write `out_path` (jsonl, {"text": source, "source": relative path} per line) from the
    standard library's sources: sorted order, files that are not UTF-8 or exceed
    `max_file_bytes` skipped, stopping before `max_bytes` of text. Atomic."""
    if max_bytes <= 0:
        raise UserError(f"max_bytes={max_bytes}: the corpus budget must be positive")
    out_path = Path(out_path)
    refuse_existing([out_path], overwrite, "corpus")
    root = Path(root) if root is not None else stdlib_root()
    n_docs = n_bytes = 0
    with atomic_file(out_path, "w", encoding="utf-8") as out:
        for f in stdlib_files(root):
            try:
                raw = f.read_bytes()
                text = raw.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if not text.strip() or len(raw) > max_file_bytes:
                continue
            if n_bytes + len(raw) > max_bytes:
                if n_docs:
                    break
                continue
            out.write(json.dumps({"text": text, "source": f.relative_to(root).as_posix()}) + "\n")
            n_docs += 1
            n_bytes += len(raw)
        if n_docs == 0:  # raised inside the block: the temporary file is removed
            raise UserError(f"no usable .py files under {root} within max_bytes={max_bytes}")
    return CorpusStats(out_path, n_docs, n_bytes, root)


# -- tokenizer training ------------------------------------------------------------------------
def train_tokenizer(
    corpus: PathLike | Sequence[PathLike] | Iterable[str],
    out_dir: PathLike,
    vocab_size: int = 8192,
    *,
    min_frequency: int = 2,
    text_key: str = "text",
    overwrite: bool = False,
    model_max_length: int | None = None,
) -> Path:
    """Train a byte-level BPE (`tokenizers`) on `corpus` and save it as a Hugging Face
    tokenizer directory. `corpus` is a jsonl/txt file or directory (str or Path), a list of
    Paths, or any other iterable of document strings. `AutoTokenizer.from_pretrained(out_dir)`
    gives a fast tokenizer with pad `<pad>`=0, bos `<s>`=1, eos `</s>`=2. Lossless:
    decode(encode(text)) == text for any text. Deterministic for a given corpus. Atomic."""
    min_vocab = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_vocab:
        raise UserError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE: it needs the 256 "
            f"byte tokens plus {len(SPECIAL_TOKENS)} special tokens (at least {min_vocab})"
        )
    out_dir = Path(out_dir)
    refuse_existing([out_dir], overwrite, "tokenizer directory")
    if isinstance(corpus, (str, os.PathLike)) or (
        isinstance(corpus, (list, tuple)) and corpus and all(isinstance(c, os.PathLike) for c in corpus)
    ):
        files = input_files(corpus)  # validate before any work
        texts: Iterable[str] = iter_documents(files, text_key=text_key)
    else:
        texts = cast(Iterable[str], corpus)  # not file names: the documents themselves

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
        **({"model_max_length": model_max_length} if model_max_length else {}),
    )
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        hf.save_pretrained(str(tmp))
    return out_dir
