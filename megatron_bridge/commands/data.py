"""`mbr data`: text → megatron-core indexed dataset, or a complete local demo dataset.

    mbr data input=FILE_OR_DIR output=PREFIX tokenizer=DIR [text_key=text] [overwrite=true]
    mbr data demo=true output_dir=DIR [vocab_size=N] [max_bytes=4000000] [overwrite=true]

The first tokenizes .jsonl/.txt files (or a directory of them) with a local Hugging Face
tokenizer into PREFIX.bin/.idx (+ PREFIX.meta.json). The second needs nothing but this
machine: it builds a corpus from the Python standard library's sources, trains a byte-level
BPE tokenizer on it (vocab = the recipe's model.vocab_size unless vocab_size=N) and
preprocesses it, into DIR/{corpus.jsonl, tokenizer/, stdlib_text_document.*}. Both print the
overrides that train on the result. Every input problem (missing input or tokenizer, an
existing output without overwrite=true, a tokenizer larger than the model) is reported before
any heavy work, and nothing is left half-written.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from megatron_bridge.config.compose import compose, to_yaml
from megatron_bridge.config.schema import Config
from megatron_bridge.data.demo import DEMO_PREFIX
from megatron_bridge.data.tokenizer import check_vocab  # noqa: F401  (re-exported for the trainer)
from megatron_bridge.errors import UserError

DEMO_MAX_VOCAB = 32768


@dataclass
class DataCommandConfig(Config):
    """`mbr data`'s own keys on top of the recipe (top-level overrides: `input=... output=...`)."""

    input: str | None = None  # .jsonl/.txt file or directory of them
    output: str | None = None  # output prefix: writes PREFIX.bin, PREFIX.idx, PREFIX.meta.json
    tokenizer: str | None = None  # local HF tokenizer dir (default: data.tokenizer)
    text_key: str = "text"  # jsonl key holding the document text
    txt_mode: str = "file"  # .txt: one document per file | line
    append_eos: bool = True
    overwrite: bool = False
    demo: bool = False
    output_dir: str | None = None  # demo output directory
    vocab_size: int | None = None  # demo tokenizer size (default: model.vocab_size, at most 32768)
    max_bytes: int = 4_000_000  # demo corpus budget


def _train_hint(prefix: str, tokenizer: str) -> str:
    return f"train on it with: data=indexed data.paths=[{prefix}] data.tokenizer={tokenizer}"


def run_preprocess(cfg: DataCommandConfig) -> int:
    from megatron_bridge.data.preprocess import preprocess

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
    from megatron_bridge.data.demo import build_demo

    if cfg.input or cfg.output or cfg.tokenizer:
        raise UserError(
            "demo=true builds its own corpus and tokenizer: drop input=/output=/tokenizer= "
            "(or drop demo=true to preprocess your own text)"
        )
    if not cfg.output_dir:
        raise UserError(
            "demo=true needs output_dir=DIR (it writes DIR/corpus.jsonl, DIR/tokenizer/ and "
            f"DIR/{DEMO_PREFIX}.bin/.idx)"
        )
    model_vocab = cfg.model.vocab_size
    vocab = cfg.vocab_size if cfg.vocab_size is not None else min(model_vocab, DEMO_MAX_VOCAB)
    if vocab > model_vocab:
        raise UserError(
            f"vocab_size={vocab} is larger than the recipe's model.vocab_size={model_vocab}: the model "
            f"could not embed its ids. Use vocab_size<={model_vocab}, or a recipe/model with a larger "
            f"vocabulary (e.g. model.vocab_size={vocab})."
        )
    demo = build_demo(cfg.output_dir, vocab, cfg.max_bytes, overwrite=cfg.overwrite, log=print)
    print(_train_hint(str(demo.prefix), str(demo.tokenizer)))
    return 0


def main(argv: Sequence[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    cfg, args = compose(argv, schema=DataCommandConfig)
    if args.cfg:
        print(to_yaml(cfg), end="")
        return 0
    if args.flags:
        raise UserError(f"unknown flag(s) {' '.join(args.flags)} for `mbr data` (it takes key=value overrides)")
    return run_demo(cfg) if cfg.demo else run_preprocess(cfg)
