"""Local text: read documents from jsonl/txt, build a corpus from the Python standard library,
train a byte-level BPE tokenizer with `tokenizers` and save it as a Hugging Face directory.

Nothing here downloads anything: the demo corpus is the interpreter's own standard library
sources (already on every machine that runs this package), read in sorted path order and
cut at a byte budget, so the same interpreter always yields the same corpus.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from megatron_bridge.data._fs import atomic_dir, atomic_file, refuse_existing
from megatron_bridge.data.columnar import COLUMNAR_SUFFIXES, is_save_to_disk, iter_texts, save_to_disk_files
from megatron_bridge.errors import UserError

PathLike = str | os.PathLike

TEXT_SUFFIXES = (".jsonl", ".json", ".txt")
INPUT_SUFFIXES = TEXT_SUFFIXES + COLUMNAR_SUFFIXES  # columnar: data/columnar.py
# Special tokens of the tokenizers this module trains (ids 0..4 in this order): padding,
# document begin/end, and ChatML's turn delimiters for CHATML_TEMPLATE.
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START, IM_END]
# The trained tokenizers' chat template (ChatML): every turn is `<|im_start|>ROLE\nCONTENT<|im_end|>\n`,
# so an assistant turn ends with its own end-of-turn token and earlier turns never change when
# one is appended (what `mbr data mode=chat` needs to find the assistant tokens).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Directories of the stdlib tree that are not the standard library's own modules, or whose
# files are deliberately odd (encoding tests, bad syntax samples).
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


# -- reading documents ----------------------------------------------------------------------
def input_files(inputs: PathLike | Sequence[PathLike]) -> list[Path]:
    """Expand files and directories (recursively: *.jsonl, *.json, *.txt, *.parquet, *.arrow,
    *.feather, sorted; a `datasets` save_to_disk directory: its arrow files in row order) into
    the list of files to read. UserError for a missing path or a directory without input files."""
    items = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    if not items:
        raise UserError("no input given: pass input=FILE_OR_DIR (a .jsonl/.txt file or a directory of them)")
    files: list[Path] = []
    for item in items:
        p = Path(item).expanduser()
        if not p.exists():
            raise UserError(f"input {p} does not exist")
        if is_save_to_disk(p):
            files.extend(save_to_disk_files(p))
        elif p.is_dir():
            found = sorted(
                f
                for f in p.rglob("*")
                if f.is_file()
                and f.suffix in INPUT_SUFFIXES
                and not any(part.startswith(".") for part in f.relative_to(p).parts)
            )
            if not found:
                raise UserError(f"input directory {p} holds no {'/'.join(INPUT_SUFFIXES)} files")
            files.extend(found)
        elif p.suffix not in INPUT_SUFFIXES:
            raise UserError(
                f"input {p}: unsupported file type {p.suffix or '(none)'}; expected "
                f"{', '.join(INPUT_SUFFIXES)} (jsonl: one JSON object per line with a text key), "
                "or a directory written by datasets' save_to_disk"
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
        if f.suffix in COLUMNAR_SUFFIXES:
            yield from iter_texts(f, text_key)
        elif f.suffix in (".jsonl", ".json"):
            yield from _iter_jsonl(f, text_key)
        elif txt_mode == "line":
            with open(f, encoding="utf-8", errors="replace") as fh:
                for line in _bounded_lines(fh, f):
                    line = line.rstrip("\n")
                    if line.strip():
                        yield line
        else:
            yield f.read_text(encoding="utf-8", errors="replace")


MAX_LINE_CHARS = 8 << 20  # one jsonl line / one .txt line document: 8 Mi characters (a long book is ~1 Mi)


def _bounded_lines(fh, path: PathLike) -> Iterator[str]:
    """The lines of a text file, each read with a bounded buffer: a line over MAX_LINE_CHARS is
    refused when its first MAX_LINE_CHARS + 1 characters are read, not after the whole line is in
    memory (one 100 MB line once took 17.6 GB of tokenizer memory)."""
    lineno = 0
    while True:
        line = fh.readline(MAX_LINE_CHARS + 2)
        if not line:
            return
        lineno += 1
        if len(line.rstrip("\n")) > MAX_LINE_CHARS:
            raise UserError(
                f"{path}:{lineno}: the line is longer than {MAX_LINE_CHARS} characters (the limit of one document "
                "per line, so that memory stays bounded). Split the document into several lines (documents) of "
                "at most that size."
            )
        yield line


def iter_jsonl(path: Path, example: str = '{"text": "..."}') -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON value) per non-blank line of `path`; invalid JSON is a
    UserError naming `path:line` (`example` shows the expected shape of a line)."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(_bounded_lines(fh, path), 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{path}:{lineno}: not valid JSON ({e.msg}); jsonl input needs one JSON object per line, e.g. {example}"
                ) from e


def _iter_jsonl(path: Path, text_key: str) -> Iterator[str]:
    for lineno, obj in iter_jsonl(path, f'{{"{text_key}": "..."}}'):
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


def _stdlib_module(rel: str) -> str | None:
    """`json/decoder.py` → `json.decoder`; None for private modules (`_pydecimal`, `json/_x`)."""
    parts = rel[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts or any(p.startswith("_") for p in parts):
        return None
    return ".".join(parts)


def _first_paragraph(doc: str | None) -> str | None:
    """A docstring's first paragraph on one line, or None when it is too short or too long to
    make a useful answer."""
    if not doc:
        return None
    para = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
    return para if 20 <= len(para) <= 600 else None


def iter_docstring_qa(root: PathLike | None = None) -> Iterator[dict]:
    """(question, answer) conversations from the standard library's public functions and methods:
    "What does `module.func(signature)` do?" → the first paragraph of its docstring. The sources
    are parsed with `ast`, never imported (importing runs module code: `antigravity` opens a
    browser); sorted file order, source order within a file, so the output is deterministic."""
    root = Path(root) if root is not None else stdlib_root()
    for f in stdlib_files(root):
        rel = f.relative_to(root).as_posix()
        module = _stdlib_module(rel)
        if module is None:
            continue
        try:
            tree = ast.parse(f.read_bytes())
        except (OSError, SyntaxError, ValueError):
            continue
        defs = [(module, n) for n in tree.body]
        defs += [
            (f"{module}.{c.name}", n)
            for c in tree.body
            if isinstance(c, ast.ClassDef) and not c.name.startswith("_")
            for n in c.body
        ]
        for owner, node in defs:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            answer = _first_paragraph(ast.get_docstring(node))
            if answer is None:
                continue
            question = f"What does `{owner}.{node.name}({ast.unparse(node.args)})` do?"
            yield {
                "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
                "source": f"{rel}:{node.lineno}",
            }


def build_docstring_chat_corpus(out_path: PathLike, max_examples: int = 2000, *, overwrite: bool = False) -> int:
    """Write up to `max_examples` docstring conversations (`iter_docstring_qa`) to `out_path`
    (jsonl, `mbr data mode=chat` input). Atomic; returns the number written."""
    if max_examples <= 0:
        raise UserError(f"max_examples={max_examples} must be positive")
    refuse_existing([Path(out_path)], overwrite, "chat corpus")
    n = 0
    with atomic_file(out_path, "w", encoding="utf-8") as out:
        for qa in iter_docstring_qa():
            out.write(json.dumps(qa) + "\n")
            n += 1
            if n >= max_examples:
                break
        if n == 0:
            raise UserError(f"no documented public functions found under {stdlib_root()}")
    return n


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
    gives a fast tokenizer with pad `<pad>`=0, bos `<s>`=1, eos `</s>`=2, ChatML's
    `<|im_start|>`=3 and `<|im_end|>`=4 and `CHATML_TEMPLATE` as its chat template. Lossless:
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
    hf.chat_template = CHATML_TEMPLATE
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
        hf.save_pretrained(str(tmp))
    return out_dir
