"""The tp plan's embedding styles in the transformers backend: `embedding_rowwise` (vocab-parallel),
`embedding_colwise` (the embedding dim split, the output gathered) and `replicate` (whole, no
gradient sum) — how their tensors split in the weight table, and the megatron layers holding
the shards against the unsharded `nn.Embedding`, at TP 2 in this process (two threads on
torch's threaded process group: real collectives, no launch)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from megatron_bridge.backends.transformers.plan import (
    COLUMN,
    GRAD_ALLREDUCE,
    HEAD,
    REPLICATED,
    ROW,
    VOCAB,
    WHOLE_LAYER,
    plan_of,
    plan_problems,
    sp_refusals,
    sp_whole,
    tensor_kinds,
)
from megatron_bridge.bridge.mapping import COLUMN as COLUMN_T
from megatron_bridge.bridge.mapping import ROW as ROW_T
from megatron_bridge.bridge.shards import Shard

TP_PLAN = {
    "embed_tokens": "replicate",  # the base model's embedding: vocab-parallel whatever the entry says
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.self_attn.gate": "replicate",  # next to a split colwise: whole, not summed
    "layers.*.mlp.down_embed": "embedding_rowwise",
    "layers.*.ple.ngram_embedding": "embedding_colwise",
}
SHAPES = {
    "model.embed_tokens.weight": (32, 8),
    "model.layers.0.self_attn.q_proj.weight": (8, 8),
    "model.layers.0.self_attn.o_proj.weight": (8, 8),
    "model.layers.0.self_attn.gate.weight": (2,),  # shaped like a per-head tensor (2 heads)
    "model.layers.0.self_attn.k_norm.weight": (2,),  # the same, unplanned: split by head
    "model.layers.0.mlp.down_embed.weight": (6, 8),
    "model.layers.0.ple.ngram_embedding.weight": (10, 8),
    "lm_head.weight": (32, 8),
}


def test_the_embedding_styles_are_mapped_and_their_tensors_split_as_the_layers_hold_them():
    assert plan_problems("x", TP_PLAN, None) == []
    plan = plan_of("x", "model", TP_PLAN, None, ["lm_head"])
    k = tensor_kinds(plan, SHAPES, heads=2, kv_heads=2, head_dim=4)
    assert k["model.embed_tokens.weight"] == VOCAB
    assert k["model.layers.0.mlp.down_embed.weight"] == COLUMN  # rows over TP, no vocab padding
    assert k["model.layers.0.ple.ngram_embedding.weight"] == ROW  # the embedding dim over TP
    assert k["model.layers.0.self_attn.gate.weight"] == REPLICATED
    assert k["model.layers.0.self_attn.k_norm.weight"] == HEAD
    assert GRAD_ALLREDUCE not in k.values()
    # under sequence parallelism the base model's embedding reduce-scatters; a layer holding an
    # embedding (or a replicated module) runs whole, as in plain TP (test_transformers_sp.py)
    assert sp_refusals(plan) == []
    assert sp_whole(plan, "full_attention") == WHOLE_LAYER


def _threads(world: int, fn: Any) -> list[Any]:
    """fn(rank, group) on `world` threads joined by torch's threaded process group; the results."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg, _uninstall_threaded_pg

    from megatron_bridge.runtime import cpu

    cpu.install()  # megatron's gathers allocate on `torch.cuda.current_device()`
    out: list[Any] = [None] * world
    _install_threaded_pg()
    store = dist.HashStore()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)

    def run(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
        try:
            out[rank] = fn(rank, dist.group.WORLD)
        except BaseException as e:  # reported by the main thread
            out[rank] = e
        finally:
            dist.destroy_process_group()

    try:
        threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        _uninstall_threaded_pg()
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


@pytest.mark.parametrize(("style", "transform"), [("embedding_rowwise", COLUMN_T), ("embedding_colwise", ROW_T)])
def test_a_split_embedding_equals_the_whole_one_and_its_shard_gets_its_slice_of_the_gradient(style, transform):
    from megatron.core.transformer import TransformerConfig

    from megatron_bridge.runtime.transformers.layers import ColumnEmbedding, VocabEmbedding

    torch.manual_seed(0)
    full = torch.nn.Embedding(6, 8, padding_idx=4)
    with torch.no_grad():
        full.weight.normal_()
    ids = torch.tensor([[0, 5, 3, 4, 2, 5, 1]])  # every row, the padding row, both shards
    target = torch.randn(1, 7, 8)
    (full(ids) * target).sum().backward()
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)

    def rank_run(rank: int, group: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kw = dict(config=cfg, init_method=torch.nn.init.zeros_, tp_group=group, padding_idx=4)
        layer = ColumnEmbedding(6, 8, **kw) if style == "embedding_colwise" else VocabEmbedding(6, 8, **kw)
        shard = transform.shard([full.weight.detach()], Shard(rank, 2), {})
        with torch.no_grad():
            layer.weight.copy_(shard)
        out = layer(ids)
        (out * target).sum().backward()
        assert layer.weight.partition_dim == (1 if style == "embedding_colwise" else 0)  # type: ignore[attr-defined]
        return out.detach(), layer.weight.grad, layer.weight.detach()

    results = _threads(2, rank_run)
    for out, _, _ in results:
        torch.testing.assert_close(out, full(ids).detach(), rtol=0, atol=0)
    grads = [g for _, g, _ in results]
    (merged,) = transform.merge(grads, {})
    torch.testing.assert_close(merged, full.weight.grad, rtol=0, atol=0)
    assert not merged[4].any()  # the padding row gets no gradient, as in nn.Embedding
    (weight,) = transform.merge([w for _, _, w in results], {})
    assert torch.equal(weight, full.weight.detach())  # what export merges is what was loaded


def test_a_lookup_then_a_module_of_its_own_is_the_vocab_parallel_lookup_then_that_module():
    """Muse's normed embedding (`embed_norm(super().forward(ids))`, declared in EMBEDDING_AFTER):
    megatron's vocab-parallel lookup, then the model's own `embed_norm`, give transformers' output
    and gradient at TP 2; an nn.Embedding subclass not declared is refused by name."""
    from megatron.core.transformer import TransformerConfig
    from transformers.models.muse_glimmer.modeling_muse_glimmer import MuseGlimmerTextNormedEmbedding

    from megatron_bridge.backends.transformers.meta import embedding_after, embedding_refusal
    from megatron_bridge.runtime.transformers.layers import VocabEmbedding

    class Unknown(torch.nn.Embedding):
        pass

    assert embedding_refusal(Unknown(6, 8)) == "its embedding is a Unknown, not nn.Embedding"
    torch.manual_seed(0)
    full = MuseGlimmerTextNormedEmbedding(6, 8, padding_idx=4)
    assert embedding_refusal(full) is None and embedding_after(full) == "embed_norm"
    with torch.no_grad():
        full.weight.normal_()
    ids = torch.tensor([[0, 5, 3, 4, 2, 5, 1]])
    target = torch.randn(1, 7, 8)
    (full(ids) * target).sum().backward()
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)

    def rank_run(rank: int, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
        after = ("embed_norm", full.embed_norm)
        kw = dict(config=cfg, init_method=torch.nn.init.zeros_, tp_group=group, padding_idx=4, after=after)
        layer = VocabEmbedding(6, 8, **kw)
        with torch.no_grad():
            layer.weight.copy_(COLUMN_T.shard([full.weight.detach()], Shard(rank, 2), {}))
        out = layer(ids)
        (out * target).sum().backward()
        return out.detach(), layer.weight.grad

    results = _threads(2, rank_run)
    for out, _ in results:
        torch.testing.assert_close(out, full(ids).detach(), rtol=0, atol=0)
    (merged,) = COLUMN_T.merge([g for _, g in results], {})
    torch.testing.assert_close(merged, full.weight.grad, rtol=1e-6, atol=1e-6)
