"""Checkpoints written the way Megatron-LM / megatron-core write them, for the tests of our reader.

A reader of Megatron-LM checkpoints must be tested on what Megatron-LM writes, not on what our
converter writes: here megatron-core itself saves our native GPTModel (`dist_checkpointing.save`
of `GPTModel.sharded_state_dict()`), and the classic per-rank files carry everything
`megatron.training.checkpointing.save_checkpoint` puts in them (args, optimizer, scheduler, RNG
states). `te_names=True` gives the names megatron-core's Transformer Engine layer spec
(`get_gpt_layer_with_transformer_engine_spec`, the spec every real run uses) produces instead
of the local spec's; Transformer Engine itself cannot be installed here, so they are derived
from megatron-core's source (`te_state_dict`, `_te_dist_keys`). Non-MLA GPT models only.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINT_VERSION = 3.0
PAYLOAD_MARKER = "/tmp/pwned_marker"
TRACKER = "latest_checkpointed_iteration.txt"


def iter_dir(out: str | Path, iteration: int) -> Path:
    """Megatron-LM's `iter_0000010`: where one iteration's checkpoint lives under the tracker dir."""
    return Path(out) / f"iter_{iteration:07d}"


def rank_dir_name(tp_rank: int, pp_rank: int = 0, ep_rank: int = 0, *, pp: int = 1, ep: int = 1) -> str:
    """Megatron-LM's `get_checkpoint_name`: `mp_rank_XX` at pp=1, `mp_rank_XX_YYY` with pp>1,
    `_EEE` appended with ep>1."""
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name + (f"_{ep_rank:03d}" if ep > 1 else "")


def te_extra_state() -> io.BytesIO:
    """A Transformer Engine module's `_extra_state` (TE <= 1.x `get_extra_state`: its FP8
    metadata, None without FP8, torch.save'd into a BytesIO). Newer TE stores a uint8 tensor."""
    buf = io.BytesIO()
    torch.save(None, buf)
    buf.seek(0)
    return buf


def rng_state() -> dict[str, Any]:
    """One rank's entry of Megatron-LM's `rng_state` list (`get_rng_state`); CPU-only, so the
    CUDA generator's state is stood in for by the CPU one (same type: a uint8 tensor)."""
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.get_rng_state(),
        "rng_tracker_states": {},
    }


def megatron_lm_args(
    spec: Any, *, tp: int, ckpt_format: str, te: bool, iteration: int, padded_vocab: int, hf_dir: str | Path
) -> argparse.Namespace:
    """The `args` Namespace Megatron-LM pickles into a checkpoint, under its real field names
    (a reader takes the model shape and parallel sizes from it; the rest is there because
    Megatron-LM stores all its arguments, values of many types: str, list, None, torch.dtype)."""
    moe, part, heads, groups = bool(spec.num_moe_experts), spec.part, spec.num_attention_heads, spec.num_query_groups
    ns = argparse.Namespace(num_layers=spec.num_layers, hidden_size=spec.hidden_size)
    a = vars(ns)
    a.update(ffn_hidden_size=spec.ffn_hidden_size, max_position_embeddings=spec.max_position_embeddings)
    a.update(num_attention_heads=heads, group_query_attention=groups != heads, num_query_groups=groups)
    a.update(kv_channels=spec.head_dim, add_position_embedding=False)
    a.update(position_embedding_type="rope", rotary_base=int(spec.rotary_base), rotary_percent=part.rotary_percent)
    a.update(normalization=part.normalization, norm_epsilon=spec.norm_epsilon, swiglu=spec.gated_linear_unit)
    a.update(untie_embeddings_and_output_weights=not spec.tie_word_embeddings, qk_layernorm=part.qk_layernorm)
    a.update(add_bias_linear=part.add_bias_linear, add_qkv_bias=part.add_qkv_bias)
    a.update(num_experts=spec.num_moe_experts, moe_ffn_hidden_size=spec.moe_ffn_hidden_size)
    a.update(moe_grouped_gemm=te and moe)
    a.update(moe_router_topk=spec.moe_router_topk if moe else 2, moe_layer_freq=list(spec.moe_layer_pattern) or 1)
    a.update(moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size)
    a.update(padded_vocab_size=padded_vocab, make_vocab_size_divisible_by=128, vocab_size=None)
    a.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None)
    a.update(expert_model_parallel_size=1, expert_tensor_parallel_size=tp, context_parallel_size=1)
    a.update(params_dtype=torch.float32, bf16=False, fp16=False, fp8=None)
    a.update(ckpt_format=ckpt_format, use_dist_ckpt=ckpt_format == "torch_dist")
    a.update(transformer_impl="transformer_engine" if te else "local", seq_length=spec.max_position_embeddings)
    a.update(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(hf_dir), data_path=["/data/pile/text_document"])
    a.update(save="/checkpoints/run", load=None, train_iters=1000, global_batch_size=8, lr=1e-4, seed=1234)
    a.update(iteration=iteration, consumed_train_samples=iteration * 8)
    return ns


@contextlib.contextmanager
def _native(hf_dir: str | Path, *, load: bool = True) -> Iterator[tuple[Any, Any]]:
    """(spec, GPTModel) of `hf_dir` at tp1 under one-process groups; `load=False`: uninitialised
    weights (enough for the state dict's key order)."""
    from megatron_bridge.bridge.hf_config import load_spec
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.weights import load_hf_weights
    from megatron_bridge.testing import one_process_groups

    with one_process_groups():
        spec = load_spec(hf_dir)
        (chunk,) = build_model(spec, Layout(), load_weights=True)
        if load:
            load_hf_weights([chunk], spec, hf_dir)
        yield spec, chunk


def _te_dist_keys(sharded: dict[str, Any]) -> None:
    """The TE spec's torch_dist keys, in place. The local spec's keys map names its norms
    `linear_qkv.layer_norm_weight` / `mlp.linear_fc1.layer_norm_weight` (TE's fused names) in
    every layer, but TE's MoE layers keep a TENorm `pre_mlp_layernorm.weight`. The rest agrees:
    TEGroupedMLP writes SequentialMLP's keys (`mlp.experts.experts.linear_fc1.weight` [E, ...],
    per-expert `_extra_state`), TEDotProductAttention writes nothing. Extra states: TE's BytesIO."""
    moe = {m.group(1) for k in sharded if (m := re.match(r"(decoder\.layers\.\d+)\.mlp\.router\.", k))}
    for name, sh in sharded.items():
        layer = re.match(r"(decoder\.layers\.\d+)\.pre_mlp_layernorm\.", name)
        if layer and layer.group(1) in moe:
            sh.key = sh.key.replace("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm.")
        if name.endswith("._extra_state") and not name.startswith("output_layer."):
            sh.data = te_extra_state()


_LAYER = re.compile(r"^(decoder\.layers\.\d+)\.(.*)$")
_FUSED = {"input_layernorm": "self_attention.linear_qkv", "pre_mlp_layernorm": "mlp.linear_fc1"}  # TE: norm + linear
_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.(\w+)$")


def te_state_dict(sd: Mapping[str, Any]) -> dict[str, Any]:
    """A local-spec state dict (megatron's module order) under the TE spec's names and order:
    norms fused into the linear after them (`linear_qkv.layer_norm_weight` before
    `linear_qkv.weight`; dense `mlp.linear_fc1.layer_norm_weight`; MoE layers keep
    `pre_mlp_layernorm.weight`), `core_attention._extra_state` (TEDotProductAttention) before
    `linear_proj`, grouped-GEMM experts (`mlp.experts.linear_fc1.weight0..N` then one
    `mlp.experts.linear_fc1._extra_state`, TE GroupedLinear's), TE extra states as BytesIO
    (the output layer stays megatron's ColumnParallelLinear: None)."""
    moe = {m.group(1) for k in sd if (m := _LAYER.match(k)) and m.group(2).startswith("mlp.router.")}
    out: dict[str, Any] = {}
    norms: dict[str, list[tuple[str, Any]]] = {}  # fused linear -> its norm's (leaf, value)
    grouped: dict[str, dict[str, Any]] = {}  # experts' GroupedLinear -> weightE / biasE

    def flush() -> None:
        for module, entries in grouped.items():
            out.update({f"{module}.{leaf}": v for leaf, v in entries.items()})
            out[f"{module}._extra_state"] = te_extra_state()
        grouped.clear()

    for k, v in sd.items():
        e = _EXPERT.match(k)
        if e:
            if e.group(4) != "_extra_state":
                grouped.setdefault(e.group(1) + e.group(3), {})[e.group(4) + e.group(2)] = v
            continue
        flush()
        m = _LAYER.match(k)
        if m:
            layer, rest = m.groups()
            norm, _, norm_leaf = rest.partition(".")
            if norm in _FUSED and not (norm == "pre_mlp_layernorm" and layer in moe):
                norms.setdefault(f"{layer}.{_FUSED[norm]}", []).append((norm_leaf, v))
                continue
            if rest == "self_attention.linear_proj.weight":
                out[f"{layer}.self_attention.core_attention._extra_state"] = te_extra_state()
        module, _, leaf = k.rpartition(".")
        for norm_leaf, nv in norms.pop(module, []):
            out[f"{module}.layer_norm_{norm_leaf}"] = nv
        out[k] = te_extra_state() if leaf == "_extra_state" and not k.startswith("output_layer.") else v
    flush()
    assert not norms, f"norms without their linear: {sorted(norms)}"
    return out


def write_dist(
    hf_dir: str | Path,
    out: str | Path,
    *,
    iteration: int = 10,
    te_names: bool = False,
    args_overrides: Mapping[str, Any] | None = None,
    rng: bool = True,
    pre_014: bool = False,
) -> Path:
    """A Megatron-LM torch_dist checkpoint of the tiny HF model at `hf_dir`, saved by
    megatron-core's `dist_checkpointing.save` (tp1; torch_dist loads at any layout), with the
    top-level entries Megatron-LM's `generate_state_dict` writes; `rng`: its `rng_state`
    ShardedObject ((pp, tp) grid); `pre_014`: in the format megatron-core wrote before 0.14
    (`singleton_local_shards`: a key per layer and per expert, SwiGLU's fc1 as `_w` / `_v`
    halves). Returns the tracker dir `out`."""
    opts = {"iteration": iteration, "te_names": te_names, "args_overrides": dict(args_overrides or {}), "rng": rng}
    opts["pre_014"] = pre_014
    return write_dists([(hf_dir, out, opts)])[0]


def write_dists(jobs: Sequence[tuple[str | Path, str | Path, Mapping[str, Any]]]) -> list[Path]:
    """`write_dist(hf_dir, out, **opts)` for each job, all in one child interpreter: the save's
    writer processes would otherwise outlive it as children of the caller (and an interpreter
    with megatron-core takes seconds to start)."""
    full = {"iteration": 10, "te_names": False, "args_overrides": {}, "rng": True, "pre_014": False}
    payload = json.dumps([[str(h), str(o), {**full, **dict(opts)}] for h, o, opts in jobs])
    code = (
        "import json, sys; from tests.megatron_ckpts import _write_dist\n"
        "for h, o, opts in json.loads(sys.argv[1]): _write_dist(h, o, **opts)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, payload], cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(f"writing the torch_dist checkpoints failed:\n{done.stdout}\n{done.stderr}")
    return [Path(o) for _, o, _ in jobs]


def _write_dist(
    hf_dir: str | Path,
    out: str | Path,
    *,
    iteration: int,
    te_names: bool,
    args_overrides: Mapping[str, Any],
    rng: bool,
    pre_014: bool,
) -> Path:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject

    out = Path(out)
    ckpt = iter_dir(out, iteration)
    ckpt.mkdir(parents=True)
    with _native(hf_dir) as (spec, chunk):
        content = {"singleton_local_shards": True} if pre_014 else None  # what megatron-core < 0.14 wrote
        sharded = chunk.sharded_state_dict(metadata=content)
        if te_names:
            _te_dist_keys(sharded)
        padded = int(chunk.embedding.word_embeddings.weight.shape[0])
        ns = megatron_lm_args(
            spec, tp=1, ckpt_format="torch_dist", te=te_names, iteration=iteration, padded_vocab=padded, hf_dir=hf_dir
        )
        vars(ns).update(args_overrides or {})
        state: dict[str, Any] = {"model": sharded, "args": ns, "checkpoint_version": CHECKPOINT_VERSION}
        state.update(iteration=iteration, num_floating_point_operations_so_far=0)
        if rng:
            state["rng_state"] = ShardedObject("rng_state", [rng_state()], (1, 1), (0, 0), replica_id=0)
        dist_checkpointing.save(state, str(ckpt), content_metadata=content)
    (out / TRACKER).write_text(str(iteration))
    return out


class _Payload:
    """Unpickled, it runs a shell command (`os.system`): the marker file appearing proves a load
    executed code from the checkpoint."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch '{self.marker}'",)


def _converted_ranks(hf_dir: str | Path, tp: int) -> list[dict[str, Any]]:
    """The "model" dict of each tp rank file `mbr convert format=torch` writes: megatron's real
    TP shards (fused QKV by query group, SwiGLU fc1 as [gate_r; up_r], vocab-parallel rows)."""
    with tempfile.TemporaryDirectory(prefix="mlm-ckpt-") as tmp:
        dst = Path(tmp) / "c"
        cmd = [sys.executable, "-m", "megatron_bridge.cli", "convert", f"src={hf_dir}", f"dst={dst}", "format=torch"]
        done = subprocess.run([*cmd, f"parallel.tp={tp}"], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"mbr convert failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        tracked = (dst / TRACKER).read_text().strip()
        sub = dst / tracked if tracked == "release" else iter_dir(dst, int(tracked))
        return [
            torch.load(sub / rank_dir_name(r) / "model_optim_rng.pt", weights_only=False)["model"] for r in range(tp)
        ]


def write_torch(
    hf_dir: str | Path,
    out: str | Path,
    *,
    tp: int = 2,
    te_names: bool = True,
    iteration: int = 10,
    payload: bool | str | Path = False,
) -> Path:
    """Megatron-LM's classic per-rank checkpoint (`--ckpt-format torch`, pp=1):
    `out/iter_0000010/mp_rank_XX/model_optim_rng.pt` with what `save_checkpoint` puts there,
    the model in megatron's module order (TE spec names with `te_names`). `payload` (True: at
    `PAYLOAD_MARKER`, or a marker path): rank 0's args carry an object that, unpickled, touches
    the marker. Returns the tracker dir `out`."""
    out = Path(out)
    ranks = _converted_ranks(hf_dir, tp)
    with _native(hf_dir, load=False) as (spec, chunk):
        order = list(chunk.state_dict())
    for r, model in enumerate(ranks):
        if set(model) != set(order):
            raise AssertionError(f"rank {r} keys differ from megatron's: {sorted(set(model) ^ set(order))}")
        sd = {k: model[k] for k in order}
        padded = int(sd["embedding.word_embeddings.weight"].shape[0]) * tp
        ns = megatron_lm_args(
            spec, tp=tp, ckpt_format="torch", te=te_names, iteration=iteration, padded_vocab=padded, hf_dir=hf_dir
        )
        if payload and r == 0:
            ns.payload = _Payload(PAYLOAD_MARKER if payload is True else str(payload))
        adam: dict[str, Any] = {"state": {0: {"exp_avg": torch.zeros(8), "exp_avg_sq": torch.zeros(8)}}}
        adam["param_groups"] = [{"lr": 1e-4, "params": [0]}]
        ckpt: dict[str, Any] = {"args": ns, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
        ckpt["model"] = te_state_dict(sd) if te_names else sd
        ckpt["optimizer"] = {"optimizer": adam, "fp32_from_fp16_params": [[torch.zeros(8)]]}
        ckpt.update(opt_param_scheduler={"max_lr": 1e-4, "num_steps": iteration}, rng_state=[rng_state()])
        ckpt["num_floating_point_operations_so_far"] = 0
        path = iter_dir(out, iteration) / rank_dir_name(r) / "model_optim_rng.pt"
        path.parent.mkdir(parents=True)
        torch.save(ckpt, path)
    (out / TRACKER).write_text(str(iteration))
    return out


@torch.no_grad()
def mcore_logits(hf_dir: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    """megatron-core's own forward of the native model of `hf_dir` (fp32, tp1): logits
    [b, s, vocab_size] (padding rows sliced off), the reference an export's logits meet."""
    with _native(hf_dir) as (spec, chunk):
        chunk.eval()
        b, s = tokens.shape
        position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
        logits = chunk(tokens, position_ids, attention_mask=None)
        return logits[..., : spec.vocab_size].float().contiguous()


@torch.no_grad()
def mcore_checkpoint_logits(hf_dir: str | Path, checkpoint: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    """megatron-core's forward of a torch_dist checkpoint (an `iter_N` directory) loaded by its own
    `dist_checkpointing.load` into the native model of `hf_dir` (random weights before the load)."""
    from megatron.core import dist_checkpointing

    with _native(hf_dir, load=False) as (spec, chunk), torch.serialization.safe_globals([argparse.Namespace]):
        content = dist_checkpointing.load_content_metadata(str(checkpoint))  # the format it was saved in
        sharded = chunk.sharded_state_dict(metadata=content)
        state = dist_checkpointing.load({"model": sharded}, str(checkpoint))["model"]
        chunk.load_state_dict(state, strict=False)
        chunk.eval()
        b, s = tokens.shape
        logits = chunk(tokens, torch.arange(s).unsqueeze(0).expand(b, s), attention_mask=None)
        return logits[..., : spec.vocab_size].float().contiguous()
