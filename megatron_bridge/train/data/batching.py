"""Per-rank micro-batches: Megatron's DP-sharded, deterministic, resumable sampling,
collation, and context-parallel slicing. Independent of how the dataset was built (any
indexable dataset of sample dicts), so it needs torch but not megatron-core.

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
`create_attention_mask`); segment_ids [mbs, seq] only for packed SFT samples (train/data/sft.py), else None;
images (a dict of tensors: a VLM's image inputs for the micro-batch) only for image chats.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from megatron_bridge.errors import UserError

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids", "segment_ids")


class PretrainingSampler:
    """Megatron-LM's `MegatronPretrainingSampler`: from global sample `consumed_samples`,
    every `micro_batch_size · dp_size` consecutive indices form one micro-step; DP rank r gets
    the slice [r·mbs, (r+1)·mbs). Yields lists of dataset indices (a torch batch sampler)."""

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        drop_last: bool = True,
    ):
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"bad sampler sizes: mbs={micro_batch_size} dp_rank={dp_rank} dp_size={dp_size}")
        step = micro_batch_size * dp_size
        if consumed_samples < 0 or consumed_samples % step:
            raise UserError(
                f"cannot resume at consumed_samples={consumed_samples}: it must be a multiple of "
                f"micro_batch_size·dp = {step} (a checkpoint saved with another global batch size?)"
            )
        if consumed_samples > total_samples:
            raise UserError(
                f"consumed_samples={consumed_samples} is past the end of the dataset ({total_samples} samples)"
            )
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.dp_rank, self.dp_size, self.drop_last = (
            micro_batch_size,
            dp_rank,
            dp_size,
            drop_last,
        )

    def __len__(self) -> int:
        step = self.micro_batch_size * self.dp_size
        left = self.total_samples - self.consumed_samples
        rem = left % step
        return left // step + (1 if rem > self.dp_rank * self.micro_batch_size and not self.drop_last else 0)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_size * self.dp_size
        beg = self.dp_rank * self.micro_batch_size
        first = self.consumed_samples
        while first + step <= self.total_samples:
            yield list(range(first + beg, first + beg + self.micro_batch_size))
            first += step
        if not self.drop_last:  # the short last micro-step: each rank its part of what is left
            idx = list(range(first, self.total_samples))[beg : beg + self.micro_batch_size]
            if idx:
                yield idx


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack samples into a micro-batch with megatron's keys (attention_mask None if absent)."""
    out: dict[str, Any] = {}
    for key in BATCH_KEYS:
        vals = [s[key] for s in samples if s.get(key) is not None]
        out[key] = torch.stack(vals) if len(vals) == len(samples) else None
    return out


def slice_for_cp(batch: dict[str, Any], cp_size: int, cp_rank: int) -> dict[str, Any]:
    """Megatron's load-balanced context-parallel split (`megatron.core.utils.
    get_batch_on_this_cp_rank`) with explicit sizes: the sequence dimension (dim 1; dim 2 for a
    [b, 1, s, s] attention_mask) is cut into 2·cp equal chunks and CP rank r keeps chunks r and
    2·cp−1−r, concatenated. Returns a new dict; None values stay None."""
    if cp_size <= 1:
        return dict(batch)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} not in [0, {cp_size})")
    out: dict[str, Any] = {}
    for key, val in batch.items():
        if val is None or key == "images":  # a VLM's image inputs: whole (a VLM runs at cp=1)
            out[key] = val
            continue
        dim = 2 if key == "attention_mask" else 1
        s = val.shape[dim]
        if s % (2 * cp_size):
            raise UserError(f"{key}: sequence length {s} is not divisible by 2·cp = {2 * cp_size}")
        v = val.view(*val.shape[:dim], 2 * cp_size, s // (2 * cp_size), *val.shape[dim + 1 :])
        index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], dtype=torch.int64, device=val.device)
        v = v.index_select(dim, index)
        out[key] = v.reshape(*v.shape[:dim], -1, *v.shape[dim + 2 :])
    return out


class DataIterator:
    """Micro-batches for one DP rank (and CP rank), from global sample `consumed_samples` on.

    `consumed_samples` advances by `micro_batch_size · dp_size` per micro-batch (the same on
    every rank); save it with a checkpoint (`state_dict()`) and pass it back to resume.
    Deterministic: the batches depend only on the dataset (its seed), the sizes and the
    starting point, not on num_workers or on how many times the iterator was rebuilt."""

    def __init__(
        self,
        dataset,
        *,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        consumed_samples: int = 0,
        cp_size: int = 1,
        cp_rank: int = 0,
        num_workers: int = 0,
        drop_last: bool = True,
    ):
        self.dataset = dataset
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.cp_size, self.cp_rank, self.num_workers = cp_size, cp_rank, num_workers
        self.sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size, drop_last)
        self.consumed_samples = consumed_samples
        self._it: Iterator | None = None

    def __len__(self) -> int:
        """Micro-batches left from the starting point."""
        return len(self.sampler)

    def __iter__(self) -> DataIterator:
        return self

    def _loader(self) -> Iterator:
        join = getattr(self.dataset, "collate", collate)  # a dataset's own (image chats: their image inputs)
        if self.num_workers == 0:  # no DataLoader machinery: plain, deterministic, cheap
            return (join([self.dataset[i] for i in idx]) for idx in self.sampler)
        return iter(
            torch.utils.data.DataLoader(
                self.dataset,
                batch_sampler=self.sampler,
                num_workers=self.num_workers,
                collate_fn=join,
                persistent_workers=False,
            )
        )

    def __next__(self) -> dict[str, Any]:
        if self._it is None:
            self._it = self._loader()
        batch = next(self._it)
        self.consumed_samples += self.micro_batch_size * self.dp_size
        return slice_for_cp(batch, self.cp_size, self.cp_rank) if self.cp_size > 1 else batch

    def global_batch(self, num_microbatches: int) -> list[dict[str, Any]]:
        """The next `num_microbatches` micro-batches: this rank's share of one optimizer step."""
        return [next(self) for _ in range(num_microbatches)]

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}


__all__ = ["BATCH_KEYS", "DataIterator", "PretrainingSampler", "collate", "slice_for_cp"]
