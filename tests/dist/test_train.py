"""The training entry point under real torchrun/gloo: loss parity across layouts and
engines, exact resume, and launch-time refusals.

All layouts start from the same tiny HF Llama (through the bridge) and read the same seeded
synthetic global batches, so the per-step losses of a layout must equal the single-process
run's. Tolerance: fp32 on CPU, the layouts differ only in the order of reductions (TP
all-reduce, DP gradient averaging, pipeline loss accumulation), ~1e-7 relative per op; over
5 Adam steps we allow 2e-5 relative — far below the ~1e-2 change a wrong shard, a missed
gradient reduction or a dropped micro-batch produces.
"""

import json

import pytest

from megatron_bridge.runtime.tiny import make_tiny
from megatron_bridge.testing import run_torchrun

pytestmark = pytest.mark.dist
SCRIPT = "tests/dist/train_scripts/layouts.py"
STEPS = 5
REL = 2e-5


def common(hf):
    return [
        f"model.hf_path={hf}",
        f"train.steps={STEPS}",
        "train.seq_length=32",
        "train.micro_batch_size=2",  # 4 micro-batches of the global 8 at dp1: accumulation kept, half the steps' cost
        "train.global_batch_size=8",
        "optimizer.warmup_steps=2",
        "optimizer.lr=3e-3",
        "data=synthetic",
    ]


def job(name, hf, *overrides):
    return f"{name}:" + ",".join(["recipe=default", *common(hf), *overrides])


def assert_close(ref, got, name):
    assert ref.keys() == got.keys(), name
    for step in ref:
        assert abs(got[step] - ref[step]) <= REL * abs(ref[step]), (name, step, ref[step], got[step])


def transformers_loss(hf, step=1, gbs=8, seq=32, seed=1234):
    """transformers' mean token loss on the synthetic global batch of `step` (samples
    (step-1)·gbs … step·gbs-1), with its router aux loss where the config asks for it (the mean of
    the micro-batches', one sample each): the oracle for a transformers-backend run's loss before any update."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_bridge.train.data.synthetic import SyntheticGPTDataset

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    data = SyntheticGPTDataset(step * gbs, seq, model.config.vocab_size, seed)
    batch = [data[i] for i in range((step - 1) * gbs, step * gbs)]
    tokens, labels = (torch.stack([b[k] for b in batch]) for k in ("tokens", "labels"))
    with torch.no_grad():
        out = model(input_ids=tokens)
        loss = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), labels.flatten())
        if (
            getattr(out, "aux_loss", None) is not None
        ):  # output_router_logits: its load-balancing loss per one-sample micro-batch
            loss += model.router_aux_loss_coef * torch.stack([model(input_ids=t[None]).aux_loss for t in tokens]).mean()
    return float(loss)


@pytest.fixture(scope="module")
def cohere(tmp_path_factory):
    """An architecture with no native family (the transformers backend: per-head q/k norms, logit scale,
    parallel block, tied embeddings)."""
    return make_tiny("cohere", tmp_path_factory.mktemp("hf") / "cohere")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="module")
def reference(llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    res = run_torchrun([SCRIPT, str(out), job("tp1", llama, "parallel.tp=1", "parallel.pp=1")], nproc=1, timeout=400)
    losses = res[0]["losses"]["tp1"]
    assert len(losses) == STEPS and all(l == l for l in losses.values())
    assert losses[str(STEPS)] < losses["1"]  # it learns (random tokens: it can only approach ln(vocab))
    return losses


def test_megatron_layouts_match_single_process(llama, reference, tmp_path):
    jobs = [
        job("tp2pp2", llama, "parallel.tp=2", "parallel.pp=2"),
        # vocab 250 pads to 512 at tp4 (256 at tp1): padded logits are masked, so the loss is the same
        job("tp4_kv2", llama, "parallel.tp=4"),
        job("tp2_dp2_zero1", llama, "parallel.tp=2", "zero.stage=1"),
        job("pp2vpp2", llama, "parallel.pp=2", "parallel.vpp=2"),
        job("cp2_dp2", llama, "parallel.cp=2"),
        job("tp2sp_cp2", llama, "parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true"),
        job("tp2pp2_recompute_full", llama, "parallel.tp=2", "parallel.pp=2", "train.recompute=full"),
        job("tp2_recompute_selective", llama, "parallel.tp=2", "train.recompute=selective"),
        job("tp2pp2_bf16", llama, "parallel.tp=2", "parallel.pp=2", "train.precision=bf16"),
    ]
    res = run_torchrun([SCRIPT, str(tmp_path), *jobs], nproc=4, timeout=900)
    losses = res[0]["losses"]
    for name in (
        "tp2pp2",
        "tp4_kv2",
        "tp2_dp2_zero1",
        "pp2vpp2",
        "cp2_dp2",
        "tp2sp_cp2",
        "tp2pp2_recompute_full",
        "tp2_recompute_selective",
    ):
        assert_close(reference, losses[name], name)
    # bf16 weights/activations (fp32 master and grads): ~3 significant digits on the loss
    for step, ref in reference.items():
        assert abs(losses["tp2pp2_bf16"][step] - ref) <= 2e-3 * abs(ref), (step, ref, losses["tp2pp2_bf16"][step])


def test_deepspeed_zero_stages_match_single_process(llama, cohere, reference, tmp_path):
    jobs = [job(f"ds_zero{z}", llama, "train.engine=deepspeed", f"zero.stage={z}") for z in (1, 2, 3)]
    jobs.append(job("ds_tp2_zero1", llama, "train.engine=deepspeed", "zero.stage=1", "parallel.tp=2"))
    # resume through DeepSpeed's own checkpoint files (Engine.write_extra), ZeRO-3 partitions included
    ck = tmp_path / "ds_ckpt"
    z3 = ["train.engine=deepspeed", "zero.stage=3", f"checkpoint.dir={ck}"]
    jobs.append(job("ds_zero3_first3", llama, *z3, "train.exit_after=3", "checkpoint.save_interval=3"))
    jobs.append(job("ds_zero3_resumed", llama, *z3, "checkpoint.resume=true"))
    # the transformers backend under ZeRO-2 at dp2 (Cohere: no native family): transformers' loss, exact resume
    hf = ["train.engine=deepspeed", "zero.stage=2", "model.backend=transformers"]
    hck = tmp_path / "hf_ds_ckpt"
    jobs.append(job("hf_zero2", cohere, *hf))
    jobs.append(job("hf_zero2_first3", cohere, *hf, "train.exit_after=3", f"checkpoint.dir={hck}",
                    "checkpoint.save_interval=3"))  # fmt: skip
    jobs.append(job("hf_zero2_resumed", cohere, *hf, f"checkpoint.dir={hck}", "checkpoint.resume=true"))
    res = run_torchrun([SCRIPT, str(tmp_path), *jobs], nproc=2, timeout=900)
    losses = res[0]["losses"]
    assert abs(losses["hf_zero2"]["1"] - transformers_loss(cohere)) < 1e-5
    assert losses["hf_zero2_first3"] | losses["hf_zero2_resumed"] == losses["hf_zero2"]  # bit-exact
    for z in (1, 2, 3):
        assert_close(reference, losses[f"ds_zero{z}"], f"zero{z}")
    assert_close(reference, losses["ds_tp2_zero1"], "ds_tp2_zero1")
    first, resumed = losses["ds_zero3_first3"], losses["ds_zero3_resumed"]
    assert sorted(map(int, first)) == [1, 2, 3] and sorted(map(int, resumed)) == [4, 5], (first, resumed)
    assert (ck / "iter_0000003" / "deepspeed").is_dir()
    for step in map(str, range(1, 6)):
        assert (first | resumed)[step] == losses["ds_zero3"][step], step  # bit-exact


def test_moe_ep2_matches_ep1(tmp_path_factory, tmp_path):
    hf = make_tiny("mixtral", tmp_path_factory.mktemp("hf") / "mixtral")
    ref = run_torchrun([SCRIPT, str(tmp_path / "r"), job("ep1", hf)], nproc=1, timeout=400)[0]["losses"]["ep1"]
    res = run_torchrun(
        [
            SCRIPT,
            str(tmp_path / "p"),
            job("ep2", hf, "parallel.ep=2"),
            job("ep2tp2", hf, "parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"),
        ],
        nproc=4,
        timeout=600,
    )
    assert_close(ref, res[0]["losses"]["ep2"], "ep2")
    assert_close(ref, res[0]["losses"]["ep2tp2"], "ep2tp2")


def test_resume_reproduces_uninterrupted_run_and_hf_backend_trains(llama, cohere, tmp_path_factory, tmp_path):
    """Resume is bit-exact (native Llama), and in the same launch the transformers backend trains at
    tp2·pp2 with the distributed optimizer: Qwen3 forced onto hf follows its native run step for
    step (its q/k norms are `replicated_with_grad_allreduce`), also at tp2·cp2, Cohere (no native family) starts at
    transformers' loss, resumes bit-exactly, and its export loads in transformers and in a new run
    at transformers' loss; Qwen3-MoE on hf at ep2 with transformers' aux loss switched on (a large
    coefficient, so a missing term shows) starts at transformers' loss incl. the aux term, follows
    its ep1 run (expert and router gradients over EP) and resumes bit-exactly."""
    ck = tmp_path / "ckpt"
    base = ["parallel.tp=2", "parallel.pp=2", "zero.stage=1", "train.steps=10"]
    qwen3 = make_tiny("qwen3", tmp_path_factory.mktemp("hf") / "qwen3")
    hf = [*base[:3], "model.backend=transformers"]
    hck, e1, e2 = tmp_path / "hf_ckpt", tmp_path / "export_full", tmp_path / "export_resumed"
    hck1, hck2 = tmp_path / "hf_ckpt_tp1pp2", tmp_path / "hf_ckpt_back"
    moe = make_tiny("qwen3_moe", tmp_path_factory.mktemp("hf") / "qwen3_moe", output_router_logits=True,
                    router_aux_loss_coef=0.5)  # fmt: skip
    # one sample per micro-batch: transformers_loss' aux term is the mean of one-sample micro-batches'
    mck, moe_hf = tmp_path / "moe_ckpt", ["model.backend=transformers", "train.steps=3", "train.micro_batch_size=1"]
    mck4 = tmp_path / "moe_ckpt_ep4"
    jobs = [
        job("full", llama, *base),
        # checkpoint.async_save: saves at 2, 4 and 5 written in the background, published at later
        # step boundaries (the last before the job ends); the sync path: the crash suite, ZeRO, hf
        job(
            "first5",
            llama,
            *base,
            "train.exit_after=5",
            f"checkpoint.dir={ck}",
            "checkpoint.save_interval=2",
            "checkpoint.async_save=true",
        ),  # fmt: skip
        job("resumed", llama, *base, f"checkpoint.dir={ck}", "checkpoint.resume=true", "checkpoint.async_save=true"),
        job("qwen3_native", qwen3, *base[:3], "model.backend=native"),
        job("qwen3_hf", qwen3, *hf),
        # context parallelism on hf (runtime/transformers/cp.py) at tp2·cp2, 2 steps (CI time): the loss and
        # gradient norm of the native run's first two batches (step 1's warmup lr is 0)
        job(
            "qwen3_hf_cp2",
            qwen3,
            "parallel.tp=2",
            "parallel.cp=2",
            "zero.stage=1",
            "model.backend=transformers",
            "train.steps=2",
        ),  # fmt: skip
        # an HF export every step, written behind the loop (a 64 KiB queue: the step waits on it)
        job(
            "cohere_full", cohere, *hf, f"export_to={e1}", "train.export_interval=1", "train.export_buffer_bytes=65536"
        ),
        # the same, stopped after 3 (train.exit_after: interval exports only) and resumed into the same
        # export_to, which then holds iter_1..5 and the end-of-run export
        job(
            "cohere_first3",
            cohere,
            *hf,
            "train.exit_after=3",
            f"checkpoint.dir={hck}",
            "checkpoint.save_interval=3",
            f"export_to={e2}",
            "train.export_interval=1",
        ),  # fmt: skip
        job(
            "cohere_resumed",
            cohere,
            *hf,
            f"checkpoint.dir={hck}",
            "checkpoint.resume=true",
            f"export_to={e2}",
            "train.export_interval=1",
        ),  # fmt: skip
        # its step-3 checkpoint resharded to tp1·pp2 (dp2), optimizer state included, resumed there
        # for steps 4-5; then that step 3 resharded back to tp2·pp2
        mbr_job(
            "reshard",
            f"src={hck / 'iter_0000003'}",
            f"dst={hck1}",
            *common(cohere),
            "zero.stage=1",
            "parallel.tp=1",
            "parallel.pp=2",
        ),  # fmt: skip
        job(
            "cohere_tp1pp2",
            cohere,
            "parallel.tp=1",
            "parallel.pp=2",
            "zero.stage=1",
            "model.backend=transformers",
            f"checkpoint.dir={hck1}",
            "checkpoint.resume=true",
        ),  # fmt: skip
        mbr_job("reshard", f"src={hck1 / 'iter_0000003'}", f"dst={hck2}", *common(cohere), *base[:3]),
        job("cohere_from_export", e1, *hf, "train.steps=1", "optimizer.warmup_steps=1"),
        job("moe_ep1", moe, *moe_hf),
        job("moe_ep2", moe, *moe_hf, "parallel.ep=2"),
        job(
            "moe_ep2_first2",
            moe,
            *moe_hf,
            "parallel.ep=2",
            "train.exit_after=2",
            f"checkpoint.dir={mck}",
            "checkpoint.save_interval=2",
        ),  # fmt: skip
        job("moe_ep2_resumed", moe, *moe_hf, "parallel.ep=2", f"checkpoint.dir={mck}", "checkpoint.resume=true"),
        # its step-2 checkpoint resharded from ep2 (the plain optimizer) to ep4 (the distributed one), resumed
        mbr_job(
            "reshard",
            f"src={mck / 'iter_0000002'}",
            f"dst={mck4}",
            *common(moe),
            *moe_hf,
            "parallel.ep=4",
            "zero.stage=1",
        ),  # fmt: skip
        job(
            "moe_ep4_resumed",
            moe,
            *moe_hf,
            "parallel.ep=4",
            "zero.stage=1",
            f"checkpoint.dir={mck4}",
            "checkpoint.resume=true",
        ),  # fmt: skip
    ]
    res = run_torchrun([SCRIPT, str(tmp_path / "runs"), *jobs], nproc=4, timeout=900)
    losses = res[0]["losses"]
    assert_close(losses["qwen3_native"], losses["qwen3_hf"], "qwen3 hf vs native")
    assert losses["qwen3_hf"][str(STEPS)] < losses["qwen3_hf"]["1"]  # it learns
    for what in ("losses", "grad_norms"):
        native = {k: res[0][what]["qwen3_native"][k] for k in ("1", "2")}
        assert_close(native, res[0][what]["qwen3_hf_cp2"], f"qwen3 hf cp2 {what}")
    assert abs(losses["cohere_full"]["1"] - transformers_loss(cohere)) < 1e-5
    first, again = losses["cohere_first3"], losses["cohere_resumed"]
    assert sorted(map(int, first)) == [1, 2, 3] and sorted(map(int, again)) == [4, 5], (first, again)
    assert first | again == losses["cohere_full"]  # bit-exact
    _assert_same_export(e1, e2, cohere)
    # train.export_interval: every step's export published (none left .tmp); the last step's is
    # the end-of-run export; step 2's export holds step 2's weights although steps 3-5 trained
    # while it was written: transformers' loss with it on step 3's batch is the run's step-3 loss
    assert sorted(p.name for p in e1.iterdir() if p.is_dir()) == [f"iter_{i:07d}" for i in range(1, STEPS + 1)]
    assert sorted(p.name for p in e2.iterdir() if p.is_dir()) == [f"iter_{i:07d}" for i in range(1, STEPS + 1)]
    _assert_same_export(e1 / f"iter_{STEPS:07d}", e2, cohere)
    _assert_same_export(e1 / "iter_0000003", e2 / "iter_0000003", cohere)  # before the stop
    _assert_same_export(e1 / "iter_0000004", e2 / "iter_0000004", cohere)  # after the resume
    assert abs(transformers_loss(e1 / "iter_0000002", step=3) - losses["cohere_full"]["3"]) < 1e-5
    assert abs(losses["cohere_from_export"]["1"] - transformers_loss(e1)) < 1e-5
    assert abs(losses["moe_ep2"]["1"] - transformers_loss(moe)) < 1e-5
    assert_close(losses["moe_ep1"], losses["moe_ep2"], "moe ep2 vs ep1")
    assert losses["moe_ep2_first2"] | losses["moe_ep2_resumed"] == losses["moe_ep2"]  # bit-exact
    # resharded checkpoints resume with the optimizer state the run had: the next losses within 1e-5
    for name, ref in (("cohere_tp1pp2", "cohere_full"), ("moe_ep4_resumed", "moe_ep2")):
        got = losses[name]
        assert got and all(abs(got[k] - losses[ref][k]) < 1e-5 for k in got), (name, got, losses[ref])
    assert sorted(map(int, losses["cohere_tp1pp2"])) == [4, 5] and sorted(map(int, losses["moe_ep4_resumed"])) == [3]
    _assert_resharded_back(hck, hck1, hck2, cohere, tmp_path)
    full, first, resumed = losses["full"], losses["first5"], losses["resumed"]
    assert sorted(map(int, first)) == [1, 2, 3, 4, 5] and sorted(map(int, resumed)) == [6, 7, 8, 9, 10]
    # the training thread's time in saves / exports, on the line after each (snapshots at 2 and 4)
    rows = {r["step"]: r for r in map(json.loads, (tmp_path / "runs/first5/metrics.jsonl").read_text().splitlines())}
    assert rows[3]["save_s"] > 0 and rows[5]["save_s"] > 0 and "save_s" not in rows[2], rows
    exports = [json.loads(x) for x in (tmp_path / "runs/cohere_full/metrics.jsonl").read_text().splitlines()]
    assert all(r["export_s"] > 0 and "export_wait_s" in r for r in exports[1:]), exports
    for step in map(str, range(6, 11)):
        assert resumed[step] == full[step], (step, full[step], resumed[step])  # bit-exact
    for step in map(str, range(1, 6)):
        assert first[step] == full[step]
    from megatron_bridge.train import manifest

    assert sorted(p.name for p in ck.glob("iter_*")) == [f"iter_{i:07d}" for i in (2, 4, 5, 10)]
    for i in (2, 4, 5, 10):  # every published one is complete: 4 rank files, checksums right
        assert len(manifest.verify(manifest.iter_dir(ck, i))["files"]) == 4


def mbr_job(name, *argv):
    """A job of the launch that runs `mbr NAME ARGV...` on rank 0 (layouts.py)."""
    return f"{name}:" + ",".join(["mbr", name, "recipe=default", "progress=off", *map(str, argv)])


def _assert_resharded_back(original, resharded, back, hf, tmp_path):
    """tp2·pp2 -> tp1·pp2 -> tp2·pp2: every rank's model and optimizer state back bit for bit, and
    `mbr export` of all three the same HF tensors."""
    import torch
    from safetensors.torch import load_file

    from megatron_bridge.cli import main as mbr
    from megatron_bridge.convert.formats.pickle_guard import TRAINING
    from megatron_bridge.runtime.safe_load import torch_load

    step3 = original / "iter_0000003"
    for r in range(4):
        a, b = (torch_load(d / f"rank_{r:05d}.pt", TRAINING) for d in (step3, back / "iter_0000003"))
        ma, mb = a["engine"]["model"][0], b["engine"]["model"][0]
        assert ma.keys() == mb.keys()  # megatron's linears' `_extra_state` (None) included
        assert all(torch.equal(ma[k], mb[k]) if torch.is_tensor(ma[k]) else ma[k] is mb[k] is None for k in ma)
        na, nb = ({k: v for st in s["engine"]["optimizer"] for k, v in st["named"].items()} for s in (a, b))
        assert na.keys() == nb.keys(), r
        for name in na:
            assert na[name]["range"] == nb[name]["range"], (r, name)
            assert all(torch.equal(na[name][k], nb[name][k]) for k in na[name] if k not in ("range", "shape")), (
                r,
                name,
            )
    exports = []
    for i, src in enumerate((step3, resharded / "iter_0000003", back)):
        out = tmp_path / f"export_{i}"
        assert mbr(["export", f"src={src}", f"dst={out}", f"model.hf_path={hf}", "progress=off"]) == 0
        exports.append({k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()})
    for other in exports[1:]:
        assert other.keys() == exports[0].keys() and all(torch.equal(other[k], exports[0][k]) for k in other)


def test_validation_loss_is_layout_independent_and_leaves_training_alone(tmp_path_factory, tmp_path):
    """`val_loss` (train.eval_iters global batches of the valid split, docs/train.md "Validation"):
    - the same weights give the same value at tp1·dp4, tp2·pp2, cp2·dp2 and DeepSpeed
      ZeRO-3·dp4 (lr=1e-30 keeps the weights at the HF start; only the reduction order differs, so
      1e-6 relative);
    - it is logged every train.eval_interval steps and at the end (eval_interval=0: the end only),
      and the same batches are read every time (frozen weights: bit-identical values);
    - the model has attention dropout, so an evaluation that drew from the RNG, left dropout on
      or touched the data order, gradients, optimizer or schedule would change the training
      losses: with evaluation they equal those without, bit for bit, on both engines. Dropout
      also differs per layout, so equal val_loss across layouts also shows eval mode."""
    hf = make_tiny("llama", tmp_path_factory.mktemp("hf") / "llama_dropout", attention_dropout=0.1)
    ev, frozen = (
        ["train.eval_interval=2", "train.eval_iters=2"],
        ["optimizer.lr=1e-30", "optimizer.min_lr=0"],
    )  # lr=0 is refused; 1e-30 moves no fp32 weight
    tp2pp2, ds = ["parallel.tp=2", "parallel.pp=2"], ["train.engine=deepspeed", "zero.stage=3"]
    mlruns = tmp_path / "mlruns"
    loggers = [
        "logger.wandb.enabled=false",
        "logger.tensorboard.enabled=false",
        "logger.mlflow.enabled=true",
        f"logger.mlflow.tracking_uri=file:{mlruns}",
    ]
    jobs = [
        job("tp1", hf, *ev, *frozen),
        job("tp2pp2", hf, *ev, *frozen, *tp2pp2),
        job("cp2_dp2", hf, *ev, *frozen, "parallel.cp=2"),
        job("ds_zero3", hf, "train.eval_iters=2", *frozen, *ds),
        job("tp2pp2_train", hf, *ev, *tp2pp2),
        # also the logger group on a real run (docs/train.md "Loggers"): wandb and TensorBoard off,
        # MLflow to a file store
        job("tp2pp2_train_noeval", hf, *tp2pp2, *loggers),
        job("ds_zero3_train", hf, *ev, *ds),
        job("ds_zero3_train_noeval", hf, *ds),
    ]
    res = run_torchrun([SCRIPT, str(tmp_path), *jobs], nproc=4, timeout=900)[0]
    val, losses = res["val_losses"], res["losses"]
    for name in ("tp1", "tp2pp2", "cp2_dp2", "tp2pp2_train", "ds_zero3_train"):
        assert sorted(map(int, val[name])) == [2, 4, 5], (name, val[name])  # every 2 steps and the end
    assert list(val["ds_zero3"]) == ["5"] and not val["tp2pp2_train_noeval"] and not val["ds_zero3_train_noeval"]
    ref = val["tp1"]["2"]
    assert all(len(set(val[name].values())) == 1 for name in ("tp1", "tp2pp2", "cp2_dp2")), val
    for name in ("tp2pp2", "cp2_dp2", "ds_zero3"):
        got = val[name]["5"]
        assert abs(got - ref) <= 1e-6 * abs(ref), (name, ref, got)
    for name in ("tp2pp2_train", "ds_zero3_train"):
        assert losses[name] == losses[f"{name}_noeval"], name  # bit for bit
        assert val[name]["5"] < val[name]["2"] != ref, (name, val[name])  # it evaluates the trained weights
    assert (tmp_path / "tp2pp2_train" / "tensorboard").is_dir()  # the default: TensorBoard on
    assert not {"wandb", "tensorboard"} & {p.name for p in (tmp_path / "tp2pp2_train_noeval").iterdir()}
    (loss,) = mlruns.rglob("metrics/loss")
    logged = {line.split()[2]: float(line.split()[1]) for line in loss.read_text().splitlines()}
    assert logged == losses["tp2pp2_train_noeval"]  # MLflow got every step's loss


def _assert_same_export(e1, e2, source):
    """Two exports of the same trained weights are equal tensor for tensor, differ from the
    untrained source, and load in transformers with no missing or unexpected keys."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    def tensors(d):
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    a, b, src = tensors(e1), tensors(e2), tensors(source)
    assert a.keys() == b.keys() == src.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], src[k]) for k in a)  # trained
    _, info = AutoModelForCausalLM.from_pretrained(e1, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
