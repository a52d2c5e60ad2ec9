"""`megatron_bridge.stream` in one process: a trained-looking model streams in bounded buckets
into a separate transformers model, whose logits then equal those of the exported directory."""

from __future__ import annotations

import pytest
import torch

from megatron_bridge.errors import UserError


def test_buckets_are_bounded_and_update_a_transformers_model_in_place(groups1, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_bridge.bridge.hf_config import load_spec
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.tiny import make_tiny
    from megatron_bridge.runtime.weights import export_hf_weights, load_hf_weights
    from megatron_bridge.stream import apply_bucket, bucket_nbytes, hf_buckets

    hf = make_tiny("llama", tmp_path / "hf")
    spec = load_spec(hf)
    chunks = build_model(spec, Layout(), load_weights=True)
    load_hf_weights(chunks, spec, hf)
    with torch.no_grad():  # "a training step": the stream must carry the new values
        for p in chunks[0].parameters():
            p.add_(0.01 * torch.randn_like(p))
    export_hf_weights(chunks, spec, tmp_path / "exported", source_dir=hf)
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()  # noqa: E731
    receiver, want = load(hf), load(tmp_path / "exported")
    with torch.no_grad():
        before, want_logits = receiver(ids).logits, want(ids).logits
    assert not torch.equal(before, want_logits)

    sizes = {n: p.numel() * p.element_size() for n, p in want.named_parameters()}
    bound = sum(sizes.values()) // 5
    buckets, n = 0, 0
    for bucket in hf_buckets(chunks, spec, bucket_bytes=bound):
        assert bucket_nbytes(bucket) <= bound or len(bucket) == 1
        n += apply_bucket(receiver, bucket)
        buckets += 1
    assert buckets >= 5 and n == len(sizes)
    with torch.no_grad():
        assert torch.equal(receiver(ids).logits, want_logits)

    with pytest.raises(UserError, match="bucket_bytes must be positive"):
        next(hf_buckets(chunks, spec, bucket_bytes=0))
    with pytest.raises(UserError, match="not a streaming mode: pass one of stage, broadcast"):
        next(hf_buckets(chunks, spec, mode="everyone"))
    with pytest.raises(UserError, match="no tensor named"):
        apply_bucket(receiver, [("model.nope.weight", torch.zeros(1))])


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_model_layout_fuses_experts_as_transformers_holds_them(groups1, tmp_path, family):
    """layout="model": Mixtral's per-expert checkpoint tensors (w1/w3/w2 of each expert) arrive
    as transformers 5's fused `experts.gate_up_proj` / `down_proj` under the module names, so
    `apply_bucket` fills a transformers model directly; logits equal the exported directory's."""
    from transformers import AutoModelForCausalLM

    from megatron_bridge.bridge.hf_config import load_spec
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.tiny import make_tiny
    from megatron_bridge.runtime.weights import export_hf_weights, load_hf_weights
    from megatron_bridge.stream import apply_bucket, hf_buckets

    hf = make_tiny(family, tmp_path / "hf")
    spec = load_spec(hf)
    chunks = build_model(spec, Layout(), load_weights=True)
    load_hf_weights(chunks, spec, hf)
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(0.01 * torch.randn_like(p))
    export_hf_weights(chunks, spec, tmp_path / "exported", source_dir=hf)
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()  # noqa: E731
    receiver, want = load(hf), load(tmp_path / "exported")
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    names = set()
    for bucket in hf_buckets(chunks, spec, bucket_bytes=1 << 16, layout="model"):
        apply_bucket(receiver, bucket)
        names |= {n for n, _ in bucket}
    assert names == {n for n, _ in want.named_parameters()} | {n for n, _ in want.named_buffers() if n in names}
    assert any(n.endswith("experts.gate_up_proj") for n in names)
    with torch.no_grad():
        assert torch.equal(receiver(ids).logits, want(ids).logits)
    with pytest.raises(UserError, match="not a streaming layout"):
        next(hf_buckets(chunks, spec, layout="fused"))


@pytest.mark.parametrize("family,backend", [("mixtral", "native"), ("qwen3_moe", "transformers")])
def test_model_layout_gathers_expert_pieces_into_their_slots(groups1, tmp_path, family, backend):
    """layout="model" hands each expert piece's slot in its stacked tensor to the exporter
    (`ModelLayout.slot` as `iter_hf_tensors(into=)`): every piece arrives as a view of the stack
    (gathered there, no piece-sized buffer beside it), and the stream equals the old path's
    (pieces gathered to new memory, then copied in) bit for bit; under a dtype cast the pieces
    are cast copies, copied in as before."""
    from megatron_bridge.backends.describe import describe_hf
    from megatron_bridge.bridge.hf_config import load_spec, read_hf_config
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.tiny import make_tiny
    from megatron_bridge.runtime.weights import iter_hf_tensors, load_hf_weights
    from megatron_bridge.stream import ModelLayout, hf_buckets, in_model_layout

    hf = make_tiny(family, tmp_path / "hf")
    specs = {"native": load_spec, "transformers": lambda p: describe_hf(read_hf_config(p), backend="transformers")}
    spec = specs[backend](hf)
    chunks = build_model(spec, Layout(), load_weights=True)
    load_hf_weights(chunks, spec, hf)
    for dtype in (torch.float16, None):  # the uncast stream last: hf_buckets' below is compared to it
        old = list(in_model_layout(iter_hf_tensors(chunks, spec, dtype), spec))
        shaped = ModelLayout(spec)
        in_slot = []

        def watched(tensors, shaped=shaped, in_slot=in_slot):
            for name, t in tensors:
                whole, _ = shaped.piece_of.get(name, ("", 0))
                if whole in shaped.stacks:
                    stack = shaped.stacks[whole][0].untyped_storage().data_ptr()
                    in_slot.append(t.untyped_storage().data_ptr() == stack)
                yield name, t

        new = list(shaped(watched(iter_hf_tensors(chunks, spec, dtype, into=shaped.slot))))
        assert [n for n, _ in new] == [n for n, _ in old]
        assert all(a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(new, old)), dtype
        assert len(in_slot) >= 8 and all(x == (dtype is None) for x in in_slot), (dtype, in_slot)
    streamed = [t for b in hf_buckets(chunks, spec, bucket_bytes=1 << 16, layout="model") for _, t in b]
    assert len(streamed) == len(old) and all(torch.equal(a, b) for a, (_, b) in zip(streamed, old))


def test_broadcast_buckets_pack_mixed_dtypes_where_the_receiver_unpacks_them():
    """Broadcast mode packs each bucket's tensors into one byte buffer as they arrive; the
    receivers cut it by `_layout` from names and shapes alone: both must agree, whatever the
    dtypes (offsets aligned), and a tensor over the bucket comes alone."""
    from megatron_bridge.stream import _layout, _packed

    g = torch.Generator().manual_seed(0)
    tensors = [
        ("a", torch.randn(3, 5, generator=g)),
        ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c", torch.tensor([True, False, True])),
        ("d", torch.randn(40, 10, generator=g)),  # 1600 bytes: over the bucket, alone
        ("e", torch.arange(5, dtype=torch.int64)),
        ("f", torch.randn(2, 2, generator=g).to(torch.float16)),
    ]
    got = list(_packed(iter(tensors), 256, torch.device("cpu")))
    assert [[n for n, _ in b] for b, _ in got] == [["a", "b", "c"], ["d"], ["e", "f"]]
    want = dict(tensors)
    for bucket, data in got:
        assert sum(t.numel() * t.element_size() for _, t in bucket) <= max(256, data.numel())
        offsets, end = _layout([(n, tuple(t.shape), t.dtype) for n, t in bucket])
        assert end == data.numel()
        for (n, t), o in zip(bucket, offsets):
            unpacked = data[o : o + t.numel() * t.element_size()].view(t.dtype).reshape(t.shape)
            assert torch.equal(unpacked, want[n]) and torch.equal(t, want[n]), n
