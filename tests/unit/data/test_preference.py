"""`mbr data mode=preference`: prompt/chosen/rejected rows → two aligned chat datasets + manifest,
and `mbr data mode=chat` on pre-tokenized rows.

The oracle is TRL 1.16 itself: `DPOTrainer._prepare_dataset` tokenizes the same rows (string rows
with a tokenizer that adds a bos, conversations with Meta's Llama-3 template), and TRL's
`DataCollatorForPreference` truncates them to max_length; the written halves must hold exactly
prompt_ids + completion ids, with the loss mask on the completion ids only."""

import json
from types import SimpleNamespace

import pytest

from megatron_bridge.commands.data import main
from megatron_bridge.data.chat_dataset import ChatDataset
from megatron_bridge.data.preference import (
    MANIFEST_SUFFIX,
    PREFERENCE_FORMAT,
    PreferencePairs,
    preference_paths,
    preprocess_preference,
)
from megatron_bridge.data.token_rows import preprocess_token_chat
from megatron_bridge.errors import UserError
from tests.unit.data.test_data_chat import LLAMA3, make_tokenizer

BOS = "<|begin_of_text|>"
STRINGS = [
    {"prompt": "What does f do?", "chosen": " It adds one.", "rejected": " It subtracts one."},
    {"prompt": "def f(x):", "chosen": "\n    return x + 1<|end_of_text|>", "rejected": "\n    pass"},  # eos given
]
IMPLICIT_STRINGS = [{"chosen": "Hello world, it adds one.", "rejected": "Hello world, höré 日本"}]
USER = {"role": "user", "content": "What does f do?"}
CONVS = [
    {
        "prompt": [{"role": "system", "content": "Be brief."}, USER],
        "chosen": [{"role": "assistant", "content": "It adds one."}],
        "rejected": [{"role": "assistant", "content": "It returns x."}],
    }
]
IMPLICIT_CONVS = [
    {
        "chosen": [USER, {"role": "assistant", "content": "It adds one."}],
        "rejected": [USER, {"role": "assistant", "content": "Nothing."}, {"role": "user", "content": "?"}],
    }
]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    """A Llama-3-like tokenizer whose text encoding adds a bos (the string rows' case), the same
    with its chat template, and one without a template."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("ptok")
    make_tokenizer(d / "plain", "llama3", None)
    tok = AutoTokenizer.from_pretrained(str(d / "plain"))
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tok.convert_tokens_to_ids(BOS))]
    )
    tok.save_pretrained(str(d / "bos"))
    tok.chat_template = LLAMA3
    tok.save_pretrained(str(d / "chat"))
    return SimpleNamespace(plain=d / "plain", bos=d / "bos", chat=d / "chat")


@pytest.fixture(scope="module")
def trl():
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer

    def prepare(rows, tok_dir):
        from datasets import Dataset
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tok_dir))
        args = SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
        ds = DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tok), Dataset.from_list(rows), tok, args, "t")
        return [{k: ex[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for ex in ds]

    return SimpleNamespace(prepare=prepare, collator=DataCollatorForPreference)


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def assert_pairs(prefix, expected):
    pairs = PreferencePairs(prefix)
    assert len(pairs) == len(expected)
    for (chosen, rejected), want in zip(pairs, expected):
        for (ids, mask), comp in ((chosen, want["chosen_ids"]), (rejected, want["rejected_ids"])):
            assert ids.tolist() == want["prompt_ids"] + comp
            assert mask.tolist() == [0] * len(want["prompt_ids"]) + [1] * len(comp)


@pytest.mark.parametrize(
    "rows,tok",
    [(STRINGS, "bos"), (IMPLICIT_STRINGS, "bos"), (CONVS, "chat"), (IMPLICIT_CONVS, "chat")],
    ids=["strings", "implicit-prompt-strings", "conversations", "implicit-prompt-conversations"],
)
def test_rows_are_tokenized_as_trl_does(toks, trl, tmp_path, rows, tok):
    out = tmp_path / "out" / "pairs"
    stats = preprocess_preference(write(tmp_path / "p.jsonl", rows), out, getattr(toks, tok))
    expected = trl.prepare(rows, getattr(toks, tok))
    assert_pairs(out, expected)
    if tok == "bos":  # the bos the tokenizer adds leads every row, the eos TRL appends ends it
        assert all(e["prompt_ids"][0] == 0 and e["chosen_ids"][-1] == 1 for e in expected)
    assert stats.pairs == len(rows) and stats.truncated == stats.dropped == 0
    manifest = json.loads((tmp_path / "out" / ("pairs" + MANIFEST_SUFFIX)).read_text())
    assert manifest["format"] == PREFERENCE_FORMAT and manifest["pairs"] == len(rows)
    assert manifest["vocab_size"] == stats.vocab_size and len(manifest["tokenizer_sha256"]) == 64
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]  # no temporaries left


def test_columnar_rows_give_the_pairs_jsonl_gives(toks, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(STRINGS), tmp_path / "p.parquet")
    preprocess_preference(tmp_path / "p.parquet", tmp_path / "pq", toks.bos)
    preprocess_preference(write(tmp_path / "p.jsonl", STRINGS), tmp_path / "js", toks.bos)
    for a, b in zip(PreferencePairs(tmp_path / "pq"), PreferencePairs(tmp_path / "js")):
        for (ids_a, mask_a), (ids_b, mask_b) in zip(a, b):
            assert ids_a.tolist() == ids_b.tolist() and mask_a.tolist() == mask_b.tolist()
    with pytest.raises(UserError, match="preference rows of strings need tokenizer=DIR"):
        preprocess_preference(tmp_path / "p.parquet", tmp_path / "none", vocab_size=10)


def test_chat_template_file_overrides_the_tokenizer(toks, trl, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(LLAMA3)
    preprocess_preference(write(tmp_path / "p.jsonl", CONVS), tmp_path / "pairs", toks.plain, chat_template=template)
    assert_pairs(tmp_path / "pairs", trl.prepare(CONVS, toks.chat))
    with pytest.raises(UserError, match="has no chat template"):
        preprocess_preference(tmp_path / "p.jsonl", tmp_path / "again", toks.plain)


def test_token_id_rows_are_used_as_given(toks, tmp_path):
    rows = [
        {"prompt_ids": [5, 6], "chosen_ids": [7, 8], "rejected_ids": [9]},
        {"prompt_ids": [], "chosen_ids": [1], "rejected_ids": [2]},
    ]
    preprocess_preference(write(tmp_path / "p.jsonl", rows), tmp_path / "pairs", vocab_size=10)
    assert_pairs(tmp_path / "pairs", rows)
    assert ChatDataset(preference_paths(tmp_path / "pairs")["chosen"]).meta["vocab_size"] == 10
    with pytest.raises(UserError, match="pass tokenizer=DIR or vocab_size=N, not both"):
        preprocess_preference(tmp_path / "p.jsonl", tmp_path / "b", toks.plain, vocab_size=10)
    with pytest.raises(UserError, match="are token ids: pass tokenizer=DIR"):
        preprocess_preference(tmp_path / "p.jsonl", tmp_path / "b")


@pytest.mark.parametrize(
    "line,needle",
    [
        ({"prompt": "a", "chosen": "b"}, "p.jsonl:2: no 'rejected'"),
        ({"prompt": "a", "chosen": " ", "rejected": "c"}, "p.jsonl:2: 'chosen' is empty"),
        ({"prompt": "a", "chosen": "b", "rejected": "b"}, "p.jsonl:2: 'chosen' and 'rejected' are the same tokens"),
        ({"prompt": "a", "chosen": "b", "rejected": 3}, "p.jsonl:2: 'rejected' is a int"),
        (
            {"prompt": "a", "chosen": [USER], "rejected": [USER]},
            "p.jsonl:2: 'prompt' is a str but 'chosen' is a message",
        ),
        ({"chosen": [USER], "rejected": []}, "p.jsonl:2: 'rejected' is empty"),
        (
            {"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [400]},
            "p.jsonl:2: 'rejected_ids' holds token id 400, outside [0, ",
        ),
        ({"prompt_ids": [1], "chosen_ids": []}, "p.jsonl:2: no 'rejected_ids'"),
        ({"prompt_ids": [1], "chosen_ids": [], "rejected_ids": [2]}, "p.jsonl:2: 'chosen_ids' is empty"),
        (
            {"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [2]},
            "p.jsonl:2: 'chosen' and 'rejected' are the same",
        ),
    ],
)
def test_bad_rows_name_file_and_line_and_write_nothing(toks, tmp_path, line, needle):
    good = STRINGS[0] if "prompt_ids" not in line else {"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]}
    write(tmp_path / "p.jsonl", [good, line])
    with pytest.raises(UserError) as e:
        preprocess_preference(tmp_path / "p.jsonl", tmp_path / "out" / "pairs", toks.chat)
    assert needle in str(e.value)
    assert not (tmp_path / "out").exists()  # not even the output directory


def test_truncation_matches_trl_and_is_counted(toks, trl, tmp_path):
    rows = [
        {"prompt": "Q", "chosen": " short", "rejected": " a much longer rejected answer that runs on and on"},
        {"prompt": "Hello world, it adds one to x and more words here", "chosen": " yes", "rejected": " no"},
        {"prompt": "Q", "chosen": " a", "rejected": " b"},
    ]
    full = trl.prepare(rows, toks.bos)
    max_length = len(full[0]["prompt_ids"]) + 4
    assert len(full[1]["prompt_ids"]) >= max_length  # its prompt alone fills max_length: TRL drops it
    stats = preprocess_preference(write(tmp_path / "p.jsonl", rows), tmp_path / "cut", toks.bos, max_length=max_length)
    assert (stats.truncated, stats.dropped, stats.pairs) == (1, 1, 2)
    batch = trl.collator(pad_token_id=0, max_length=max_length)([full[0], full[2]])
    pairs = PreferencePairs(tmp_path / "cut")
    got = [pairs[0][0], pairs[1][0], pairs[0][1], pairs[1][1]]  # TRL's order: all chosen, then all rejected
    for (ids, mask), want_ids, want_mask, attn in zip(
        got, batch["input_ids"], batch["completion_mask"], batch["attention_mask"]
    ):
        n = int(attn.sum())
        assert ids.tolist() == want_ids[:n].tolist() and mask.tolist() == want_mask[:n].tolist()
    stats = preprocess_preference(
        tmp_path / "p.jsonl", tmp_path / "drop", toks.bos, max_length=max_length, truncation="drop"
    )
    assert (stats.truncated, stats.dropped, stats.pairs) == (0, 2, 1)
    assert "truncated 0 pairs, dropped 2" in stats.describe()


def test_reader_refuses_halves_of_another_build(toks, tmp_path):
    write(tmp_path / "p.jsonl", STRINGS)
    for name in ("a", "b"):
        preprocess_preference(tmp_path / "p.jsonl", tmp_path / name, toks.bos)
    for suffix in (".bin", ".idx", ".meta.json", ".loss_mask.bin", ".loss_mask.idx"):
        (tmp_path / f"b.rejected{suffix}").replace(tmp_path / f"a.rejected{suffix}")
    with pytest.raises(UserError, match="is not the rejected half"):
        PreferencePairs(tmp_path / "a")
    with pytest.raises(UserError, match="preference dataset already exists"):
        preprocess_preference(tmp_path / "p.jsonl", tmp_path / "b", toks.bos)
    with pytest.raises(UserError, match="is not a preference dataset"):
        PreferencePairs(tmp_path / "none")


def test_command_prints_the_counts_and_the_overrides(toks, tmp_path, capsys):
    write(tmp_path / "p.jsonl", STRINGS)
    args = ["mode=preference", f"input={tmp_path / 'p.jsonl'}", f"output={tmp_path / 'pairs'}", f"tokenizer={toks.bos}"]
    assert main([*args, "max_length=9"]) == 0
    out = capsys.readouterr().out
    stats = preprocess_preference(tmp_path / "p.jsonl", tmp_path / "again", toks.bos, max_length=9)
    assert stats.truncated + stats.dropped > 0
    assert f"truncated {stats.truncated} pairs, dropped {stats.dropped}" in out
    assert "objective=dpo data=preference data.paths=[" in out


# -- pre-tokenized chat rows (mode=chat) ---------------------------------------------------------
TOKEN_ROWS = [
    {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]},
    {"input_ids": [1, 2, 3], "labels": [-100, 2, -100]},
]


def test_token_chat_rows_are_stored_as_given(tmp_path, capsys):
    write(tmp_path / "t.jsonl", TOKEN_ROWS + [{"input_ids": [4], "labels": [-100]}])  # no loss: skipped
    args = ["mode=chat", f"input={tmp_path / 't.jsonl'}", f"output={tmp_path / 'chat'}", "vocab_size=9"]
    assert main(args) == 0
    assert "2 conversations" in capsys.readouterr().out
    ds = ChatDataset(tmp_path / "chat")
    for (ids, mask), row in zip(ds, TOKEN_ROWS):
        assert ids.tolist() == row["input_ids"] and mask.tolist() == [int(v != -100) for v in row["labels"]]
    assert ds.meta["vocab_size"] == 9 and ds.meta["eos_id"] == -1 and ds.meta["tokenizer"] is None


@pytest.mark.parametrize(
    "line,needle",
    [
        ({"input_ids": [1, 2], "labels": [-100, 3]}, "t.jsonl:2: labels[1] = 3 is neither -100 nor input_ids[1] = 2"),
        ({"input_ids": [1, 2], "labels": [2]}, "t.jsonl:2: 'labels' has 1 entries and 'input_ids' 2"),
        ({"input_ids": [1, 9], "labels": [1, 9]}, "t.jsonl:2: 'input_ids' holds token id 9, outside [0, 9)"),
        ({"input_ids": [1, 2]}, "t.jsonl:2: no 'labels'"),
    ],
)
def test_bad_token_chat_rows_name_file_and_line_and_write_nothing(tmp_path, line, needle):
    write(tmp_path / "t.jsonl", [TOKEN_ROWS[0], line])
    with pytest.raises(UserError) as e:
        preprocess_token_chat(tmp_path / "t.jsonl", tmp_path / "out" / "chat", vocab_size=9)
    assert needle in str(e.value)
    assert not (tmp_path / "out").exists()
