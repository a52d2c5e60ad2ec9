"""TEMPORARY: CPU fixes the bridge needs that `parallel/cpu.py` (the shim) does not cover yet.

Delete this file once the shim handles the point below; `apply()` is a no-op on CUDA hosts
and when the shim already fixed it.

1. Context parallelism: `rope_utils.get_pos_emb_on_this_cp_rank` builds its chunk index
   with `torch.tensor(..., pin_memory=True).cuda(non_blocking=True)`. The shim drops
   `pin_memory` but `Tensor.cuda()` still raises "Torch not compiled with CUDA enabled".
   Fix in the shim: add the function to the list wrapped with `_in_cuda_view` (as
   `broadcast_data`). Here: an identical function that indexes on the tensor's device,
   rebound in every megatron module that imported it.
"""

from __future__ import annotations

import sys

import torch

_APPLIED = False


def _pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[(seq_dim + 1):])
    pos_emb = pos_emb.index_select(seq_dim, cp_idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[(seq_dim + 2):])


def apply() -> None:
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding  # noqa: F401

    old = rope_utils.get_pos_emb_on_this_cp_rank
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("megatron.core") and getattr(mod, "get_pos_emb_on_this_cp_rank", None) is old:
            mod.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank
    _APPLIED = True
