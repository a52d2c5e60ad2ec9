"""data=preference samples (train/data/preference.py) on a preference dataset written by
`preprocess_preference` from token-id pairs: each half of a sample is the unpacked SFT sample of
that half (train/data/sft.py as the oracle), the loss mask covers exactly the completion labels,
and `collate` interleaves pairs as rows 2k (chosen), 2k + 1 (rejected)."""

import json

import numpy as np
import pytest
import torch

from megatron_bridge.config.schema import DataConfig
from megatron_bridge.data.preference import PreferencePairs, preprocess_preference
from megatron_bridge.errors import UserError
from megatron_bridge.parallel.dims import ParallelDims
from megatron_bridge.train.data.batching import BATCH_KEYS, collate
from megatron_bridge.train.data.loader import build_datasets, make_iterator
from megatron_bridge.train.data.preference import PreferenceDataset
from megatron_bridge.train.data.sft import SFTDataset, split_ranges

SEQ = 12
VOCAB = 64


def pair(i, prompt, chosen, rejected):
    base = (7 * i) % 40
    return {
        "prompt_ids": [base + k for k in range(prompt)],
        "chosen_ids": [40 + (i + k) % 10 for k in range(chosen)],
        "rejected_ids": [50 + (i + k) % 10 for k in range(rejected)],
    }


ROWS = [pair(i, 2 + i % 4, 1 + i % 3, 2 + (i * 5) % 7) for i in range(20)]
ROWS[3] = pair(3, 6, 9, 2)  # chosen row of 15 tokens: longer than SEQ + 1


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    d = tmp_path_factory.mktemp("pref")
    (d / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    preprocess_preference(d / "p.jsonl", d / "pairs", vocab_size=VOCAB)
    return d / "pairs"


def test_each_half_is_the_sft_sample_of_that_half(prefix):
    pairs = PreferencePairs(prefix)
    r = split_ranges(len(pairs), "80,20,0")[0]
    ds = PreferenceDataset(str(prefix), r, SEQ, seed=5, num_samples=40)
    assert len(ds) == 40 and ds.truncated == 1
    assert sorted(ds.pair(i) for i in range(len(r))) == list(r)  # each pair once per epoch
    halves = [SFTDataset(h, r, SEQ, packing=False, seed=5, num_samples=40) for h in (pairs.chosen, pairs.rejected)]
    for i in range(len(ds)):
        s = ds[i]
        assert int(s.pop("pair")) == ds.pair(i)  # what precomputed reference log-probabilities are keyed by
        assert {k: tuple(v.shape) for k, v in s.items()} == dict.fromkeys(s, (2, SEQ))
        for row, half in enumerate(halves):
            assert half.conversations(i) == [ds.pair(i)]
            for k, v in half[i].items():
                assert torch.equal(s[k][row], v), k


def test_loss_mask_covers_exactly_the_completion_labels(prefix):
    ds = PreferenceDataset(prefix, range(len(ROWS)), SEQ, seed=1)
    for i in range(len(ds)):
        row = ROWS[ds.pair(i)]
        s = ds[i]
        for j, comp in enumerate((row["chosen_ids"], row["rejected_ids"])):
            full = (row["prompt_ids"] + comp)[: SEQ + 1]
            n, p = len(full) - 1, len(row["prompt_ids"])
            labels = s["labels"][j][s["loss_mask"][j] == 1].tolist()
            assert labels == full[p:]  # every completion token kept, no prompt token, no pad
            assert s["tokens"][j][:n].tolist() == full[:-1] and s["loss_mask"][j][n:].sum() == 0


def test_collate_orders_pair_k_as_rows_2k_and_2k_plus_1(prefix):
    ds = PreferenceDataset(prefix, range(len(ROWS)), SEQ, seed=2)
    samples = [ds[i] for i in range(3)]
    batch = ds.collate(samples)
    rows = [{k: s[k][j] for k in s if k != "pair"} for s in samples for j in (0, 1)]
    want = collate(rows)
    assert set(batch) == {*BATCH_KEYS, "pair"} and batch["attention_mask"] is None and batch["segment_ids"] is None
    assert batch["pair"].tolist() == [ds.pair(i) for i in range(3)]
    for k in ("tokens", "labels", "loss_mask", "position_ids"):
        assert batch[k].shape == (6, SEQ) and torch.equal(batch[k], want[k])
        assert torch.equal(batch[k][0::2], torch.stack([s[k][0] for s in samples]))  # chosen
        assert torch.equal(batch[k][1::2], torch.stack([s[k][1] for s in samples]))  # rejected


def test_build_datasets_and_iterator_use_the_pair_collate(prefix, capsys):
    dims = ParallelDims(world_size=1, gpus_per_node=1, micro_batch_size=2, global_batch_size=4, grad_accum=2)
    data = DataConfig(kind="preference", paths=[str(prefix)], split="80,20,0", packing=False)
    ds = build_datasets(data, dims, seq_length=SEQ, seed=3, train_steps=3, model_vocab_size=VOCAB)
    assert isinstance(ds.train, PreferenceDataset) and len(ds.train) == 12 and len(ds.valid) == 4
    assert ds.vocab_size == VOCAB and "1 pair(s) with a row longer" in capsys.readouterr().out
    batch = next(make_iterator(ds.train, dims))
    assert torch.equal(batch["tokens"], ds.train.collate([ds.train[0], ds.train[1]])["tokens"])
    assert batch["tokens"].shape == (4, SEQ)
    with pytest.raises(UserError, match="has .* ids"):
        build_datasets(data, dims, seq_length=SEQ, seed=3, train_steps=3, model_vocab_size=VOCAB - 1)
    with pytest.raises(UserError, match="takes one preference dataset"):
        build_datasets(DataConfig(kind="preference", paths=[]), dims, seq_length=SEQ, seed=3, train_steps=1)


def test_a_split_without_usable_pairs_is_refused(tmp_path):
    rows = [{"prompt_ids": [], "chosen_ids": [1], "rejected_ids": [2, 3]}]
    (tmp_path / "p.jsonl").write_text(json.dumps(rows[0]) + "\n")
    preprocess_preference(tmp_path / "p.jsonl", tmp_path / "pairs", vocab_size=VOCAB)
    with pytest.raises(UserError, match="no pair whose rows have 2 or more tokens"):
        PreferenceDataset(tmp_path / "pairs", np.arange(1), SEQ, seed=0)


def test_packed_rows_hold_whole_pairs_as_chosen_then_rejected_segments(prefix):
    """Packed: each row's segments are its pairs' chosen and rejected sequences in `pair` order,
    each the unpacked row's tokens, labels and mask at restarting positions; a pair too long for
    one row has both sequences cut to SEQP//2 + 1 tokens; the rows' pairs follow the permutation."""
    r, SEQP = range(len(ROWS)), 20  # long enough for two pairs a row; pair 3 (21 positions) is cut
    ds = PreferenceDataset(prefix, r, SEQP, seed=3, num_samples=30, packing=True)
    plain = PreferenceDataset(prefix, r, SEQP, seed=3, num_samples=40)
    held = [p for i in range(len(ds)) for p in ds.pairs_of(i)]
    assert held == [plain.pair(i) for i in range(len(held))]  # greedy packing keeps the order
    assert any(len(ds.pairs_of(i)) > 1 for i in range(len(ds))) and 3 in held and ds.truncated >= 1
    for i in range(len(ds)):
        s = ds[i]
        assert s["pair"].tolist() == ds.pairs_of(i)
        seg, off = s["segment_ids"], 0
        for k, p in enumerate(ds.pairs_of(i)):
            whole = sum(len(ROWS[p]["prompt_ids"]) + len(ROWS[p][c]) - 1 for c in ("chosen_ids", "rejected_ids")) > SEQP
            for j, c in enumerate(("chosen_ids", "rejected_ids")):
                ids = (ROWS[p]["prompt_ids"] + ROWS[p][c])[: SEQP // 2 + 1 if whole else SEQP + 1]
                n = len(ids) - 1
                assert (seg[off : off + n] == 2 * k + j).all()
                assert (
                    s["tokens"][off : off + n].tolist() == ids[:-1] and s["labels"][off : off + n].tolist() == ids[1:]
                )
                assert s["position_ids"][off : off + n].tolist() == list(range(n))
                want_mask = [0.0] * (len(ROWS[p]["prompt_ids"]) - 1) + [1.0] * (n - len(ROWS[p]["prompt_ids"]) + 1)
                assert s["loss_mask"][off : off + n].tolist() == want_mask[:n]
                off += n
        assert (s["loss_mask"][off:] == 0).all() and (seg[off:] == 2 * len(ds.pairs_of(i))).all()
    batch = ds.collate([ds[0], ds[1]])
    assert batch["tokens"].shape == (2, SEQP) and batch["pair"].tolist() == ds.pairs_of(0) + ds.pairs_of(1)
