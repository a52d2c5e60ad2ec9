"""DPO samples from a preference dataset (`data=preference`, `mbr data mode=preference`).

Sample i is one pair: its chosen and its rejected row side by side, every key a [2, seq_length]
tensor (row 0 chosen, row 1 rejected), each row built as an unpacked SFT sample is
(train/data/sft.py): inputs `ids[:-1]`, labels `ids[1:]`, loss mask `mask[1:]` (1 where the label
is a completion token), padded with loss mask 0. A row longer than seq_length + 1 tokens keeps its
first seq_length + 1 (the prompt first); the count is printed when the datasets are built.

The split is by pair, contiguous (data.split weights, megatron's rounding), and every epoch visits
the split's pairs in a permutation seeded by train.seed and the epoch, as SFT does. `collate`
gives the micro-batch of batching.collate over 2·len(samples) rows, pair k in rows 2k (chosen)
and 2k + 1 (rejected), so a DPO loss reads chosen rows as `[0::2]` and rejected as `[1::2]`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megatron_bridge.data.indexed import SPLITS
from megatron_bridge.data.preference import PreferencePairs, check_preference_data
from megatron_bridge.errors import UserError
from megatron_bridge.train.data.batching import collate
from megatron_bridge.train.data.sft import split_ranges

ROW_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
PAIR = "pair"


class PreferenceDataset:
    """Fixed-length pair samples over the pairs `split_range` of `prefix_or_datasets` (a
    preference dataset prefix, or its `PreferencePairs`); `num_samples=None`: one epoch."""

    def __init__(
        self,
        prefix_or_datasets: str | os.PathLike | PreferencePairs,
        split_range: Sequence[int],
        seq_length: int,
        seed: int,
        num_samples: int | None = None,
    ):
        pairs = (
            prefix_or_datasets
            if isinstance(prefix_or_datasets, PreferencePairs)
            else PreferencePairs(prefix_or_datasets)
        )
        self.pairs, self.seq_length = pairs, seq_length
        ids = np.asarray(split_range, dtype=np.int64)
        halves = [np.asarray(h.lengths, dtype=np.int64) for h in (pairs.chosen, pairs.rejected)]
        shortest = np.minimum(*halves)
        ids = ids[shortest[ids] >= 2]  # a row of one token has nothing to predict
        if ids.size == 0:
            raise UserError(f"{pairs.prefix}: no pair whose rows have 2 or more tokens in this split")
        self.truncated = int((np.maximum(*halves)[ids] > seq_length + 1).sum())
        order: list[int] = []
        epoch = 0
        while True:
            order += np.random.RandomState((seed + 7919 * epoch) % 2**32).permutation(ids).tolist()
            epoch += 1
            if num_samples is None or len(order) >= num_samples:
                break
        self._order = order if num_samples is None else order[:num_samples]

    def __len__(self) -> int:
        return len(self._order)

    def pair(self, i: int) -> int:
        """The pair index (into the preference dataset) that sample i holds."""
        return self._order[i]

    def _row(self, ids: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        s = self.seq_length
        ids, mask = ids[: s + 1], mask[: s + 1]
        n = ids.size - 1
        tokens, labels = np.zeros(s, np.int64), np.zeros(s, np.int64)
        loss = np.zeros(s, np.float32)
        tokens[:n], labels[:n], loss[:n] = ids[:-1], ids[1:], mask[1:]
        pos = np.concatenate([np.arange(n), np.arange(s - n)])
        return {"tokens": tokens, "labels": labels, "loss_mask": loss, "position_ids": pos}

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.pair_sample(self._order[i])

    def pair_sample(self, p: int) -> dict[str, Any]:
        """The sample of pair `p` (its index into the preference dataset, kept under `pair`: what
        `objective.precompute_reference` looks the reference log-probabilities up by)."""
        rows = [self._row(*half) for half in self.pairs[p]]
        out: dict[str, Any] = {k: torch.from_numpy(np.stack([r[k] for r in rows])) for k in ROW_KEYS}
        out[PAIR] = torch.tensor(p, dtype=torch.int64)
        return out

    @staticmethod
    def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
        """batching.collate over the pairs' rows: pair k → rows 2k (chosen) and 2k + 1 (rejected);
        `pair` [pairs]: each pair's index."""
        out = collate([{k: s[k][j] for k in ROW_KEYS} for s in samples for j in (0, 1)])
        out[PAIR] = torch.stack([s[PAIR] for s in samples])
        return out


def build_preference_datasets(
    data,
    *,
    seq_length: int,
    seed: int,
    train_samples: int,
    valid_samples: int | None,
    test_samples: int | None,
    model_vocab_size: int | None,
    log=print,
):
    """(train, valid, test, vocab, eod) for `data.kind=preference`: one preference dataset
    (data.paths=[PREFIX]), its halves checked like chat data (data/preference.py)."""
    prefix, vocab, eod = check_preference_data(data, model_vocab_size)
    pairs = PreferencePairs(prefix)
    wanted = {"train": train_samples, "valid": valid_samples, "test": test_samples}
    out = {}
    for name, r in zip(SPLITS, split_ranges(len(pairs), data.split)):
        n = wanted[name]
        out[name] = None if len(r) == 0 or n == 0 else PreferenceDataset(pairs, r, seq_length, seed, n)
    truncated = sum(d.truncated for d in out.values() if d is not None)
    if truncated and log and _rank() == 0:
        log(
            f"data=preference: {truncated} pair(s) with a row longer than train.seq_length+1={seq_length + 1} tokens truncated"
        )
    return out["train"], out["valid"], out["test"], vocab, eod


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


__all__ = ["PreferenceDataset", "build_preference_datasets"]
