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

Packed (`data.packing=true`): a sample is one row of seq_length holding whole pairs, greedily in
the permutation's order as SFT packs conversations — pair k's chosen sequence, then its rejected
one, each a segment of its own (`segment_ids`: block-diagonal causal attention, positions
restarting), the padded tail a last segment; a pair whose two sequences do not fit one row
together has each cut to its first seq_length//2 + 1 tokens (counted as truncated). Segments in
order are chosen, rejected, chosen, … of the pairs `pair` lists, in that order too.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megatron_bridge.data.preference import PreferencePairs, check_preference_data
from megatron_bridge.errors import UserError
from megatron_bridge.train.data.batching import collate
from megatron_bridge.train.data.sft import global_rank, is_packed, per_split

ROW_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
PAIR = "pair"


def rows_per_sample(data) -> int:
    """Model rows a preference sample is: its chosen and rejected rows, or one packed row."""
    return 1 if is_packed(data) else 2


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
        *,
        packing: bool = False,
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
        self.packing = packing
        # tokens kept per row: a packed pair whose two rows do not fit one row shares it evenly
        longest = np.minimum(halves[0], seq_length + 1) + np.minimum(halves[1], seq_length + 1) - 2 > seq_length
        self._cap = np.where(packing & longest, seq_length // 2 + 1, seq_length + 1)
        self._positions = np.minimum(halves[0], self._cap) + np.minimum(halves[1], self._cap) - 2
        self.truncated = int((np.maximum(*halves)[ids] > self._cap[ids]).sum())
        samples: list[list[int]] = []
        epoch = 0
        while True:
            perm = np.random.RandomState((seed + 7919 * epoch) % 2**32).permutation(ids).tolist()
            samples += self._pack(perm) if packing else [[p] for p in perm]
            epoch += 1
            if num_samples is None or len(samples) >= num_samples:
                break
        self._samples = samples if num_samples is None else samples[:num_samples]

    def _pack(self, order: list[int]) -> list[list[int]]:
        out: list[list[int]] = []
        cur: list[int] = []
        used = 0
        for p in order:
            n = int(self._positions[p])
            if cur and used + n > self.seq_length:
                out.append(cur)
                cur, used = [], 0
            cur.append(p)
            used += n
        return out + [cur] if cur else out

    def __len__(self) -> int:
        return len(self._samples)

    def pairs_of(self, i: int) -> list[int]:
        """The pair indices (into the preference dataset) that sample i holds, in order."""
        return list(self._samples[i])

    def pair(self, i: int) -> int:
        """The pair an unpacked sample i holds."""
        return self._samples[i][0]

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
        return self.sample_of(self._samples[i])

    def sample_of(self, pairs: list[int]) -> dict[str, Any]:
        """The sample of `pairs` (one unless packed), their indices kept under `pair` (what
        `objective.precompute_reference` looks the reference log-probabilities up by)."""
        if not self.packing:
            rows = [self._row(*half) for half in self.pairs[pairs[0]]]
            out: dict[str, Any] = {k: torch.from_numpy(np.stack([r[k] for r in rows])) for k in ROW_KEYS}
        else:
            out = self._packed(pairs)
        out[PAIR] = torch.tensor(pairs, dtype=torch.int64)
        return out

    def _packed(self, pairs: list[int]) -> dict[str, Any]:
        s = self.seq_length
        tokens, labels = np.zeros(s, np.int64), np.zeros(s, np.int64)
        mask, pos = np.zeros(s, np.float32), np.zeros(s, np.int64)
        seg = np.full(s, 2 * len(pairs), np.int64)  # the padded tail: a segment of its own
        off = k = 0
        for p in pairs:
            cap = int(self._cap[p])
            for ids, m in self.pairs[p]:
                ids, m = ids[:cap], m[:cap]
                n = ids.size - 1
                tokens[off : off + n], labels[off : off + n] = ids[:-1], ids[1:]
                mask[off : off + n], pos[off : off + n], seg[off : off + n] = m[1:], np.arange(n), k
                off, k = off + n, k + 1
        pos[off:] = np.arange(s - off)
        arrays = {"tokens": tokens, "labels": labels, "loss_mask": mask, "position_ids": pos, "segment_ids": seg}
        return {key: torch.from_numpy(v) for key, v in arrays.items()}

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        """batching.collate over the samples' rows — unpacked, pair k → rows 2k (chosen) and 2k + 1
        (rejected); packed, one row per sample — and `pair` [pairs]: the pairs in order."""
        rows = samples if self.packing else [{k: s[k][j] for k in ROW_KEYS} for s in samples for j in (0, 1)]
        out = collate(rows)
        out[PAIR] = torch.cat([s[PAIR] for s in samples])
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
    out = per_split(
        len(pairs),
        data.split,
        (train_samples, valid_samples, test_samples),
        lambda r, n: PreferenceDataset(pairs, r, seq_length, seed, n, packing=is_packed(data)),
    )
    truncated = sum(d.truncated for d in out if d is not None)
    if truncated and log and global_rank() == 0:
        log(
            f"data=preference: {truncated} pair(s) with a row longer than train.seq_length+1={seq_length + 1} tokens truncated"
        )
    return (*out, vocab, eod)


__all__ = ["PAIR", "PreferenceDataset", "build_preference_datasets", "rows_per_sample"]
