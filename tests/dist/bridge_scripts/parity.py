"""One torchrun launch, many (layout, family) parity checks: see tests/dist/test_bridge_parity.py.

    torchrun --nproc-per-node 4 tests/dist/bridge_scripts/parity.py --root DIR \
        --families llama,qwen3 --layouts tp2,pp2vpp2,cp2tp2:logits+grads --checks logits --out OUT

DIR holds one tiny HF model per family (DIR/<family>) and its transformers reference
(DIR/refs/<family>.pt: input_ids, labels, logits, loss, grads). A layout may name its own
checks after a colon (default --checks). Layouts with ep > 1 run for MoE families only;
--skip names family/layout pairs a rule refuses; --backend describes every model as
`model.backend` does (hf: transformers' own modeling code, tests/dist/test_transformers_backend_parity.py).
Every rank reports
{"<family>/<layout>/<check>": findings} through megatron_bridge.testing.report.
"""

import argparse
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--families", required=True)
    ap.add_argument("--layouts", required=True)
    ap.add_argument("--checks", default="logits")
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip", default="", help="family/layout pairs the rules refuse (comma-separated)")
    ap.add_argument("--backend", default="auto", help="model.backend: auto | native | hf")
    a = ap.parse_args()

    from megatron_bridge.backends.describe import describe_hf
    from megatron_bridge.bridge.hf_config import read_hf_config
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.parity import check_layout
    from megatron_bridge.testing import report

    root = Path(a.root)
    families = a.families.split(",")
    refs = {f: torch.load(root / "refs" / f"{f}.pt") for f in families}
    moe = {f: describe_hf(read_hf_config(root / f), backend=a.backend).is_moe for f in families}
    for item in a.layouts.split(","):
        text, _, only = item.partition(":")
        checks = (only or a.checks).replace("+", ",").split(",")
        layout = Layout.parse(text)
        for fam in families:
            if layout.ep > 1 and not moe[fam] or f"{fam}/{text}" in a.skip.split(","):
                continue
            t0 = time.perf_counter()
            ref = refs[fam]
            res = check_layout(
                root / fam,
                layout,
                checks,
                ref=ref,
                input_ids=ref["input_ids"],
                labels=ref["labels"],
                export_dir=Path(a.out) / fam / text,
                backend=a.backend,
            )
            res["seconds"] = round(time.perf_counter() - t0, 3)
            report({f"{fam}/{text}": res})
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
