"""One torchrun launch, many (layout, family) LoRA checks: see tests/dist/test_lora_parity.py.

    torchrun --nproc-per-node 4 tests/dist/bridge_scripts/lora_parity.py --root DIR \
        --families llama,mixtral --layouts tp2,pp2,tp2sp,ep2 --out OUT

DIR/<family> is a tiny HF model, DIR/adapters/<family> an HF PEFT adapter of it (B non-zero),
DIR/refs/<family>.pt peft's reference (input_ids, labels, loss, grads by adapter-file key,
targets, rank, alpha). For each pair: build, load the base, attach the adapter
(`peft.init_from`), one forward/backward → loss and adapter gradients in HF PEFT's names;
then `--steps` SGD steps on the adapters, megatron's logits, the adapter exported in HF PEFT
format and the merged model exported as HF. Every rank reports {"<family>/<layout>": ...}.
"""

import argparse
import time
from pathlib import Path

import torch


def _stream_adapter(model, spec, adapter_dir, modes=None) -> dict:
    """`hf_buckets(adapter=True)` in each mode: the peft keys this rank received and whether each
    equals the exported adapter file's tensor (small buckets: several per stage)."""
    from safetensors.torch import load_file

    from megatron_bridge.stream import hf_buckets

    want = load_file(str(adapter_dir / "adapter_model.safetensors"))
    out = {}
    for mode in modes or ("stage", "broadcast"):
        got = {}
        for bucket in hf_buckets(model, spec, bucket_bytes=4096, mode=mode, adapter=True):
            for k, t in bucket:
                got[k] = k in want and torch.equal(t.float().cpu(), want[k])
        out[mode] = {"keys": sorted(got), "equal": all(got.values())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--families", required=True)
    ap.add_argument("--layouts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--skip", default="", help="family/layout pairs not to run, comma-separated")
    a = ap.parse_args()

    from megatron_bridge.bridge.hf_config import load_spec
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.weights import export_hf_weights, load_hf_weights
    from megatron_bridge.runtime.lora_modules import apply_lora, export_adapter, iter_adapter_tensors, merged
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.parity import ensure_groups, training_layout
    from megatron_bridge.runtime.schedule import forward_backward, forward_logits, unwrap, wrap_ddp
    from megatron_bridge.config.schema import PeftConfig
    from megatron_bridge.testing import report

    root = Path(a.root)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 0
    for text in a.layouts.split(","):
        layout = Layout.parse(text)
        for fam in a.families.split(","):
            hf_dir = root / fam
            spec = load_spec(hf_dir, make_vocab_size_divisible_by=1)
            if (layout.ep > 1 and not spec.is_moe) or f"{fam}/{text}" in a.skip.split(","):
                continue
            t0 = time.perf_counter()
            ref = torch.load(root / "refs" / f"{fam}.pt")
            peft = PeftConfig(
                method="lora",
                rank=ref["rank"],
                alpha=ref["alpha"],
                target_modules=ref["targets"],
                init_from=str(root / "adapters" / fam),
            )
            world = world or int(__import__("os").environ["WORLD_SIZE"])
            ensure_groups(layout, world)
            world = torch.distributed.get_world_size()
            glayout = training_layout(spec, layout)
            chunks = build_model(spec, glayout, load_weights=True)
            load_hf_weights(chunks, spec, hf_dir)
            n_linears = apply_lora(chunks, spec, peft)
            ddp = wrap_ddp(chunks)
            res = {"linears": n_linears}
            loss = forward_backward(ddp, ref["input_ids"], ref["labels"], train=True)
            if loss is not None:
                res["loss"] = loss
            grads = dict(iter_adapter_tensors(unwrap(ddp), value=lambda p: p.main_grad))
            worst, bad = 0.0, []
            for k, g in grads.items():
                r = ref["grads"].get(k)
                if r is None or tuple(r.shape) != tuple(g.shape):
                    bad.append(f"{k}: {tuple(g.shape)} vs {None if r is None else tuple(r.shape)}")
                    continue
                worst = max(worst, float((g.float() - r).abs().max()))
            res["grads"] = {"n": len(grads), "max_abs": worst, "bad": bad, "keys": sorted(grads)}
            frozen = [n for c in unwrap(ddp) for n, p in c.named_parameters() if p.requires_grad != (".lora." in n)]
            res["frozen_bad"] = frozen[:4]
            for _ in range(a.steps):
                forward_backward(ddp, ref["input_ids"], ref["labels"], train=True)
                with torch.no_grad():
                    for c in ddp:
                        for p in c.parameters():
                            if p.requires_grad:
                                p.add_(p.main_grad.to(p.dtype), alpha=-a.lr)
            model = unwrap(ddp)
            logits = forward_logits(model, ref["input_ids"])
            if logits is not None:
                res["logits"] = logits[..., : spec.vocab_size].tolist()
            out = Path(a.out) / fam / text
            export_adapter(model, peft, str(out / "adapter"), str(hf_dir))
            res["stream"] = _stream_adapter(model, spec, out / "adapter")
            with merged(model):
                export_hf_weights(model, spec, out / "merged", source_dir=hf_dir)
            res["seconds"] = round(time.perf_counter() - t0, 3)
            report({f"{fam}/{text}": res})
            del ddp, chunks, model
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
