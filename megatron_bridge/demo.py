"""Helpers for scripts/demo.sh: make the starting HF model, and generate from the result.

`python -m megatron_bridge.demo init OUT TOKENIZER_DIR` writes a randomly initialised
Llama with the `tiny_llama` recipe's shape (GQA, 4 layers) and the demo tokenizer's files;
`python -m megatron_bridge.demo generate HF_DIR "prompt"` loads an exported model with
transformers and greedily generates a few tokens.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path


def init_model(out: str, tokenizer_dir: str, seed: int = 0) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    for f in Path(tokenizer_dir).iterdir():
        if f.is_file():
            shutil.copy(f, Path(out) / f.name)
    print(f"initial HF Llama ({sum(p.numel() for p in model.parameters()):,} params) written to {out}")


def generate(hf_dir: str, prompt: str, new_tokens: int = 24) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
    print(f"prompt:     {prompt!r}\ngenerated:  {tok.decode(out[0][ids.shape[1] :])!r}")


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    commands: dict[str, Callable[..., None]] = {"init": init_model, "generate": generate}
    commands[cmd](*rest)
