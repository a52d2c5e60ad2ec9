"""Write a chat dataset (data/chat_dataset.py) from rows of token ids and a loss mask: what
`preprocess_chat` renders, pre-tokenized chat rows (data/token_rows.py), and the two halves of
preference pairs (data/preference.py).

Every file goes under a temporary name; `publish` renames them (the token `.idx` last, so the
dataset exists for a reader only once it is complete) and `discard` removes them, so a failure
leaves nothing behind. `meta` gives the keys every chat dataset's `.meta.json` holds, which is
what `ChatDataset` and `check_indexed_data` read.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from megatron_bridge.data._fs import remove, temp_path_for
from megatron_bridge.data.chat import CHAT_FORMAT, MASK_SUFFIX, chat_paths
from megatron_bridge.data.helpers import quiet_megatron_import
from megatron_bridge.data.tokenizer import NO_EOS

PathLike = str | os.PathLike
MASK_MEANING = "loss_mask[i] = 1: token i belongs to an assistant turn (train on predicting it: labels = tokens[1:], loss_mask[1:])"


class ChatWriter:
    """Streams (ids, mask) rows into the chat dataset `prefix` under temporary names."""

    def __init__(self, prefix: PathLike, vocab_size: int):
        import numpy as np

        quiet_megatron_import()
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

        self.prefix, self.vocab_size = str(prefix), int(vocab_size)
        self.paths = chat_paths(self.prefix)
        self.dtype = DType.optimal_dtype(self.vocab_size)
        self.tmp = {k: temp_path_for(v) for k, v in self.paths.items()}
        self.rows = self.tokens = self.loss_tokens = 0
        self.max_id = -1
        self.build_id = uuid.uuid4().hex
        self._builders = [
            IndexedDatasetBuilder(self.tmp["bin"], dtype=self.dtype),
            IndexedDatasetBuilder(self.tmp["mask_bin"], dtype=np.uint8),
        ]

    def add(self, ids: Sequence[int], mask: Sequence[int]) -> None:
        import numpy as np

        arr = np.asarray(ids, dtype=np.int64)
        self._builders[0].add_document(arr, [arr.size])
        self._builders[1].add_document(np.asarray(mask, dtype=np.uint8), [arr.size])
        self.rows += 1
        self.tokens += arr.size
        self.loss_tokens += int(sum(mask))
        self.max_id = max(self.max_id, int(arr.max()) if arr.size else -1)

    def meta(self, *, tokenizer: str | None, eos_id: int | None, **extra: Any) -> dict[str, Any]:
        """The dataset's `.meta.json` (chat_dataset's keys; `extra` adds the writer's own)."""
        import numpy as np

        return {
            "format": CHAT_FORMAT,
            "build_id": self.build_id,
            "tokenizer": tokenizer,
            "loss_mask": {"prefix_suffix": MASK_SUFFIX, "dtype": "uint8", "meaning": MASK_MEANING},
            "documents": self.rows,
            "conversations": self.rows,
            "tokens": self.tokens,
            "loss_tokens": self.loss_tokens,
            "dtype": np.dtype(self.dtype).name,
            "vocab_size": self.vocab_size,
            "eos_id": NO_EOS if eos_id is None else int(eos_id),
            "max_token_id": self.max_id,
            **extra,
        }

    def publish(self, meta: dict[str, Any], before_index: Callable[[], None] | None = None) -> None:
        """Finish the files and rename them into place, the token `.idx` last (`before_index`
        publishes what else belongs to the dataset, e.g. image chats' sidecar, just before it)."""
        self._builders[1].finalize(self.tmp["mask_idx"])
        self._builders[0].finalize(self.tmp["idx"])
        with open(self.tmp["meta"], "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
        for k in ("bin", "mask_bin", "mask_idx"):
            os.replace(self.tmp[k], self.paths[k])
        if before_index is not None:
            before_index()
        for k in ("meta", "idx"):
            os.replace(self.tmp[k], self.paths[k])

    def discard(self) -> None:
        for b in self._builders:
            if not b.data_file.closed:
                b.data_file.close()
        for p in self.tmp.values():
            remove(p)
