"""The bridged HF families train under `megatron_bridge.train`: one torchrun launch of 2
processes runs a sample of families and layouts on the demo data (stdlib text, BPE tokenizer),
both engines.

Per family kind: dense ones at tp2 (Gemma 2: zero-centred norms, sandwich norms, soft-capping,
windows; Granite: multipliers), cp2 (OLMo-2: post-norms, full q/k norm), pp2 (Gemma 3);
MoE at ep2·tp2·etp1 (GPT-OSS: sinks, biased clamped experts; DeepSeek-V3: MLA, sigmoid group
routing with its frozen fp32 correction bias, in bf16), MLA under cp2 and pp2 (DeepSeek-V2);
DeepSpeed ZeRO-1 (Gemma 2) and ZeRO-2 (DeepSeek-V3). Asserted: every loss is finite and goes
down; resuming is bit-exact on both engines for families with our own modules (Gemma 2,
DeepSeek-V3); `train.init_from` of an `mbr convert` torch_dist output (written at tp2, loaded
at another layout) starts from the same weights; the exported HF directories load in
transformers with the source's keys, trained weights and DeepSeek-V3's correction bias
untouched (fp32, bit for bit).
"""

import math

import pytest
import torch

from megatron_bridge.runtime.tiny import make_tiny
from megatron_bridge.testing import run_torchrun

pytestmark = pytest.mark.dist
SCRIPT = "tests/dist/train_scripts/layouts.py"
STEPS = 4
FAMILIES = ("gemma2", "granite", "olmo2", "gemma3_text", "gpt_oss", "deepseek_v3", "deepseek_v2")
MOE = ("parallel.tp=2", "parallel.ep=2", "parallel.etp=1")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from megatron_bridge.data.demo import build_demo

    root = tmp_path_factory.mktemp("families")
    demo = build_demo(root / "demo", 320, 60000)
    hf = {f: make_tiny(f, root / f, vocab_size=demo.vocab_size) for f in FAMILIES}
    return root, demo, hf


def _convert(src, dst):
    from megatron_bridge.cli import main

    assert main(["convert", f"src={src}", f"dst={dst}", "parallel.tp=2"]) == 0


def test_families_train_resume_and_export(inputs, tmp_path):
    root, demo, hf = inputs
    data = ["data=indexed", f"data.paths=[{demo.prefix}]", f"data.tokenizer={demo.tokenizer}", "data.split=100/0/0"]
    common = [
        "recipe=default",
        f"train.steps={STEPS}",
        "train.seq_length=32",
        "train.micro_batch_size=2",  # CI time: half the micro-batches of one-sample ones
        "train.global_batch_size=4",
        "optimizer.warmup_steps=0",
        "optimizer.lr=1e-2",
        "cluster.gpus_per_node=2",
        *data,
    ]
    ck, out = tmp_path / "ckpt", tmp_path / "export"
    for f in ("gemma2", "deepseek_v3"):
        _convert(hf[f], root / f"conv_{f}")

    def job(name, fam, *o):
        return f"{name}:" + ",".join([*common, f"model.hf_path={hf[fam]}", *o])

    g2, v3 = ("parallel.tp=2",), (*MOE, "train.precision=bf16")
    ds_v3 = ("train.engine=deepspeed", "zero.stage=2")
    jobs = [
        job("gemma2_tp2", "gemma2", *g2, f"export_to={out / 'gemma2'}"),
        job(
            "gemma2_first",
            "gemma2",
            *g2,
            "train.exit_after=2",
            f"checkpoint.dir={ck / 'g2'}",
            "checkpoint.save_interval=2",
        ),
        job("gemma2_resumed", "gemma2", *g2, f"checkpoint.dir={ck / 'g2'}", "checkpoint.resume=true"),
        job("granite_tp2", "granite", "parallel.tp=2"),
        job("olmo2_cp2", "olmo2", "parallel.cp=2"),
        job("gemma3_pp2", "gemma3_text", "parallel.pp=2"),
        job("gpt_oss_ep2tp2", "gpt_oss", *MOE, f"export_to={out / 'gpt_oss'}"),
        job("v3_ep2tp2_bf16", "deepseek_v3", *v3, f"export_to={out / 'deepseek_v3'}"),
        job(
            "v3_first",
            "deepseek_v3",
            *v3,
            "train.exit_after=2",
            f"checkpoint.dir={ck / 'v3'}",
            "checkpoint.save_interval=2",
        ),
        job("v3_resumed", "deepseek_v3", *v3, f"checkpoint.dir={ck / 'v3'}", "checkpoint.resume=true"),
        job("v3_cp2", "deepseek_v3", "parallel.cp=2"),
        job("v2_pp2", "deepseek_v2", "parallel.pp=2"),
        job("ds_gemma2_zero1", "gemma2", "train.engine=deepspeed", "zero.stage=1"),
        job("ds_v3_zero2", "deepseek_v3", *ds_v3),
        job(
            "ds_v3_first",
            "deepseek_v3",
            *ds_v3,
            "train.exit_after=2",
            f"checkpoint.dir={ck / 'ds'}",
            "checkpoint.save_interval=2",
        ),
        job("ds_v3_resumed", "deepseek_v3", *ds_v3, f"checkpoint.dir={ck / 'ds'}", "checkpoint.resume=true"),
        # weights from a torch_dist checkpoint written at tp2, loaded at another layout
        job("gemma2_conv_dp2", "gemma2", f"train.init_from={root / 'conv_gemma2'}", "train.steps=1"),
        job(
            "v3_conv_cp2",
            "deepseek_v3",
            f"train.init_from={root / 'conv_deepseek_v3'}",
            "parallel.cp=2",
            "train.steps=1",
        ),
    ]
    losses = run_torchrun([SCRIPT, str(tmp_path / "runs"), *jobs], nproc=2, timeout=600)[0]["losses"]

    for name in (
        "gemma2_tp2",
        "granite_tp2",
        "olmo2_cp2",
        "gemma3_pp2",
        "gpt_oss_ep2tp2",
        "v3_ep2tp2_bf16",
        "v3_cp2",
        "v2_pp2",
        "ds_gemma2_zero1",
        "ds_v3_zero2",
    ):
        got = losses[name]
        assert sorted(map(int, got)) == list(range(1, STEPS + 1)), (name, got)
        assert all(math.isfinite(v) for v in got.values()), (name, got)
        # it learns the text (4 steps of lr 1e-2 from random weights: not monotonic everywhere)
        assert got[str(STEPS)] < got["1"] and min(got.values()) < got["1"] - 0.02, (name, got)
    for full, first, resumed in (
        ("gemma2_tp2", "gemma2_first", "gemma2_resumed"),
        ("v3_ep2tp2_bf16", "v3_first", "v3_resumed"),
        ("ds_v3_zero2", "ds_v3_first", "ds_v3_resumed"),
    ):
        assert sorted(map(int, losses[resumed])) == [3, 4], losses[resumed]
        assert losses[first] | losses[resumed] == losses[full], (full, losses[full], losses[resumed])  # bit-exact
    # same weights as from the HF directory: layouts differ only in reduction order
    assert losses["gemma2_conv_dp2"]["1"] == pytest.approx(losses["gemma2_tp2"]["1"], rel=1e-6)
    assert losses["v3_conv_cp2"]["1"] == pytest.approx(losses["v3_cp2"]["1"], rel=1e-6)

    _check_exports(hf, out)


def _check_exports(hf, out):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    def weights(d):
        return {k: v for p in sorted(d.glob("*.safetensors")) for k, v in load_file(p).items()}

    for fam in ("gemma2", "gpt_oss", "deepseek_v3"):
        src, got = weights(hf[fam]), weights(out / fam)
        assert src.keys() == got.keys(), fam
        frozen = {k for k in src if k.endswith("e_score_correction_bias")}
        assert bool(frozen) == (fam == "deepseek_v3")
        for k in frozen:  # never trained, kept fp32 through bf16 training
            assert got[k].dtype == torch.float32 and torch.equal(got[k], src[k]), k
        trained = [k for k in src if k not in frozen and not torch.equal(src[k].float(), got[k].float())]
        assert len(trained) == len(src) - len(frozen), (fam, sorted(set(src) - set(trained) - frozen)[:5])
        model = AutoModelForCausalLM.from_pretrained(out / fam, dtype=torch.float32)
        logits = model(torch.arange(16).view(1, 16)).logits
        assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all(), fam
