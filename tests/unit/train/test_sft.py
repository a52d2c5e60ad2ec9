"""data=sft samples (train/data/sft.py) and their packing description (runtime/packing.py), on a chat
dataset stand-in with known conversations; the end-to-end parity against transformers is
tests/dist/test_sft_parity.py."""

import numpy as np
import pytest
import torch

from megatron_bridge.runtime.packing import cu_seqlens, model_inputs, schedule_shape, segment_mask
from megatron_bridge.train.data.batching import collate
from megatron_bridge.train.data.sft import SFTDataset, split_ranges

SEQ = 16


class FakeChat:
    """Conversation i: tokens 100·i + 0..L-1, mask 1 on the second half."""

    prefix = "fake"

    def __init__(self, lengths):
        self.lengths = np.asarray(lengths, dtype=np.int32)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        n = int(self.lengths[i])
        mask = np.zeros(n, np.uint8)
        mask[n // 2 :] = 1
        return np.arange(n, dtype=np.int64) + 100 * i, mask


CHAT = FakeChat([5, 9, 1, 30, 7, 4, 12, 6])  # conversation 2 has nothing to predict, 3 is too long


def test_packed_samples_hold_whole_conversations_in_permutation_order():
    ds = SFTDataset(CHAT, range(8), SEQ, packing=True, seed=3, num_samples=20)
    again = SFTDataset(CHAT, range(8), SEQ, packing=True, seed=3, num_samples=20)
    assert len(ds) == 20 and all(ds.conversations(i) == again.conversations(i) for i in range(20))  # deterministic
    flat = [c for i in range(len(ds)) for c in ds.conversations(i)]
    epoch = flat[:7]
    assert sorted(epoch) == [0, 1, 3, 4, 5, 6, 7]  # each once per epoch, conversation 2 left out
    assert ds.truncated == 1
    start = 0  # position of sample i's first conversation in `flat`
    for i in range(len(ds)):
        convs, s = ds.conversations(i), ds[i]
        used = [min(int(CHAT.lengths[c]), SEQ + 1) - 1 for c in convs]
        assert sum(used) <= SEQ
        off = 0
        for k, (c, n) in enumerate(zip(convs, used)):
            ids, mask = CHAT[c]
            assert s["tokens"][off : off + n].tolist() == ids[:n].tolist()
            assert s["labels"][off : off + n].tolist() == ids[1 : n + 1].tolist()
            assert s["loss_mask"][off : off + n].tolist() == mask[1 : n + 1].tolist()
            assert s["position_ids"][off : off + n].tolist() == list(range(n))  # restart per conversation
            assert set(s["segment_ids"][off : off + n].tolist()) == {k}
            off += n
        assert s["loss_mask"][off:].sum() == 0 and set(s["segment_ids"][off:].tolist()) <= {len(convs)}
        start += len(convs)
        if start < 7:  # greedy: within an epoch, a sample is closed only when the next conversation does not fit
            nxt = min(int(CHAT.lengths[flat[start]]), SEQ + 1) - 1
            assert sum(used) + nxt > SEQ


def test_padded_samples_are_one_conversation_each_in_the_same_order():
    packed = SFTDataset(CHAT, range(8), SEQ, packing=True, seed=3, num_samples=3)
    padded = SFTDataset(CHAT, range(8), SEQ, packing=False, seed=3, num_samples=7)
    order = [c for i in range(3) for c in packed.conversations(i)]
    assert [padded.conversations(i)[0] for i in range(len(order))] == order
    s = padded[0]
    n = min(int(CHAT.lengths[order[0]]), SEQ + 1) - 1
    assert "segment_ids" not in s and s["loss_mask"][n:].sum() == 0 and s["tokens"].shape == (SEQ,)
    assert collate([padded[0], padded[1]])["segment_ids"] is None


def test_split_ranges_are_contiguous_and_disjoint():
    assert split_ranges(10, "80,20,0") == [range(0, 8), range(8, 10), range(10, 10)]
    assert split_ranges(7, "1/1/1")[2].stop == 7


def test_cu_seqlens_and_block_diagonal_causal_mask():
    seg = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 0, 1, 1, 1, 1]])
    cu = cu_seqlens(seg)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 6, 8, 12]
    m = segment_mask(cu, 12)
    assert m[2, :3].all() and not m[3, :3].any() and m[4, 3:5].all() and not m[1, 2]  # causal, per segment
    assert m[6].tolist() == [False] * 6 + [True] + [False] * 5  # a new row starts a new sequence


def test_model_inputs_flatten_packed_batches_only():
    batch = collate([SFTDataset(CHAT, range(8), SEQ, packing=True, seed=0, num_samples=2)[i] for i in range(2)])
    args, kw = model_inputs(batch)
    assert args[0].shape == (1, 2 * SEQ) and kw["labels"].shape == (1, 2 * SEQ)
    p = kw["packed_seq_params"]
    assert p.qkv_format == "thd" and p.cu_seqlens_q[-1] == 2 * SEQ and p.max_seqlen_q <= SEQ
    assert torch.equal(args[0].view(2, SEQ), batch["tokens"])
    plain = collate([SFTDataset(CHAT, range(8), SEQ, packing=False, seed=0, num_samples=2)[i] for i in range(2)])
    args, kw = model_inputs(plain)
    assert args[0].shape == (2, SEQ) and set(kw) == {"labels"}
    assert schedule_shape(SEQ, 2, packed=True) == (2 * SEQ, 1) and schedule_shape(SEQ, 2, packed=False) == (SEQ, 2)


def test_a_split_without_trainable_conversations_is_refused():
    from megatron_bridge.errors import UserError

    with pytest.raises(UserError, match="no conversation of 2 or more tokens"):
        SFTDataset(CHAT, [2], SEQ, packing=True, seed=0)
