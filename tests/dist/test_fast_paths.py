"""The fast paths train exactly like the plain one, in one 2-rank torchrun launch, fp32 on gloo:

* `train.compile=true`: a native Llama at tp2 and at pp2 and a transformers-backend model
  (Cohere: no native family) at tp2 on the megatron engine, and the Llama at dp2 under
  DeepSpeed ZeRO-1, each eager and compiled, every compiled layer one graph (no graph breaks,
  tensor-parallel linears included);
* `train.loss_chunk=8` (the LM head and cross entropy 8 of 32 positions at a time): the Llama
  at tp2 with sequence parallelism and at pp2, the Cohere at tp2 with sequence parallelism.

* `train.fused=true` (megatron-core's fused kernels, run eagerly on CPU): SwiGLU and
  bias-dropout-add in the Llama at tp2 and at pp2 (fp32), the fused vocab-parallel cross
  entropy in the Cohere at tp2 (bf16: the only precision it is used in).

* `train.recompute=selective` with `train.recompute_modules=[core_attn,mlp,layernorm]` (the
  native Llama at tp2 with sequence parallelism);
* `train.recompute=full` on the transformers backend (each decoder layer under
  torch.utils.checkpoint): the Cohere at tp2, and a Qwen3-MoE with transformers' router aux loss
  on (its router logits recorded inside the recomputed layers) at dp2.

Every step's loss and gradient norm agree with the plain run's within 1e-5 (relative); the
Cohere with sequence parallelism also agrees with the Cohere without it.

* `train.precision=fp8` (float8 GEMMs, torchao): the Llama at tp2 with sequence parallelism,
  at pp2 (rowwise scales), at tp2 compiled, at dp2 under DeepSpeed ZeRO-1, the Cohere at tp2:
  every loss within 1 % of the fp32 run's, and not equal to it (the GEMMs did change)."""

import pytest

from megatron_bridge.runtime.tiny import make_tiny
from megatron_bridge.testing import run_torchrun

pytestmark = pytest.mark.dist

SCRIPT = "tests/dist/train_scripts/layouts.py"
REL = 1e-5
COMMON = [
    "recipe=default",
    "train.steps=3",
    "train.seq_length=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "optimizer.warmup_steps=1",
    "optimizer.lr=3e-3",
    "data=synthetic",
    "train.precision=fp32",
]


def test_compiled_layers_match_eager(tmp_path):
    llama = make_tiny("llama", tmp_path / "llama")
    cohere = make_tiny("cohere", tmp_path / "cohere")
    cases = {
        "llama_tp2": [f"model.hf_path={llama}", "parallel.tp=2"],
        "llama_pp2": [f"model.hf_path={llama}", "parallel.pp=2"],
        "cohere_tp2": [f"model.hf_path={cohere}", "parallel.tp=2"],
        "llama_ds_zero1": [f"model.hf_path={llama}", "train.engine=deepspeed", "zero.stage=1"],  # dp2
    }
    chunked = {
        "llama_tp2_sp": [f"model.hf_path={llama}", "parallel.tp=2", "parallel.sequence_parallel=true"],
        "llama_pp2": cases["llama_pp2"],
        "cohere_tp2_sp": [f"model.hf_path={cohere}", "parallel.tp=2", "parallel.sequence_parallel=true"],
    }
    jobs = [
        f"{name}{suffix}:" + ",".join([*COMMON, *extra, f"train.compile={str(on).lower()}"])
        for name, extra in cases.items()
        for suffix, on in (("", False), ("_compiled", True))
    ]
    jobs += [f"{name}:" + ",".join([*COMMON, *chunked[name]]) for name in ("llama_tp2_sp", "cohere_tp2_sp")]
    jobs += [f"{name}_chunked:" + ",".join([*COMMON, *extra, "train.loss_chunk=8"]) for name, extra in chunked.items()]
    fp8 = {  # name: (the fp32 run it is compared with, its overrides)
        "llama_tp2_sp_fp8": ("llama_tp2_sp", chunked["llama_tp2_sp"]),
        "llama_pp2_fp8_rowwise": ("llama_pp2", [*cases["llama_pp2"], "train.fp8_recipe=rowwise"]),
        "llama_tp2_fp8_compiled": ("llama_tp2", [*cases["llama_tp2"], "train.compile=true"]),
        "llama_ds_zero1_fp8": ("llama_ds_zero1", cases["llama_ds_zero1"]),
        "cohere_tp2_fp8": ("cohere_tp2", cases["cohere_tp2"]),
    }
    jobs += [f"{name}:" + ",".join([*COMMON, *extra, "train.precision=fp8"]) for name, (_, extra) in fp8.items()]
    fused = {"llama_tp2": cases["llama_tp2"], "llama_pp2": cases["llama_pp2"]}
    fused["cohere_tp2_bf16"] = [*cases["cohere_tp2"], "train.precision=bf16"]
    jobs.append("cohere_tp2_bf16:" + ",".join([*COMMON, *fused["cohere_tp2_bf16"]]))
    jobs += [f"{name}_fused:" + ",".join([*COMMON, *extra, "train.fused=true"]) for name, extra in fused.items()]
    moe = make_tiny("qwen3_moe", tmp_path / "qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.5)
    recomputed = {
        "cohere_tp2": cases["cohere_tp2"],
        "moe_aux": [f"model.hf_path={moe}", "model.backend=transformers"],
    }
    jobs.append("moe_aux:" + ",".join([*COMMON, *recomputed["moe_aux"]]))
    selective = ["train.recompute=selective", "train.recompute_modules=[core_attn,mlp,layernorm]"]
    jobs.append("llama_tp2_sp_recompute:" + ",".join([*COMMON, *chunked["llama_tp2_sp"], *selective]))
    jobs += [f"{n}_recompute:" + ",".join([*COMMON, *e, "train.recompute=full"]) for n, e in recomputed.items()]
    res = run_torchrun([SCRIPT, str(tmp_path / "runs"), *jobs], nproc=2, timeout=900)[0]
    pairs = [(name, f"{name}_compiled") for name in cases] + [(name, f"{name}_chunked") for name in chunked]
    pairs += [(name, f"{name}_fused") for name in fused] + [(name, f"{name}_recompute") for name in (*recomputed, "llama_tp2_sp")]
    assert {name: res["graph_breaks"][f"{name}_compiled"] for name in cases} == dict.fromkeys(cases, 0)
    assert res["graph_breaks"]["llama_tp2_fp8_compiled"] == 0
    pairs.append(("cohere_tp2", "cohere_tp2_sp"))  # the transformers backend trains the same under SP
    for name, fast in pairs:
        for what in ("losses", "grad_norms"):
            ref, got = res[what][name], res[what][fast]
            assert ref.keys() == got.keys() and len(ref) == 3, (name, what)
            for step in ref:
                assert abs(got[step] - ref[step]) <= REL * abs(ref[step]), (fast, what, step, ref[step], got[step])
    for name, (ref_name, _) in fp8.items():
        ref, got = res["losses"][ref_name], res["losses"][name]
        assert ref.keys() == got.keys() and len(ref) == 3, name
        rel = [abs(got[step] - ref[step]) / abs(ref[step]) for step in ref]
        assert max(rel) <= 0.01 and max(rel) > 1e-6, (name, rel)
