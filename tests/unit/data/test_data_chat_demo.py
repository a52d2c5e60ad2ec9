"""The chat demo: docstring questions from the standard library → the demo tokenizer's ChatML
template → a chat dataset, read back by `ChatDataset` and checked against its jsonl source; and
`mbr data mode=chat`'s argument errors."""

import json

import pytest

from megatron_bridge.commands.data import main
from megatron_bridge.data.chat_dataset import ChatDataset
from megatron_bridge.data.corpus import IM_END, IM_START, build_docstring_chat_corpus
from megatron_bridge.data.demo import CHAT_DEMO_PREFIX, build_demo
from megatron_bridge.errors import UserError

SMALL = ["max_bytes=60000", "vocab_size=320"]


@pytest.fixture(scope="module")
def chat_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("chatdemo") / "demo"
    assert main(["mode=chat", "demo=true", f"output_dir={out}", "max_examples=40", *SMALL]) == 0
    return out


def test_docstring_corpus_is_deterministic(tmp_path):
    assert build_docstring_chat_corpus(tmp_path / "a.jsonl", 60) == 60
    build_docstring_chat_corpus(tmp_path / "b.jsonl", 60)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    rows = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    for r in rows:
        (user, assistant) = r["messages"]
        assert (
            user["role"] == "user" and user["content"].startswith("What does `") and user["content"].endswith(")` do?")
        )
        assert assistant["role"] == "assistant" and len(assistant["content"]) >= 20 and "\n" not in assistant["content"]
        module = r["source"].split(":")[0]
        assert module.endswith(".py") and not any(p.startswith("_") and p != "__init__.py" for p in module.split("/"))
    with pytest.raises(UserError, match="chat corpus already exists"):
        build_docstring_chat_corpus(tmp_path / "a.jsonl", 60)


def test_chat_demo_matches_its_jsonl_and_the_pretraining_demo_tokenizer(chat_demo, tmp_path, capsys):
    from transformers import AutoTokenizer

    assert sorted(p.name for p in chat_demo.iterdir()) == [
        "chat.jsonl",
        f"{CHAT_DEMO_PREFIX}.bin",
        f"{CHAT_DEMO_PREFIX}.idx",
        f"{CHAT_DEMO_PREFIX}.loss_mask.bin",
        f"{CHAT_DEMO_PREFIX}.loss_mask.idx",
        f"{CHAT_DEMO_PREFIX}.meta.json",
        "tokenizer",
    ]
    assert not [p for p in chat_demo.parent.iterdir() if p.name.startswith(".")]  # no temporaries left
    tok = AutoTokenizer.from_pretrained(str(chat_demo / "tokenizer"))
    assert tok.convert_tokens_to_ids([IM_START, IM_END]) == [3, 4] and len(tok) == 320
    ds = ChatDataset(chat_demo / CHAT_DEMO_PREFIX)
    rows = [json.loads(line) for line in (chat_demo / "chat.jsonl").read_text().splitlines()]
    assert len(ds) == len(rows) == 40
    for (ids, mask), r in zip(ds, rows):
        (q, a) = (m["content"] for m in r["messages"])
        assert tok.decode(ids) == f"{IM_START}user\n{q}{IM_END}\n{IM_START}assistant\n{a}{IM_END}\n"
        assert tok.decode(ids[mask == 1]) == f"{a}{IM_END}\n"
    meta = ds.meta
    assert meta["tokenizer"] == str(chat_demo / "tokenizer") and meta["files"] == [str(chat_demo / "chat.jsonl")]
    assert meta["chat_template"] == f"the tokenizer in {chat_demo / 'tokenizer'}"

    # the same tokenizer as the pre-training demo's with the same sizes: fine-tune what that pre-trained
    demo = build_demo(tmp_path / "pre", 320, 60000)
    assert (demo.tokenizer / "tokenizer.json").read_text() == (chat_demo / "tokenizer" / "tokenizer.json").read_text()
    # ... or use that tokenizer directly
    capsys.readouterr()
    assert (
        main(
            ["mode=chat", "demo=true", f"output_dir={tmp_path / 'c2'}", "max_examples=5", f"tokenizer={demo.tokenizer}"]
        )
        == 0
    )
    assert "tokenizer" not in [p.name for p in (tmp_path / "c2").iterdir()]
    assert (
        f"data=sft data.paths=[{tmp_path / 'c2' / CHAT_DEMO_PREFIX}] data.tokenizer={demo.tokenizer}"
        in capsys.readouterr().out
    )
    assert ChatDataset(tmp_path / "c2" / CHAT_DEMO_PREFIX).meta["tokenizer"] == str(demo.tokenizer)


def test_chat_command_on_a_file(chat_demo, tmp_path, capsys):
    tok = chat_demo / "tokenizer"
    args = [f"input={chat_demo / 'chat.jsonl'}", f"output={tmp_path / 'c'}", f"tokenizer={tok}", "max_length=100"]
    assert main(["mode=chat", *args]) == 0
    out = capsys.readouterr().out
    assert "longer than max_length=100 tokens:" in out
    assert f"data=sft data.paths=[{tmp_path / 'c'}] data.tokenizer={tok}" in out
    with pytest.raises(UserError, match="loss-mask dataset already exists|indexed dataset already exists"):
        main(["mode=chat", *args])
    assert main(["mode=chat", *args, "overwrite=true", "overlong=drop"]) == 0


@pytest.mark.parametrize(
    "args,needle",
    [
        (["mode=bogus", "input=a.jsonl"], "mode='bogus': expected text"),
        (["input=a.jsonl", "output=o", "chat_template=t.jinja"], "belong to mode=chat"),
        (["mode=chat"], "no input given: pass input=FILE.jsonl"),
        (["mode=chat", "input=a.jsonl", "output_dir=d"], "belong to demo=true"),
        (
            ["mode=chat", "demo=true", "output_dir=OUT/d", "tokenizer=OUT", "vocab_size=300"],
            "with tokenizer=DIR there is",
        ),
        (["mode=chat", "input=OUT/a.txt", "output=OUT/o", "tokenizer=TOK"], "chat data is jsonl"),
    ],
)
def test_chat_argument_errors(chat_demo, tmp_path, args, needle):
    (tmp_path / "a.txt").write_text("hello")
    args = [a.replace("OUT", str(tmp_path)).replace("TOK", str(chat_demo / "tokenizer")) for a in args]
    with pytest.raises(UserError, match=needle):
        main(args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]
