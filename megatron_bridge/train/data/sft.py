"""Supervised fine-tuning samples from a chat dataset (`data=sft`, docs/finetune.md).

A chat dataset (`mbr data mode=chat`, format megatron_bridge.chat/1) holds one token sequence and
one loss mask per conversation. A conversation of L tokens gives L-1 training positions: inputs
`tokens[:-1]`, labels `tokens[1:]`, loss mask `mask[1:]` (the mask is per token; a label is trained
when the token it predicts is an assistant token). A conversation longer than train.seq_length + 1
tokens is truncated to its first seq_length + 1 tokens (make the data with `max_length` to control
this instead; the count is printed when the datasets are built).

The split is by conversation, contiguous (data.split weights, megatron's rounding), so the train
and valid conversations never mix. Every epoch visits the split's conversations in a permutation
seeded by train.seed and the epoch; samples are then built in that order:

* `packing=true`: greedy sequential packing — conversations are appended to the current sequence
  of seq_length tokens while they fit, else the sequence is closed (its tail padded) and the next
  one starts. Deterministic, and sample k's conversations follow sample k-1's, so the first n
  samples hold a prefix of the permutation. Each sample carries `segment_ids` (which conversation
  a position belongs to; the padded tail is a segment of its own), from which the model builds
  the cumulative sequence lengths of the block-diagonal causal attention (runtime/packing.py), and
  position ids restart at 0 for every conversation.
* `packing=false`: one conversation per sample, padded to seq_length (loss mask 0 on the pads).

Either way the loss is the sum of the masked token losses over the global batch divided by their
count (train/engines.py), so packed and padded samples of the same conversations give the same loss.

Image chats (format megatron_bridge.chat/2, docs/data.md "Image chats"): a sample also carries its
conversations' images (`image_refs`, in order; an image whose placeholders the inputs do not all
hold is refused), and `collate` turns a micro-batch's images into the model's image inputs
(`images`: pixel_values, image_grid_thw, ...) with the processor the data was made with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megatron_bridge.data.chat_dataset import ImageChatDataset
from megatron_bridge.data.indexed import check_indexed_data, parse_split
from megatron_bridge.errors import UserError
from megatron_bridge.train.data.batching import collate


def is_packed(data) -> bool:
    """Whether `data` (a DataConfig) yields packed samples (several conversations, or preference
    pairs, per sequence)."""
    return data.kind in ("sft", "preference") and bool(getattr(data, "packing", False))


def split_ranges(n: int, split: str) -> list[range]:
    """Conversation index ranges of the train/valid/test splits (contiguous, megatron's rounding)."""
    out, acc = [], 0.0
    for w in parse_split(split):
        out.append(range(int(round(acc * n)), int(round((acc + w) * n))))
        acc += w
    return out


class SFTDataset:
    """Fixed-length SFT samples over `conversations` (indices into `chat`, a `ChatDataset`): dicts
    of torch tensors with megatron's batch keys (module docstring). `num_samples=None`: one epoch."""

    def __init__(
        self,
        chat: Any,
        conversations: Sequence[int],
        seq_length: int,
        *,
        packing: bool,
        seed: int,
        num_samples: int | None = None,
    ):
        self.chat, self.seq_length, self.packing = chat, seq_length, packing
        ids = np.asarray(conversations, dtype=np.int64)
        # training positions per conversation after truncation; < 1 has nothing to predict
        self._positions = np.minimum(np.asarray(chat.lengths, dtype=np.int64), seq_length + 1) - 1
        ids = ids[self._positions[ids] >= 1]
        if ids.size == 0:
            raise UserError(f"{chat.prefix}: no conversation of 2 or more tokens in this split")
        self.truncated = int((np.asarray(chat.lengths)[ids] > seq_length + 1).sum())
        samples: list[list[int]] = []
        epoch = 0
        while True:
            perm = np.random.RandomState((seed + 7919 * epoch) % 2**32).permutation(ids)
            samples += self._pack(perm) if packing else [[int(c)] for c in perm]
            epoch += 1
            if num_samples is None or len(samples) >= num_samples:
                break
        self._samples = samples if num_samples is None else samples[:num_samples]

    def _pack(self, order: np.ndarray) -> list[list[int]]:
        out: list[list[int]] = []
        cur: list[int] = []
        used = 0
        for c in order.tolist():
            n = int(self._positions[c])
            if cur and used + n > self.seq_length:
                out.append(cur)
                cur, used = [], 0
            cur.append(c)
            used += n
        if cur:
            out.append(cur)
        return out

    def __len__(self) -> int:
        return len(self._samples)

    def conversations(self, i: int) -> list[int]:
        """The conversation indices (into the chat dataset) that sample i holds, in order."""
        return list(self._samples[i])

    def __getitem__(self, i: int) -> dict[str, Any]:
        s = self.seq_length
        tokens, labels = np.zeros(s, np.int64), np.zeros(s, np.int64)
        mask, pos = np.zeros(s, np.float32), np.zeros(s, np.int64)
        segs = self._samples[i]
        seg = np.full(s, len(segs), np.int64)  # the padded tail: a segment of its own
        off = 0
        for k, c in enumerate(segs):
            ids, m = self.chat[c][:2]  # an image chat gives its images third (`_images`)
            ids, m = ids[: s + 1], m[: s + 1]
            n = ids.size - 1
            tokens[off : off + n], labels[off : off + n] = ids[:-1], ids[1:]
            mask[off : off + n], pos[off : off + n], seg[off : off + n] = m[1:], np.arange(n), k
            off += n
        pos[off:] = np.arange(s - off)
        out: dict[str, Any] = {
            "tokens": torch.from_numpy(tokens),
            "labels": torch.from_numpy(labels),
            "loss_mask": torch.from_numpy(mask),
            "position_ids": torch.from_numpy(pos),
        }
        if self.packing:
            out["segment_ids"] = torch.from_numpy(seg)
        if isinstance(self.chat, ImageChatDataset) and self.chat.meta.get("images"):
            out["image_refs"] = self._images(segs)
        return out

    def _images(self, conversations: list[int]) -> list[Any]:
        """The images of a sample's conversations in order; one whose placeholders the sample's
        inputs do not all hold (tokens[:-1] of the first seq_length + 1) is refused: its features
        would outnumber its placeholders."""
        kept = []
        for c in conversations:
            n = int(self._positions[c])
            for im in self.chat.images(c):
                if im.start + im.tokens > n:
                    raise UserError(
                        f"{self.chat.prefix}: conversation {c} has an image at tokens {im.start}..{im.start + im.tokens - 1}, "
                        f"and a sample's inputs hold its first {n} tokens (train.seq_length={self.seq_length}; the last "
                        f"token kept is only a label): make the data with max_length={self.seq_length + 1} "
                        "(`mbr data mode=chat ... max_length=`), which never cuts an image nor ends on one"
                    )
                kept.append(im)
        return kept

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        """A micro-batch (train/data/batching.py `collate`), with its images' model inputs."""
        out = collate(samples)
        refs = [im for s in samples for im in s.get("image_refs", ())]
        if refs:
            out["images"] = self.chat.load_images(refs)
        return out


def build_sft_datasets(
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
    """(train, valid, test, vocab, eod) for `data.kind=sft`: one chat dataset (data.paths=[PREFIX]),
    checked like indexed data (the vocab against the model, every weighted split non-empty)."""
    prefixes, weights, vocab, eod = check_indexed_data(data, model_vocab_size)
    if weights is not None or len(prefixes) != 1:
        raise UserError(
            f"data=sft takes one chat dataset, data.paths=[PREFIX] (got {list(data.paths)}); combine the "
            "conversations into one jsonl and run `mbr data mode=chat` once"
        )
    chat = ImageChatDataset(prefixes[0])  # text chats too (no images)
    out = per_split(
        len(chat),
        data.split,
        (train_samples, valid_samples, test_samples),
        lambda r, n: SFTDataset(chat, r, seq_length, packing=is_packed(data), seed=seed, num_samples=n),
    )
    truncated = sum(d.truncated for d in out if d is not None)
    if truncated and log and global_rank() == 0:
        log(f"data=sft: {truncated} conversation(s) longer than train.seq_length+1={seq_length + 1} tokens truncated")
    return (*out, vocab, eod)


def per_split(n: int, split: str, samples: Sequence[int | None], make: Any) -> list[Any]:
    """[train, valid, test]: `make(range, num_samples)` over each split's contiguous range of the
    n items (`split_ranges`), None for an empty split or one asked for 0 samples."""
    return [None if len(r) == 0 or k == 0 else make(r, k) for r, k in zip(split_ranges(n, split), samples, strict=True)]


def global_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


__all__ = ["SFTDataset", "build_sft_datasets", "global_rank", "is_packed", "per_split", "split_ranges"]
