"""The data entry points for training: `build_datasets` (megatron-core GPTDataset, or seeded
synthetic tokens), `make_iterator` (one rank's micro-batches) and `build_data_iterators`
(both, from a composed `Config`).

This is the module the trainer and docs/data.md import; the parts live beside it:
`indexed` checks indexed data before megatron-core is imported, `synthetic` holds the
synthetic dataset, `batching` the DP-sharded, resumable sampler, collation and CP slicing
(its docstring states the sampling contract), `helpers` megatron-core's C++ index helpers.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from megatron_bridge.data.helpers import ensure_helpers
from megatron_bridge.data.indexed import check_indexed_data, idx_lengths, parse_split
from megatron_bridge.data.preprocess import output_paths, read_meta
from megatron_bridge.data.tokenizer import check_vocab, load_tokenizer
from megatron_bridge.errors import UserError
from megatron_bridge.train.data.batching import DataIterator
from megatron_bridge.train.data.preference import build_preference_datasets
from megatron_bridge.train.data.sft import build_sft_datasets
from megatron_bridge.train.data.synthetic import SyntheticGPTDataset


# -- what GPTDatasetConfig needs from a tokenizer -------------------------------------------------
class DatasetTokenizer:
    """The few tokenizer facts megatron-core's GPTDataset reads (vocab_size, eod, pad), plus
    `unique_identifiers`, which megatron hashes into its index-cache file names: it carries a
    fingerprint of the data files, so re-preprocessing a prefix never reuses stale indices.
    `pad` is -1 (megatron's "no pad id"): no real token is ever masked as padding."""

    def __init__(self, vocab_size: int | None, eod: int | None, name: str = "", fingerprint: str = ""):
        self.vocab_size = vocab_size
        self.eod = eod if eod is not None else -1
        self.eos = self.eod
        self.pad = -1
        self.unique_identifiers = {
            "class": "DatasetTokenizer",
            "name": name,
            "vocab_size": vocab_size,
            "eod": self.eod,
            "data": fingerprint,
        }

    def __repr__(self) -> str:
        return f"DatasetTokenizer({self.unique_identifiers})"


def _fingerprint(prefixes: Sequence[str]) -> str:
    h = hashlib.sha256()
    for p in prefixes:
        meta = read_meta(p)
        if meta and meta.get("build_id"):
            h.update(f"{p}|{meta['build_id']}".encode())
        else:
            paths = output_paths(p)
            h.update(f"{p}|{os.path.getsize(paths['bin'])}|{os.path.getsize(paths['idx'])}".encode())
    return h.hexdigest()[:16]


# -- building the datasets ----------------------------------------------------------------------
@dataclass
class Datasets:
    train: Any
    valid: Any
    test: Any
    kind: str
    vocab_size: int | None  # the data's token-id range (tokenizer size)
    eod: int | None
    helpers: str = ""  # how megatron-core's C++ helpers were provided ("" for synthetic)

    def split(self, name: str) -> Any:
        return {"train": self.train, "valid": self.valid, "test": self.test}[name]


CHAT_BUILDERS = {"sft": build_sft_datasets, "preference": build_preference_datasets}
"""`data.kind` → the builder of its (train, valid, test, vocab, eod) from one chat or preference dataset."""


def _default_cache_dir(prefixes: Sequence[str]) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), "cache")


def build_datasets(
    data,
    dims,
    *,
    seq_length: int,
    seed: int,
    train_steps: int,
    valid_samples: int | None = None,
    test_samples: int | None = None,
    model_vocab_size: int | None = None,
    cache_dir: str | None = None,
    create_attention_mask: bool = False,
    eod_mask_loss: bool = False,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    is_built_on_rank: Callable[[], bool] | None = None,
) -> Datasets:
    """Build the train/valid/test datasets for `data` (a `DataConfig`).

    The train split holds at least `train_steps · dims.global_batch_size` samples; valid and
    test hold `valid_samples`/`test_samples` (None: one epoch of their split; a 0-weight
    split is None). `kind=indexed` goes through megatron-core's `BlendedMegatronDatasetBuilder`
    with a `GPTDatasetConfig` seeded by `seed` (a blend when data.paths has several prefixes);
    its sample/shuffle indices are cached in `cache_dir` (default: `cache/` next to the first
    prefix). Under torch.distributed, call it on every rank (megatron builds on rank 0 first,
    then the others load its cache). `kind=sft`/`kind=preference` read chat data / preference pairs
    (train/data/sft.py, train/data/preference.py). `kind=synthetic` needs `model_vocab_size`.
    All user errors surface before megatron-core is imported."""
    if seq_length < 1:
        raise UserError(f"train.seq_length={seq_length} must be >= 1")
    if dims.cp > 1 and seq_length % (2 * dims.cp):
        raise UserError(
            f"train.seq_length={seq_length} is not divisible by 2·cp = {2 * dims.cp} (context "
            "parallelism cuts each sequence into 2·cp chunks)"
        )
    if dims.global_batch_size < 1 or train_steps < 0:
        raise UserError(f"bad sizes: train steps {train_steps}, global batch {dims.global_batch_size}")
    train_samples = train_steps * dims.global_batch_size
    kind = data.kind

    if kind == "synthetic":
        vocab = model_vocab_size
        if data.tokenizer:
            vocab = (
                check_vocab(data.tokenizer, model_vocab_size)
                if model_vocab_size
                else len(load_tokenizer(data.tokenizer))
            )
        if vocab is None:
            raise UserError("data.kind=synthetic needs a vocab size: pass the model's vocab_size")
        n_valid = valid_samples if valid_samples is not None else 4 * dims.global_batch_size
        n_test = test_samples if test_samples is not None else 0

        n_vocab = vocab  # an int from here on (the indexed branch below rebinds `vocab`)

        def mk(n, split):
            return SyntheticGPTDataset(n, seq_length, n_vocab, seed, split, create_attention_mask)

        return Datasets(
            mk(train_samples, "train"),
            mk(n_valid, "valid") if n_valid else None,
            mk(n_test, "test") if n_test else None,
            kind,
            vocab,
            None,
        )

    if kind in CHAT_BUILDERS:  # one dataset file of conversations or pairs (train/data/sft.py, preference.py)
        train, valid, test, vocab, eod = CHAT_BUILDERS[kind](
            data,
            seq_length=seq_length,
            seed=seed,
            train_samples=train_samples,
            valid_samples=valid_samples,
            test_samples=test_samples,
            model_vocab_size=model_vocab_size,
        )
        return Datasets(train, valid, test, kind, vocab, eod)
    if kind != "indexed":
        raise UserError(
            f"data.kind={kind!r}: expected 'indexed' (megatron-core .bin/.idx made by `mbr data`), "
            "'sft' (chat data made by `mbr data mode=chat`), 'preference' (DPO pairs made by `mbr data "
            "mode=preference`) or 'synthetic' (seeded random tokens)"
        )

    prefixes, weights, vocab, eod = check_indexed_data(data, model_vocab_size)
    # A size of 0 ("not wanted") is built as one epoch (megatron builds the split anyway).
    sizes = [train_samples] + [None if n == 0 else n for n in (valid_samples, test_samples)]
    if weights is not None and None in sizes:
        # megatron-core needs a size per split for a weighted blend: take about one epoch's worth.
        tokens = sum(int(idx_lengths(p).sum()) for p in prefixes)
        per_epoch = [max(1, int(tokens * w) // seq_length) for w in parse_split(data.split)]
        sizes = [n if n is not None else per_epoch[i] for i, n in enumerate(sizes)]
    if (eod_mask_loss or reset_position_ids or reset_attention_mask) and eod is None:
        raise UserError("eod_mask_loss/reset_position_ids/reset_attention_mask need the eos id: set data.tokenizer")
    cache = os.path.abspath(cache_dir or _default_cache_dir(prefixes))
    try:
        os.makedirs(cache, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"cannot create the dataset index cache {cache}: {e.strerror or e}; pass a writable cache directory"
        ) from e
    if not os.access(cache, os.W_OK):
        raise UserError(f"the dataset index cache {cache} is not writable; pass a writable cache directory")

    how = ensure_helpers()  # megatron-core imports its C++ helpers while it builds the indices
    tokenizer = DatasetTokenizer(vocab, eod, name=str(data.tokenizer or ""), fingerprint=_fingerprint(prefixes))
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(prefixes, weights),
        split=data.split,
        path_to_cache=cache,
        tokenizer=tokenizer,
        mmap_bin_files=True,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
    )
    with _rank0_without_process_group():
        train, valid, test = BlendedMegatronDatasetBuilder(
            GPTDataset, sizes, is_built_on_rank or (lambda: True), config
        ).build()
    valid = None if valid_samples == 0 else valid  # built by megatron anyway; not wanted
    test = None if test_samples == 0 else test
    return Datasets(train, valid, test, kind, vocab, eod, how)


@contextlib.contextmanager
def _rank0_without_process_group():
    """megatron-core 0.16.1's BlendedDataset._build_indices calls torch.distributed.get_rank()
    without checking is_initialized() (GPTDataset does check), so a weighted blend fails in a
    single process with "Default process group has not been initialized". Without a process
    group, answer rank 0 while the datasets are built; with one, change nothing."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        yield
        return
    with mock.patch.object(torch.distributed, "get_rank", lambda group=None: 0):
        yield


def make_iterator(
    dataset, dims, *, dp_rank: int = 0, cp_rank: int = 0, consumed_samples: int = 0, num_workers: int = 0
) -> DataIterator:
    """A `DataIterator` with mbs, dp and cp from `dims` (a `ParallelDims`)."""
    return DataIterator(
        dataset,
        micro_batch_size=dims.micro_batch_size,
        dp_rank=dp_rank,
        dp_size=max(dims.dp, 1),
        consumed_samples=consumed_samples,
        cp_size=dims.cp,
        cp_rank=cp_rank,
        num_workers=num_workers,
    )


def build_data_iterators(
    cfg,
    dims,
    spec: Any,
    *,
    dp_rank: int = 0,
    cp_rank: int = 0,
    consumed_samples: int = 0,
    valid_samples: int | None = None,
    cache_dir: str | None = None,
    is_built_on_rank: Callable[[], bool] | None = None,
):
    """From a composed `Config`: (datasets, train iterator from `consumed_samples`, valid
    iterator or None). Seeds and sizes come from cfg.train / cfg.data, the vocabulary from the
    model description `spec`."""
    data = cfg.data
    # Optional DataConfig fields (read when the schema has them; defaults otherwise).
    flags = {
        k: bool(getattr(data, k, False))
        for k in ("create_attention_mask", "eod_mask_loss", "reset_position_ids", "reset_attention_mask")
    }
    ds = build_datasets(
        data,
        dims,
        seq_length=cfg.train.seq_length,
        seed=cfg.train.seed,
        train_steps=cfg.train.steps,
        valid_samples=valid_samples,
        model_vocab_size=spec.vocab_size,
        cache_dir=cache_dir or getattr(data, "cache_dir", None),
        is_built_on_rank=is_built_on_rank,
        **flags,
    )
    kw = dict(dp_rank=dp_rank, cp_rank=cp_rank, num_workers=cfg.data.num_workers)
    train = make_iterator(ds.train, dims, consumed_samples=consumed_samples, **kw)
    valid = make_iterator(ds.valid, dims, **kw) if ds.valid is not None and len(ds.valid) else None
    return ds, train, valid


__all__ = ["Datasets", "DatasetTokenizer", "build_data_iterators", "build_datasets", "make_iterator"]
