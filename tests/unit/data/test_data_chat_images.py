"""Image chats: conversations with images → the processor's tokens (each placeholder expanded to
the image processor's count) + the assistant loss mask + the images recorded per conversation,
read back by `ImageChatDataset` and turned into pixels by `load_images`.

The oracle is transformers: the tokens must be the processor's `apply_chat_template`'s (which
opens the image files itself), and the mask found by incremental rendering must equal its
`return_assistant_tokens_mask` on the same template with `{% generation %}` markers. The
processor is a tiny Qwen2-VL-style one built here (tests/vlm_processor.py)."""

import json

import numpy as np
import pytest

from megatron_bridge.data.chat import CHAT_FORMAT
from megatron_bridge.data.chat_dataset import ChatDataset, ImageChatDataset, preprocess_chat
from megatron_bridge.data.chat_images import IMAGE_CHAT_FORMAT
from megatron_bridge.data.images import ImageRef, load_images
from megatron_bridge.errors import UserError
from tests.vlm_processor import MARKED, PIXELS, TEXT_ONLY_TEMPLATE, make_processor, png, png_bytes


def user(*parts):
    return {"role": "user", "content": list(parts)}


def img(path=None):
    return {"type": "image", **({"image": str(path)} if path is not None else {})}


def txt(t):
    return {"type": "text", "text": t}


ANSWER = {"role": "assistant", "content": "a red square"}


@pytest.fixture(scope="module")
def proc_dir(tmp_path_factory):
    return make_processor(tmp_path_factory.mktemp("proc") / "p")


@pytest.fixture(scope="module")
def marked_dir(tmp_path_factory):
    return make_processor(tmp_path_factory.mktemp("mproc") / "p", MARKED)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    d = tmp_path_factory.mktemp("imgs")
    a, b = png(d / "pics" / "a.png", 60, 90), png(d / "b.png", 30, 30, (0, 0, 255))
    convs = [
        [user(img("pics/a.png"), txt("what is in this picture?")), ANSWER],  # relative to the file
        [{"role": "user", "content": "no image here"}, {"role": "assistant", "content": "hello world"}],
        [user(txt("compare"), img(a), img(b)), ANSWER, user(txt("and?")), {"role": "assistant", "content": "blue"}],
    ]
    (d / "convs.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs))
    return d, convs, (a, b)


def absolute(convs, d):
    """The conversations as transformers' processor takes them: image parts with absolute paths."""
    fix = {"pics/a.png": str(d / "pics" / "a.png")}
    return [
        [
            {
                **m,
                "content": [
                    {**p, "image": fix.get(p["image"], p["image"])} if "image" in p else p for p in m["content"]
                ],
            }
            if isinstance(m["content"], list)
            else m
            for m in msgs
        ]
        for msgs in convs
    ]


@pytest.mark.parametrize("marked", [False, True], ids=["incremental", "generation"])
def test_tokens_mask_and_images_match_transformers(src, proc_dir, marked_dir, tmp_path, marked):
    from transformers import AutoProcessor

    d, convs, (a, b) = src
    marked_proc = AutoProcessor.from_pretrained(str(marked_dir))
    st = preprocess_chat(d / "convs.jsonl", tmp_path / "out" / "chat", marked_dir if marked else proc_dir)
    assert st.mask_method == ("generation" if marked else "incremental")
    assert (st.conversations, st.images, st.image_conversations, st.embedded_images) == (3, 3, 2, 0)
    meta = json.loads((tmp_path / "out" / "chat.meta.json").read_text())
    assert meta["format"] == IMAGE_CHAT_FORMAT
    assert meta["images"]["processor"] == "PaddleOCRVLProcessor" and meta["images"]["image_token"] == "<|image_pad|>"

    ds = ImageChatDataset(tmp_path / "out" / "chat")
    pad = marked_proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for i, msgs in enumerate(absolute(convs, d)):
        want = marked_proc.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        tokens, mask, images = ds[i]
        assert tokens.tolist() == list(want["input_ids"][0])
        assert mask.tolist() == list(want["assistant_masks"][0])
        assert not mask[tokens == pad].any()  # image tokens are never trained on
        for ref in images:
            assert (tokens[ref.start : ref.start + ref.tokens] == pad).all()
        assert sum(r.tokens for r in images) == int((tokens == pad).sum())
    assert [r.path for r in ds.images(0)] == [str(a.resolve())]
    assert ds.images(1) == [] and [r.path for r in ds.images(2)] == [str(a.resolve()), str(b.resolve())]
    # 60x90 resizes to 56x84: 2x3 tokens of 28x28 pixels; 30x30 to 28x28: one
    assert [r.tokens for r in ds.images_of([0, 1, 2])] == [6, 6, 1]  # a packed sample: its conversations' images

    pixels = ds.load_images(ds.images(2))
    grid = pixels["image_grid_thw"]
    assert set(pixels) == {"pixel_values", "image_grid_thw"}
    assert (grid.prod(-1) // 4).tolist() == [6, 1] and pixels["pixel_values"].shape[0] == int(grid.prod(-1).sum())

    with pytest.raises(UserError, match="holds image chats .* Read it with ImageChatDataset"):
        ChatDataset(tmp_path / "out" / "chat")


def test_images_column_bytes_are_stored_once(proc_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    blue = png_bytes(PIXELS, 2 * PIXELS)
    rows = [
        {  # a datasets struct column: every part has every key, None where unused
            "messages": [user(img(), txt("what is this?")), {"role": "assistant", "content": [txt("blue")]}],
            "images": [{"bytes": blue, "path": "blue.png"}],
        },
        {
            "messages": [user(img(), img()), {"role": "assistant", "content": [txt("two")]}],
            "images": [{"bytes": blue, "path": None}, {"bytes": blue, "path": None}],
        },
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    assert pq.read_table(tmp_path / "chat.parquet").to_pylist()[0]["messages"][0]["content"][0] == {
        "type": "image",
        "text": None,
    }
    st = preprocess_chat(tmp_path / "chat.parquet", tmp_path / "out" / "chat", proc_dir)
    assert (st.images, st.embedded_images) == (3, 1)
    stored = sorted((tmp_path / "out" / "chat.images").iterdir())
    assert len(stored) == 1 and stored[0].suffix == ".png" and stored[0].read_bytes() == blue
    ds = ImageChatDataset(tmp_path / "out" / "chat")
    assert [r.path for r in ds.images_of(range(2))] == [str(stored[0])] * 3
    assert [r.tokens for r in ds.images(1)] == [2, 2]
    assert load_images(ds.images(0), ds.processor())["image_grid_thw"].tolist() == [[1, 4, 2]]

    # rebuilt without images over it: the sidecar and the image directory go too, the format is chat/1
    (tmp_path / "text.jsonl").write_text(json.dumps({"messages": [user(txt("hi")), ANSWER]}) + "\n")
    preprocess_chat(tmp_path / "text.jsonl", tmp_path / "out" / "chat", proc_dir, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "chat.bin",
        "chat.idx",
        "chat.loss_mask.bin",
        "chat.loss_mask.idx",
        "chat.meta.json",
    ]
    assert ImageChatDataset(tmp_path / "out" / "chat").meta["format"] == CHAT_FORMAT
    assert ImageChatDataset(tmp_path / "out" / "chat")[0][2] == []

    # a videos column (LLaVA-Video-style rows) is refused, not dropped; an empty one is no video
    rows[0]["videos"], rows[1]["videos"] = [], ["clip.mp4"]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "video.parquet")
    with pytest.raises(UserError, match=r"video.parquet:row 2: the row has a 'videos' column; video inputs are not"):
        preprocess_chat(tmp_path / "video.parquet", tmp_path / "v" / "chat", proc_dir)
    assert not (tmp_path / "v").exists()


def test_truncation_never_splits_an_image(proc_dir, tmp_path):
    a = png(tmp_path / "a.png", 60, 90)
    msgs = [user(txt("hi")), {"role": "assistant", "content": "hello"}, user(img(a)), ANSWER]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": msgs}) + "\n")
    full = preprocess_chat(tmp_path / "c.jsonl", tmp_path / "full", proc_dir).tokens
    start = ImageChatDataset(tmp_path / "full").images(0)[0].start
    st = preprocess_chat(tmp_path / "c.jsonl", tmp_path / "cut", proc_dir, max_length=start + 3)
    tokens, mask, images = ImageChatDataset(tmp_path / "cut")[0]
    assert st.truncated == 1 and len(tokens) == start < full and images == [] and mask.any()
    # a cut right after the image would end the conversation on it: its last token, a label only
    end = start + ImageChatDataset(tmp_path / "full").images(0)[0].tokens
    for n, kept in ((end, 0), (end + 1, 1)):
        preprocess_chat(tmp_path / "c.jsonl", tmp_path / f"at{n}", proc_dir, max_length=n)
        tokens, _, images = ImageChatDataset(tmp_path / f"at{n}")[0]
        assert (len(tokens), len(images)) == ((start, 0) if not kept else (n, 1))


def test_load_images_refuses_a_changed_processor(src, proc_dir, tmp_path):
    from transformers import AutoProcessor

    d, _, (a, _) = src
    small = AutoProcessor.from_pretrained(str(make_processor(tmp_path / "small", max_pixels=PIXELS * PIXELS)))
    with pytest.raises(
        UserError, match=r"gives it 1 placeholder tokens, the data was made with 6: the processor changed"
    ):
        load_images([ImageRef(str(a), 6, 0)], small)
    assert set(load_images([str(a)], small)) == {"pixel_values", "image_grid_thw"}  # bare paths: nothing to check


@pytest.fixture(scope="module")
def no_processor(proc_dir, tmp_path_factory):
    import shutil

    d = tmp_path_factory.mktemp("tok") / "tok"
    shutil.copytree(proc_dir, d)
    (d / "processor_config.json").unlink()
    return d


@pytest.mark.parametrize(
    "case",
    [
        "missing",
        "unreadable",
        "url",
        "url_column",
        "count",
        "too_large",
        "no_processor",
        "column_count",
        "bad_part",
        "video_part",
        "videos_column",
    ],
)
def test_bad_image_input_is_refused_and_writes_nothing(case, proc_dir, no_processor, tmp_path):
    png(tmp_path / "ok.png", 60, 90)
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    line, kw, needle = {
        "missing": (
            {"messages": [user(img("nope.png")), ANSWER]},
            {},
            r"c.jsonl:2 \(image 1: nope.png\): image file .*nope.png not found",
        ),
        "unreadable": (
            {"messages": [user(img("broken.png")), ANSWER]},
            {},
            r"c.jsonl:2 \(image 1: broken.png\): Pillow cannot read this image",
        ),
        "url": (
            {"messages": [user(img("https://example.com/a.png")), ANSWER]},
            {},
            r"c.jsonl:2: message 0 \(user\), part 0: image 'https://example.com/a.png' is a URL; .*nothing is fetched",
        ),
        "url_column": (
            {"messages": [user(img()), ANSWER], "images": ["s3://bucket/a.png"]},
            {},
            r"c.jsonl:2 \(image 1: images\[0\]\): image 's3://bucket/a.png' is a URL",
        ),
        "count": (
            {"messages": [user(img("ok.png")), ANSWER]},
            {"chat_template": tmp_path / "t.jinja"},
            r"c.jsonl:2: the conversation has 1 image\(s\) but the chat template of .*t.jinja rendered 0 image "
            r"placeholder\(s\) '<\|image_pad\|>'",
        ),
        "too_large": (
            {"messages": [user(img("ok.png")), ANSWER]},
            {"max_image_pixels": 1000},
            r"c.jsonl:2 \(image 1: ok.png\): image is 60x90 = 5400 pixels, more than max_image_pixels=1000",
        ),
        "no_processor": (
            {"messages": [user(img("ok.png")), ANSWER]},
            {"tokenizer": no_processor},
            r"c.jsonl:2 \(image 1: ok.png\): this conversation has images, but .*holds no image processor",
        ),
        "column_count": (
            {"messages": [user(img()), ANSWER], "images": ["ok.png", "ok.png"]},
            {},
            r"c.jsonl:2: 1 image part\(s\) without a file take their images from the 'images' column, which holds 2",
        ),
        "bad_part": (
            {"messages": [user({"type": "audio", "audio": "a.wav"}), ANSWER]},
            {},
            r"c.jsonl:2: message 0 \(user\): content part 0 is not a text or image part",
        ),
        "video_part": (
            {"messages": [user({"type": "video", "video": "v.mp4"}), ANSWER]},
            {},
            r"c.jsonl:2: message 0 \(user\): content part 0 is a video part; video inputs are not supported",
        ),
        "videos_column": (
            {"messages": [user(txt("what?")), ANSWER], "videos": ["v.mp4"]},
            {},
            r"c.jsonl:2: the row has a 'videos' column; video inputs are not supported",
        ),
    }[case]
    (tmp_path / "t.jinja").write_text(TEXT_ONLY_TEMPLATE)
    # line 1 is written (with its image, where the case lets an image through) before line 2 fails
    first = [img("ok.png"), txt("what?")] if case not in ("count", "too_large", "no_processor") else [txt("what?")]
    good = json.dumps({"messages": [user(*first), ANSWER]})
    (tmp_path / "c.jsonl").write_text(good + "\n" + json.dumps(line) + "\n")
    out = tmp_path / "out"
    with pytest.raises(UserError, match=needle):
        preprocess_chat(tmp_path / "c.jsonl", out / "chat", kw.pop("tokenizer", proc_dir), batch_size=1, **kw)
    assert not out.exists()  # not even the output directory
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_reader_checks_the_sidecar(src, proc_dir, tmp_path):
    d, _, _ = src
    preprocess_chat(d / "convs.jsonl", tmp_path / "chat", proc_dir)
    side = tmp_path / "chat.images.jsonl"
    side.write_text("\n".join(side.read_text().splitlines()[:2]) + "\n")
    with pytest.raises(UserError, match=r"chat.images.jsonl has 2 lines for 3 conversations"):
        ImageChatDataset(tmp_path / "chat")
    side.unlink()
    with pytest.raises(UserError, match="holds image chats but .*chat.images.jsonl is missing"):
        ImageChatDataset(tmp_path / "chat")
    np.testing.assert_array_equal(ImageChatDataset.FORMATS, (CHAT_FORMAT, IMAGE_CHAT_FORMAT))
