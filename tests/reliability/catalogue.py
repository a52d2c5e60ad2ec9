"""The bad-input catalogue: every input a user can get wrong, and what must happen.

Each `Case` is one invalid input — a command line, the environment it runs in, the fixture
files it points at — with the problem the message must name and the fix it must give. Every
case runs what the user would run (`mbr ...`, `python -m megatron_bridge.train ...`, or a real
`torchrun` launch) in its own empty working directory — as its own subprocess (the torchrun and
`mbr launch` cases and at least one per area), or, to save the interpreter start, in a batch
interpreter that calls the console scripts' own entry function (inproc.py) — and must:

  1. exit non-zero (2, a user error; torchrun reports its workers' failure as 1),
  2. print one message naming the problem (`expect[0]`) and the fix (`expect[1:]`) — under
     torchrun every worker prints the same message, so: one distinct message,
  3. print no traceback (torchrun's own ChildFailedError report aside: it is the launcher's),
  4. write nothing: the working directory stays empty, the case's output paths
     (`must_not_exist`) are not created, and the shared fixtures are unchanged.

    python -m tests.reliability.catalogue            # run all cases, print the table
    python -m tests.reliability.catalogue -k data    # the cases whose id contains "data"
    python -m tests.reliability.catalogue --markdown table.md   # the table for docs/reliability.md

`tests/reliability/test_catalogue.py` drives the same table through pytest (one test per case)
and prints the table in pytest's terminal summary.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
TIMEOUT = 120  # per case (per batch: twice that); a timed-out case's processes are killed
CLEARED = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "HYDRA_FULL_ERROR", "MBR_FAULT", "MBR_FAULT_DIR")


@dataclass(frozen=True)
class Case:
    id: str
    area: str  # config | data | checkpoint | launch | convert
    argv: tuple[str, ...]  # "mbr ...", "train ..." (python -m megatron_bridge.train) or "torchrun ..."
    rule: str  # the rule / problem the case is about (the table's "expected" column)
    expect: tuple[str, ...]  # substrings of the message: the problem, then the fix
    nproc: int = 0  # torchrun cases: --nproc-per-node
    env: tuple[tuple[str, str], ...] = ()
    must_not_exist: tuple[str, ...] = ()  # relative to the case's working directory, or {FX}/...
    rc: int = 2
    proc: bool = False  # run as its own subprocess (always for torchrun); else in a batch interpreter

    @property
    def own_process(self) -> bool:
        return self.proc or self.argv[0] == "torchrun" or self.argv[:2] == ("mbr", "launch")

    @property
    def input(self) -> str:
        head = f"torchrun×{self.nproc} train" if self.argv[0] == "torchrun" else self.argv[0]
        env = " ".join(f"{k}={v}" for k, v in self.env)
        return " ".join(filter(None, [env, head, *self.argv[1:]]))


def C(id, area, cmd, rule, *expect, nproc=0, env=(), out=(), rc=2, proc=False) -> Case:
    return Case(id, area, tuple(cmd.split()), rule, tuple(expect), nproc, tuple(env), tuple(out), rc, proc)


# A training command that would write a run directory and a checkpoint if it were accepted.
SHORT = " train.steps=2 optimizer.warmup_steps=1"  # (dropped from the table, like the output paths)
T = f"train recipe=default{SHORT} run_dir=out/run checkpoint.dir=out/ckpt"
OUT = ("out",)

CASES: list[Case] = [
    # -- configs: every layout rule (mbr check: no torch, no process group) ------------------
    C(
        "rule-choice",
        "config",
        "mbr check train.engine=tensorflow",
        "choice",
        "train.engine='tensorflow' is not one of",
        "set train.engine to one of them",
    ),
    C(
        "rule-negative-degree",
        "config",
        "mbr check parallel.tp=-2",
        "positive-degree",
        "parallel.tp=-2 must be >= 1",
        "Fix: set parallel.tp to 1 or more",
    ),
    C(
        "rule-zero-stage",
        "config",
        "mbr check zero.stage=4",
        "zero-stage",
        "zero.stage=4 is not a ZeRO stage",
        "use zero.stage=0, 1, 2 or 3",
    ),
    C(
        "rule-world-size",
        "config",
        "mbr check parallel.dp=3",
        "world-size",
        "[world-size]",
        "!= world size 4",
        "set parallel.dp=-1",
        proc=True,
    ),
    C(
        "rule-heads-tp",
        "config",
        "mbr check model.num_attention_heads=6 model.hidden_size=96 parallel.tp=4",
        "heads-tp",
        "num_attention_heads=6 is not divisible by tp=4",
        "choose tp dividing the head count",
    ),
    C(
        "rule-hidden-heads",
        "config",
        "mbr check model.hidden_size=66",
        "hidden-heads",
        "hidden_size=66 is not divisible by num_attention_heads=4",
        "set model.kv_channels",
    ),
    C(
        "rule-kv-heads-tp",
        "config",
        "mbr check model.num_attention_heads=6 model.hidden_size=96 model.num_query_groups=3 parallel.tp=2",
        "kv-heads-tp",
        "(KV heads)=3 and tp=2",
        "choose tp dividing 3",
    ),
    C(
        "rule-layers-pp",
        "config",
        "mbr check model.num_layers=6 parallel.pp=4",
        "layers-pp",
        "num_layers=6 is not divisible by pp·vpp",
        "layers_first_stage",
    ),
    C(
        "rule-layers-uneven",
        "config",
        "mbr check parallel.pp=2 parallel.layers_first_stage=5",
        "layers-uneven",
        "[layers-uneven]",
        "adjust layers_first_stage/layers_last_stage",
    ),
    C(
        "rule-seq-length",
        "config",
        "mbr check train.seq_length=0",
        "seq-length",
        "train.seq_length=0 must be >= 1",
        "set a positive sequence length",
    ),
    C(
        "rule-seq-length-huge",
        "config",
        "mbr check train.seq_length=1099511627776",
        "seq-length",
        "train.seq_length=1099511627776 is more than 16777216 tokens",
        "set the sequence length the model is trained for",
    ),
    C(
        "rule-seq-cp",
        "config",
        "mbr check parallel.cp=2 train.seq_length=33",
        "seq-cp",
        "seq_length=33 is not divisible by 2·cp = 4",
        "use a multiple of 4",
    ),
    C(
        "rule-seq-sp",
        "config",
        "mbr check parallel.tp=2 parallel.sequence_parallel=true train.seq_length=33",
        "seq-sp",
        "[seq-sp]",
        "use a seq_length that is a multiple of 2",
    ),
    C(
        "rule-ep-dense",
        "config",
        "mbr check parallel.ep=2",
        "ep-dense",
        "parallel.ep=2 but model tiny_llama has no experts",
        "set parallel.ep=1",
    ),
    C(
        "rule-experts-ep",
        "config",
        "mbr check recipe=tiny_mixtral parallel.ep=3",
        "experts-ep",
        "num_moe_experts=4 is not divisible by ep=3",
        "choose ep dividing the expert count",
    ),
    C(
        "rule-moe-tp-sp",
        "config",
        "mbr check recipe=tiny_mixtral parallel.tp=2 parallel.pp=1 parallel.sequence_parallel=false",
        "moe-tp-sp",
        "needs sequence parallelism",
        "parallel.sequence_parallel=true",
    ),
    C(
        "rule-expert-grid",
        "config",
        "mbr check recipe=tiny_mixtral parallel.pp=1 parallel.ep=4 parallel.etp=2",
        "expert-grid",
        "etp·ep·pp = 2·4·1 = 8 must divide the world size 4",
        "lower ep or etp",
    ),
    C(
        "rule-global-batch",
        "config",
        "mbr check train.global_batch_size=7",
        "global-batch",
        "global_batch_size=7 is not divisible by micro_batch_size·dp",
        "multiple of 4",
    ),
    C(
        "rule-grad-accum",
        "config",
        "mbr check train.grad_accum=3",
        "global-batch",
        "global_batch_size=8 != micro·grad_accum·dp",
        "train.grad_accum=null",
    ),
    C(
        "rule-microbatches-pp",
        "config",
        "mbr check parallel.pp=4 train.global_batch_size=2",
        "microbatches-pp",
        "the pipeline never fills",
        "raise train.global_batch_size to at least 4",
    ),
    C(
        "rule-vpp-pp",
        "config",
        "mbr check parallel.vpp=2",
        "vpp-pp",
        "parallel.vpp=2 needs pp > 1",
        "set parallel.vpp=null or raise pp",
    ),
    C(
        "rule-vpp-microbatches",
        "config",
        "mbr check parallel.pp=2 parallel.vpp=2 train.global_batch_size=6",
        "vpp-microbatches",
        "interleaved 1F1B needs microbatches % pp == 0",
        "a multiple of 2",
    ),
    C(
        "rule-zero-pp",
        "config",
        "mbr check parallel.pp=2 zero.stage=2 train.engine=deepspeed",
        "zero-pp",
        "zero.stage=2 with pp=2",
        "use zero.stage=1 with pipeline parallelism",
    ),
    C(
        "rule-zero-engine",
        "config",
        "mbr check zero.stage=3",
        "zero-engine",
        "zero.stage=3 needs train.engine=deepspeed",
        "add train.engine=deepspeed",
    ),
    C(
        "rule-zero-offload",
        "config",
        "mbr check zero.offload_param=cpu zero.stage=1",
        "zero-offload",
        "zero.offload_param needs zero.stage=3",
        "set zero.stage=3",
    ),
    C(
        "rule-deepspeed-engine",
        "config",
        "mbr check train.engine=deepspeed parallel.cp=2",
        "deepspeed-engine",
        "cp=2 needs megatron-core's schedules",
        "use train.engine=megatron",
    ),
    C(
        "rule-tp-in-node",
        "config",
        "mbr check model=llama3_8b cluster=dgx_h100 cluster.nodes=2 parallel.tp=16",
        "tp-in-node",
        "tp=16 does not fit evenly in a node of 8 GPUs",
        "parallel.allow_cross_node_tp=true",
    ),
    C(
        "rule-cp-in-node",
        "config",
        "mbr check model=llama3_8b cluster=dgx_h100 cluster.nodes=2 parallel.tp=8 parallel.cp=2",
        "cp-in-node",
        "tp·cp = 16 does not fit evenly in a node of 8 GPUs",
        "lower cp",
    ),
    C(
        "rule-sft-packing-cp",
        "config",
        "mbr check recipe=default data=sft parallel.cp=2",
        "sft-packing-cp",
        "data.packing=true with parallel.cp=2",
        "set data.packing=false",
    ),
    C(
        "rule-eval-iters",
        "config",
        "mbr check train.eval_interval=100",
        "eval-iters",
        "train.eval_interval=100 evaluates nothing",
        "set train.eval_iters=K",
    ),
    C(
        "rule-eval-split",
        "config",
        f"{T} data=indexed data.paths=[{{FX}}/demo/stdlib_text_document] data.split=100/0/0 train.eval_iters=2",
        "eval-split",
        "gives it no weight",
        "give the valid split a share (e.g. data.split=98/2/0)",
        out=OUT,
    ),
    # -- configs: optimizer, schedule and interval values (config/values.py) -----------------
    C("value-lr", "config", "mbr check optimizer.lr=0", "lr", "optimizer.lr=0 must be > 0", "set a positive peak"),
    C(
        "value-lr-train",
        "config",
        f"{T} optimizer.lr=-1",
        "lr (trainer)",
        "[lr] optimizer.lr=-1 must be > 0",
        "set a positive peak learning rate",
        out=OUT,
    ),
    C(
        "value-min-lr",
        "config",
        "mbr check optimizer.min_lr=0.01",
        "min-lr",
        "optimizer.min_lr=0.01 must lie in [0, optimizer.lr=0.0003]",
        "set optimizer.min_lr to at most optimizer.lr",
    ),
    C(
        "value-min-lr-negative",
        "config",
        "mbr check optimizer.min_lr=-1e-5",
        "min-lr",
        "optimizer.min_lr=-1e-05 must lie in [0,",
        "or 0",
    ),
    C(
        "value-weight-decay",
        "config",
        "mbr check optimizer.weight_decay=-0.1",
        "weight-decay",
        "optimizer.weight_decay=-0.1 must be >= 0",
        "set optimizer.weight_decay to 0",
    ),
    C(
        "value-adam-beta1",
        "config",
        "mbr check optimizer.adam_beta1=1",
        "adam-betas",
        "optimizer.adam_beta1=1 must lie in [0, 1)",
        "set optimizer.adam_beta1 below 1",
    ),
    C(
        "value-adam-beta2",
        "config",
        "mbr check optimizer.adam_beta2=-0.5",
        "adam-betas",
        "optimizer.adam_beta2=-0.5 must lie in [0, 1)",
        "set optimizer.adam_beta2 below 1",
    ),
    C("value-adam-eps", "config", "mbr check optimizer.adam_eps=0", "adam-eps", "adam_eps=0 must be > 0", "1e-8"),
    C(
        "value-lr-inf",
        "config",
        "mbr check optimizer.lr=inf",
        "finite-value",
        "optimizer.lr=inf: a setting must be a finite number",
        "give each a finite value",
    ),
    C(
        "value-eps-nan",
        "config",
        f"{T} model.norm_epsilon=nan",
        "finite-value (trainer)",
        "model.norm_epsilon=nan: a setting must be a finite number",
        "give each a finite value",
        out=OUT,
    ),
    C(
        "value-max-skipped",
        "config",
        "mbr check train.on_nonfinite=skip train.max_skipped_steps=0",
        "max-skipped-steps",
        "train.max_skipped_steps=0 must be >= 1",
        "set train.max_skipped_steps=5",
    ),
    C(
        "value-fp8-a100",
        "config",
        "mbr check cluster=dgx_a100_80g train.precision=fp8",
        "fp8",
        "train.precision=fp8 needs GPUs with FP8 tensor cores",
        "use train.precision=bf16",
    ),
    C(
        "value-recompute-modules",
        "config",
        "mbr check train.recompute=selective train.recompute_modules=[core_attn,mpl]",
        "recompute-modules",
        "train.recompute_modules=['core_attn', 'mpl']: mpl (not one of",
        "list what to recompute among core_attn, mlp, layernorm",
    ),
    C(
        "value-loss-chunk",
        "config",
        "mbr check train.loss_chunk=-8",
        "loss-chunk",
        "train.loss_chunk=-8 must lie in [0, train.seq_length=",
        "set train.loss_chunk=0",
    ),
    C(
        "value-straggler-factor",
        "config",
        "mbr check train.straggler_interval=100 train.straggler_factor=0.8",
        "straggler-factor",
        "train.straggler_factor=0.8 must be > 1",
        "set train.straggler_factor=1.5",
    ),
    C(
        "value-straggler-interval",
        "config",
        "mbr check train.straggler_interval=-1",
        "interval",
        "train.straggler_interval=-1 must be >= 0",
        "set train.straggler_interval=0 to turn straggler detection off",
    ),
    C(
        "value-on-nonfinite",
        "config",
        "mbr check train.on_nonfinite=ignore",
        "choice (on_nonfinite)",
        "train.on_nonfinite='ignore' is not one of ('stop', 'skip')",
        "set train.on_nonfinite to one of them",
    ),
    C(
        "hf-config-nan",
        "config",
        "mbr check model.hf_path={FX}/hf_nan_eps",
        "non-finite config.json",
        "config.json holds non-finite numbers: rms_norm_eps: nan",
        "fix the value (e.g. rms_norm_eps: 1e-6)",
    ),
    C(
        "value-clip-grad",
        "config",
        "mbr check optimizer.clip_grad=-1",
        "clip-grad",
        "optimizer.clip_grad=-1 must be >= 0",
        "or 0 to disable clipping",
    ),
    C(
        "value-warmup",
        "config",
        "mbr check optimizer.warmup_steps=20 train.steps=10",
        "warmup-steps",
        "optimizer.warmup_steps=20 must lie in [0, train.steps=10]",
        "set optimizer.warmup_steps to at most 10",
    ),
    C(
        "value-decay-style",
        "config",
        "mbr check optimizer.decay_style=exponential",
        "choice (decay_style)",
        "optimizer.decay_style='exponential' is not one of ('constant', 'linear', 'cosine', 'inverse-square-root')",
        "set optimizer.decay_style to one of them",
    ),
    C(
        "value-train-steps",
        "config",
        "mbr check train.steps=0 optimizer.warmup_steps=0",
        "train-steps",
        "train.steps=0 must be >= 1",
        "set the number of optimizer steps",
    ),
    C(
        "value-log-interval",
        "config",
        "mbr check train.log_interval=0",
        "interval",
        "train.log_interval=0 must be >= 1",
        "set train.log_interval=1",
    ),
    C(
        "value-save-interval",
        "config",
        "mbr check checkpoint.save_interval=-5",
        "interval",
        "checkpoint.save_interval=-5 must be >= 0",
        "set checkpoint.save_interval=0",
    ),
    C(
        "value-seq-positions",
        "config",
        "mbr check recipe=gpt3_175b train.seq_length=4096",
        "seq-positions",
        "train.seq_length=4096 > model.max_position_embeddings=2048",
        "learned absolute position embeddings",
        "set train.seq_length to at most 2048",
    ),
    # -- configs: the shape of the input ---------------------------------------------------
    C(
        "cfg-unknown-key",
        "config",
        "mbr check parallel.tpp=2",
        "unknown key",
        "Key 'tpp' not in 'ParallelConfig'",
        "Check the spelling of the key",
        proc=True,
    ),
    C(
        "cfg-unknown-top-key",
        "config",
        "mbr check learning_rate=1e-3",
        "unknown key",
        "Key 'learning_rate' not in 'Config'",
        "Check the spelling of the key",
    ),
    C(
        "cfg-wrong-type-int",
        "config",
        "mbr check parallel.tp=two",
        "wrong type",
        "Value 'two' of type 'str' could not be converted to Integer",
        "--cfg job",
    ),
    C(
        "cfg-wrong-type-bool",
        "config",
        "mbr check parallel.sequence_parallel=maybe",
        "wrong type",
        "'maybe' is not a valid bool",
        "Give the value the field's type",
    ),
    C(
        "cfg-missing-recipe",
        "config",
        "mbr check recipe=llama9",
        "unknown recipe",
        "unknown recipe 'llama9'",
        "Pick one with `recipe=NAME`",
    ),
    C(
        "cfg-missing-group-option",
        "config",
        "mbr check model=llama9",
        "unknown group option",
        "Could not find 'model/llama9'",
        "the group options `mbr recipes` lists",
    ),
    C("cfg-stray-argument", "config", "mbr check tp2", "not key=value", "unexpected argument 'tp2'", "`key=value`"),
    C(
        "cfg-hf-path-missing",
        "config",
        "mbr check model.hf_path=/nonexistent/model",
        "missing HF model",
        "/nonexistent/model",
        "config.json",
    ),
    C(
        "cfg-unknown-command",
        "config",
        "mbr chek recipe=default",
        "unknown command",
        "unknown command 'chek'",
        "See `mbr --help`",
        proc=True,
    ),
    C(
        "cfg-train-layout",
        "config",
        f"{T} parallel.tp=3",
        "heads-tp (trainer)",
        "[heads-tp]",
        "choose tp dividing the head count",
        out=OUT,
        proc=True,
    ),
    C(
        "cfg-train-unknown-key",
        "config",
        f"{T} train.stepz=5",
        "unknown key (trainer)",
        "Key 'stepz' not in 'TrainConfig'",
        "Check the spelling",
        out=OUT,
    ),
    C(
        "cfg-plan-pinned",
        "config",
        "mbr plan recipe=tiny_llama parallel.tp=3",
        "no layout (plan)",
        "no candidate layout passes the layout rules",
        "`mbr check` with the same arguments",
    ),
    C(
        "cfg-recipe-self-including",
        "config",
        "mbr check recipe={FX}/recipes/self_including.yaml",
        "recipe includes itself",
        "includes itself",
        "Remove the entry that names it again",
    ),
    C(
        "cfg-recipe-no-defaults",
        "config",
        "mbr check recipe={FX}/recipes/no_defaults.yaml",
        "recipe without defaults",
        "does not build on the schema",
        "a defaults list starting with mbr_schema",
    ),
    C(
        "cfg-path-space-unquoted",
        "config",
        "mbr check model.hf_path={FX}/my models",
        "unquoted path with a space",
        "unexpected argument 'models'",
        "quote the whole argument",
    ),
    C(
        "cfg-path-unicode-unquoted",
        "config",
        "mbr check model.hf_path=/data/modèle",
        "unquoted non-ASCII path",
        "token recognition error",
        "must be quoted for Hydra inside the shell's quotes",
    ),
    C(
        "cfg-path-comma-unquoted",
        "config",
        "mbr check model.hf_path=/data/a,b",
        "unquoted path with a comma",
        "Ambiguous value",
        "must be quoted for Hydra inside the shell's quotes",
    ),
    C(
        "cfg-plan-world-huge",
        "config",
        "mbr plan recipe=tiny_llama cluster.nodes=1099511627776",
        "absurd cluster (hang)",
        "is more than 4194304 GPUs",
        "give the cluster you have",
    ),
    # -- data ---------------------------------------------------------------------------
    C(
        "data-missing-files",
        "data",
        f"{T} data=indexed data.paths=[{{FX}}/nope/corpus]",
        "missing data files",
        "indexed dataset(s) not found: {FX}/nope/corpus",
        "mbr data input=",
        out=OUT,
    ),
    C(
        "data-no-paths",
        "data",
        f"{T} data=indexed",
        "no data paths",
        "data.kind=indexed needs data.paths",
        "made by `mbr data`",
        out=OUT,
    ),
    C(
        "data-chat-pretrained",
        "data",
        f"{T} data=indexed data.paths=[{{FX}}/chat/chatdata]",
        "chat data with data=indexed",
        "{FX}/chat/chatdata is chat data",
        "use data=sft data.paths=[{FX}/chat/chatdata]",
        out=OUT,
    ),
    C(
        "data-sft-plain",
        "data",
        f"{T} data=sft data.paths=[{{FX}}/demo/stdlib_text_document]",
        "plain data with data=sft",
        "data=sft needs chat data",
        "mbr data mode=chat input=FILE.jsonl",
        out=OUT,
    ),
    C(
        "data-sft-no-paths",
        "data",
        f"{T} data=sft",
        "no chat data paths",
        "data=sft needs data.paths=[PREFIX]",
        "mbr data mode=chat input=FILE.jsonl",
        out=OUT,
    ),
    C(
        "data-tokenizer-missing",
        "data",
        f"{T} data=indexed data.paths=[{{FX}}/demo/stdlib_text_document] data.tokenizer={{FX}}/nope",
        "missing tokenizer",
        "data.tokenizer directory {FX}/nope does not exist",
        "local directories",
        out=OUT,
    ),
    C(
        "data-truncated-bin",
        "data",
        f"{T} data=indexed data.paths=[{{FX}}/cut/stdlib_text_document]",
        "truncated .bin",
        "{FX}/cut/stdlib_text_document.bin is truncated",
        "Copy it again, or re-run `mbr data`",
        out=OUT,
    ),
    C(
        "data-tokenizer-config-only",
        "data",
        f"{T} data=indexed data.paths=[{{FX}}/demo/stdlib_text_document] data.tokenizer={{FX}}/tok_config_only",
        "tokenizer without vocabulary",
        "holds tokenizer_config.json but no vocabulary",
        "Copy the tokenizer's other files",
        out=OUT,
    ),
    C(
        "data-oov-ids",
        "data",
        f"{T} data=indexed data.paths=[{{FX}}/oov/stdlib_text_document]",
        "token id ≥ vocab",
        "{FX}/oov/stdlib_text_document.bin holds token id 700, but the model's vocabulary has 512 ids",
        "Re-run `mbr data` with the model's tokenizer",
        out=OUT,
    ),
    C(
        "data-vocab-model",
        "data",
        f"{T} data=indexed data.paths=[{{FX}}/big/stdlib_text_document] data.tokenizer={{FX}}/big/tokenizer",
        "vocab > model",
        "has 600 tokens",
        "the model's vocab_size is 512",
        "set model.vocab_size=600",
        out=OUT,
        proc=True,
    ),
    C(
        "data-vocab-tokenizer",
        "data",
        f"{T} data=indexed data.paths=[{{FX}}/demo/stdlib_text_document] data.tokenizer={{FX}}/big/tokenizer",
        "data ≠ tokenizer",
        "the data and the tokenizer do not match",
        "Re-run `mbr data` with this tokenizer",
        out=OUT,
    ),
    C(
        "data-empty-split",
        "data",
        f"{T} data=indexed data.paths=[{{FX}}/demo/stdlib_text_document] data.split=1000/1/0",
        "empty split",
        "leaves its valid split 0 of them",
        "change data.split",
        out=OUT,
    ),
    C(
        "data-bad-split",
        "data",
        f"{T} data=indexed data.paths=[{{FX}}/demo/stdlib_text_document] data.split=a/b",
        "bad split",
        "data.split='a/b'",
        "non-negative train,valid,test weights",
        out=OUT,
    ),
    C(
        "data-split-as-list",
        "data",
        f"{T} data.split=98,2,0",
        "unquoted list value",
        "Ambiguous value for argument 'data.split=98,2,0'",
        "quote the value: key='value1,value2'",
        out=OUT,
    ),
    C(
        "data-cli-missing-input",
        "data",
        "mbr data input=nope.jsonl output=out/ds tokenizer={FX}/demo/tokenizer",
        "missing input",
        "nope.jsonl does not exist",
        out=OUT,
    ),
    C(
        "data-cli-existing-output",
        "data",
        "mbr data input={FX}/demo/corpus.jsonl output={FX}/demo/stdlib_text_document tokenizer={FX}/demo/tokenizer",
        "existing output",
        "indexed dataset already exists",
        "overwrite=true",
    ),
    C(
        "data-cli-demo-vocab",
        "data",
        "mbr data demo=true output_dir=out/d vocab_size=4096",
        "vocab > model",
        "vocab_size=4096 is larger than the recipe's model.vocab_size=512",
        "vocab_size<=512",
        out=OUT,
    ),
    C(
        "data-chat-no-template",
        "data",
        "mbr data mode=chat input={FX}/chat/good.jsonl output=out/chat tokenizer={FX}/chat/tok_no_template",
        "tokenizer without chat template",
        "the tokenizer in {FX}/chat/tok_no_template has no chat template",
        "Pass chat_template=FILE",
        out=OUT,
    ),
    C(
        "data-chat-bad-json",
        "data",
        "mbr data mode=chat input={FX}/chat/bad_json.jsonl output=out/chat tokenizer={FX}/demo/tokenizer",
        "chat: invalid JSON",
        "{FX}/chat/bad_json.jsonl:2: not valid JSON",
        '{"messages": [{"role": "user"',
        out=OUT,
    ),
    C(
        "data-chat-unknown-role",
        "data",
        "mbr data mode=chat input={FX}/chat/bad_role.jsonl output=out/chat tokenizer={FX}/demo/tokenizer",
        "chat: unknown role",
        "{FX}/chat/bad_role.jsonl:2: message 0 has unknown role 'bot'",
        "the allowed roles are system, user, assistant, tool",
        out=OUT,
    ),
    C(
        "data-chat-template-not-prefix-consistent",
        "data",
        "mbr data mode=chat input={FX}/chat/good.jsonl output=out/chat tokenizer={FX}/demo/tokenizer "
        "chat_template={FX}/chat/last_differs.jinja",
        "template not prefix-consistent",
        "the chat template of {FX}/chat/last_differs.jinja is not prefix-consistent",
        "{% generation %}...{% endgeneration %}",
        out=OUT,
    ),
    C(
        "data-chat-overlong-choice",
        "data",
        "mbr data mode=chat input={FX}/chat/good.jsonl output=out/chat tokenizer={FX}/demo/tokenizer "
        "max_length=8 overlong=cut",
        "overlong ∉ truncate|drop",
        "overlong='cut': expected truncate or drop",
        out=OUT,
        proc=True,
    ),
    C(
        "data-chat-image-missing",
        "data",
        "mbr data mode=chat input={FX}/vlm/missing.jsonl output=out/chat tokenizer={FX}/vlm/proc",
        "image chat: missing image file",
        "{FX}/vlm/missing.jsonl:2 (image 1: nope.png): image file {FX}/vlm/nope.png not found",
        "relative paths are read from the data file's directory",
        out=OUT,
    ),
    C(
        "data-chat-image-unreadable",
        "data",
        "mbr data mode=chat input={FX}/vlm/broken.jsonl output=out/chat tokenizer={FX}/vlm/proc",
        "image chat: undecodable image",
        "{FX}/vlm/broken.jsonl:1 (image 1: broken.png): Pillow cannot read this image",
        "replace or drop it",
        out=OUT,
    ),
    C(
        "data-chat-image-url",
        "data",
        "mbr data mode=chat input={FX}/vlm/url.jsonl output=out/chat tokenizer={FX}/vlm/proc",
        "image chat: URL image",
        "image 'https://example.com/cat.png' is a URL",
        "Download it and give its path",
        out=OUT,
    ),
    C(
        "data-chat-image-placeholders",
        "data",
        "mbr data mode=chat input={FX}/vlm/ok.jsonl output=out/chat tokenizer={FX}/vlm/proc "
        "chat_template={FX}/vlm/text_only.jinja",
        "image chat: placeholders ≠ images",
        "has 1 image(s) but the chat template of {FX}/vlm/text_only.jinja rendered 0 image placeholder(s)",
        "Use the processor's chat template",
        out=OUT,
    ),
    C(
        "data-chat-image-too-large",
        "data",
        "mbr data mode=chat input={FX}/vlm/ok.jsonl output=out/chat tokenizer={FX}/vlm/proc max_image_pixels=1000",
        "image chat: image > max_image_pixels",
        "(image 1: ok.png): image is 60x90 = 5400 pixels, more than max_image_pixels=1000",
        "raise max_image_pixels=N",
        out=OUT,
    ),
    C(
        "data-chat-image-no-processor",
        "data",
        "mbr data mode=chat input={FX}/vlm/ok.jsonl output=out/chat tokenizer={FX}/demo/tokenizer",
        "image chat: no image processor",
        "this conversation has images, but {FX}/demo/tokenizer holds no image processor",
        "Pass tokenizer=DIR of the vision-language model",
        out=OUT,
    ),
    C(
        "vlm-cp",
        "config",
        "mbr check recipe=default model.hf_path={FX}/vlm/model model.backend=transformers parallel.cp=2",
        "a VLM under context parallelism",
        "context parallelism (cp=2) over a vision-language model: its vision tower (model.visual)",
        "set parallel.cp=1",
    ),
    C(
        "vlm-freeze-text-model",
        "config",
        "mbr check recipe=default model.freeze=[vision]",
        "model.freeze on a text model",
        "[model-freeze] model.freeze=['vision']: LlamaForCausalLM has no part 'vision'",
        "drop model.freeze",
    ),
    # -- checkpoints: resume, init, export, mbr check-ckpt ------------------------------------
    C(
        "ckpt-resume-no-dir",
        "checkpoint",
        "train recipe=default run_dir=out/run checkpoint.resume=true",
        "resume without dir",
        "checkpoint.resume=true needs checkpoint.dir=DIR",
        "the first run saved to",
        out=OUT,
    ),
    C(
        "ckpt-resume-layout",
        "checkpoint",
        "train recipe=default run_dir=out/run checkpoint.dir={FX}/ck_tp2pp2 checkpoint.resume=true",
        "resume, other layout",
        "was written with a different setup (layout: checkpoint tp2·pp2",
        "Resume with the same layout",
        out=OUT,
        proc=True,
    ),
    C(
        "ckpt-resume-other-model",
        "checkpoint",
        "train recipe=default run_dir=out/run checkpoint.dir={FX}/ck_other_model checkpoint.resume=true",
        "resume, other model",
        "was written with a different setup (model: checkpoint LlamaForCausalLM layers=32 hidden=4096 vs now",
        "Resume with the same layout and model",
        out=OUT,
    ),
    C(
        "ckpt-resume-bad-latest",
        "checkpoint",
        "train recipe=default run_dir=out/run checkpoint.dir={FX}/ck_bad_latest checkpoint.resume=true",
        "corrupt latest pointer",
        "latest_checkpointed_iteration.txt is corrupt",
        "delete it to restart",
        out=OUT,
    ),
    C(
        "ckpt-resume-missing-iter",
        "checkpoint",
        "train recipe=default run_dir=out/run checkpoint.dir={FX}/ck_missing_iter checkpoint.resume=true",
        "latest names no directory",
        "names iteration 8, but",
        "Point it at an existing iter_* directory",
        out=OUT,
    ),
    C(
        "ckpt-resume-bad-manifest",
        "checkpoint",
        "train recipe=default run_dir=out/run checkpoint.dir={FX}/ck_bad_manifest checkpoint.resume=true",
        "corrupt manifest",
        "manifest.json is corrupt",
        "Resume from an earlier iteration",
        out=OUT,
    ),
    C(
        "ckpt-init-from-missing",
        "checkpoint",
        f"{T} train.init_from={{FX}}/nope",
        "missing init_from",
        "train.init_from={FX}/nope does not exist",
        "Point it at a Hugging Face model directory",
        out=OUT,
    ),
    C(
        "ckpt-export-nonempty",
        "checkpoint",
        f"{T} export_to={{FX}}/nonempty",
        "export_to not empty",
        "export_to={FX}/nonempty exists and is not empty",
        "choose a new directory",
        out=OUT,
    ),
    C(
        "ckpt-check-corrupt",
        "checkpoint",
        "mbr check-ckpt {FX}/ck_corrupt",
        "checksum mismatch",
        "rank_00001.pt (checksum mismatch)",
        "Resume from an earlier iteration",
        proc=True,
    ),
    C(
        "ckpt-check-truncated",
        "checkpoint",
        "mbr check-ckpt {FX}/ck_truncated",
        "truncated file",
        "rank_00000.pt (size",
        "truncated",
        "Resume from an earlier iteration",
    ),
    C(
        "ckpt-check-missing-file",
        "checkpoint",
        "mbr check-ckpt {FX}/ck_missing_file/iter_0000002",
        "missing file",
        "rank_00001.pt (missing)",
        "re-create it",
    ),
    C(
        "ckpt-check-torn-only",
        "checkpoint",
        "mbr check-ckpt {FX}/ck_torn",
        "only a torn save",
        "holds no checkpoint",
        "interrupted saves: iter_0000004.tmp",
    ),
    C(
        "ckpt-check-not-ckpt",
        "checkpoint",
        "mbr check-ckpt {FX}/nonempty",
        "not a checkpoint",
        "holds no checkpoint",
        "Pass the directory given as checkpoint.dir=",
    ),
    C(
        "ckpt-check-nonexistent",
        "checkpoint",
        "mbr check-ckpt {FX}/nope",
        "no such directory",
        "{FX}/nope does not exist",
        "usage: mbr check-ckpt DIR",
    ),
    C(
        "ckpt-lease-held",
        "checkpoint",
        "train recipe=default run_dir=out/run checkpoint.dir={FX}/ck_leased",
        "directory held by a live job",
        "checkpoint.dir={FX}/ck_leased is in use by another training job",
        "pid 1 (SLURM_JOB_ID=4242",
        "give this job its own checkpoint.dir=NEW_DIR",
        out=OUT,
    ),
    # -- fine-tuning: LoRA (peft=lora) ---------------------------------------------------------
    C(
        "peft-unknown-target",
        "config",
        f"{T} model.hf_path={{FX}}/hf peft=lora peft.target_modules=[q_proj,w1]",
        "LoRA target not in the family",
        "['w1'] names no linear module of the llama family",
        "q_proj",
        out=OUT,
    ),
    C(
        "peft-rank",
        "config",
        f"{T} model.hf_path={{FX}}/hf peft=lora peft.rank=0",
        "LoRA rank <= 0",
        "peft.rank=0 must be >= 1",
        "set peft.rank to a positive rank",
        out=OUT,
    ),
    C(
        "peft-adapter-shape",
        "checkpoint",
        f"{T} model.hf_path={{FX}}/hf peft=lora peft.target_modules=[down_proj] peft.init_from={{FX}}/lora_other_size",
        "adapter for another model",
        "needs [8, 64]",
        "Use the base it was made for",
        out=OUT,
    ),
    C(
        "peft-adapter-truncated",
        "checkpoint",
        f"{T} model.hf_path={{FX}}/hf peft=lora peft.target_modules=[down_proj] peft.init_from={{FX}}/lora_truncated",
        "truncated adapter",
        "the file is truncated",
        "re-download or re-save it",
        out=OUT,
    ),
    C(
        "peft-adapter-targets",
        "checkpoint",
        f"{T} model.hf_path={{FX}}/hf peft=lora peft.init_from={{FX}}/lora_other_size",
        "adapter with other targets",
        "adapts target_modules=['down_proj']",
        "Set peft.target_modules=[down_proj]",
        out=OUT,
    ),
    C(
        "peft-adapter-module",
        "checkpoint",
        f"{T} model.hf_path={{FX}}/hf peft=lora peft.target_modules=[down_proj] peft.init_from={{FX}}/lora_other_model",
        "adapter for another model",
        "which the base model",
        "Use the base it was made for",
        out=OUT,
    ),
    C(
        "peft-export-no-adapter",
        "checkpoint",
        "mbr export src={FX}/ck_tp2pp2 dst=out/adapter adapter=true",
        "checkpoint without adapter",
        "holds no LoRA adapter",
        "point src at a peft=lora checkpoint",
        out=OUT,
    ),
    # -- a checkpoint from a stranger: a pickle payload on every load path (docs/reliability.md) --
    C(
        "payload-resume",
        "checkpoint",
        "train recipe=default run_dir=out/run checkpoint.dir={FX}/ck_payload checkpoint.resume=true",
        "payload in a rank file (resume)",
        "{FX}/ck_payload/iter_0000002/rank_00000.pt was refused: it holds a `io.open` object",
        "use a checkpoint from a source you trust",
        out=(*OUT, "{FX}/PWNED_resume"),
        proc=True,
    ),
    C(
        "payload-resume-deepspeed",
        "checkpoint",
        "train recipe=default train.engine=deepspeed run_dir=out/run checkpoint.dir={FX}/ck_payload_ds "
        "checkpoint.resume=true",
        "payload in a DeepSpeed file (resume)",
        "deepspeed/mp_rank_00_model_states.pt was refused: it holds a `io.open` object",
        "use a checkpoint from a source you trust",
        out=(*OUT, "{FX}/PWNED_resume_ds"),
    ),
    C(
        "payload-check-ckpt",
        "checkpoint",
        "mbr check-ckpt {FX}/ck_payload",
        "payload in a rank file (check-ckpt)",
        "rank_00000.pt was refused: it holds a `io.open` object",
        "use a checkpoint from a source you trust",
        out=("{FX}/PWNED_resume",),
    ),
    C(
        "tampered-init-from-dist",
        "checkpoint",
        "train recipe=default run_dir=out/run train.init_from={FX}/cv_tampered_torch_dist",
        "tampered bytes (init_from torch_dist)",
        "its bytes changed since conversion",
        "re-convert or restore it",
        out=OUT,
    ),
    C(
        "tampered-init-from-torch",
        "checkpoint",
        "train recipe=default run_dir=out/run train.init_from={FX}/cv_tampered_torch",
        "tampered bytes (init_from torch)",
        "its bytes changed since conversion",
        "re-convert or restore it",
        out=OUT,
    ),
    C(
        "tampered-init-from-export",
        "checkpoint",
        "train recipe=default run_dir=out/run train.init_from={FX}/hf_exported_tampered",
        "tampered bytes (init_from an exported HF directory)",
        "weights changed since they were written",
        "Export it again or restore the files",
        out=OUT,
    ),
    C(
        "megatron-payload-init-from",
        "checkpoint",
        "train recipe=default run_dir=out/run train.init_from={FX}/mlm_payload model.hf_path={FX}/hf",
        "payload in a Megatron-LM rank file (init_from)",
        "model_optim_rng.pt was refused: it holds a",
        "use a checkpoint from a source you trust",
        out=(*OUT, "{FX}/PWNED_init_torch"),
    ),
    C(
        "payload-init-from-dist",
        "checkpoint",
        "train recipe=default run_dir=out/run train.init_from={FX}/cv_payload_dist",
        "payload in _extra_state (init_from torch_dist)",
        "was refused: it holds a `io.open` object",
        "use a checkpoint from a source you trust",
        out=(*OUT, "{FX}/PWNED_init_dist"),
    ),
    C(
        "payload-init-from-torch",
        "checkpoint",
        "train recipe=default run_dir=out/run train.init_from={FX}/cv_payload_torch",
        "payload in a rank file (init_from format=torch)",
        "model_optim_rng.pt was refused: it holds a `io.open` object",
        "use a checkpoint from a source you trust",
        out=(*OUT, "{FX}/PWNED_init_torch"),
    ),
    C(
        "payload-init-from-hf-bin",
        "checkpoint",
        "train recipe=default run_dir=out/run train.init_from={FX}/hf_bin_payload",
        "pickled weights only (init_from HF)",
        "train.init_from={FX}/hf_bin_payload is neither a Hugging Face model directory (config.json + *.safetensors)",
        out=(*OUT, "{FX}/PWNED_hf_bin"),
    ),
    C(
        "payload-peft-init-from",
        "checkpoint",
        "train recipe=default run_dir=out/run model.hf_path={FX}/hf peft=lora peft.init_from={FX}/lora_bin_payload",
        "pickled adapter only (peft.init_from)",
        "is not an HF PEFT adapter directory (adapter_config.json + adapter_model.safetensors)",
        "Point it at what `PeftModel.save_pretrained`",
        out=(*OUT, "{FX}/PWNED_lora_bin"),
    ),
    C(
        "escape-check-ckpt",
        "checkpoint",
        "mbr check-ckpt {FX}/ck_escape",
        "manifest names a file outside",
        "names file '../../ck_payload/iter_0000002/rank_00000.pt': an absolute path or one with '..'",
        "a checkpoint names only files inside its own directory",
        out=("{FX}/PWNED_resume",),
    ),
    C(
        "fifo-check-ckpt",
        "checkpoint",
        "mbr check-ckpt {FX}/ck_fifo",
        "manifest names a FIFO",
        "names file 'extra.pt', which is a FIFO (named pipe), not a regular file",
        "Replace it with the file itself",
    ),
    C(
        "fifo-train-hf-path",
        "checkpoint",
        "train recipe=default run_dir=out/run model.hf_path={FX}/hf_fifo",
        "FIFO for weights (HF loading)",
        "holds weight file 'model.safetensors', which is a FIFO (named pipe), not a regular file",
        "Replace it with the file itself",
        out=OUT,
    ),
    # -- launch ------------------------------------------------------------------------------
    C(
        "launch-lease-held",
        "launch",
        "torchrun recipe=default run_dir=out/run checkpoint.dir={FX}/ck_leased",
        "held directory (torchrun ×2: every rank refuses before init)",
        "checkpoint.dir={FX}/ck_leased is in use by another training job",
        "give this job its own checkpoint.dir=NEW_DIR",
        nproc=2,
        out=OUT,
        rc=1,
    ),
    C(
        "launch-world-size",
        "launch",
        "torchrun recipe=tiny_llama run_dir=out/run checkpoint.dir=out/ckpt",
        "world-size (torchrun ×2, tp2·pp2)",
        "tp·pp·cp = 2·2·1 = 4 does not divide the world size 2",
        "Start 4 processes",
        nproc=2,
        out=OUT,
        rc=1,
    ),
    C(
        "launch-local-world-size",
        "launch",
        "torchrun recipe=default cluster.gpus_per_node=4 run_dir=out/run checkpoint.dir=out/ckpt",
        "LOCAL_WORLD_SIZE ≠ gpus_per_node",
        "this node runs 2 processes (LOCAL_WORLD_SIZE) but cluster.gpus_per_node=4",
        "--nproc-per-node 4",
        nproc=2,
        out=OUT,
        rc=1,
    ),
    C(
        "launch-no-launcher",
        "launch",
        "train recipe=tiny_llama run_dir=out/run",
        "world-size (no launcher)",
        "does not divide the world size 1",
        "it runs without a launcher",
        "`torchrun --nproc-per-node 4",
        out=OUT,
        proc=True,
    ),
    C(
        "launch-world-env",
        "launch",
        "train recipe=default parallel.dp=2 run_dir=out/run",
        "world-size (WORLD_SIZE=4)",
        "!= world size 4",
        "the launcher started WORLD_SIZE=4",
        env=(("WORLD_SIZE", "4"),),
        out=OUT,
    ),
    C(
        "launch-bad-launcher",
        "launch",
        "mbr launch launcher=mpirun --dry-run",
        "unknown launcher",
        "launcher='mpirun' is not one of",
        "'torchrun', 'deepspeed', 'slurm'",
    ),
    C(
        "launch-no-hosts",
        "launch",
        "mbr launch cluster.nodes=2 --dry-run output=out",
        "nodes without hosts",
        "cluster.nodes=2 but 0 host(s) are known",
        "cluster.hostnames=[host1,host2,...]",
        out=OUT,
    ),
    C(
        "launch-missing-hostfile",
        "launch",
        "mbr launch cluster.nodes=2 cluster.hostfile={FX}/nope --dry-run output=out",
        "missing hostfile",
        "cluster.hostfile={FX}/nope does not exist",
        "cluster.hostnames=[a,b]",
        out=OUT,
    ),
    C(
        "launch-slurm-exec",
        "launch",
        "mbr launch launcher=slurm",
        "slurm without --dry-run",
        "launcher=slurm needs `sbatch`",
        "use --dry-run with output=DIR",
    ),
    C(
        "launch-restarts-no-ckpt",
        "launch",
        "mbr launch max_restarts=2 --dry-run output=out",
        "restarts without checkpoints",
        "checkpoint.dir is not set: every restart would start over from step 0",
        "checkpoint.dir=DIR checkpoint.save_interval=N",
        out=OUT,
    ),
    C(
        "launch-restarts-no-resume",
        "launch",
        "mbr launch launcher=slurm max_restarts=2 checkpoint.dir=ck checkpoint.save_interval=5 checkpoint.resume=false --dry-run output=out",
        "restarts with checkpoint.resume=false",
        "with checkpoint.resume=false: every restart would start over",
        "drop checkpoint.resume",
        out=OUT,
    ),
]


CONVERT_CASES: list[Case] = [
    C(
        "convert-tampered-export",
        "convert",
        "mbr convert src={FX}/hf_exported_tampered dst=out/cv",
        "tampered bytes (src= an HF directory we exported)",
        "weights changed since they were written",
        "Export it again or restore the files",
        out=OUT,
    ),
    C(
        "convert-truncated-shard",
        "convert",
        "mbr convert src={FX}/hf_truncated dst=out/cv",
        "truncated shard",
        "the file is truncated",
        "re-download or re-save it",
        out=OUT,
        proc=True,
    ),
    C(
        "convert-corrupt-shard",
        "convert",
        "mbr convert src={FX}/hf_corrupt dst=out/cv",
        "corrupt shard",
        "model.safetensors: corrupt safetensors header",
        out=OUT,
    ),
    C(
        "convert-missing-shard",
        "convert",
        "mbr convert src={FX}/hf_missing_shard dst=out/cv",
        "missing shard",
        "names 1 file(s) that do not exist: model-00002-of-00002.safetensors",
        out=OUT,
    ),
    C(
        "convert-no-weights",
        "convert",
        "mbr convert src={FX}/hf_no_weights dst=out/cv",
        "no weight files",
        "no *.safetensors weights",
        "only safetensors checkpoints are supported",
        out=OUT,
    ),
    C(
        "convert-nonfinite",
        "convert",
        "mbr convert src={FX}/hf_nan_weights dst=out/cv",
        "NaN in a source tensor",
        "holds non-finite weights (NaN or infinity) in 1 tensor(s): model.layers.0.mlp.down_proj.weight",
        "pass allow_nonfinite=true",
        out=OUT,
    ),
    C(
        "convert-wrong-shapes",
        "convert",
        "mbr convert src={FX}/hf_wrong_shape dst=out/cv",
        "shapes ≠ config.json",
        "tensor shape(s) disagree with config.json",
        "the config implies [192, 32]",
        out=OUT,
    ),
    C(
        "verify-wrong-shapes",
        "convert",
        "mbr verify model.hf_path={FX}/hf_wrong_shape verify.layouts=[tp2]",
        "shapes ≠ config.json (verify: both sides load them)",
        "model.hf_path={FX}/hf_wrong_shape: 8 tensor shape(s) disagree with config.json",
        "the config implies [192, 32]",
        out=OUT,
    ),
    C(
        "verify-pickle-weights",
        "convert",
        "mbr verify model.hf_path={FX}/hf_bin_payload",
        "pickled weights only (verify)",
        "model.hf_path={FX}/hf_bin_payload is neither a Hugging Face model directory (config.json + *.safetensors)",
        out=(*OUT, "{FX}/PWNED_hf_bin"),
    ),
    C(
        "convert-unknown-arch",
        "convert",
        "mbr convert src={FX}/hf_unknown_arch dst=out/cv",
        "unknown architecture",
        "FooForCausalLM (model_type 'foo') has no native family",
        "transformers has no causal-LM class for model_type 'foo'",
        out=OUT,
    ),
    # -- checkpoints Megatron-LM wrote (docs/convert.md, "From Megatron-LM / NeMo / Megatron-Bridge") --
    C(
        "megatron-no-hf-path",
        "convert",
        "mbr export src={FX}/mlm_noargs dst=out/ex",
        "Megatron checkpoint without args or model.hf_path",
        "is a Megatron-LM checkpoint (torch_dist, iteration release), and the checkpoint records no training",
        "Set model.hf_path=DIR",
        out=OUT,
    ),
    C(
        "megatron-other-layers",
        "convert",
        "mbr export src={FX}/mlm_dist dst=out/ex model.hf_path={FX}/hf_other_layers/config.json",
        "model.hf_path of another layer count",
        "holds another model than model.hf_path=",
        "point model.hf_path at the HF config of the model this checkpoint trained",
        "num_layers: model.hf_path=",
        out=OUT,
    ),
    C(
        "megatron-other-vocab",
        "convert",
        "mbr reshard src={FX}/mlm_torch dst=out/rs model.hf_path={FX}/hf_other_vocab parallel.tp=2",
        "model.hf_path of another vocabulary",
        "fewer than the vocabulary of 350",
        "point model.hf_path at the config of the model this checkpoint trained",
        out=OUT,
    ),
    C(
        "megatron-payload-export",
        "convert",
        "mbr export src={FX}/mlm_payload dst=out/ex model.hf_path={FX}/hf",
        "payload in a Megatron-LM rank file (export)",
        "model_optim_rng.pt was refused: it holds a",
        "use a checkpoint from a source you trust",
        out=(*OUT, "{FX}/PWNED_init_torch"),
    ),
    C(
        "convert-existing-dst",
        "convert",
        "mbr convert src={FX}/hf dst={FX}/nonempty",
        "existing dst",
        "already exists",
        "choose a new directory or pass overwrite=true",
    ),
    C(
        "convert-overlapping-offsets",
        "convert",
        "mbr convert src={FX}/hf_overlap dst=out/cv",
        "overlapping data_offsets",
        "claim overlapping bytes (data_offsets)",
        "re-download or re-save the file",
        out=OUT,
    ),
    C(
        "convert-layers-huge",
        "convert",
        "mbr convert src={FX}/hf_layers_huge dst=out/cv",
        "absurd size (hang)",
        '"num_hidden_layers": 100000000 in the model config',
        "outside the sane range 0..10000",
        out=OUT,
    ),
    C(
        "convert-layers-string",
        "convert",
        "mbr convert src={FX}/hf_layers_str dst=out/cv",
        "config.json wrong type",
        '"num_hidden_layers": "4" in the model config',
        'write the number without quotes ("num_hidden_layers": 4',
        out=OUT,
    ),
    C(
        "export-manifest-layers-huge",
        "convert",
        "mbr export src={FX}/cv_layers_huge dst=out/hf",
        "absurd size in hf_config (memory)",
        '"num_hidden_layers": 100000000 in the model config',
        "outside the sane range",
        out=OUT,
    ),
    C(
        "convert-overwrite-foreign-dst",
        "convert",
        "mbr convert src={FX}/hf dst={FX}/nonempty overwrite=true",
        "overwrite of a directory not ours",
        "is not an output of mbr convert/reshard/export",
        "overwrite=true will not delete it",
    ),
    C(
        "convert-missing-src",
        "convert",
        "mbr convert src={FX}/nope dst=out/cv",
        "missing src",
        "src={FX}/nope does not exist",
        out=OUT,
    ),
    C(
        "convert-index-absolute",
        "convert",
        "mbr convert src={FX}/hf_index_abs dst=out/cv",
        "index names /etc/passwd",
        "model.safetensors.index.json names shard '/etc/passwd': an absolute path",
        "a checkpoint names only files inside its own directory",
        out=OUT,
    ),
    C(
        "convert-index-outside",
        "convert",
        "mbr convert src={FX}/hf_index_outside dst=out/cv",
        "index names a valid file outside",
        "names shard '../hf/model.safetensors': an absolute path or one with '..'",
        "a checkpoint names only files inside its own directory",
        out=OUT,
    ),
    C(
        "convert-fifo",
        "convert",
        "mbr convert src={FX}/hf_fifo dst=out/cv",
        "FIFO named model.safetensors",
        "holds weight file 'model.safetensors', which is a FIFO (named pipe), not a regular file",
        "Replace it with the file itself",
        out=OUT,
    ),
    C(
        "convert-weights-dir",
        "convert",
        "mbr convert src={FX}/hf_weights_dir dst=out/cv",
        "model.safetensors is a directory",
        "holds weight file 'model.safetensors', which is a directory, not a regular file",
        "Replace it with the file itself",
        out=OUT,
    ),
    C(
        "convert-asset-link",
        "convert",
        "mbr convert src={FX}/hf_asset_link dst=out/cv",
        "asset linking outside src",
        "holds file 'notes.txt', which leads outside",
        "a checkpoint names only files inside its own directory",
        out=OUT,
    ),
    C(
        "export-asset-escape",
        "convert",
        "mbr export src={FX}/cv_asset_escape dst=out/hf",
        "manifest asset '../x' (export)",
        "names asset '../escaped.txt': an absolute path or one with '..'",
        "a checkpoint names only files inside its own directory",
        out=(*OUT, "{FX}/escaped.txt"),
    ),
    C(
        "reshard-layout-tp0",
        "convert",
        "mbr reshard src={FX}/cv_tp0 dst=out/r format=torch",
        "manifest layout.tp=0 (reshard)",
        "malformed manifest (layout",
        "tp and pp must be positive integers",
        out=OUT,
    ),
    C(
        "export-training-ckpt",
        "convert",
        "mbr export src={FX}/ck_tp2pp2 dst=out/hf",
        "a training checkpoint without its layout's grid (export)",
        "src={FX}/ck_tp2pp2 was written by an mbr that did not record its layout's grid",
        "resume it once with this mbr (checkpoint.resume=true)",
        out=OUT,
    ),
    C(
        "export-payload-torch",
        "convert",
        "mbr export src={FX}/cv_payload_torch dst=out/hf",
        "payload in a rank file (export)",
        "model_optim_rng.pt was refused: it holds a `io.open` object",
        "use a checkpoint from a source you trust",
        out=(*OUT, "{FX}/PWNED_init_torch"),
        proc=True,
    ),
    C(
        "convert-bad-layout",
        "convert",
        "mbr convert src={FX}/hf dst=out/cv format=torch parallel.tp=3",
        "layout rule (convert)",
        "[heads-tp]",
        "choose tp dividing the head count",
        out=OUT,
    ),
]


def convert_available() -> bool:
    """`mbr convert` is written separately; its cases run only when the command is there."""
    import importlib.util

    from megatron_bridge.cli import COMMANDS

    return "convert" in COMMANDS and importlib.util.find_spec("megatron_bridge.commands.convert") is not None


def convert_cases() -> list[Case]:
    return CONVERT_CASES if convert_available() else []


# -- fixtures -----------------------------------------------------------------------------
def build_fixtures(fx: Path) -> Path:
    """Build the files the cases point at (tests/reliability/fixtures.py), in a subprocess."""
    p = subprocess.run(
        [PY, "-m", "tests.reliability.fixtures", str(fx)], cwd=ROOT, timeout=300, capture_output=True, text=True
    )
    if p.returncode:
        raise RuntimeError(f"building the catalogue fixtures failed:\n{p.stdout}\n{p.stderr}")
    return fx


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns) if p.is_file() else (-1, 0)
    return out


# -- running a case ----------------------------------------------------------------------
@dataclass
class Result:
    case: Case
    rc: int | None
    stderr: str
    seconds: float
    how: str = "proc"  # proc: its own subprocess; in-proc: in a batch interpreter
    problems: list[str] = field(default_factory=list)
    message: str = ""
    shown: str = ""  # the message with the fixture directory written {FX}

    @property
    def ok(self) -> bool:
        return not self.problems

    def got(self) -> str:
        rules = sorted(set(re.findall(r"\[([a-z][a-z-]+)\]", self.message)))
        first = self.shown.splitlines()[0] if self.shown else "(no error message)"
        first = first[len("error: ") :] if first.startswith("error: ") else first
        if rules:
            return f"exit {self.rc}: " + " ".join(f"[{r}]" for r in rules)
        return f"exit {self.rc}: {first[:70]}{'…' if len(first) > 70 else ''}"


def _fill(s: str, fx: Path) -> str:
    return s.replace("{FX}", str(fx))


def command(case: Case, fx: Path) -> list[str]:
    args = [_fill(a, fx) for a in case.argv[1:]]
    head = case.argv[0]
    if head == "mbr":
        return [PY, "-m", "megatron_bridge.cli", *args]
    if head == "train":
        return [PY, "-m", "megatron_bridge.train", *args]
    if head == "torchrun":
        from megatron_bridge.testing import free_port

        return [
            PY,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(case.nproc),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "--max-restarts",
            "0",
            "-m",
            "megatron_bridge.train",
            *args,
        ]
    raise ValueError(head)


TORCHRUN_REPORT = re.compile(
    r"Traceback \(most recent call last\):\n(?:(?!Traceback).*\n)*?"
    r"torch\.distributed\.elastic\.multiprocessing\.errors\.ChildFailedError:"
)


def error_messages(stderr: str) -> list[str]:
    """The `error: ...` paragraphs (a message runs until a line that does not continue it)."""
    out, cur = [], None
    for line in stderr.splitlines():
        if line.startswith("error: "):
            if cur is not None:
                out.append("\n".join(cur))
            cur = [line]
        elif cur is not None and line.startswith("  "):
            cur.append(line)
        else:
            if cur is not None:
                out.append("\n".join(cur))
            cur = None
    if cur is not None:
        out.append("\n".join(cur))
    return out


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update({"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", **extra})
    return env


def run_case(case: Case, fx: Path, workroot: Path) -> Result:
    """Run one case as its own subprocess, exactly as a user would type it."""
    cwd = Path(tempfile.mkdtemp(prefix=f"{case.id}-", dir=workroot))
    t0 = time.monotonic()
    try:
        p = subprocess.run(
            command(case, fx),
            cwd=cwd,
            env=_env(dict(case.env)),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            start_new_session=True,
        )
        rc, stderr = p.returncode, p.stderr + p.stdout
    except subprocess.TimeoutExpired as e:
        rc, stderr = None, f"TIMEOUT after {TIMEOUT} s\n{e.stderr or ''}"
        _kill_in(cwd)  # torchrun starts its workers in sessions of their own
    res = Result(case, rc, stderr, time.monotonic() - t0, how="proc")
    check(res, cwd, fx)
    shutil.rmtree(cwd, ignore_errors=True)
    return res


def _kill_in(cwd: Path) -> None:
    """SIGKILL every process whose working directory is `cwd` (a timed-out case's)."""
    import signal

    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/cwd") == str(cwd):
                    os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass


def run_batch(cases: Sequence[Case], fx: Path, workroot: Path) -> list[Result]:
    """Run cases one after another in one interpreter (tests/reliability/inproc.py)."""
    if not cases:
        return []
    batch = Path(tempfile.mkdtemp(prefix="batch-", dir=workroot))
    cwds = {c.id: Path(tempfile.mkdtemp(prefix=f"{c.id}-", dir=workroot)) for c in cases}
    specs = [
        {
            "id": c.id,
            "entry": c.argv[0],
            "argv": [_fill(a, fx) for a in c.argv[1:]],
            "cwd": str(cwds[c.id]),
            "env": dict(c.env),
        }
        for c in cases
    ]
    (batch / "spec.json").write_text(json.dumps(specs))
    try:
        p = subprocess.run(
            [PY, "-m", "tests.reliability.inproc", str(batch / "spec.json"), str(batch / "out.json")],
            cwd=ROOT,
            env=_env({}),
            capture_output=True,
            text=True,
            timeout=TIMEOUT * 2,
        )
        crash = p.stderr if p.returncode else ""
    except subprocess.TimeoutExpired:
        crash = "the batch timed out"
    out = batch / "out.json"
    done = {r["id"]: r for r in json.loads(out.read_text())} if out.exists() else {}
    results = []
    for c in cases:
        r = done.get(c.id)
        if r is None:
            res = Result(c, None, f"the batch interpreter died before this case: {crash[-2000:]}", 0.0, how="in-proc")
        else:
            res = Result(c, r["rc"], r["stderr"] + r["stdout"], r["seconds"], how="in-proc")
        check(res, cwds[c.id], fx)
        shutil.rmtree(cwds[c.id], ignore_errors=True)
        results.append(res)
    shutil.rmtree(batch, ignore_errors=True)
    return results


def check(res: Result, cwd: Path, fx: Path) -> None:
    case, err, bad = res.case, res.stderr, res.problems
    if res.rc is None:
        bad.append("timed out")
    elif res.rc == 0:
        bad.append("exit 0: the bad input was accepted")
    elif res.rc != case.rc:
        bad.append(f"exit {res.rc}, expected {case.rc}")
    msgs = error_messages(err)
    distinct = sorted(set(msgs))
    res.message = distinct[0] if distinct else ""
    res.shown = res.message.replace(str(fx), "{FX}")
    if not distinct:
        bad.append("no `error: ...` message")
    elif len(distinct) > 1:
        bad.append(f"{len(distinct)} different error messages")
    if case.argv[0] != "torchrun" and not err.startswith("error: "):
        bad.append("output before the error message: " + err.splitlines()[0][:80] if err else "no output")
    for needle in case.expect:
        needle = _fill(needle, fx)
        if needle and needle not in res.message:
            bad.append(f"message lacks {needle!r}")
    rest = TORCHRUN_REPORT.sub("", err) if case.argv[0] == "torchrun" else err
    if "Traceback" in rest:
        bad.append("traceback printed")
    left = sorted(str(p.relative_to(cwd)) for p in cwd.rglob("*"))
    if left:
        bad.append(f"wrote {', '.join(left[:3])}")
    for rel in case.must_not_exist:
        p = Path(_fill(rel, fx))
        if (p if p.is_absolute() else cwd / p).exists():
            bad.append(f"created {rel}")


def all_cases() -> list[Case]:
    cases = CASES + convert_cases()
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    return cases


def run_all(cases: Sequence[Case], fx: Path, workroot: Path, workers: int = 3) -> list[Result]:
    """The subprocess cases (torchrun first: they take longest) on a few threads, next to two
    batch interpreters that run the other cases in-process."""
    procs = sorted((c for c in cases if c.own_process), key=lambda c: c.argv[0] != "torchrun")
    inproc = [c for c in cases if not c.own_process]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        batches = [pool.submit(run_batch, half, fx, workroot) for half in (inproc[0::2], inproc[1::2])]
        results = list(pool.map(lambda c: run_case(c, fx, workroot), procs))
        for b in batches:
            results += b.result()
    by_id = {r.case.id: r for r in results}
    return [by_id[c.id] for c in cases]


def table(results: Sequence[Result], width: int = 64) -> str:
    rows = [("#", "area", "input", "expected rule", "got", "run", "pass", "s")]
    for i, r in enumerate(results, 1):
        inp = r.case.input.replace(" run_dir=out/run checkpoint.dir=out/ckpt", "").replace(SHORT, "")
        inp = inp if len(inp) <= width else inp[: width - 1] + "…"
        rows.append(
            (
                str(i),
                r.case.area,
                inp,
                r.case.rule,
                r.got(),
                r.how,
                "PASS" if r.ok else "FAIL: " + "; ".join(r.problems),
                f"{r.seconds:.1f}",
            )
        )
    widths = [max(len(row[k]) for row in rows) if k < 6 else 0 for k in range(8)]
    lines = []
    for row in rows:
        lines.append("  ".join(c.ljust(w) if w else c for c, w in zip(row, widths)))
        if row is rows[0]:
            lines.append("-" * min(200, sum(widths) + 20))
    n_ok = sum(r.ok for r in results)
    total = sum(r.seconds for r in results)
    areas = {}
    for r in results:
        a = areas.setdefault(r.case.area, [0, 0])
        a[0] += 1
        a[1] += r.ok
    lines.append(
        f"{len(results)} invalid inputs, {n_ok} rejected cleanly (exit != 0, one message with the fix, "
        f"no traceback, nothing written); "
        + ", ".join(f"{k} {v[1]}/{v[0]}" for k, v in areas.items())
        + f"; {total:.0f} s of subprocess time"
    )
    return "\n".join(lines)


def markdown(results: Sequence[Result]) -> str:
    """The table as Markdown (docs/reliability.md)."""

    def cell(x: str) -> str:
        return x.replace("|", "\\|")

    out = ["| # | area | input | expected rule | got | pass |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(results, 1):
        inp = r.case.input.replace(" run_dir=out/run checkpoint.dir=out/ckpt", "").replace(SHORT, "")
        out.append(
            f"| {i} | {r.case.area} | `{cell(inp)}` | {cell(r.case.rule)} | {cell(r.got())} | "
            f"{'pass' if r.ok else 'FAIL'} |"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", default="", help="only cases whose id contains this")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--markdown", help="also write the table as Markdown here")
    a = ap.parse_args(argv)
    cases = [c for c in all_cases() if a.k in c.id]
    with tempfile.TemporaryDirectory(prefix="mbr-catalogue-") as tmp:
        fx = build_fixtures(Path(tmp) / "fx")
        before = snapshot(fx)
        work = Path(tmp) / "work"
        work.mkdir()
        t0 = time.monotonic()
        results = run_all(cases, fx, work)
        print(table(results))
        print(f"wall time {time.monotonic() - t0:.1f} s")
        if snapshot(fx) != before:
            print("FAIL: a case modified the shared fixtures")
            return 1
        if a.markdown:
            Path(a.markdown).write_text(markdown(results) + "\n")
        if a.json:
            Path(a.json).write_text(
                json.dumps(
                    [
                        {
                            "id": r.case.id,
                            "input": r.case.input,
                            "rule": r.case.rule,
                            "got": r.got(),
                            "ok": r.ok,
                            "problems": r.problems,
                            "seconds": round(r.seconds, 2),
                        }
                        for r in results
                    ],
                    indent=1,
                )
            )
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
