"""Files the bad-input catalogue points at, built once and never written by a case.

    python -m tests.reliability.fixtures DIR

DIR/demo (a small indexed dataset + its 320-token tokenizer), DIR/big (a 600-token tokenizer,
larger than the model's 512, and data made with it), DIR/chat (chat jsonl with one defect per
file, a template that is not prefix-consistent, a tokenizer without a chat template, a chat dataset), DIR/vlm (a tiny
vision-language processor, an image, image chats with one defect per file: a missing, an undecodable and a URL
image, and a template that renders no image placeholder), fake training checkpoints — complete
under another layout, and damaged in every way (corrupt/truncated/missing rank file, corrupt
`latest` pointer, pointer to a missing iteration, corrupt manifest, only an interrupted save) —
a checkpoint directory leased by a live job (pid 1), a non-empty directory, and Hugging Face model directories for `mbr convert`: a good tiny Llama
and one per defect (truncated/corrupt/missing shard, no weights, shapes that disagree with
config.json, unknown architecture); and checkpoints from a stranger: a pickle payload on every
load path, names leading out of their directory, FIFOs where files belong.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import sys
from pathlib import Path

LAYOUT_1 = "tp1·pp1·cp1·ep1·etp1·dp1 zero0 world=1 mbs=1 gbs=8 accum=8"
LAYOUT_4 = "tp2·pp2·cp1·ep1·etp2·dp1 zero0 world=4 mbs=1 gbs=8 accum=8"


def fake_checkpoint(root: Path, iterations, *, layout: str = LAYOUT_1, world: int = 2) -> Path:
    """A checkpoint root in the trainer's format (checkpoint.py) with small per-rank files."""
    import torch

    from megatron_bridge.train import manifest as ck

    for it in iterations:
        tmp = ck.iter_dir(root, it).with_suffix(".tmp")
        tmp.mkdir(parents=True)
        files = []
        for r in range(world):
            buf = io.BytesIO()
            torch.save({"w": torch.full((64,), float(r + it))}, buf)
            data = buf.getvalue()
            (tmp / f"rank_{r:05d}.pt").write_bytes(data)
            files.append({"file": f"rank_{r:05d}.pt", "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)})
        (tmp / ck.MANIFEST).write_text(
            json.dumps({"iteration": it, "world_size": world, "files": files, "layout": layout, "engine": "megatron"})
        )
        tmp.rename(ck.iter_dir(root, it))
        (Path(root) / ck.LATEST).write_text(f"{it}\n")
    return Path(root)


def build(fx: Path) -> None:
    from megatron_bridge.data.corpus import train_tokenizer
    from megatron_bridge.data.demo import build_demo
    from megatron_bridge.data.preprocess import preprocess
    from megatron_bridge.train import manifest as ck

    fx.mkdir(parents=True, exist_ok=True)
    (fx / "recipes").mkdir()
    (fx / "recipes" / "self_including.yaml").write_text("defaults:\n  - mbr_schema\n  - self_including\n  - _self_\n")
    (fx / "recipes" / "no_defaults.yaml").write_text("train:\n  steps: 3\n")
    demo = build_demo(fx / "demo", 320, 60000)
    big = fx / "big"
    big.mkdir()
    train_tokenizer(demo.corpus, big / "tokenizer", 600, min_frequency=1)
    preprocess(demo.corpus, big / "stdlib_text_document", big / "tokenizer")

    chat = fx / "chat"
    chat.mkdir()
    good = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
    (chat / "good.jsonl").write_text(good)
    (chat / "bad_json.jsonl").write_text(good + '{"messages": [\n')
    (chat / "bad_role.jsonl").write_text(good + '{"messages": [{"role": "bot", "content": "hi"}]}\n')
    (chat / "last_differs.jinja").write_text(
        "{% for m in messages %}{% if loop.last and m['role'] == 'assistant' %}<|im_start|>final\n{% else %}"
        "<|im_start|>{{ m['role'] }}\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    from megatron_bridge.data.chat_dataset import preprocess_chat

    (chat / "two.jsonl").write_text(good * 2)
    preprocess_chat(chat / "two.jsonl", chat / "chatdata", demo.tokenizer)  # chat-format data (data=sft)
    shutil.copytree(demo.tokenizer, chat / "tok_no_template")
    (chat / "tok_no_template" / "chat_template.jinja").unlink()
    cfg = chat / "tok_no_template" / "tokenizer_config.json"
    cfg.write_text(json.dumps({k: v for k, v in json.loads(cfg.read_text()).items() if k != "chat_template"}))

    from tests.vlm_processor import TEXT_ONLY_TEMPLATE, make_processor, make_vlm, png

    vlm = fx / "vlm"
    make_processor(vlm / "proc")
    make_vlm(vlm / "model")  # a tiny Qwen2.5-VL with its processor
    png(vlm / "ok.png", 60, 90)
    (vlm / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot an image")
    (vlm / "text_only.jinja").write_text(TEXT_ONLY_TEMPLATE)

    def image_chat(image: str) -> str:
        parts = [{"type": "image", "image": image}, {"type": "text", "text": "what is this?"}]
        return (
            json.dumps({"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "red"}]})
            + "\n"
        )

    (vlm / "ok.jsonl").write_text(image_chat("ok.png"))
    (vlm / "missing.jsonl").write_text(image_chat("ok.png") + image_chat("nope.png"))
    (vlm / "broken.jsonl").write_text(image_chat("broken.png"))
    (vlm / "url.jsonl").write_text(image_chat("https://example.com/cat.png"))

    fake_checkpoint(fx / "ck_tp2pp2", [2], layout=LAYOUT_4, world=4)
    (fake_checkpoint(fx / "ck_bad_latest", [2]) / ck.LATEST).write_text("iter_2?\n")
    (fake_checkpoint(fx / "ck_missing_iter", [2]) / ck.LATEST).write_text("8\n")
    (fake_checkpoint(fx / "ck_bad_manifest", [2]) / "iter_0000002" / ck.MANIFEST).write_text('{"files": [')
    f = fake_checkpoint(fx / "ck_corrupt", [2, 4]) / "iter_0000004" / "rank_00001.pt"
    b = bytearray(f.read_bytes())
    b[-20] ^= 0xFF  # same size, one byte flipped
    f.write_bytes(bytes(b))
    f = fake_checkpoint(fx / "ck_truncated", [2]) / "iter_0000002" / "rank_00000.pt"
    f.write_bytes(f.read_bytes()[:100])
    (fake_checkpoint(fx / "ck_missing_file", [2]) / "iter_0000002" / "rank_00001.pt").unlink()
    torn = fx / "ck_torn" / "iter_0000004.tmp"
    torn.mkdir(parents=True)
    (torn / "rank_00000.pt.partial").write_bytes(b"half")
    # a checkpoint directory leased by a live job: pid 1 of this host (always alive)
    import dataclasses

    from megatron_bridge.train import lease as ls

    held = dataclasses.replace(
        ls.Holder.me(), pid=1, pid_start=ls._proc_start(1), launcher_pid=0, job_id="SLURM_JOB_ID=4242", job_key="x"
    )
    (fx / "ck_leased").mkdir()
    (fx / "ck_leased" / ls.LEASE).write_text(json.dumps(dataclasses.asdict(held)))
    (fx / "nonempty").mkdir()
    (fx / "nonempty" / "README").write_text("not a checkpoint")

    from safetensors import safe_open

    from megatron_bridge.runtime.tiny import make_tiny

    hf = Path(make_tiny("llama", fx / "hf"))

    def variant(name: str) -> Path:
        shutil.copytree(hf, fx / name)
        return fx / name

    f = variant("hf_truncated") / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    f = variant("hf_corrupt") / "model.safetensors"
    b = bytearray(f.read_bytes())
    b[8:40] = b"\xff" * 32  # the JSON header
    f.write_bytes(bytes(b))
    f = variant("hf_overlap") / "model.safetensors"  # two tensors of one size share their bytes
    b = f.read_bytes()
    n = int.from_bytes(b[:8], "little")
    head = json.loads(b[8 : 8 + n])
    names = [k for k in head if k != "__metadata__"]
    first, second = next(
        (x, y)
        for x in names
        for y in names
        if x < y and (head[x]["shape"], head[x]["dtype"]) == (head[y]["shape"], head[y]["dtype"])
    )
    head[second]["data_offsets"] = head[first]["data_offsets"]
    raw = json.dumps(head, separators=(",", ":")).encode()
    f.write_bytes(b[:8] + raw + b" " * (n - len(raw)) + b[8 + n :])
    d = variant("hf_missing_shard")
    with safe_open(str(d / "model.safetensors"), "pt") as h:
        keys = list(h.keys())
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    wm = {k: "model-00001-of-00002.safetensors" for k in keys}
    wm[keys[-1]] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    (variant("hf_no_weights") / "model.safetensors").unlink()
    for name, change in (
        ("hf_wrong_shape", {"intermediate_size": 96}),
        ("hf_unknown_arch", {"architectures": ["FooForCausalLM"], "model_type": "foo"}),
        ("hf_layers_huge", {"num_hidden_layers": 100_000_000}),
        ("hf_layers_str", {"num_hidden_layers": "4"}),
    ):
        c = variant(name) / "config.json"
        c.write_text(json.dumps({**json.loads(c.read_text()), **change}))
    _lora_fixtures(fx)
    _stranger_fixtures(fx, hf)
    _megatron_fixtures(fx, hf)
    _numerics_fixtures(fx, hf)
    _weak_fixtures(fx)


def _weak_fixtures(fx: Path) -> None:
    """Inputs that used to end in a traceback or wrong advice (issue 23, item 8)."""
    cut = fx / "cut"
    cut.mkdir()
    for f in (fx / "demo").glob("stdlib_text_document*"):
        shutil.copy(f, cut / f.name)
    b = cut / "stdlib_text_document.bin"
    b.write_bytes(b.read_bytes()[: b.stat().st_size // 2])  # the .idx still announces every document
    other = fake_checkpoint(fx / "ck_other_model", [2]) / "iter_0000002" / "manifest.json"
    m = json.loads(other.read_text())
    other.write_text(json.dumps({**m, "model": "LlamaForCausalLM layers=32 hidden=4096"}))
    (fx / "tok_config_only").mkdir()
    shutil.copy(fx / "demo" / "tokenizer" / "tokenizer_config.json", fx / "tok_config_only")


def _numerics_fixtures(fx: Path, hf: Path) -> None:
    """Non-finite numbers and token ids past the vocabulary (docs/reliability.md, section 8)."""
    d = fx / "hf_nan_eps"
    shutil.copytree(hf, d)
    c = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**c, "rms_norm_eps": float("nan")}))  # json writes NaN
    d = fx / "hf_nan_weights"
    shutil.copytree(hf, d)
    from megatron_bridge.convert.formats.safetensors_io import read_header

    info = read_header(d / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    b = bytearray((d / "model.safetensors").read_bytes())
    b[info.start + 40 : info.start + 44] = b"\x00\x00\xc0\x7f"  # a float32 NaN
    (d / "model.safetensors").write_bytes(bytes(b))
    oov = fx / "oov"
    oov.mkdir()
    for f in (fx / "demo").glob("stdlib_text_document*"):
        shutil.copy(f, oov / f.name)
    b = bytearray((oov / "stdlib_text_document.bin").read_bytes())  # uint16 ids (vocab 320)
    b[10:12] = (700).to_bytes(2, "little")  # past the model's 512; .meta.json still says otherwise
    (oov / "stdlib_text_document.bin").write_bytes(bytes(b))


def _stranger_fixtures(fx: Path, hf: Path) -> None:
    """Checkpoints from a stranger (docs/reliability.md, "A checkpoint from a stranger"): a
    marker payload (tests/payloads.py: unpickled, it creates `{fx}/PWNED_<name>`, which the
    catalogue's unchanged-fixtures check would see) on every load path, and names that leave
    their directory or are not regular files."""
    import os

    from megatron_bridge.cli import main as mbr
    from megatron_bridge.convert.formats.safetensors_io import read_header
    from tests import payloads as pl

    pl.training_checkpoint(fx / "ck_payload", fx / "PWNED_resume", layout=LAYOUT_1)
    pl.training_checkpoint(fx / "ck_payload_ds", fx / "PWNED_resume_ds", layout=LAYOUT_1, engine="deepspeed")
    for fmt in ("torch_dist", "torch"):
        assert mbr(["convert", f"src={hf}", f"dst={fx / f'cv_{fmt}'}", f"format={fmt}", "progress=off"]) == 0
    for fmt in ("torch_dist", "torch"):  # 4 bytes changed inside the largest file (same size)
        d = Path(shutil.copytree(fx / f"cv_{fmt}", fx / f"cv_tampered_{fmt}"))
        big = max(
            (p for p in d.rglob("*") if p.is_file() and p.name != "mbr_manifest.json"), key=lambda p: p.stat().st_size
        )
        b = bytearray(big.read_bytes())
        b[len(b) // 2 : len(b) // 2 + 4] = bytes(x ^ 0xFF for x in b[len(b) // 2 : len(b) // 2 + 4])
        big.write_bytes(bytes(b))
    # an HF directory we exported (its index records each file's CRC-32), and a copy with 4 bytes
    # of tensor data changed (same size, headers intact)
    assert mbr(["export", f"src={fx / 'cv_torch_dist'}", f"dst={fx / 'hf_exported'}", "progress=off"]) == 0
    d = Path(shutil.copytree(fx / "hf_exported", fx / "hf_exported_tampered"))
    (big,) = d.glob("*.safetensors")
    b = bytearray(big.read_bytes())
    b[-8:-4] = bytes(x ^ 0xFF for x in b[-8:-4])
    big.write_bytes(bytes(b))
    shutil.copytree(fx / "cv_torch_dist", fx / "cv_payload_dist")
    pl.payload_in_extra_state(fx / "cv_payload_dist", fx / "PWNED_init_dist")
    shutil.copytree(fx / "cv_torch", fx / "cv_payload_torch")
    pl.payload_in_rank_file(fx / "cv_payload_torch", fx / "PWNED_init_torch")
    d = fx / "hf_bin_payload"
    d.mkdir()
    shutil.copy(hf / "config.json", d / "config.json")
    pl.pickle_file(d / "pytorch_model.bin", fx / "PWNED_hf_bin")
    d = fx / "lora_bin_payload"
    d.mkdir()
    (d / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]})
    )
    pl.pickle_file(d / "adapter_model.bin", fx / "PWNED_lora_bin")

    keys = list(read_header(hf / "model.safetensors"))
    for name, target in (("hf_index_abs", "/etc/passwd"), ("hf_index_outside", "../hf/model.safetensors")):
        d = fx / name
        shutil.copytree(hf, d)
        (d / "model.safetensors").unlink()
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: target for k in keys}}))
    d = fx / "hf_fifo"
    shutil.copytree(hf, d)
    (d / "model.safetensors").unlink()
    os.mkfifo(d / "model.safetensors")  # a reader that opens it blocks forever
    d = fx / "hf_weights_dir"
    shutil.copytree(hf, d)
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").mkdir()
    d = fx / "hf_asset_link"
    shutil.copytree(hf, d)
    os.symlink("../nonempty/README", d / "notes.txt")  # its target would be copied into dst

    def edited(name: str, src: str, **fields) -> None:
        shutil.copytree(fx / src, fx / name)
        mf = fx / name / "mbr_manifest.json"
        mf.write_text(json.dumps({**json.loads(mf.read_text()), **fields}))

    edited("cv_asset_escape", "cv_torch_dist", assets=["../escaped.txt"])
    man = json.loads((fx / "cv_torch_dist" / "mbr_manifest.json").read_text())
    edited("cv_tp0", "cv_torch_dist", layout={**man["layout"], "tp": 0})
    edited("cv_layers_huge", "cv_torch_dist", hf_config={**man["hf_config"], "num_hidden_layers": 100_000_000})

    from megatron_bridge.train import manifest as ck

    for name, entry in (("ck_escape", "../../ck_payload/iter_0000002/rank_00000.pt"), ("ck_fifo", "extra.pt")):
        d = ck.iter_dir(fake_checkpoint(fx / name, [2]), 2)
        m = json.loads((d / ck.MANIFEST).read_text())
        m["files"].append({"file": entry, "sha256": "0" * 64, "bytes": 0})
        (d / ck.MANIFEST).write_text(json.dumps(m))
    os.mkfifo(ck.iter_dir(fx / "ck_fifo", 2) / "extra.pt")


def _megatron_fixtures(fx: Path, hf: Path) -> None:
    """Checkpoints as Megatron-LM writes them (our conversions without their manifest: the
    tracker, `release/`, the `args` in every file), one with a payload in a rank file, and HF
    configs of other models (another layer count, another vocabulary) to describe them by."""
    for name, src in (("mlm_dist", "cv_torch_dist"), ("mlm_torch", "cv_torch"), ("mlm_payload", "cv_payload_torch")):
        d = Path(shutil.copytree(fx / src, fx / name))
        for f in ("mbr_manifest.json", "config.json"):
            (d / f).unlink()
    d = Path(shutil.copytree(fx / "mlm_dist", fx / "mlm_noargs"))
    (d / "release" / "common.pt").unlink()  # no `args`: nothing says what the model is
    config = json.loads((hf / "config.json").read_text())
    for name, field, delta in (("hf_other_layers", "num_hidden_layers", 1), ("hf_other_vocab", "vocab_size", 100)):
        (fx / name).mkdir()
        (fx / name / "config.json").write_text(json.dumps({**config, field: config[field] + delta}))


def _lora_fixtures(fx: Path) -> None:
    """HF PEFT adapters that do not fit the tiny Llama in fx/hf (hidden 32, intermediate 64):
    one made for a wider MLP, one for a MoE model's modules."""
    import torch
    from safetensors.torch import save_file

    conf = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["down_proj"]}
    for name, module, in_features in (
        ("lora_other_size", "model.layers.0.mlp.down_proj", 96),
        ("lora_other_model", "model.layers.0.block_sparse_moe.experts.0.w2", 64),
    ):
        d = fx / name
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps(conf))
        tensors = {
            f"base_model.model.{module}.lora_A.weight": torch.zeros(8, in_features),
            f"base_model.model.{module}.lora_B.weight": torch.zeros(32, 8),
        }
        save_file(tensors, str(d / "adapter_model.safetensors"))
    shutil.copytree(fx / "lora_other_size", fx / "lora_truncated")
    f = fx / "lora_truncated" / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])  # the header still announces every byte


if __name__ == "__main__":
    build(Path(sys.argv[1]))
