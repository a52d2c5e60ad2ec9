"""`mbr export`: an `mbr convert` / `mbr reshard` output -> a Hugging Face model directory.

    mbr export src=OUT dst=HF_DIR [dtype=source|bf16|fp32] [max_shard_gb=5] [overwrite=true]

Writes model-0000i-of-0000n.safetensors + model.safetensors.index.json, config.json and
the tokenizer files kept at conversion; the result loads with
`transformers.AutoModelForCausalLM.from_pretrained`. Every tensor is rebuilt with the
bridge's mapping and checked against the CRC-32 recorded at conversion, so a round trip
HF -> convert -> export is bit-exact or fails loudly. See docs/convert.md.
"""

from __future__ import annotations

from typing import Sequence

from megatron_bridge.config.compose import compose, to_yaml


def main(argv: Sequence[str]) -> int:
    from megatron_bridge.convert import read_ahead_source, use_huge_pages

    use_huge_pages()
    read_ahead_source(argv)
    from megatron_bridge.convert.options import ExportConfig

    cfg, args = compose(argv, schema=ExportConfig, resolve_hf=False)
    if args.cfg:
        print(to_yaml(cfg), end="")
        return 0
    from megatron_bridge.convert.pipeline import export

    return export(cfg)
