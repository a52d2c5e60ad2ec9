"""`mbr data` on columnar input (data/columnar.py): parquet, Arrow IPC files and a `datasets`
save_to_disk directory (written here with pyarrow in datasets' layout: arrow stream files plus
state.json and dataset_info.json) give the same dataset files, byte for byte, as the
equivalent jsonl, in text and chat modes, read in bounded batches."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_bridge.data import columnar
from megatron_bridge.data.chat import chat_paths
from megatron_bridge.data.chat_dataset import preprocess_chat
from megatron_bridge.data.corpus import input_files, train_tokenizer
from megatron_bridge.data.preprocess import output_paths, preprocess
from megatron_bridge.errors import UserError

TEXTS = [f"document {i}: def f{i}(x):\n    return x * {i}  # höré 日本" * (1 + i % 3) for i in range(40)]
CONVS = [
    [{"role": "user", "content": f"What is {i} + 1?"}, {"role": "assistant", "content": f"It is {i + 1}."}]
    for i in range(30)
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tokenizer(TEXTS, tmp_path_factory.mktemp("tok") / "tok", 300)


@pytest.fixture(autouse=True)
def small_batches(monkeypatch):
    monkeypatch.setattr(columnar, "BATCH_ROWS", 4)  # many batches per file: the bounded path is the one tested


def _save_to_disk(d, table, shards=2):
    """A directory as `Dataset.save_to_disk` writes it: data-0000K-of-0000N.arrow (IPC stream) files,
    dataset_info.json and state.json listing the files in row order."""
    d.mkdir()
    n = table.num_rows
    names = []
    for k in range(shards):
        name = f"data-{k:05d}-of-{shards:05d}.arrow"
        part = table.slice(k * n // shards, (k + 1) * n // shards - k * n // shards)
        with pa.ipc.new_stream(d / name, part.schema) as w:
            for b in part.to_batches(max_chunksize=5):
                w.write_batch(b)
        names.append(name)
    (d / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "features": {}}))
    state = {"_data_files": [{"filename": f} for f in names], "_fingerprint": "0" * 16, "_split": None}
    (d / "state.json").write_text(json.dumps(state))
    return d


def _bytes(paths, keys):
    return {k: open(paths[k], "rb").read() for k in keys}


def test_text_parquet_arrow_and_save_to_disk_equal_jsonl(tmp_path, tok):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"body": t, "n": i}) + "\n" for i, t in enumerate(TEXTS)))
    table = pa.table({"n": list(range(len(TEXTS))), "body": TEXTS})
    pq.write_table(table, tmp_path / "docs.parquet", row_group_size=7)
    pdir = tmp_path / "pdir"
    pdir.mkdir()
    pq.write_table(table.slice(0, 25), pdir / "a.parquet")
    pq.write_table(table.slice(25), pdir / "b.parquet")
    with pa.ipc.new_file(tmp_path / "docs.arrow", table.schema) as w:
        w.write_table(table, max_chunksize=9)
    std = _save_to_disk(tmp_path / "std", table)
    ref = preprocess(tmp_path / "docs.jsonl", tmp_path / "out" / "ref", tok, text_key="body")
    want = _bytes(output_paths(ref.prefix), ("bin", "idx"))
    for name, src in [
        ("pq", tmp_path / "docs.parquet"),
        ("pdir", pdir),
        ("arrow", tmp_path / "docs.arrow"),
        ("std", std),
    ]:
        st = preprocess(src, tmp_path / "out" / name, tok, text_key="body")
        assert (st.documents, st.tokens) == (ref.documents, ref.tokens), name
        assert _bytes(output_paths(st.prefix), ("bin", "idx")) == want, name
    assert [f.name for f in input_files(std)] == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]


def test_chat_parquet_and_save_to_disk_equal_jsonl(tmp_path, tok):
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVS))
    table = pa.table({"conv": CONVS, "id": list(range(len(CONVS)))})
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=6)
    std = _save_to_disk(tmp_path / "std", table, shards=3)
    ref = preprocess_chat(tmp_path / "c.jsonl", tmp_path / "out" / "ref", tok)
    keys = ("bin", "idx", "mask_bin", "mask_idx")
    want = _bytes(chat_paths(ref.prefix), keys)
    for name, src in [("pq", tmp_path / "c.parquet"), ("std", std)]:
        st = preprocess_chat(src, tmp_path / "out" / name, tok, messages_key="conv")
        assert _bytes(chat_paths(st.prefix), keys) == want, name


def test_refusals(tmp_path, tok):
    pq.write_table(pa.table({"content": ["a", "b"]}), tmp_path / "x.parquet")
    with pytest.raises(UserError, match="no column 'text'.*'content'.*text_key=NAME"):
        preprocess(tmp_path / "x.parquet", tmp_path / "o" / "x", tok)
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "y.parquet")
    with pytest.raises(UserError, match="y.parquet:row 1: 'text' is a int"):
        preprocess(tmp_path / "y.parquet", tmp_path / "o" / "y", tok)
    (tmp_path / "bad.arrow").write_bytes(b"not arrow at all")
    with pytest.raises(UserError, match="cannot read .*bad.arrow with pyarrow"):
        preprocess(tmp_path / "bad.arrow", tmp_path / "o" / "z", tok)
    dd = tmp_path / "dd"
    _save_to_disk(dd.parent / "dd_train", pa.table({"text": ["a"]}))
    dd.mkdir()
    (dd.parent / "dd_train").rename(dd / "train")
    (dd / "dataset_dict.json").write_text('{"splits": ["train"]}')
    (dd / "state.json").write_text("{}")
    (dd / "dataset_info.json").write_text("{}")
    with pytest.raises(UserError, match="DatasetDict; pass one split's directory"):
        input_files(dd)
