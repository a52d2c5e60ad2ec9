"""`build_model(load_weights=True)`: no random init, the same model otherwise, and every tensor
proven loaded (one process, tp1; tp2 builds run in the dist tests' verify and load_parity)."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

from megatron_bridge.bridge.tiny import TINY
from megatron_bridge.errors import UserError


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from megatron_bridge.runtime.tiny import make_tiny

    root = tmp_path_factory.mktemp("tiny")
    return {fam: make_tiny(fam, root / fam) for fam in TINY}


def _build(hf_dir, load_weights):
    from megatron_bridge.bridge.hf_config import load_spec
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.build import build_model

    spec = load_spec(hf_dir)
    return spec, build_model(spec, Layout(), load_weights=load_weights)


def _seed(s=7):
    from megatron_bridge.runtime import cpu

    torch.manual_seed(s)
    cpu.model_parallel_manual_seed(s)


@pytest.mark.parametrize("family", list(TINY))
def test_uninitialised_build_loads_to_the_same_model(family, groups1, tiny_dirs):
    """Same parameters, buffers and megatron tensor-parallel attributes as the random-init
    build; poisoned with NaN before the load, every tensor equals the random-init build's
    after it (so the loader wrote all of them)."""
    from megatron_bridge.runtime.weights import checkpoint_tensors, load_hf_weights

    spec, ref = _build(tiny_dirs[family], load_weights=False)
    _, new = _build(tiny_dirs[family], load_weights=True)
    for r, c in zip(ref, new, strict=True):
        rt, ct = checkpoint_tensors(r), checkpoint_tensors(c)
        assert [(k, t.shape, t.dtype) for k, t in rt.items()] == [(k, t.shape, t.dtype) for k, t in ct.items()]
        for (k, p), q in zip(r.named_parameters(), c.parameters(), strict=True):
            assert vars(p) == vars(q), k  # tensor_model_parallel, partition_dim/stride, allreduce, ...
            assert "partition_dim" not in vars(p) or p.tensor_model_parallel
        with torch.no_grad():
            for t in ct.values():
                t.fill_(float("nan"))
    n_ref = load_hf_weights(ref, spec, tiny_dirs[family])
    assert load_hf_weights(new, spec, tiny_dirs[family]) == n_ref > 0
    for r, c in zip(ref, new, strict=True):
        for k, t in checkpoint_tensors(c).items():
            assert torch.equal(t, checkpoint_tensors(r)[k]), k


def test_no_random_draws_and_megatron_restored(groups1, tiny_dirs):
    """A dense model built for loading draws nothing from the RNG (the init is really
    skipped), and afterwards megatron's initialisers are back: a from-scratch build is
    bit-for-bit the one made before it under the same seed."""
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer.moe import experts

    originals = (layers._initialize_affine_weight_cpu, experts._initialize_affine_weight_cpu)
    _seed()
    seeded = torch.get_rng_state()
    _, first = _build(tiny_dirs["llama"], load_weights=False)
    state = torch.get_rng_state()
    assert not torch.equal(state, seeded)  # megatron's init draws from this generator
    _build(tiny_dirs["llama"], load_weights=True)
    assert torch.equal(torch.get_rng_state(), state)
    assert (layers._initialize_affine_weight_cpu, experts._initialize_affine_weight_cpu) == originals
    _seed()
    _, again = _build(tiny_dirs["llama"], load_weights=False)
    for (k, p), q in zip(first[0].state_dict().items(), again[0].state_dict().values(), strict=True):
        if torch.is_tensor(p):
            assert torch.equal(p, q), k


def test_a_tensor_missing_from_the_checkpoint_is_named(groups1, tiny_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    from megatron_bridge.runtime.weights import load_hf_weights

    src = tiny_dirs["llama"]
    dst = tmp_path / "llama"
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    spec, chunks = _build(dst, load_weights=True)
    with pytest.raises(UserError, match=r"decoder\.layers\.1\.mlp\.linear_fc2\.weight"):
        load_hf_weights(chunks, spec, dst)


def test_persistent_buffers_must_come_from_the_checkpoint(groups1, tiny_dirs):
    """A persistent buffer is checkpoint state: without a table row it is refused, not left
    as built; a non-persistent one (derived from the config) is not the checkpoint's."""
    from megatron_bridge.runtime.weights import checkpoint_tensors, load_hf_weights

    spec, chunks = _build(tiny_dirs["llama"], load_weights=True)
    norm = chunks[0].decoder.final_layernorm
    norm.register_buffer("derived", torch.zeros(2), persistent=False)
    assert "decoder.final_layernorm.derived" not in checkpoint_tensors(chunks[0])
    load_hf_weights(chunks, spec, tiny_dirs["llama"])
    norm.register_buffer("stateful", torch.zeros(2))
    with pytest.raises(UserError, match=r"without an HF source \['decoder\.final_layernorm\.stateful'\]"):
        load_hf_weights(chunks, spec, tiny_dirs["llama"])


def test_require_all_written_names_what_was_left():
    from megatron_bridge.runtime.weights import require_all_written

    require_all_written({"a": 0, "b": 0}, {"a", "b"}, "src")
    with pytest.raises(UserError, match=r"src left 1 tensor\(s\) of the model unloaded .*: b$"):
        require_all_written({"a": 0, "b": 0}, {"a"}, "src")


def test_converted_state_must_cover_the_chunk(groups1, tiny_dirs):
    """`train.init_from=` a converted checkpoint: the same guarantee before the strict load."""
    from megatron_bridge.runtime.native.converted import load_chunk as _load_chunk

    _, (ref,) = _build(tiny_dirs["qwen2"], load_weights=False)
    _, (new,) = _build(tiny_dirs["qwen2"], load_weights=True)
    state = ref.state_dict()
    del state["decoder.layers.0.self_attention.linear_qkv.bias"]
    with pytest.raises(UserError, match=r"linear_qkv\.bias"):
        _load_chunk(new, state, "train.init_from=X")
    _load_chunk(new, ref.state_dict(), "train.init_from=X")
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), new.parameters(), strict=True))


@pytest.mark.parametrize(
    "init_from, hf_path, resume, peft, loads",
    [
        (None, None, False, "none", False),  # from scratch: megatron's init
        ("/ckpt", None, False, "none", True),
        ("/ckpt", "/hf", True, "none", True),
        (None, "/hf", False, "none", True),
        (None, "/hf", True, "none", False),  # resuming: the checkpoint brings the weights
        (None, "/hf", True, "lora", True),  # a LoRA checkpoint holds no base
    ],
)
def test_one_decision_for_build_and_load(init_from, hf_path, resume, peft, loads):
    from megatron_bridge.train.init import loads_weights

    cfg = SimpleNamespace(
        train=SimpleNamespace(init_from=init_from),
        checkpoint=SimpleNamespace(resume=resume),
        peft=SimpleNamespace(method=peft),
    )
    assert loads_weights(cfg, SimpleNamespace(source=hf_path)) is loads
