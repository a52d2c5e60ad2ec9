"""One torchrun launch: `mbr convert` outputs load into megatron-core models and train.

    torchrun --nproc-per-node 4 tests/dist/convert_scripts/load_parity.py --root DIR \
        --cases llama:torch_dist:tp2pp2,llama:torch:tp2pp2,... --train llama --out OUT

DIR/<family> is a tiny HF model, DIR/refs/<family>.pt its transformers logits for fixed
input_ids, DIR/ckpt/<family>-<format>-<layout> its conversion (a format name is only a
directory tag: `torch_dist_pad` is a torch_dist written with another vocab padding). For each case, on every
rank: the layout's process groups, the model built by the bridge, the checkpoint loaded
through `train.init_from`'s loader (`train.init.load_initial_weights`), then
* `params_equal`: every parameter bitwise equal to the same model loaded from the HF
  directory by the bridge's online loader (the one mapping, two paths);
* `logits`: max |Δ| against transformers on the real vocabulary (last pipeline stage).
`--train FAMILY` then runs 2 training steps at tp2·pp2 from the HF directory and from both
conversions (`model.hf_path=CKPT train.init_from=CKPT`); rank 0 reports the losses.
"""

import argparse
import json
from pathlib import Path

import torch


def stream_check(chunks, spec, hf: Path) -> dict:
    """`megatron_bridge.stream` in both modes, buckets of ~1/7 of the model: which HF tensors this
    rank received, whether each equals the HF directory's bit for bit, and how many multi-tensor
    buckets went over the bound."""
    from safetensors.torch import load_file

    from megatron_bridge.stream import bucket_nbytes, hf_buckets

    want = {k: v for f in sorted(hf.glob("*.safetensors")) for k, v in load_file(f).items()}
    bound = sum(t.numel() * t.element_size() for t in want.values()) // 7
    out = {}
    for mode in ("stage", "broadcast"):
        got, over, buckets = {}, 0, 0
        for bucket in hf_buckets(chunks, spec, bucket_bytes=bound, mode=mode):
            over += int(bucket_nbytes(bucket) > bound and len(bucket) > 1)
            buckets += 1
            for n, t in bucket:
                got[n] = n in want and torch.equal(t.cpu(), want[n])
        out[mode] = {
            "names": sorted(got),
            "equal": all(got.values()),
            "over": over,
            "buckets": buckets,
            "want": sorted(want),
        }
    # layout="model": transformers' in-memory names and fused experts, on every rank
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    held = dict(model.named_parameters())  # a tied head is the embedding (not streamed twice)
    held |= {n: b for n, b in model.state_dict().items() if n not in held and not n.endswith("lm_head.weight")}
    got = {
        n: n in held and torch.equal(t.cpu().float(), held[n])
        for b in hf_buckets(chunks, spec, bucket_bytes=bound, mode="broadcast", layout="model")
        for n, t in b
    }
    out["model"] = {"missing": sorted(set(held) - set(got))[:4], "equal": all(got.values())}
    return out


def stream_to_process(chunks, spec, hf: Path, ref: Path, out: Path) -> dict | None:
    """`mode="stage"` into a separate process (stream_receiver.py, started by rank 0): every rank
    connects, sends the buckets it receives as raw bytes after a JSON header, then `done`; the
    receiver loads them with transformers. Rank 0 returns the receiver's report."""
    import json
    import subprocess
    import sys
    import time
    from multiprocessing.connection import Client

    from megatron_bridge.stream import hf_buckets

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    port_file, report = out / "receiver.port", out / "receiver.json"
    receiver = None
    if rank == 0:
        script = str(Path(__file__).with_name("stream_receiver.py"))
        receiver = subprocess.Popen(
            [sys.executable, script, str(hf), str(ref), str(world), str(port_file), str(report)]
        )
        while not (port_file.exists() and port_file.read_text()):
            assert receiver.poll() is None, "the receiver ended before listening"
            time.sleep(0.05)
    port = [int(port_file.read_text()) if rank == 0 else 0]
    torch.distributed.broadcast_object_list(port, src=0)
    conn = Client(("127.0.0.1", port[0]), authkey=b"mbr-stream-test")
    bound = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters()) // 3
    for bucket in hf_buckets(chunks, spec, bucket_bytes=max(bound, 1), mode="stage"):
        for n, t in bucket:
            t = t.detach().cpu().contiguous()
            head = {"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
            conn.send_bytes(json.dumps(head).encode())
            conn.send_bytes(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    conn.send_bytes(b"done")
    conn.close()
    if receiver is None:
        return None
    assert receiver.wait(timeout=300) == 0
    return json.loads(report.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--cases", required=True)
    ap.add_argument("--train", default="")
    ap.add_argument(
        "--train-moe", default="", help="a MoE family trained at ep2·pp2 from HF and its Megatron checkpoints"
    )
    ap.add_argument(
        "--stream-hf", default="", help="family:layout,... built by the transformers backend, streamed only"
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab-divisor", type=int, default=64)  # the default recipe's, as training uses
    a = ap.parse_args()

    from megatron_bridge.backends.describe import describe_hf
    from megatron_bridge.bridge.hf_config import read_hf_config
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.weights import load_hf_weights
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.parity import ensure_groups
    from megatron_bridge.runtime.schedule import forward_logits
    from megatron_bridge.testing import report
    from megatron_bridge.train.init import load_initial_weights

    root = Path(a.root)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 4
    for case in a.cases.split(","):
        family, fmt, text = case.split(":")
        layout = Layout.parse(text)
        ensure_groups(layout, world)
        hf = root / family
        ckpt = root / "ckpt" / f"{family}-{fmt}-{text}"
        spec = describe_hf(read_hf_config(hf), make_vocab_size_divisible_by=a.vocab_divisor)  # auto: native or hf
        chunks = build_model(spec, layout, load_weights=True)
        load_initial_weights(chunks, spec, str(ckpt))
        ref_chunks = build_model(spec, layout, load_weights=True)
        load_hf_weights(ref_chunks, spec, hf)
        same = all(
            torch.equal(p, q)
            for c, r in zip(chunks, ref_chunks)
            for p, q in zip(c.state_dict().values(), r.state_dict().values())
            if torch.is_tensor(p)
        )
        ref = torch.load(root / "refs" / f"{family}.pt")
        logits = forward_logits(chunks, ref["input_ids"])
        res = {"params_equal": same, "stream": stream_check(chunks, spec, hf)}
        if logits is not None:
            v = ref["logits"].shape[-1]
            res["max_abs"] = float((logits[..., :v] - ref["logits"]).abs().max())
        report({case: res})

    for case in filter(None, a.stream_hf.split(",")):  # the transformers backend's exporter streams the same way
        family, text = case.split(":")
        layout = Layout.parse(text)
        ensure_groups(layout, world)
        hf = root / family
        spec = describe_hf(read_hf_config(hf), make_vocab_size_divisible_by=a.vocab_divisor, backend="transformers")
        chunks = build_model(spec, layout, load_weights=True)
        load_hf_weights(chunks, spec, hf)
        out = Path(a.out) / f"receiver-{family}-{text}"
        out.mkdir(exist_ok=True)
        received = stream_to_process(chunks, spec, hf, root / "refs" / f"{family}.pt", out)
        report({f"hf:{case}": {"stream": stream_check(chunks, spec, hf), "receiver": received}})

    if a.train:
        from megatron_bridge.train.runner import train

        hf = root / a.train
        common = [
            "recipe=default",
            "parallel.tp=2",
            "parallel.pp=2",
            "train.steps=2",
            "train.seq_length=32",
            "train.micro_batch_size=1",
            "train.global_batch_size=4",
            "optimizer.warmup_steps=1",
            "data=synthetic",
        ]
        jobs = {"hf": [f"model.hf_path={hf}"]}
        for fmt in ("torch_dist", "torch"):
            ckpt = root / "ckpt" / f"{a.train}-{fmt}-tp2pp2"
            jobs[fmt] = [f"model.hf_path={ckpt}", f"train.init_from={ckpt}"]
        ck = root / "ckpt"
        if (ck / f"{a.train}-mlm_dist-tp2pp2").is_dir():  # Megatron-LM checkpoints (described by the HF
            # directory): torch_dist, per-rank tp2 files, and the first's `mbr reshard`
            for name in ("mlm_dist", "mlm_torch"):
                jobs[name] = [f"model.hf_path={hf}", f"train.init_from={ck / f'{a.train}-{name}-tp2pp2'}"]
            resharded = ck / f"{a.train}-mlm_reshard-tp2pp2"
            jobs["mlm_reshard"] = [f"model.hf_path={resharded}", f"train.init_from={resharded}"]
        moe = ["parallel.tp=1", "parallel.ep=2", "parallel.pp=2"]  # after `common`: the last value wins
        if a.train_moe:  # a MoE model from HF, from its TE-named torch_dist and from that one's reshard
            hf_moe = root / a.train_moe
            jobs["moe_hf"] = [*moe, f"model.hf_path={hf_moe}"]
            jobs["moe_mlm"] = [
                *moe,
                f"model.hf_path={hf_moe}",
                f"train.init_from={ck / f'{a.train_moe}-mlm_te-ep2pp2'}",
            ]
            resharded = ck / f"{a.train_moe}-mlm_reshard-ep2pp2"
            jobs["moe_mlm_reshard"] = [*moe, f"model.hf_path={resharded}", f"train.init_from={resharded}"]
        losses = {}
        for name, extra in jobs.items():
            run_dir = Path(a.out) / name
            assert train([*common, *extra, f"run_dir={run_dir}"], finalize=False) == 0
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists():
                losses[name] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
        if losses:
            report({"losses": losses})
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
