"""Text → tokenizer → indexed dataset: the stdlib corpus, the BPE tokenizer through
AutoTokenizer, preprocessing round trips, and bad inputs (clear UserError, nothing written)."""

import json
import os

import numpy as np
import pytest

from megatron_bridge.data.corpus import (
    EOS_TOKEN,
    build_stdlib_corpus,
    iter_documents,
    stdlib_files,
    stdlib_root,
    train_tokenizer,
)
from megatron_bridge.data.preprocess import preprocess, read_meta
from megatron_bridge.data.tokenizer import check_vocab, load_tokenizer
from megatron_bridge.errors import UserError

CORPUS_BYTES = 120_000
VOCAB = 400


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("pipeline")
    corpus = build_stdlib_corpus(d / "corpus.jsonl", max_bytes=CORPUS_BYTES)
    tok = train_tokenizer(corpus.path, d / "tok", VOCAB)
    return d, corpus, tok


def listing(d):
    return sorted(p.name for p in d.iterdir())


def test_stdlib_corpus_is_deterministic_and_bounded(base, tmp_path):
    d, corpus, _ = base
    again = build_stdlib_corpus(tmp_path / "c.jsonl", max_bytes=CORPUS_BYTES)
    assert (tmp_path / "c.jsonl").read_bytes() == corpus.path.read_bytes()
    assert 0 < corpus.bytes <= CORPUS_BYTES and again.documents == corpus.documents >= 5
    rows = [json.loads(line) for line in corpus.path.read_text().splitlines()]
    assert all(r["text"].strip() and r["source"].endswith(".py") for r in rows)
    rel = [p.relative_to(stdlib_root()).as_posix() for p in stdlib_files()]
    assert rel == sorted(rel) and len(rel) > 100
    assert not any(r.startswith(("site-packages/", "test/")) or "/tests/" in r for r in rel)
    assert oct(os.stat(corpus.path).st_mode & 0o777) != oct(0o600)  # not left with mkstemp's mode


def test_tokenizer_round_trips_through_autotokenizer(base):
    from transformers import AutoTokenizer

    _, corpus, tok_dir = base
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    assert tok.is_fast and len(tok) == VOCAB
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<s>", EOS_TOKEN)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    samples = list(iter_documents(corpus.path))[:3] + ["  héllo\twörld 日本語 🙂\n\n", "x = 1  # </s> literal"]
    for text in samples:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert max(ids) < VOCAB and tok.decode(ids) == text


def test_tokenizer_training_is_deterministic(base, tmp_path):
    _, corpus, tok_dir = base
    train_tokenizer(corpus.path, tmp_path / "tok2", VOCAB)
    assert (tmp_path / "tok2" / "tokenizer.json").read_text() == (tok_dir / "tokenizer.json").read_text()


def test_preprocess_documents_decode_back(base, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    _, corpus, tok_dir = base
    stats = preprocess(corpus.path, tmp_path / "out" / "doc", tok_dir)
    texts = list(iter_documents(corpus.path))
    ds = IndexedDataset(str(tmp_path / "out" / "doc"))
    tok = load_tokenizer(tok_dir)
    assert len(ds) == stats.documents == len(texts)
    assert ds.index.dtype == np.uint16 and stats.dtype == "uint16"
    assert int(ds.sequence_lengths.sum()) == stats.tokens
    for i, text in enumerate(texts):
        ids = ds[i]
        assert ids[-1] == tok.eos_token_id and tok.eos_token_id not in ids[:-1]
        assert tok.decode(ids[:-1].tolist()) == text
    meta = read_meta(tmp_path / "out" / "doc")
    assert meta["vocab_size"] == VOCAB and meta["eos_id"] == 2 and meta["documents"] == len(texts)
    assert meta["max_token_id"] == max(int(ds[i].max()) for i in range(len(ds)))
    assert listing(tmp_path / "out") == ["doc.bin", "doc.idx", "doc.meta.json"]  # no temporaries left


def test_preprocess_txt_files_lines_and_directories(base, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    _, _, tok_dir = base
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("first document\nstill first\n")
    (src / "sub" / "b.jsonl").write_text(json.dumps({"body": "second"}) + "\n\n" + json.dumps({"body": ""}) + "\n")
    (src / "sub" / "c.txt").write_text("line one\n\nline two\n")
    tok = load_tokenizer(tok_dir)

    def docs(prefix):
        ds = IndexedDataset(str(prefix))
        return [tok.decode(ds[i][:-1].tolist()) for i in range(len(ds))]

    s = preprocess(src, tmp_path / "f", tok_dir, text_key="body")
    assert docs(tmp_path / "f") == ["first document\nstill first\n", "second", "line one\n\nline two\n"]
    assert s.skipped_empty == 1
    preprocess(src, tmp_path / "l", tok_dir, text_key="body", txt_mode="line")
    assert docs(tmp_path / "l") == ["first document", "still first", "second", "line one", "line two"]


def test_overwrite_replaces_and_refusal_keeps_old(base, tmp_path):
    _, corpus, tok_dir = base
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"text": "only document"}) + "\n")
    preprocess(corpus.path, tmp_path / "d", tok_dir)
    before = (tmp_path / "d.bin").read_bytes()
    with pytest.raises(UserError, match="already exists.*overwrite=true"):
        preprocess(one, tmp_path / "d", tok_dir)
    assert (tmp_path / "d.bin").read_bytes() == before
    s = preprocess(one, tmp_path / "d", tok_dir, overwrite=True)
    assert s.documents == 1 and (tmp_path / "d.bin").stat().st_size < len(before)


@pytest.mark.parametrize(
    "case,needle",
    [
        ("missing_input", "does not exist"),
        ("missing_tokenizer", "tokenizer directory .* does not exist"),
        ("no_tokenizer", "no tokenizer given"),
        ("empty_tokenizer_dir", "holds no tokenizer files"),
        ("bad_json", r"bad\.jsonl:2: not valid JSON"),
        ("missing_key", r"no 'text' key \(found: 'body'\)"),
        ("empty", "no documents"),
        ("bin_suffix", "without the extension"),
        ("unsupported", "unsupported file type .csv"),
    ],
)
def test_bad_inputs_raise_user_error_and_write_nothing(base, tmp_path, case, needle):
    _, corpus, tok_dir = base
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": nope}\n')
    (tmp_path / "key.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "empty.jsonl").write_text('{"text": "  "}\n\n')
    (tmp_path / "x.csv").write_text("a,b\n")
    (tmp_path / "emptytok").mkdir()
    args = {
        "missing_input": (tmp_path / "nope.jsonl", out / "d", tok_dir),
        "missing_tokenizer": (corpus.path, out / "d", tmp_path / "notok"),
        "no_tokenizer": (corpus.path, out / "d", None),
        "empty_tokenizer_dir": (corpus.path, out / "d", tmp_path / "emptytok"),
        "bad_json": (tmp_path / "bad.jsonl", out / "d", tok_dir),
        "missing_key": (tmp_path / "key.jsonl", out / "d", tok_dir),
        "empty": (tmp_path / "empty.jsonl", out / "d", tok_dir),
        "bin_suffix": (corpus.path, out / "d.bin", tok_dir),
        "unsupported": (tmp_path / "x.csv", out / "d", tok_dir),
    }[case]
    with pytest.raises(UserError, match=needle):
        preprocess(*args)
    assert listing(out) == []


def test_check_vocab(base):
    _, _, tok_dir = base
    assert check_vocab(tok_dir, 512) == VOCAB
    assert check_vocab(load_tokenizer(tok_dir), VOCAB) == VOCAB
    with pytest.raises(UserError, match=rf"has {VOCAB} tokens .* model's vocab_size is 256.*model.vocab_size={VOCAB}"):
        check_vocab(str(tok_dir), 256)


def test_train_tokenizer_refuses_bad_sizes_and_existing_dirs(base, tmp_path):
    _, corpus, tok_dir = base
    with pytest.raises(UserError, match="too small for a byte-level BPE"):
        train_tokenizer(corpus.path, tmp_path / "t", 100)
    with pytest.raises(UserError, match="already exists"):
        train_tokenizer(corpus.path, tok_dir, VOCAB)
    assert not (tmp_path / "t").exists()
    # An iterable of strings works too (and a directory that exists but is empty is fine).
    (tmp_path / "t2").mkdir()
    train_tokenizer(["def f(x):\n    return x\n"] * 50, tmp_path / "t2", 300)
    assert load_tokenizer(tmp_path / "t2").decode(load_tokenizer(tmp_path / "t2")("def f")["input_ids"]) == "def f"


def test_a_line_over_the_limit_is_refused_after_reading_only_the_limit(tmp_path, monkeypatch):
    """One huge jsonl line (100 MB once took 17.6 GB): refused naming file:line, having read at
    most MAX_LINE_CHARS + 2 characters of it."""
    import pytest

    from megatron_bridge.data import corpus
    from megatron_bridge.errors import UserError

    monkeypatch.setattr(corpus, "MAX_LINE_CHARS", 100)
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "ok"}\n' + '{"text": "' + "x" * 88 + '"}\n' + '{"text": "' + "y" * 500 + '"}\n')
    with pytest.raises(UserError, match=r"c.jsonl:3: the line is longer than 100 characters"):
        list(corpus.iter_documents(f))
    t = tmp_path / "c.txt"
    t.write_text("short\n" + "z" * 101 + "\n")
    with pytest.raises(UserError, match=r"c.txt:2: the line is longer"):
        list(corpus.iter_documents(t, txt_mode="line"))
    g = tmp_path / "ok.jsonl"
    g.write_text('{"text": "' + "x" * 88 + '"}\n')  # exactly 100 characters before the newline
    assert list(corpus.iter_documents(g)) == ["x" * 88]
