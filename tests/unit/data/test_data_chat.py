"""`mbr data mode=chat`: conversations → chat template → tokens + assistant loss mask → two
aligned indexed datasets, read back by `ChatDataset`.

The oracle is transformers: the tokens must be `apply_chat_template`'s, and the mask found by
incremental rendering must equal transformers' `return_assistant_tokens_mask` on the same template
with `{% generation %}` markers around the assistant turns. Two real templates (Meta's Llama-3
instruct template, and a Qwen2.5-style ChatML one with its default system prompt) run on tiny
BPE tokenizers built here with their special tokens."""

import json

import numpy as np
import pytest

from megatron_bridge.data.chat import CHAT_FORMAT, MASK_SUFFIX, chat_paths
from megatron_bridge.data.chat_dataset import ChatDataset, preprocess_chat
from megatron_bridge.errors import UserError

# Meta-Llama-3-8B-Instruct's chat template.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA3_MARKED = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen2.5-instruct style: ChatML with a default system prompt when the conversation has none.
QWEN = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\n' }}{%- endif %}{%- for message in messages %}{%- if message.role != 'system' or not loop.first %}"
    "{{- '<|im_start|>' + message.role + '\n' }}{%- if message.role == 'assistant' %}{% generation %}"
    "{{- message.content + '<|im_end|>\n' }}{% endgeneration %}{%- else %}{{- message.content + '<|im_end|>\n' }}"
    "{%- endif %}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
QWEN_PLAIN = QWEN.replace("{% generation %}", "").replace("{% endgeneration %}", "")
# Renders the final assistant turn differently from earlier ones: not prefix-consistent.
LAST_DIFFERS = (
    "{% for m in messages %}{% if loop.last and m['role'] == 'assistant' %}<|im_start|>final\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FAMILIES = {
    "llama3": (
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        0,
        1,
    ),
    "qwen": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, 0),
}
TEXT = ["What does f do? It adds one to x.\n\n def f(x):\n    return x + 1", "Be brief. Hello world, höré 日本"] * 20
CONVS = [
    {"messages": [{"role": "user", "content": "What does f do?"}, {"role": "assistant", "content": "It adds one."}]},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "\nHello world"},  # a newline right after the header
            {"role": "user", "content": "And x?"},
            {"role": "assistant", "content": "x + 1, höré 日本"},
        ]
    },
    {"prompt": "def f(x):", "completion": "    return x + 1"},
    {
        "messages": [
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "two"},
            {"role": "user", "content": "?"},
        ]
    },
]


def make_tokenizer(d, family, template):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials, bos, eos = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None if bos is None else specials[bos], eos_token=specials[eos]
    )
    if template:
        hf.chat_template = template
    hf.save_pretrained(str(d))
    return d


def messages_of(c):
    return (
        c["messages"]
        if "messages" in c
        else [{"role": "user", "content": c["prompt"]}, {"role": "assistant", "content": c["completion"]}]
    )


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    (d / "convs.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CONVS))
    return d


def listing(d):
    return sorted(p.name for p in d.iterdir())


@pytest.mark.parametrize(
    "family,plain,marked", [("llama3", LLAMA3, LLAMA3_MARKED), ("qwen", QWEN_PLAIN, QWEN)], ids=["llama3", "qwen"]
)
def test_tokens_and_mask_match_transformers(src, tmp_path, family, plain, marked):
    from transformers import AutoTokenizer

    tok_dir = make_tokenizer(tmp_path / "tok", family, plain)
    (tmp_path / "marked.jinja").write_text(marked)
    st = preprocess_chat(src / "convs.jsonl", tmp_path / "inc" / "chat", tok_dir)
    st_g = preprocess_chat(
        src / "convs.jsonl", tmp_path / "gen" / "chat", tok_dir, chat_template=tmp_path / "marked.jinja"
    )
    assert (st.mask_method, st_g.mask_method) == ("incremental", "generation")
    assert st.conversations == st_g.conversations == len(CONVS)
    assert listing(tmp_path / "inc") == [
        "chat.bin",
        "chat.idx",
        "chat.loss_mask.bin",
        "chat.loss_mask.idx",
        "chat.meta.json",
    ]

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    eot = {"llama3": "<|eot_id|>", "qwen": "<|im_end|>\n"}[family]
    inc, gen = ChatDataset(tmp_path / "inc" / "chat"), ChatDataset(tmp_path / "gen" / "chat")
    assert len(inc) == len(gen) == len(CONVS)
    for i, c in enumerate(CONVS):
        msgs = messages_of(c)
        (ids, mask), (ids_g, mask_g) = inc[i], gen[i]
        # tokens: transformers' own rendering + tokenization of the conversation
        assert ids.tolist() == tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
        assert ids_g.tolist() == ids.tolist()
        # mask: transformers' {% generation %} mask, and exactly the assistant contents + end-of-turn
        oracle = tok.apply_chat_template(
            msgs, chat_template=marked, return_dict=True, return_assistant_tokens_mask=True
        )
        assert mask.tolist() == mask_g.tolist() == oracle["assistant_masks"]
        trim = (lambda s: s.strip()) if family == "llama3" else (lambda s: s)
        want = "".join(trim(m["content"]) + eot for m in msgs if m["role"] == "assistant")
        if family == "qwen" and i == 2:
            # "assistant\n" + "    return": BPE merges "\n    " across the boundary; the token
            # overlapping the assistant turn counts (transformers' rule, checked equal above)
            want = "\n" + want
        assert tok.decode(ids[mask == 1]) == want
        assert inc.lengths[i] == len(ids) and mask.dtype == np.uint8 and ids.dtype == np.int64
    assert st.loss_tokens == sum(int(inc[i][1].sum()) for i in range(len(inc)))
    meta = inc.meta
    assert meta["format"] == CHAT_FORMAT and meta["loss_mask"]["prefix_suffix"] == MASK_SUFFIX
    assert meta["documents"] == len(CONVS) and meta["vocab_size"] == len(tok) and meta["max_token_id"] < len(tok)


def test_not_prefix_consistent_template_is_refused(src, tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok", "qwen", LAST_DIFFERS)
    out = tmp_path / "out"
    with pytest.raises(UserError) as e:
        preprocess_chat(src / "convs.jsonl", out / "chat", tok_dir)
    msg = str(e.value)
    assert f"{src / 'convs.jsonl'}:1" in msg and "is not prefix-consistent" in msg and str(tok_dir) in msg
    assert "{% generation %}" in msg
    assert not out.exists()  # not even the output directory


def test_tokenizer_without_template_needs_chat_template_file(src, tmp_path):
    tok_dir = make_tokenizer(tmp_path / "tok", "qwen", None)
    with pytest.raises(UserError, match="has no chat template.*chat_template=FILE"):
        preprocess_chat(src / "convs.jsonl", tmp_path / "out" / "chat", tok_dir)
    assert not (tmp_path / "out").exists()  # not even the output directory
    (tmp_path / "t.jinja").write_text(QWEN_PLAIN)
    st = preprocess_chat(src / "convs.jsonl", tmp_path / "out" / "chat", tok_dir, chat_template=tmp_path / "t.jinja")
    assert st.conversations == len(CONVS) and st.chat_template == str(tmp_path / "t.jinja")


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("qtok") / "tok", "qwen", QWEN_PLAIN)


@pytest.mark.parametrize(
    "line,needle",
    [
        ('{"messages": [', "convs.jsonl:2: not valid JSON"),
        (
            '{"messages": [{"role": "bot", "content": "x"}]}',
            "convs.jsonl:2: message 0 has unknown role 'bot'; the allowed roles are system, user, assistant, tool",
        ),
        ('{"text": "x"}', 'convs.jsonl:2: expected a "messages" list or "prompt" and "completion"'),
        ('{"messages": {"role": "user"}}', 'convs.jsonl:2: "messages" is a dict'),
        ('{"messages": [{"role": "user"}]}', "convs.jsonl:2: message 0 is not a"),
        ('{"messages": [{"role": "user", "content": 3}]}', "convs.jsonl:2: message 0 (user) content is a int"),
    ],
)
def test_bad_lines_name_file_and_line_and_write_nothing(qwen_tok, tmp_path, line, needle):
    (tmp_path / "convs.jsonl").write_text(json.dumps(CONVS[0]) + "\n" + line + "\n")
    out = tmp_path / "out"
    with pytest.raises(UserError) as e:
        preprocess_chat(tmp_path / "convs.jsonl", out / "chat", qwen_tok, batch_size=1)  # line 1 already written
    assert needle in str(e.value)
    assert not out.exists()  # not even the output directory


def test_bad_arguments_are_refused_before_work(qwen_tok, src, tmp_path):
    out = tmp_path / "out" / "chat"
    for kw, needle in [
        ({"overlong": "cut"}, "overlong='cut': expected truncate or drop"),
        ({"max_length": 0}, "max_length=0 must be a positive"),
        ({"chat_template": tmp_path / "nope.jinja"}, "nope.jinja does not exist"),
    ]:
        with pytest.raises(UserError, match=needle):
            preprocess_chat(src / "convs.jsonl", out, qwen_tok, **kw)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / ("chat" + MASK_SUFFIX + ".bin")).write_text("x")
    with pytest.raises(UserError, match="loss-mask dataset already exists"):
        preprocess_chat(src / "convs.jsonl", out, qwen_tok)


def test_skips_and_overlong_are_counted(qwen_tok, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(qwen_tok))
    rows = [
        *CONVS,
        {"messages": []},
        {"messages": [{"role": "user", "content": "  "}]},
        {"messages": [{"role": "user", "content": "hi"}]},
    ]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lengths = [len(tok.apply_chat_template(messages_of(c), tokenize=True, return_dict=False)) for c in CONVS]
    limit = sorted(lengths)[1]  # two conversations fit, two are longer
    st = preprocess_chat(tmp_path / "c.jsonl", tmp_path / "t" / "chat", qwen_tok, max_length=limit)
    assert (st.skipped_empty, st.skipped_no_assistant) == (2, 1)
    assert st.truncated + st.dropped_overlong == 2 and st.conversations == 4 - st.dropped_overlong
    ds = ChatDataset(tmp_path / "t" / "chat")
    assert max(ds.lengths) <= limit and all(m.sum() > 0 for _, m in ds)
    assert "2 empty, 1 without an assistant turn" in st.describe() and f"max_length={limit}" in st.describe()
    st = preprocess_chat(tmp_path / "c.jsonl", tmp_path / "d" / "chat", qwen_tok, max_length=limit, overlong="drop")
    assert (st.conversations, st.dropped_overlong, st.truncated) == (2, 2, 0)
    (tmp_path / "none.jsonl").write_text(json.dumps(rows[-1]) + "\n")
    with pytest.raises(UserError, match="no conversation to train on.*1 without an assistant turn"):
        preprocess_chat(tmp_path / "none.jsonl", tmp_path / "n" / "chat", qwen_tok)
    assert not (tmp_path / "n").exists()  # not even the output directory


def test_reader_refuses_other_data_and_mismatched_halves(qwen_tok, src, tmp_path):
    from megatron_bridge.data.preprocess import preprocess

    (tmp_path / "t.jsonl").write_text('{"text": "hello world"}\n')
    preprocess(tmp_path / "t.jsonl", tmp_path / "plain", qwen_tok)
    with pytest.raises(UserError, match="incomplete: .*plain.loss_mask.bin"):
        ChatDataset(tmp_path / "plain")
    preprocess_chat(src / "convs.jsonl", tmp_path / "a", qwen_tok)
    ds = ChatDataset(tmp_path / "a")
    assert np.array_equal(ds[-1][0], ds[len(ds) - 1][0])
    with pytest.raises(IndexError):
        ds[len(ds)]
    preprocess_chat(src / "convs.jsonl", tmp_path / "b", qwen_tok, max_length=int(ds.lengths.max()) - 1)
    paths_a, paths_b = chat_paths(tmp_path / "a"), chat_paths(tmp_path / "b")
    for k in ("mask_bin", "mask_idx"):
        (tmp_path / paths_b[k]).replace(paths_a[k])
    with pytest.raises(UserError, match="disagree on conversation lengths"):
        ChatDataset(tmp_path / "a")
    preprocess_chat(src / "convs.jsonl", tmp_path / "c", qwen_tok)
    meta_path = chat_paths(tmp_path / "c")["meta"]
    meta = json.loads(open(meta_path).read())
    meta["format"] = "megatron_bridge.chat/0"
    open(meta_path, "w").write(json.dumps(meta))
    with pytest.raises(UserError, match="not chat data in the format this version reads"):
        ChatDataset(tmp_path / "c")


@pytest.mark.parametrize("template", [QWEN, QWEN_PLAIN], ids=["generation", "incremental"])
def test_template_errors_name_the_conversation(qwen_tok, tmp_path, template):
    boom = (
        "{% for m in messages %}{% if m['content'] == 'boom' %}{{ raise_exception('no boom') }}{% endif %}{% endfor %}"
    )
    (tmp_path / "t.jinja").write_text(boom + template)
    (tmp_path / "c.jsonl").write_text(
        json.dumps(CONVS[0]) + "\n" + json.dumps({"prompt": "boom", "completion": "x"}) + "\n"
    )
    with pytest.raises(
        UserError, match=r"c.jsonl:2: the chat template of .*t.jinja failed on this conversation: no boom"
    ):
        preprocess_chat(tmp_path / "c.jsonl", tmp_path / "o" / "c", qwen_tok, chat_template=tmp_path / "t.jinja")
    assert not (tmp_path / "o").exists()
