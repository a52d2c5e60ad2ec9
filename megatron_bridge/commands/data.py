"""`mbr data`: text → megatron-core indexed dataset, or a complete local demo dataset.

    mbr data input=FILE_OR_DIR output=PREFIX tokenizer=DIR [text_key=text] [overwrite=true]
    mbr data demo=true output_dir=DIR [vocab_size=N] [max_bytes=4000000] [overwrite=true]
    mbr data mode=chat input=FILE.jsonl output=PREFIX tokenizer=DIR [messages_key=messages] [chat_template=FILE]
             [max_length=N] [overlong=truncate|drop] [max_image_pixels=N] [overwrite=true]
    mbr data mode=chat demo=true output_dir=DIR [tokenizer=DIR] [max_examples=N] [max_length=N]
    mbr data mode=chat input=TOKENS.jsonl output=PREFIX (tokenizer=DIR | vocab_size=N) [max_length=N]
    mbr data mode=preference input=PAIRS.jsonl output=PREFIX (tokenizer=DIR | vocab_size=N) [chat_template=FILE]
             [max_length=N] [truncation=keep_start|drop] [overwrite=true]

The first tokenizes .jsonl/.txt/.parquet/.arrow files (a directory of them, or a directory
written by datasets' save_to_disk; docs/data.md "Input formats") with a local Hugging Face
tokenizer into PREFIX.bin/.idx (+ PREFIX.meta.json). The second needs nothing but this
machine: it builds a corpus from the Python standard library's sources, trains a byte-level
BPE tokenizer on it (vocab = the recipe's model.vocab_size unless vocab_size=N) and
preprocesses it, into DIR/{corpus.jsonl, tokenizer/, stdlib_text_document.*}. Both print the
overrides that train on the result. mode=chat renders conversations ({"messages": [...]} or
{"prompt", "completion"} per line) with the tokenizer's chat template into token ids plus a
loss mask on the assistant tokens (PREFIX.bin/.idx + PREFIX.loss_mask.bin/.idx); messages with
image parts are rendered with the tokenizer directory's processor and their images recorded
(PREFIX.images.jsonl, docs/data.md "Image chats"); rows of token ids ({"input_ids", "labels"},
Hugging Face's -100 convention) are stored as given; its demo makes
questions and answers from the standard library's docstrings. mode=preference turns
prompt/chosen/rejected rows (strings, message lists or token ids) into the DPO pairs of
data=preference (PREFIX.chosen, PREFIX.rejected, PREFIX.preference.json; docs/data.md
"Preference pairs"). Every input problem (missing input or tokenizer, an
existing output without overwrite=true, a tokenizer larger than the model) is reported before
any heavy work, and nothing is left half-written.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_bridge.backends.describe import describe
from megatron_bridge.config.compose import parse_command, to_yaml
from megatron_bridge.config.schema import Config
from megatron_bridge.convert.command import sigterm_as_interrupt
from megatron_bridge.convert.pipeline.dst import dst_lease
from megatron_bridge.data.chat_dataset import preprocess_chat
from megatron_bridge.data.demo import DEMO_PREFIX, build_chat_demo, build_demo
from megatron_bridge.data.preference import preprocess_preference
from megatron_bridge.data.preprocess import preprocess
from megatron_bridge.data.token_rows import is_token_chat, preprocess_token_chat
from megatron_bridge.data.tokenizer import check_vocab  # noqa: F401  (re-exported for the trainer)
from megatron_bridge.errors import UserError

DEMO_MAX_VOCAB = 32768


@dataclass
class DataCommandConfig(Config):
    """`mbr data`'s own keys on top of the recipe (top-level overrides: `input=... output=...`)."""

    input: str | None = None  # .jsonl/.txt/.parquet/.arrow file, a directory of them, or a datasets save_to_disk dir
    output: str | None = None  # output prefix: writes PREFIX.bin, PREFIX.idx, PREFIX.meta.json
    tokenizer: str | None = None  # local HF tokenizer dir (default: data.tokenizer)
    text_key: str = "text"  # jsonl key (parquet/arrow column) holding the document text
    messages_key: str = "messages"  # chat: jsonl key (parquet/arrow column) holding the message list
    txt_mode: str = "file"  # .txt: one document per file | line
    append_eos: bool = True
    overwrite: bool = False
    demo: bool = False
    output_dir: str | None = None  # demo output directory
    # demo: the tokenizer's size (default: model.vocab_size, at most 32768); token-id rows without
    # a tokenizer (mode=chat input_ids/labels, mode=preference *_ids): every id lies in [0, vocab_size)
    vocab_size: int | None = None
    max_bytes: int = 4_000_000  # demo corpus budget (the demo tokenizer's training text)
    mode: str = "text"  # text (pre-training documents) | chat (conversations + loss mask) | preference (DPO pairs)
    chat_template: str | None = None  # chat: a Jinja template file (default: the tokenizer's own)
    max_length: int | None = None  # chat: longest conversation in tokens (default: no limit)
    overlong: str = "truncate"  # chat: a conversation longer than max_length is cut (truncate) or left out (drop)
    max_image_pixels: int | None = None  # chat: larger images (width x height) are refused (default 4096x4096)
    max_examples: int = 2000  # chat demo: number of docstring questions
    truncation: str = "keep_start"  # preference: a pair past max_length is cut (keep_start) or left out (drop)


def _train_hint(prefix: str, tokenizer: str) -> str:
    return f"train on it with: data=indexed data.paths=[{prefix}] data.tokenizer={tokenizer}"


def _sft_hint(prefix: str, tokenizer: str) -> str:
    return f"fine-tune on it with: data=sft data.paths=[{prefix}] data.tokenizer={tokenizer}"


def _images_hint(prefix: str, tokenizer: str) -> str:
    return (
        f"fine-tune a vision-language model on it with: data=sft data.paths=[{prefix}] data.tokenizer={tokenizer} "
        "model.hf_path=<the VLM's directory>, and data.packing=false where its positions come from the images "
        '(Qwen-style M-RoPE; docs/finetune.md, "Vision-language models")'
    )


def _dpo_hint(prefix: str, tokenizer: str | None) -> str:
    tok = f" data.tokenizer={tokenizer}" if tokenizer else ""
    return f"train DPO on it with: objective=dpo data=preference data.paths=[{prefix}]{tok}"


def run_preference(cfg: DataCommandConfig) -> int:
    if cfg.output_dir is not None:
        raise UserError(
            "output_dir= and max_examples= belong to demo=true; mode=preference takes input=, output=, tokenizer="
        )
    if not cfg.input or not cfg.output:
        raise UserError(
            "mode=preference needs input=FILE.jsonl (one pair per line, e.g. "
            '{"prompt": "2+2=", "chosen": "4", "rejected": "5"}) and output=PREFIX (writes PREFIX.chosen, '
            "PREFIX.rejected and PREFIX.preference.json)"
        )
    tokenizer = _rows_tokenizer(cfg)
    stats = preprocess_preference(
        cfg.input,
        cfg.output,
        tokenizer,
        vocab_size=cfg.vocab_size,
        chat_template=cfg.chat_template,
        max_length=cfg.max_length,
        truncation=cfg.truncation,
        overwrite=cfg.overwrite,
        log=print,
    )
    print(stats.describe())
    print(_dpo_hint(os.path.abspath(stats.prefix), stats.tokenizer))
    return 0


def _rows_tokenizer(cfg: DataCommandConfig) -> str | None:
    """The tokenizer of a pre-tokenized or preference input: `tokenizer=`, else none when
    `vocab_size=` bounds the ids, else the recipe's `data.tokenizer`."""
    return cfg.tokenizer or (None if cfg.vocab_size is not None else cfg.data.tokenizer)


def run_chat(cfg: DataCommandConfig) -> int:
    if cfg.output_dir is not None:
        raise UserError(
            "output_dir= and max_examples= belong to demo=true; mode=chat takes input=, output=, tokenizer="
        )
    if cfg.input and is_token_chat(cfg.input):
        if not cfg.output:
            raise UserError("mode=chat needs output=PREFIX (where the indexed files go)")
        tok = _rows_tokenizer(cfg)
        stats = preprocess_token_chat(
            cfg.input,
            cfg.output,
            tok,
            vocab_size=cfg.vocab_size,
            max_length=cfg.max_length,
            overlong=cfg.overlong,
            overwrite=cfg.overwrite,
            log=print,
        )
        print(stats.describe())
        print(_sft_hint(os.path.abspath(stats.prefix), os.path.abspath(str(tok)) if tok else "<the tokenizer>"))
        return 0
    if cfg.vocab_size is not None:
        raise UserError(
            "vocab_size= belongs to demo=true and to rows of token ids (input_ids/labels); conversations are "
            "tokenized with tokenizer=DIR"
        )
    if not cfg.input:
        raise UserError(
            "no input given: pass input=FILE.jsonl (one conversation per line, "
            '{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]} or '
            '{"prompt": ..., "completion": ...}), or demo=true output_dir=DIR for a demo chat dataset'
        )
    tokenizer = cfg.tokenizer or cfg.data.tokenizer
    if not cfg.output or not tokenizer:
        raise UserError(
            "mode=chat needs output=PREFIX (where the indexed files go) and tokenizer=DIR (a local Hugging Face "
            "tokenizer with a chat template, or chat_template=FILE to supply one)"
        )
    stats = preprocess_chat(
        cfg.input,
        cfg.output,
        tokenizer,
        chat_template=cfg.chat_template,
        max_length=cfg.max_length,
        overlong=cfg.overlong,
        messages_key=cfg.messages_key,
        max_image_pixels=cfg.max_image_pixels,
        overwrite=cfg.overwrite,
        log=print,
    )
    print(stats.describe())
    hint = _images_hint if stats.images else _sft_hint
    print(hint(os.path.abspath(stats.prefix), os.path.abspath(str(tokenizer))))
    return 0


def run_preprocess(cfg: DataCommandConfig) -> int:
    if cfg.output_dir is not None or cfg.vocab_size is not None:
        raise UserError(
            "output_dir= and vocab_size= belong to demo=true; preprocessing takes input=, output=, tokenizer="
        )
    if not cfg.input:
        raise UserError(
            "no input given: pass input=FILE_OR_DIR (.jsonl with a 'text' key per line, .txt, or a "
            "directory of them), or demo=true output_dir=DIR to build a demo dataset from the stdlib"
        )
    tokenizer = cfg.tokenizer or cfg.data.tokenizer
    stats = preprocess(
        cfg.input,
        cfg.output,
        tokenizer,
        text_key=cfg.text_key,
        txt_mode=cfg.txt_mode,
        append_eos=cfg.append_eos,
        overwrite=cfg.overwrite,
        log=print,
    )
    print(stats.describe())
    print(_train_hint(os.path.abspath(stats.prefix), os.path.abspath(str(tokenizer))))
    return 0


def run_demo(cfg: DataCommandConfig) -> int:
    chat = cfg.mode == "chat"
    if cfg.input or cfg.output or (cfg.tokenizer and not chat):
        raise UserError(
            "demo=true builds its own corpus and tokenizer: drop input=/output=/tokenizer= "
            "(or drop demo=true to preprocess your own text)"
        )
    if not cfg.output_dir:
        raise UserError(
            "demo=true needs output_dir=DIR (it writes DIR/corpus.jsonl, DIR/tokenizer/ and "
            f"DIR/{DEMO_PREFIX}.bin/.idx)"
        )
    if chat and cfg.tokenizer and cfg.vocab_size is not None:
        raise UserError("vocab_size= sizes the demo tokenizer it trains; with tokenizer=DIR there is none to train")
    model_vocab = describe(cfg.model).vocab_size
    vocab = cfg.vocab_size if cfg.vocab_size is not None else min(model_vocab, DEMO_MAX_VOCAB)
    if vocab > model_vocab:
        raise UserError(
            f"vocab_size={vocab} is larger than the recipe's model.vocab_size={model_vocab}: the model "
            f"could not embed its ids. Use vocab_size<={model_vocab}, or a recipe/model with a larger "
            f"vocabulary (e.g. model.vocab_size={vocab})."
        )
    if chat:
        cd = build_chat_demo(
            cfg.output_dir,
            vocab,
            cfg.max_bytes,
            max_examples=cfg.max_examples,
            tokenizer=cfg.tokenizer,
            max_length=cfg.max_length,
            overlong=cfg.overlong,
            overwrite=cfg.overwrite,
            log=print,
        )
        print(_sft_hint(str(cd.prefix), str(cd.tokenizer)))
        return 0
    demo = build_demo(cfg.output_dir, vocab, cfg.max_bytes, overwrite=cfg.overwrite, log=print)
    print(_train_hint(str(demo.prefix), str(demo.tokenizer)))
    return 0


def main(argv: Sequence[str]) -> int:
    cfg, args = parse_command(argv, DataCommandConfig, doc=__doc__)
    if args.cfg:
        print(to_yaml(cfg), end="")
        return 0
    if args.flags:
        raise UserError(f"unknown flag(s) {' '.join(args.flags)} for `mbr data` (it takes key=value overrides)")
    if cfg.mode not in ("text", "chat", "preference"):
        raise UserError(
            f"mode={cfg.mode!r}: expected text (pre-training documents), chat (conversations) or preference "
            "(prompt/chosen/rejected pairs for DPO)"
        )
    if cfg.demo and cfg.mode == "preference":
        raise UserError("demo=true makes text or chat data; mode=preference takes input=, output=, tokenizer=")
    if cfg.mode == "text" and (cfg.chat_template or cfg.max_length is not None or cfg.max_image_pixels is not None):
        raise UserError(
            "chat_template=, max_length= and max_image_pixels= belong to mode=chat (conversations); add mode=chat"
        )
    with sigterm_as_interrupt(), _leased(cfg.output_dir if cfg.demo else cfg.output, cfg.demo):
        if cfg.demo:
            return run_demo(cfg)
        return {"chat": run_chat, "preference": run_preference}.get(cfg.mode, run_preprocess)(cfg)


@contextlib.contextmanager
def _leased(target: str | None, demo: bool) -> Iterator[None]:
    """The output (prefix or directory) is leased like convert's dst (convert/pipeline/dst.py),
    so two `mbr data` runs never write one output; where its parent does not exist yet the
    command creates it later and runs unleased."""
    if not target or not Path(target).absolute().parent.is_dir():
        yield
        return
    with dst_lease(Path(target).absolute(), "output_dir" if demo else "output"):
        yield
