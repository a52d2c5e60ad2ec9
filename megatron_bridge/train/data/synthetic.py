"""`SyntheticGPTDataset`: seeded random tokens shaped like megatron-core's GPTDataset samples.

`data.kind=synthetic` exercises the whole training path (sampling, DP/CP sharding, resume)
with no files and no tokenizer, so it must be as deterministic as the real data: a sample is
a function of (seed, split, index) alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_SPLIT_SALT = {"train": 0, "valid": 1, "test": 2}


class SyntheticGPTDataset:
    """Seeded random tokens with GPTDataset's sample layout. Sample i depends only on (seed,
    split, i): any order of access, any worker, any resume point gives the same sample."""

    def __init__(
        self,
        num_samples: int,
        seq_length: int,
        vocab_size: int,
        seed: int,
        split: str = "train",
        create_attention_mask: bool = False,
    ):
        if vocab_size < 1 or seq_length < 1 or num_samples < 0:
            raise ValueError(f"bad synthetic dataset sizes: samples={num_samples} seq={seq_length} vocab={vocab_size}")
        self.num_samples, self.seq_length, self.vocab_size = num_samples, seq_length, vocab_size
        self.seed, self.split, self.create_attention_mask = seed, split, create_attention_mask

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, Any]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(idx)
        rng = np.random.default_rng([self.seed, _SPLIT_SALT[self.split], int(idx)])
        text = torch.from_numpy(rng.integers(0, self.vocab_size, size=self.seq_length + 1, dtype=np.int64))
        s = self.seq_length
        out = {
            "tokens": text[:-1].contiguous(),
            "labels": text[1:].contiguous(),
            "loss_mask": torch.ones(s, dtype=torch.float),
            "position_ids": torch.arange(s, dtype=torch.long),
        }
        if self.create_attention_mask:
            out["attention_mask"] = ~torch.tril(torch.ones(s, s, dtype=torch.bool)).unsqueeze(0)
        return out


__all__ = ["SyntheticGPTDataset"]
