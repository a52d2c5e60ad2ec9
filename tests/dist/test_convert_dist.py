"""Converted checkpoints in real megatron-core models: one 4-process torchrun launch (gloo).

`mbr convert` runs here, in the test process (one CPU process, no process group); the
launch then loads every output the way training does (`train.init_from`) at tp2·pp2
(dense, tied and untied), pp2·vpp2 and ep2·pp2 (homogeneous and mixed MoE stacks) — native
models and transformers-backed ones (transformers' modules: Cohere tied at tp2·pp2, dots.llm1's experts
at ep2·pp2) —, and
checks: every parameter bitwise equal to the bridge's online load of the HF directory,
logits equal to transformers' (fp32), weights streamed by `megatron_bridge.stream` in both
modes equal to the HF directory's tensors (per stage: once over the receiving ranks;
broadcast: on every rank) — and, for the transformers backend's tp2·pp2 dense and ep2·tp2 MoE cases,
streamed into a separate process (convert_scripts/stream_receiver.py) whose transformers
model then gives the reference logits —, and 2 training steps from either format reproducing the
HF-initialized run's losses exactly. torch_dist checkpoints are always written for
tp1·pp1, so their loads are megatron-core resharding on load — including to another vocab
padding (one is written unpadded, 250 rows, and loaded into the 256-row embedding).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_bridge.cli import main as mbr
from megatron_bridge.testing import run_torchrun

pytestmark = pytest.mark.dist

SCRIPT = str(Path(__file__).parent / "convert_scripts" / "load_parity.py")
TOL = 1e-5
LAYOUT_ARGS = {
    "tp2pp2": ["parallel.tp=2", "parallel.pp=2"],
    "pp2vpp2": ["parallel.pp=2", "parallel.vpp=2"],
    "ep2pp2": ["parallel.ep=2", "parallel.pp=2"],
}
# streamed only (megatron_bridge.stream), built by the transformers backend: transformers' modules, experts
# gathered over EP and split over TP
STREAM_HF = ["llama:tp2pp2", "qwen3_moe:ep2tp2"]
CASES = [
    ("llama", "tp2pp2"),
    ("llama", "pp2vpp2"),
    ("qwen2", "tp2pp2"),
    ("mixtral", "ep2pp2"),
    ("qwen2_moe", "ep2pp2"),
    # the transformers backend (transformers' modules): a tied dense model, experts stacked from per-expert tensors
    ("cohere", "tp2pp2"),
    ("dots1", "ep2pp2"),
]
# checkpoints megatron-core / Megatron-LM wrote (tests/megatron_ckpts.py), loaded through `train.init_from`
# at another layout: torch_dist by `dist_checkpointing.save` (local spec; TE names with shared experts),
# per-rank tp2 files with TE names, and `mbr reshard` of the first into per-rank tp2·pp2 files
MEGATRON = [
    "llama:mlm_dist:tp2pp2",
    "llama:mlm_torch:tp2pp2",
    "qwen2_moe:mlm_te:ep2pp2",
    "llama:mlm_reshard:tp2pp2",
    "qwen2_moe:mlm_reshard:ep2pp2",
]
HF_CATALOGUE = {"dots1"}  # built by runtime/hf_tiny.py (the transformers backend's catalogue), not runtime/tiny.py


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    from megatron_bridge.runtime import hf_tiny, tiny
    from megatron_bridge.runtime.parity import hf_reference, make_batch

    base = tmp_path_factory.mktemp("convert")
    (base / "refs").mkdir()
    for fam in sorted({f for f, _ in CASES} | {c.split(":")[0] for c in STREAM_HF}):
        hf = (hf_tiny if fam in HF_CATALOGUE else tiny).make_tiny(fam, base / fam)
        ids, _ = make_batch(250)
        torch.save(dict(input_ids=ids, **hf_reference(hf, ids)), base / "refs" / f"{fam}.pt")
    for fam, layout in CASES:
        for fmt in ("torch_dist", "torch"):
            args = LAYOUT_ARGS[layout] if fmt == "torch" else []  # torch_dist: written for tp1·pp1
            assert (
                mbr(
                    [
                        "convert",
                        f"src={base / fam}",
                        f"dst={base / 'ckpt' / f'{fam}-{fmt}-{layout}'}",
                        f"format={fmt}",
                        "progress=off",
                        *args,
                    ]
                )
                == 0
            )
    assert (
        mbr(
            [
                "convert",
                f"src={base / 'llama'}",
                f"dst={base / 'ckpt' / 'llama-torch_dist_pad-tp2pp2'}",
                "model.make_vocab_size_divisible_by=2",
                "progress=off",
            ]
        )
        == 0
    )
    from tests import megatron_ckpts as mc

    ck = base / "ckpt"
    mc.write_dists(
        [
            (base / "llama", ck / "llama-mlm_dist-tp2pp2", {}),
            (base / "qwen2_moe", ck / "qwen2_moe-mlm_te-ep2pp2", {"te_names": True}),
        ]
    )
    mc.write_torch(base / "llama", ck / "llama-mlm_torch-tp2pp2", tp=2)
    assert (
        mbr(
            [
                "reshard",
                f"src={ck / 'llama-mlm_dist-tp2pp2'}",
                f"dst={ck / 'llama-mlm_reshard-tp2pp2'}",
                f"model.hf_path={base / 'llama'}",
                "parallel.tp=2",
                "parallel.pp=2",
                "progress=off",
            ]
        )
        == 0
    )
    assert (
        mbr(
            [
                "reshard",
                f"src={ck / 'qwen2_moe-mlm_te-ep2pp2'}",
                f"dst={ck / 'qwen2_moe-mlm_reshard-ep2pp2'}",
                f"model.hf_path={base / 'qwen2_moe'}",
                "parallel.ep=2",
                "parallel.pp=2",
                "progress=off",
            ]
        )
        == 0
    )
    return base


def test_converted_checkpoints_load_exactly_and_train(root, tmp_path):
    cases = [f"{fam}:{fmt}:{layout}" for fam, layout in CASES for fmt in ("torch_dist", "torch")]
    cases.append("llama:torch_dist_pad:tp2pp2")  # stored vocab 250 rows, the model pads to 256
    cases += MEGATRON
    results = run_torchrun(
        [
            SCRIPT,
            "--root",
            str(root),
            "--cases",
            ",".join(cases),
            "--train",
            "llama",
            "--train-moe",
            "qwen2_moe",
            "--stream-hf",
            ",".join(STREAM_HF),
            "--out",
            str(tmp_path),
        ],
        nproc=4,
        timeout=600,
    )
    for case in [*cases, *(f"hf:{c}" for c in STREAM_HF)]:
        per_rank = [r[case] for r in results if case in r]
        assert len(per_rank) == 4, case
        if not case.startswith("hf:"):
            assert all(r["params_equal"] for r in per_rank), f"{case}: parameters differ from the HF load"
            got = [r["max_abs"] for r in per_rank if "max_abs" in r]
            assert got and max(got) <= TOL, (case, got)
        # megatron_bridge.stream: every HF tensor bit-exact, buckets within the bound; "stage"
        # covers the model once over the receiving ranks, "broadcast" gives every rank all of it
        streams = [r["stream"] for r in per_rank]
        want = streams[0]["stage"]["want"]
        for mode in ("stage", "broadcast"):
            assert all(s[mode]["equal"] and s[mode]["over"] == 0 for s in streams), (case, mode)
        assert sorted({n for s in streams for n in s["stage"]["names"]}) == want, case
        assert all(s["broadcast"]["names"] == want and s["broadcast"]["buckets"] >= 7 for s in streams), case
        assert all(s["model"]["equal"] and not s["model"]["missing"] for s in streams), (case, streams[0]["model"])
        if case.startswith("hf:"):  # "stage" into a separate process's transformers model (stream_receiver.py)
            (got,) = [r["receiver"] for r in per_rank if r["receiver"] is not None]
            assert got["tensors"] == len(want) and got["max_abs"] <= TOL, (case, got)
    losses = next(r["losses"] for r in results if "losses" in r)
    assert len(losses["hf"]) == 2
    assert losses["torch_dist"] == losses["hf"] and losses["torch"] == losses["hf"], losses
    # Megatron-LM checkpoints (torch_dist; per-rank tp2 files; the first's reshard) start the HF run
    for name, ref in [(n, "hf") for n in ("mlm_dist", "mlm_torch", "mlm_reshard")] + [
        (n, "moe_hf") for n in ("moe_mlm", "moe_mlm_reshard")
    ]:
        assert len(losses[name]) == 2 and max(abs(a - b) for a, b in zip(losses[name], losses[ref])) <= TOL, losses
