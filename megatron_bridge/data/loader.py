"""Datasets and batches for training: megatron-core GPTDataset (or seeded synthetic tokens),
a DP-sharded, deterministic, resumable micro-batch iterator, and context-parallel slicing.

Sampling is Megatron's: the train dataset is a fixed, seeded permutation of samples
(`GPTDataset`'s shuffle index, built from `train.seed`); the global sample index of the
next sample is `consumed_samples`. Each micro-step takes the next `micro_batch_size · dp`
samples and DP rank r keeps the slice `[r·mbs, (r+1)·mbs)`, so the `grad_accum` micro-steps of
one optimizer step cover exactly the `global_batch_size` samples `[step·gbs, (step+1)·gbs)`,
disjointly across DP ranks. Resuming is starting the iterator at the checkpoint's
`consumed_samples` (= steps done · global batch): the batches that follow are the ones an
uninterrupted run would have seen. Context parallelism slices every micro-batch along the
sequence into 2·cp chunks, CP rank r keeping chunks r and 2·cp−1−r (megatron-core's
`get_batch_on_this_cp_rank`, which needs an initialized process group; `slice_for_cp` is
the same operation with explicit sizes).

Batches are dicts with megatron's keys: tokens, labels, loss_mask, position_ids ([mbs, seq]
each) and attention_mask (None: causal masking is left to the attention kernel, unless
`create_attention_mask`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from megatron_bridge.data.preprocess import output_paths, read_meta
from megatron_bridge.data.tokenizer import check_vocab, load_tokenizer, validate_tokenizer_dir
from megatron_bridge.errors import UserError

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
SPLITS = ("train", "valid", "test")
_SPLIT_SALT = {"train": 0, "valid": 1, "test": 2}


# -- what GPTDatasetConfig needs from a tokenizer -------------------------------------------------
class DatasetTokenizer:
    """The few tokenizer facts megatron-core's GPTDataset reads (vocab_size, eod, pad), plus
    `unique_identifiers`, which megatron hashes into its index-cache file names: it carries a
    fingerprint of the data files, so re-preprocessing a prefix never reuses stale indices.
    `pad` is -1 (megatron's "no pad id"): no real token is ever masked as padding."""

    def __init__(self, vocab_size: Optional[int], eod: Optional[int], name: str = "", fingerprint: str = ""):
        self.vocab_size = vocab_size
        self.eod = eod if eod is not None else -1
        self.eos = self.eod
        self.pad = -1
        self.unique_identifiers = {"class": "DatasetTokenizer", "name": name, "vocab_size": vocab_size,
                                   "eod": self.eod, "data": fingerprint}

    def __repr__(self) -> str:
        return f"DatasetTokenizer({self.unique_identifiers})"


# -- the synthetic dataset --------------------------------------------------------------------
class SyntheticGPTDataset:
    """Seeded random tokens with GPTDataset's sample layout. Sample i depends only on (seed,
    split, i): any order of access, any worker, any resume point gives the same sample."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int, split: str = "train",
                 create_attention_mask: bool = False):
        if vocab_size < 1 or seq_length < 1 or num_samples < 0:
            raise ValueError(f"bad synthetic dataset sizes: samples={num_samples} seq={seq_length} vocab={vocab_size}")
        self.num_samples, self.seq_length, self.vocab_size = num_samples, seq_length, vocab_size
        self.seed, self.split, self.create_attention_mask = seed, split, create_attention_mask

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, Any]:
        import numpy as np
        import torch

        if not 0 <= idx < self.num_samples:
            raise IndexError(idx)
        rng = np.random.default_rng([self.seed, _SPLIT_SALT[self.split], int(idx)])
        text = torch.from_numpy(rng.integers(0, self.vocab_size, size=self.seq_length + 1, dtype=np.int64))
        s = self.seq_length
        out = {"tokens": text[:-1].contiguous(), "labels": text[1:].contiguous(),
               "loss_mask": torch.ones(s, dtype=torch.float), "position_ids": torch.arange(s, dtype=torch.long)}
        if self.create_attention_mask:
            out["attention_mask"] = ~torch.tril(torch.ones(s, s, dtype=torch.bool)).unsqueeze(0)
        return out


# -- building the datasets ----------------------------------------------------------------------
@dataclass
class Datasets:
    train: Any
    valid: Any
    test: Any
    kind: str
    vocab_size: Optional[int]  # the data's token-id range (tokenizer size)
    eod: Optional[int]
    helpers: str = ""  # how megatron-core's C++ helpers were provided ("" for synthetic)

    def split(self, name: str) -> Any:
        return {"train": self.train, "valid": self.valid, "test": self.test}[name]


def parse_blend(paths: Sequence[str]) -> Tuple[List[str], Optional[List[float]]]:
    """`data.paths`: prefixes [p1, p2, ...] or weighted [w1, p1, w2, p2, ...] (megatron's
    --data-path syntax). Returns (prefixes, weights or None)."""
    paths = [str(p).strip() for p in paths]
    if not paths:
        raise UserError("data.kind=indexed needs data.paths: the prefix(es) of datasets made by `mbr data` "
                        "(e.g. data.paths=[/data/stdlib_text_document]), optionally weighted: [0.3,A,0.7,B]")

    def num(s: str) -> Optional[float]:
        try:
            return float(s)
        except ValueError:
            return None

    if len(paths) % 2 == 0 and all(num(w) is not None for w in paths[0::2]):
        weights = [num(w) for w in paths[0::2]]
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise UserError(f"data.paths weights {weights} must be >= 0 and not all 0")
        return paths[1::2], weights
    bad = [p for p in paths if num(p) is not None]
    if bad:
        raise UserError(f"data.paths={paths} mixes weights and prefixes; use [w1,prefix1,w2,prefix2,...] "
                        "with a weight before every prefix, or only prefixes")
    return paths, None


def parse_split(split: str) -> List[float]:
    """'98,2,0' → normalized [0.98, 0.02, 0.0]; UserError for anything else."""
    parts = [s.strip() for s in str(split).replace("/", ",").split(",")]
    try:
        vals = [float(s) for s in parts if s != ""]
    except ValueError:
        vals = []
    if not 1 <= len(vals) <= 3 or any(v < 0 for v in vals) or sum(vals) <= 0:
        raise UserError(f"data.split={split!r}: expected up to three non-negative train,valid,test weights "
                        "that are not all zero, e.g. data.split=98/2/0 (or, quoted for the shell, "
                        "'data.split=\"98,2,0\"')")
    vals += [0.0] * (3 - len(vals))
    return [v / sum(vals) for v in vals]


def _idx_lengths(prefix: str):
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


def check_indexed_data(data, model_vocab_size: Optional[int] = None
                       ) -> Tuple[List[str], Optional[List[float]], Optional[int], Optional[int]]:
    """Validate `data` (a DataConfig with kind=indexed) without building anything: every prefix
    exists, the data's token ids fit the tokenizer and the model, the tokenizer matches the
    one the data was made with, every split with a weight has documents. Returns
    (prefixes, weights, vocab_size, eod)."""
    prefixes, weights = parse_blend(data.paths)
    missing = [p for p in prefixes for f in ("bin", "idx") if not os.path.isfile(output_paths(p)[f])]
    if missing:
        raise UserError(
            "data.paths: indexed dataset(s) not found: "
            + ", ".join(sorted({p for p in missing}))
            + " (each prefix P needs P.bin and P.idx; make them with `mbr data input=... output=P tokenizer=DIR`)"
        )
    split = parse_split(data.split)
    metas = {p: read_meta(p) for p in prefixes}

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
            vocab, eod, tok_desc = int(m["vocab_size"]), int(m["eos_id"]), f"the tokenizer {m.get('tokenizer')} ({p}{'.meta.json'})"
            continue
        if int(m["max_token_id"]) >= vocab or int(m["eos_id"]) != eod or int(m["vocab_size"]) != vocab:
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
        for p, m in metas.items():
            if m and int(m["max_token_id"]) >= model_vocab_size:
                raise UserError(f"{p} holds token id {m['max_token_id']} ≥ model.vocab_size={model_vocab_size}")

    # Every split with a weight needs tokens: megatron-core builds it (even when no samples are
    # requested from it) and loops forever on an empty one.
    bounds, acc = [], 0.0
    for w in split:
        bounds.append((acc, acc + w) if w > 0 else None)
        acc += w
    for p in prefixes:
        lengths = _idx_lengths(p)
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


def _default_cache_dir(prefixes: Sequence[str]) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), "cache")


def build_datasets(data, dims, *, seq_length: int, seed: int, train_steps: int,
                   valid_samples: Optional[int] = None, test_samples: Optional[int] = None,
                   model_vocab_size: Optional[int] = None, cache_dir: Optional[str] = None,
                   create_attention_mask: bool = False, eod_mask_loss: bool = False,
                   reset_position_ids: bool = False, reset_attention_mask: bool = False,
                   is_built_on_rank: Optional[Callable[[], bool]] = None) -> Datasets:
    """Build the train/valid/test datasets for `data` (a `DataConfig`).

    The train split holds at least `train_steps · dims.global_batch_size` samples; valid and
    test hold `valid_samples`/`test_samples` (None: one epoch of their split; a 0-weight
    split is None). `kind=indexed` goes through megatron-core's `BlendedMegatronDatasetBuilder`
    with a `GPTDatasetConfig` seeded by `seed` (a blend when data.paths has several prefixes);
    its sample/shuffle indices are cached in `cache_dir` (default: `cache/` next to the first
    prefix). Under torch.distributed, call it on every rank (megatron builds on rank 0 first,
    then the others load its cache). `kind=synthetic` needs `model_vocab_size`.
    All user errors surface before megatron-core is imported."""
    if seq_length < 1:
        raise UserError(f"train.seq_length={seq_length} must be >= 1")
    if dims.cp > 1 and seq_length % (2 * dims.cp):
        raise UserError(f"train.seq_length={seq_length} is not divisible by 2·cp = {2 * dims.cp} (context "
                        "parallelism cuts each sequence into 2·cp chunks)")
    if dims.global_batch_size < 1 or train_steps < 0:
        raise UserError(f"bad sizes: train steps {train_steps}, global batch {dims.global_batch_size}")
    train_samples = train_steps * dims.global_batch_size
    kind = data.kind

    if kind == "synthetic":
        vocab = model_vocab_size
        if data.tokenizer:
            vocab = check_vocab(data.tokenizer, model_vocab_size) if model_vocab_size else len(load_tokenizer(data.tokenizer))
        if vocab is None:
            raise UserError("data.kind=synthetic needs a vocab size: pass the model's vocab_size")
        n_valid = valid_samples if valid_samples is not None else 4 * dims.global_batch_size
        n_test = test_samples if test_samples is not None else 0
        mk = lambda n, split: SyntheticGPTDataset(n, seq_length, vocab, seed, split, create_attention_mask)
        return Datasets(mk(train_samples, "train"), mk(n_valid, "valid") if n_valid else None,
                        mk(n_test, "test") if n_test else None, kind, vocab, None)

    if kind != "indexed":
        raise UserError(f"data.kind={kind!r}: expected 'indexed' (megatron-core .bin/.idx made by `mbr data`) or "
                        "'synthetic' (seeded random tokens)")

    prefixes, weights, vocab, eod = check_indexed_data(data, model_vocab_size)
    # A size of 0 ("not wanted") is built as one epoch (megatron builds the split anyway).
    sizes = [train_samples] + [None if n == 0 else n for n in (valid_samples, test_samples)]
    if weights is not None and None in sizes:
        # megatron-core needs a size per split for a weighted blend: take about one epoch's worth.
        tokens = sum(int(_idx_lengths(p).sum()) for p in prefixes)
        per_epoch = [max(1, int(tokens * w) // seq_length) for w in parse_split(data.split)]
        sizes = [n if n is not None else per_epoch[i] for i, n in enumerate(sizes)]
    if (eod_mask_loss or reset_position_ids or reset_attention_mask) and eod is None:
        raise UserError("eod_mask_loss/reset_position_ids/reset_attention_mask need the eos id: set data.tokenizer")
    cache = os.path.abspath(cache_dir or _default_cache_dir(prefixes))
    try:
        os.makedirs(cache, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the dataset index cache {cache}: {e.strerror or e}; pass a writable "
                        "cache directory") from e
    if not os.access(cache, os.W_OK):
        raise UserError(f"the dataset index cache {cache} is not writable; pass a writable cache directory")

    from megatron_bridge.data.helpers import ensure_helpers

    how = ensure_helpers()
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    tokenizer = DatasetTokenizer(vocab, eod, name=str(data.tokenizer or ""), fingerprint=_fingerprint(prefixes))
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=(prefixes, weights), split=data.split,
        path_to_cache=cache, tokenizer=tokenizer, mmap_bin_files=True,
        reset_position_ids=reset_position_ids, reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss, create_attention_mask=create_attention_mask,
    )
    with _rank0_without_process_group():
        train, valid, test = BlendedMegatronDatasetBuilder(
            GPTDataset, sizes, is_built_on_rank or (lambda: True), config).build()
    valid = None if valid_samples == 0 else valid  # built by megatron anyway; not wanted
    test = None if test_samples == 0 else test
    return Datasets(train, valid, test, kind, vocab, eod, how)


@contextlib.contextmanager
def _rank0_without_process_group():
    """megatron-core 0.16.1's BlendedDataset._build_indices calls torch.distributed.get_rank()
    without checking is_initialized() (GPTDataset does check), so a weighted blend fails in a
    single process with "Default process group has not been initialized". Without a process
    group, answer rank 0 while the datasets are built; with one, change nothing."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        yield
        return
    from unittest import mock

    with mock.patch.object(torch.distributed, "get_rank", lambda group=None: 0):
        yield


# -- sampling and batching ------------------------------------------------------------------
class PretrainingSampler:
    """Megatron-LM's `MegatronPretrainingSampler`: from global sample `consumed_samples`,
    every `micro_batch_size · dp_size` consecutive indices form one micro-step; DP rank r gets
    the slice [r·mbs, (r+1)·mbs). Yields lists of dataset indices (a torch batch sampler)."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, drop_last: bool = True):
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"bad sampler sizes: mbs={micro_batch_size} dp_rank={dp_rank} dp_size={dp_size}")
        step = micro_batch_size * dp_size
        if consumed_samples < 0 or consumed_samples % step:
            raise UserError(
                f"cannot resume at consumed_samples={consumed_samples}: it must be a multiple of "
                f"micro_batch_size·dp = {step} (a checkpoint saved with another global batch size?)")
        if consumed_samples > total_samples:
            raise UserError(f"consumed_samples={consumed_samples} is past the end of the dataset "
                            f"({total_samples} samples)")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.dp_rank, self.dp_size, self.drop_last = micro_batch_size, dp_rank, dp_size, drop_last

    def __len__(self) -> int:
        step = self.micro_batch_size * self.dp_size
        left = self.total_samples - self.consumed_samples
        rem = left % step
        return left // step + (1 if rem > self.dp_rank * self.micro_batch_size and not self.drop_last else 0)

    def __iter__(self) -> Iterator[List[int]]:
        step = self.micro_batch_size * self.dp_size
        beg = self.dp_rank * self.micro_batch_size
        first = self.consumed_samples
        while first + step <= self.total_samples:
            yield list(range(first + beg, first + beg + self.micro_batch_size))
            first += step
        if not self.drop_last:  # the short last micro-step: each rank its part of what is left
            idx = list(range(first, self.total_samples))[beg:beg + self.micro_batch_size]
            if idx:
                yield idx


def collate(samples: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Stack samples into a micro-batch with megatron's keys (attention_mask None if absent)."""
    import torch

    out: Dict[str, Any] = {}
    for key in BATCH_KEYS:
        vals = [s.get(key) for s in samples]
        out[key] = None if any(v is None for v in vals) else torch.stack(vals)
    return out


def slice_for_cp(batch: Dict[str, Any], cp_size: int, cp_rank: int) -> Dict[str, Any]:
    """Megatron's load-balanced context-parallel split (`megatron.core.utils.
    get_batch_on_this_cp_rank`) with explicit sizes: the sequence dimension (dim 1; dim 2 for a
    [b, 1, s, s] attention_mask) is cut into 2·cp equal chunks and CP rank r keeps chunks r and
    2·cp−1−r, concatenated. Returns a new dict; None values stay None."""
    if cp_size <= 1:
        return dict(batch)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} not in [0, {cp_size})")
    import torch

    out = {}
    for key, val in batch.items():
        if val is None:
            out[key] = None
            continue
        dim = 2 if key == "attention_mask" else 1
        s = val.shape[dim]
        if s % (2 * cp_size):
            raise UserError(f"{key}: sequence length {s} is not divisible by 2·cp = {2 * cp_size}")
        v = val.view(*val.shape[:dim], 2 * cp_size, s // (2 * cp_size), *val.shape[dim + 1:])
        index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], dtype=torch.int64, device=val.device)
        v = v.index_select(dim, index)
        out[key] = v.reshape(*v.shape[:dim], -1, *v.shape[dim + 2:])
    return out


class DataIterator:
    """Micro-batches for one DP rank (and CP rank), from global sample `consumed_samples` on.

    `consumed_samples` advances by `micro_batch_size · dp_size` per micro-batch (the same on
    every rank); save it with a checkpoint (`state_dict()`) and pass it back to resume.
    Deterministic: the batches depend only on the dataset (its seed), the sizes and the
    starting point, not on num_workers or on how many times the iterator was rebuilt."""

    def __init__(self, dataset, *, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 consumed_samples: int = 0, cp_size: int = 1, cp_rank: int = 0, num_workers: int = 0,
                 drop_last: bool = True):
        self.dataset = dataset
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.cp_size, self.cp_rank, self.num_workers = cp_size, cp_rank, num_workers
        self.sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size,
                                          drop_last)
        self.consumed_samples = consumed_samples
        self._it: Optional[Iterator] = None

    def __len__(self) -> int:
        """Micro-batches left from the starting point."""
        return len(self.sampler)

    def __iter__(self) -> "DataIterator":
        return self

    def _loader(self) -> Iterator:
        if self.num_workers == 0:  # no DataLoader machinery: plain, deterministic, cheap
            return (collate([self.dataset[i] for i in idx]) for idx in self.sampler)
        import torch

        return iter(torch.utils.data.DataLoader(self.dataset, batch_sampler=self.sampler,
                                                num_workers=self.num_workers, collate_fn=collate,
                                                persistent_workers=False))

    def __next__(self) -> Dict[str, Any]:
        if self._it is None:
            self._it = self._loader()
        batch = next(self._it)
        self.consumed_samples += self.micro_batch_size * self.dp_size
        return slice_for_cp(batch, self.cp_size, self.cp_rank) if self.cp_size > 1 else batch

    def global_batch(self, num_microbatches: int) -> List[Dict[str, Any]]:
        """The next `num_microbatches` micro-batches: this rank's share of one optimizer step."""
        return [next(self) for _ in range(num_microbatches)]

    def state_dict(self) -> Dict[str, int]:
        return {"consumed_samples": self.consumed_samples}


def make_iterator(dataset, dims, *, dp_rank: int = 0, cp_rank: int = 0, consumed_samples: int = 0,
                  num_workers: int = 0) -> DataIterator:
    """A `DataIterator` with mbs, dp and cp from `dims` (a `ParallelDims`)."""
    return DataIterator(dataset, micro_batch_size=dims.micro_batch_size, dp_rank=dp_rank, dp_size=max(dims.dp, 1),
                        consumed_samples=consumed_samples, cp_size=dims.cp, cp_rank=cp_rank, num_workers=num_workers)


def build_data_iterators(cfg, dims, *, dp_rank: int = 0, cp_rank: int = 0, consumed_samples: int = 0,
                         valid_samples: Optional[int] = None, cache_dir: Optional[str] = None,
                         is_built_on_rank: Optional[Callable[[], bool]] = None):
    """From a composed `Config`: (datasets, train iterator from `consumed_samples`, valid
    iterator or None). Seeds, sizes and vocab come from cfg.train / cfg.model / cfg.data."""
    data = cfg.data
    # Optional DataConfig fields (read when the schema has them; defaults otherwise).
    flags = {k: bool(getattr(data, k, False)) for k in
             ("create_attention_mask", "eod_mask_loss", "reset_position_ids", "reset_attention_mask")}
    ds = build_datasets(data, dims, seq_length=cfg.train.seq_length, seed=cfg.train.seed,
                        train_steps=cfg.train.steps, valid_samples=valid_samples,
                        model_vocab_size=cfg.model.vocab_size, cache_dir=cache_dir or getattr(data, "cache_dir", None),
                        is_built_on_rank=is_built_on_rank, **flags)
    kw = dict(dp_rank=dp_rank, cp_rank=cp_rank, num_workers=cfg.data.num_workers)
    train = make_iterator(ds.train, dims, consumed_samples=consumed_samples, **kw)
    valid = make_iterator(ds.valid, dims, **kw) if ds.valid is not None and len(ds.valid) else None
    return ds, train, valid


__all__ = [
    "BATCH_KEYS", "DataIterator", "Datasets", "DatasetTokenizer", "PretrainingSampler", "SyntheticGPTDataset",
    "build_data_iterators", "build_datasets", "check_indexed_data", "collate", "make_iterator", "parse_blend",
    "parse_split", "slice_for_cp",
]
