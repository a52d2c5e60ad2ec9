"""What the transformers backend meets in every causal-LM architecture transformers ships with a tp plan.

    python benchmarks/hf_arch_survey.py [MODEL_TYPE ...] [--out docs/hf_architectures.md]

For each model type of `megatron_bridge.runtime.hf_tiny.architectures()` (or those named), builds
its tiny model (hf_tiny: every distinctive feature on, constant weights perturbed), runs one fp32
forward and backward on CPU with transformers alone (no process group, no megatron), saves it
with save_pretrained, loads it back and compares the logits. It records the facts the parallel
backend needs:

- tp plan: the styles the model's full plan uses (`model.tp_plan`: the config's
  `base_model_tp_plan`, the embedding rule transformers adds and the head's `_tp_plan`), and the
  rules that match no module or parameter of the tiny model;
- pp / ep plan: whether the model has one, and whether every pp-plan entry names a module;
- MoE (an ep plan, or parameters under `experts`), layer kinds (`layer_types`,
  `mlp_layer_types` and the like), tied input/output embeddings;
- per-head parameters the tp plan does not cover: a parameter outside every plan rule with a
  dimension of heads, kv heads, heads×head_dim or kv×head_dim (inside an attention module; outside
  one, heads×head_dim or kv×head_dim only where it differs from the hidden size). The tiny sizes
  (hidden 96, 4 heads, 2 kv heads, head_dim 32) keep these apart from the hidden size;
- hard-coded head counts: `view(` / `reshape(` / `unflatten(` / `split(` calls in the source of
  the model's own module classes whose arguments name a head count (an identifier ending in
  `heads`) or the hidden size instead of -1: under tensor parallelism a rank holds heads/tp heads,
  so these lines need an override;
- special attention (sliding window, chunked, sinks, NoPE layers, softcapping, MLA, per-layer
  sizes) and linear-attention / state-space / indexer / compressor / hyper-connection modules;
- parameters left without a gradient by the backward (indexers trained by their own loss,
  encoders the text forward never calls).

Prints a markdown table; `--out FILE` writes it with its header (docs/hf_architectures.md is
this output). Takes under a minute on an idle 2-core machine (torch on one thread).
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from megatron_bridge.runtime import hf_tiny

BATCH, SEQ = 2, 32  # longer than the tiny windows and chunks (hf_tiny.WINDOW), so they bite

# Module classes (the model's prefix dropped) worth a look: those that say what they are, and any that is
# none of the ordinary decoder parts.
SPECIAL_MODULE = re.compile(
    r"Delta|Mamba|LinearAttention|Lightning|Indexer|Compressor|Conv|Hyper|PLE|Ngram|Recurrent|Laurel|AltUp"
)
ORDINARY_MODULE = re.compile(
    r"(DecoderLayer|Layer|Block|Attention|MLP|Mlp|FeedForward|MoE|Moe|MoeBlock|Experts|Router|Gate|Norm|Dropout"
    r"|Identity|Linear|RotaryEmbedding|Embedding|ModuleList|ModuleDict|Sequential|Act\w*|GELU\w*|SiLU|ReLU\w*)$"
)
RESHAPE_CALL = re.compile(r"\.(view|reshape|unflatten|split)\(")
HEADS_NAME = re.compile(r"\b\w*heads\b")
HIDDEN_NAME = re.compile(r"\bhidden_size\b")  # counts only in attention-like classes: an expert's input is not split
ATTENTION_CLASS = re.compile(r"Attention|Attn|DeltaNet|Mixer|Mamba|Indexer|Compressor")
ATTENTION_PATH = re.compile(r"attn|attention|mixer", re.IGNORECASE)
NOPE_SOURCE = re.compile(
    r"\b(no_rope\w*|use_rope|is_nope\w*|nope_layer\w*|NoPE)\b"  # named NoPE layers
    r"|if [^\n]*(sliding|rope|nope|local|global)[^\n]*:\s*\n\s*[^\n]*apply_rotary"  # rotary only on some layers
)


@dataclass
class Facts:
    model_type: str
    cls: str = ""
    ok: bool = False
    error: str = ""
    seconds: float = 0.0
    params: int = 0
    moe: bool = False
    tp_styles: list[str] = field(default_factory=list)
    tp_unused: list[str] = field(default_factory=list)
    attn_plan: list[str] = field(default_factory=list)
    pp: str = "no"
    ep: bool = False
    kinds: list[str] = field(default_factory=list)
    tied: bool = False
    attention: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    per_head: list[str] = field(default_factory=list)
    hard_coded: list[str] = field(default_factory=list)
    no_grad: list[str] = field(default_factory=list)
    reload: str = ""


def generic(name: str) -> str:
    """`model.layers.3.self_attn.q_norm.weight` -> `layers.*.self_attn.q_norm.weight`."""
    name = re.sub(r"\.\d+(?=\.|$)", ".*", name)
    return name.removeprefix("model.")


HEAD_COUNT = re.compile(r"(num|n)_\w*heads|\w*_n_heads|\w*num_heads")


def head_sizes(cfg) -> tuple[int, set[int], set[int]]:
    """(hidden, head-related sizes, the wide ones), neither holding the hidden size. Head counts are the config's
    fields named like `num_*heads` / `*_n_heads` (attention, kv, linear-attention, Mamba, indexer heads,
    globally and per layer); sizes are the counts and their products with every `*head_dim` field (and
    MLA's nope+rope and nope+v widths)."""
    d = cfg.get_text_config().to_dict()
    hidden = d["hidden_size"]
    counts: set[int] = set()
    dims: set[int] = set()
    for layer in [d, *(d.get("per_layer_config") or {}).values()]:
        for k, v in layer.items():
            if isinstance(v, int) and not isinstance(v, bool) and v > 1:
                if HEAD_COUNT.fullmatch(k):
                    counts.add(v)
                elif k.endswith("head_dim"):
                    dims.add(v)
    if d.get("qk_nope_head_dim"):
        dims |= {
            d["qk_nope_head_dim"] + (d.get("qk_rope_head_dim") or 0),
            d["qk_nope_head_dim"] + (d.get("v_head_dim") or 0),
        }
    if not dims and d.get("num_attention_heads"):
        dims.add(hidden // d["num_attention_heads"])
    wide = {c * h for c in counts for h in dims} - {hidden}
    return hidden, counts | wide, wide


def covered(model) -> tuple[set[str], list[str]]:
    """Names of parameters some tp-plan rule covers, and the plan's rules that match nothing."""
    plan = model.tp_plan
    expanded = model._expand_parallel_plan(plan)
    out = set()
    for name, _ in model.named_parameters():
        parts = name.split(".")
        if any(".".join(parts[:i]) in expanded for i in range(1, len(parts) + 1)):
            out.add(name)
    names = {generic("model." + n) if not n.startswith("model.") else generic(n) for n in expanded}
    unused = sorted(k for k in plan if generic(k) not in names and generic("model." + k) not in names)
    return out, unused


def attention_plan(model) -> list[str]:
    """For each attention-like module of the decoder layers (`self_attn`, `linear_attn`, `mixer`, ...):
    `sharded` (the plan splits its projections by head), `gathered` (planned, outputs gathered: every
    rank computes every head) or `none` (no rule)."""
    names = set()
    for name, module in model.named_modules():
        parts = generic(name).split(".")
        if (
            next(module.parameters(), None) is not None
            and len(parts) >= 3
            and parts[-2] == "*"
            and ATTENTION_PATH.search(parts[-1])
            and "norm" not in parts[-1]
        ):
            names.add(parts[-1])
    out = []
    for a in sorted(names):
        styles = {v for k, v in model.tp_plan.items() if f".{a}." in f".{generic(k)}."}
        if styles & {"colwise", "packed_colwise", "mla_kv_a_proj", "local_params"}:
            out.append(f"{a}: sharded")
        else:
            out.append(f"{a}: {'gathered' if styles else 'none'}")
    return out


def per_head_uncovered(model, cov: set[str]) -> list[str]:
    hidden, inside, outside = head_sizes(model.config)
    inside.discard(1)
    found = []
    for name, p in model.named_parameters():
        if name in cov:
            continue
        in_attention = any(ATTENTION_PATH.search(c) and "norm" not in c for c in name.split(".")[:-1])
        dims = set(p.shape)
        if (in_attention and dims & inside) or dims & outside:
            found.append(f"{generic(name)} {list(p.shape)}")
    return sorted(set(found))


def hard_coded_heads(model) -> list[str]:
    """`file:line` of reshape-like calls naming a head count or the hidden size, in the model's classes."""
    classes = {type(m) for m in model.modules() if type(m).__module__.startswith("transformers.models.")}
    hits = set()
    for cls in classes:
        try:
            lines, start = inspect.getsourcelines(cls)
        except (OSError, TypeError):
            continue
        src = "".join(lines)
        fname = Path(inspect.getsourcefile(cls) or "?").name
        for m in RESHAPE_CALL.finditer(src):
            depth, i = 1, m.end()
            while i < len(src) and depth:
                depth += {"(": 1, ")": -1}.get(src[i], 0)
                i += 1
            args = src[m.end() : i - 1]
            names = HEADS_NAME.search(args) or (ATTENTION_CLASS.search(cls.__name__) and HIDDEN_NAME.search(args))
            if names:
                hits.add(f"{fname}:{start + src.count(chr(10), 0, m.start())}")
    return sorted(hits, key=lambda s: (s.split(":")[0], int(s.split(":")[1])))


def special_modules(model) -> list[str]:
    prefix = type(model).__name__.removesuffix("ForCausalLM")
    names = set()
    for mod in model.modules():
        if not type(mod).__module__.startswith("transformers.models."):
            continue
        c = type(mod).__name__.removeprefix(prefix).removeprefix("Text")
        if c and c not in ("Model", "ForCausalLM") and (SPECIAL_MODULE.search(c) or not ORDINARY_MODULE.search(c)):
            names.add(re.sub(r"^(Audio|Vision)\w+", r"\1*", c))
    if model.config.get_text_config().to_dict().get("hidden_size_per_layer_input"):
        names.add("per-layer inputs")
    return sorted(names)


def attention_tags(model) -> list[str]:
    t = model.config.get_text_config()
    d = t.to_dict()
    kinds = set(d.get("layer_types") or [])
    tags = []
    if "sliding_attention" in kinds or any("sliding" in k for k in kinds) or d.get("sliding_window_size"):
        tags.append(f"sliding({d.get('sliding_window') or d.get('sliding_window_size')})")
    elif d.get("sliding_window") and d.get("use_sliding_window", True):
        tags.append(f"sliding({d['sliding_window']}, every attention layer)")
    if "chunked_attention" in kinds or d.get("attention_chunk_size"):
        tags.append(f"chunked({d.get('attention_chunk_size')})")
    if any("sink" in n for n, _ in model.named_parameters()):
        tags.append("sinks")
    rope = d.get("rope_parameters") or {}
    nope = 0 in (d.get("no_rope_layers") or []) or (isinstance(rope, dict) and None in rope.values())
    src = inspect.getsource(inspect.getmodule(type(model)))  # type: ignore[arg-type]
    if nope or NOPE_SOURCE.search(src):
        tags.append("NoPE")
    if d.get("attn_logit_softcapping"):
        tags.append("attn-softcap")
    if d.get("final_logit_softcapping"):
        tags.append("logit-softcap")
    if d.get("kv_lora_rank"):
        tags.append("MLA")
    if any(k in kinds for k in ("indexed_attention", "compressed_sparse_attention", "minimax_m3_sparse")):
        tags.append("sparse(indexer)")
    if "heavily_compressed_attention" in kinds:
        tags.append("compressed")
    if d.get("per_layer_config") or d.get("num_attention_heads_per_layer"):
        tags.append("per-layer sizes")
    return tags


def layer_kinds(cfg) -> list[str]:
    d = cfg.get_text_config().to_dict()
    out = []
    for k, v in sorted(d.items()):
        if (k.endswith("layer_types") or k in ("layers_block_type", "indexer_types")) and isinstance(v, list):
            kinds = list(dict.fromkeys(v))
            out.append(f"{k}: {'/'.join(kinds)}" if k != "layer_types" else "/".join(kinds))
    return out


def survey(model_type: str) -> Facts:
    f = Facts(model_type)
    t0 = time.perf_counter()
    try:
        model = hf_tiny.build_tiny(model_type)
        cfg = model.config
        f.cls = type(model).__name__
        f.params = sum(p.numel() for p in model.parameters())
        cov, f.tp_unused = covered(model)
        f.tp_styles = sorted(set(model.tp_plan.values()))
        f.attn_plan = attention_plan(model)
        pp = model.pp_plan  # the head's own `_pp_plan` is always there: the config's plan decides
        if getattr(cfg.get_text_config(), "base_model_pp_plan", None):
            modules = dict(model.named_modules())
            missing = [k for k in pp if k not in modules]
            f.pp = "yes" if not missing else f"names missing modules: {', '.join(missing)}"
        f.ep = bool(model.ep_plan)
        f.moe = f.ep or any(".experts." in n for n, _ in model.named_parameters())
        f.kinds = layer_kinds(cfg)
        emb, out = model.get_input_embeddings(), model.get_output_embeddings()
        f.tied = out is not None and emb is not None and out.weight is emb.weight
        f.attention = attention_tags(model)
        f.modules = special_modules(model)
        f.per_head = per_head_uncovered(model, cov)
        f.hard_coded = hard_coded_heads(model)

        ids = torch.randint(
            0, cfg.get_text_config().vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)
        )
        model.train()
        res = model(input_ids=ids, labels=ids)
        if not torch.isfinite(res.loss):
            raise FloatingPointError(f"loss {res.loss.item()}")
        res.loss.backward()
        f.no_grad = sorted({generic(n) for n, p in model.named_parameters() if p.requires_grad and p.grad is None})
        bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        if bad:
            raise FloatingPointError(f"non-finite gradient in {bad[0]}")

        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            saved = set()
            for file in Path(tmp).glob("*.safetensors"):
                with safe_open(file, "pt") as fh:
                    saved |= set(fh.keys())
            back = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
            with torch.no_grad():
                diff = (back(input_ids=ids).logits - logits).abs().max().item()
        renamed = len(saved - set(model.state_dict()))
        f.reload = "equal" if diff == 0 else f"max abs diff {diff:.1e}"
        if renamed:
            f.reload += f"; {renamed} checkpoint keys are not module names"
        f.ok = True
    except Exception as e:  # a failure is a fact of the survey: recorded, not raised
        tb = traceback.extract_tb(e.__traceback__)[-1]
        f.error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]} ({Path(tb.filename).name}:{tb.lineno})"
    f.seconds = time.perf_counter() - t0
    return f


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def short(items: list[str], n: int = 4) -> str:
    if not items:
        return ""
    more = f" (+{len(items) - n})" if len(items) > n else ""
    return "<br>".join(f"`{i}`" for i in items[:n]) + more


def table(facts: list[Facts]) -> str:
    head = (
        "| model type | class | fwd+bwd | params | MoE | tp styles | attention in the tp plan | pp | ep | layer kinds "
        "| tied | attention "
        "| special modules | per-head params outside the tp plan | hard-coded head counts | no gradient | save/load |"
    )
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for f in facts:
        if not f.ok:
            rows.append(f"| {f.model_type} | {f.cls} | **fail**: {cell(f.error)} |" + " |" * 14)
            continue
        styles = ", ".join(f.tp_styles)
        if f.tp_unused:
            styles += f"; unused: {short(f.tp_unused, 2)}"
        rows.append(
            "| "
            + " | ".join(
                cell(c)
                for c in [
                    f.model_type,
                    f.cls,
                    f"ok {f.seconds:.1f}s",
                    f"{f.params / 1e6:.2f}M",
                    "yes" if f.moe else "",
                    styles,
                    "<br>".join(f.attn_plan),
                    f.pp,
                    "yes" if f.ep else "",
                    "<br>".join(f.kinds),
                    "yes" if f.tied else "",
                    ", ".join(f.attention),
                    ", ".join(f.modules),
                    short(f.per_head),
                    f"{len(f.hard_coded)}: " + short(f.hard_coded, 3) if f.hard_coded else "",
                    short(f.no_grad, 3),
                    f.reload,
                ]
            )
            + " |"
        )
    return "\n".join(rows)


def summary(facts: list[Facts]) -> str:
    ok = [f for f in facts if f.ok]
    lines = [
        f"- architectures: {len(facts)} (causal-LM model types with a `base_model_tp_plan`)",
        f"- forward + backward on CPU: {len(ok)} ok, {len(facts) - len(ok)} fail",
        f"- MoE: {sum(f.moe for f in ok)}; with an ep plan: {sum(f.ep for f in ok)}; "
        f"with a pp plan: {sum(f.pp != 'no' for f in ok)} "
        f"({sum(f.pp.startswith('names missing') for f in ok)} naming modules the model lacks)",
        f"- per-head parameters outside the tp plan: {sum(bool(f.per_head) for f in ok)} architectures; "
        f"hard-coded head counts: {sum(bool(f.hard_coded) for f in ok)}; "
        f"parameters without a gradient: {sum(bool(f.no_grad) for f in ok)}",
        f"- tp styles used: {', '.join(sorted({s for f in ok for s in f.tp_styles}))}",
    ]
    for f in facts:
        if not f.ok:
            lines.append(f"- **{f.model_type}** fails: {f.error}")
    return "\n".join(lines)


HEADER = """# Architectures transformers ships with a tp plan

The catalogue the transformers backend's matrix runs over (issue 22, item 7): every causal-LM model type of
transformers {version} whose config declares `base_model_tp_plan`, each built by
`megatron_bridge/runtime/hf_tiny.py` (a tiny config derived from its config class with its
distinctive features on, constant weights perturbed), run forward and backward in fp32 on CPU with
transformers alone, saved with `save_pretrained` and loaded back. Made by

    python benchmarks/hf_arch_survey.py --out docs/hf_architectures.md

(this run: {seconds:.0f} s on a shared 2-core CPU machine). Columns:

- **fwd+bwd**: ok, and the seconds the whole check took (build, forward, backward, save, load).
- **tp styles**: the styles of the model's full plan (`model.tp_plan`: the config's rules, the
  `embedding_rowwise` rule transformers adds for `embed_tokens`, the head's own rule); *unused*:
  rules that match no module or parameter of the tiny model.
- **attention in the tp plan**: per attention-like module of the decoder layers, `sharded` (split by
  head), `gathered` (planned, outputs gathered: every rank computes every head) or `none`.
- **pp**: `base_model_pp_plan` present, and whether every entry names a module of the model.
- **layer kinds**: the kinds of the tiny config's per-layer lists (`layer_types` unlabelled).
- **attention**: sliding window (per layer kind, or on every attention layer), chunked, sinks, NoPE
  layers (named in the config, or rotary applied under a condition), softcapping, MLA, sparse
  attention through an indexer, compressed attention, sizes that vary per layer.
- **special modules**: module classes that are not the ordinary attention / MLP / MoE / norm parts
  (the model's prefix dropped): linear attention, state-space mixers, indexers, compressors,
  hyper-connections, short convolutions, per-layer inputs, encoders.
- **per-head params outside the tp plan**: parameters no rule covers with a dimension of a head
  count or head count × head_dim (any `num_*heads` / `*head_dim` field; outside attention modules
  only the products, and never the hidden size). A heuristic: the tiny sizes keep these apart from
  the other widths, but read the names.
- **hard-coded head counts**: `view(` / `reshape(` / `unflatten(` / `split(` calls in the model's own
  classes whose arguments name a head count (or, in attention-like classes, the hidden size)
  rather than -1; under tensor parallelism a rank holds heads/tp of them.
- **no gradient**: parameters the backward leaves without a gradient (indexers trained by their own
  loss in the original recipes, encoders a text-only forward never calls).
- **save/load**: logits of the model loaded back against the original; checkpoint keys that are not
  module names (transformers converts them on load: per-expert tensors, fused projections).

"""


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_types", nargs="*", help="default: every architecture")
    ap.add_argument("--out", type=Path, help="write the markdown page here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # tiny models: a second thread only spins
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore")
    archs = args.model_types or hf_tiny.architectures()
    facts, t0 = [], time.perf_counter()
    for mt in archs:
        f = survey(mt)
        facts.append(f)
        print(f"{mt:24s} {'ok' if f.ok else 'FAIL ' + f.error} ({f.seconds:.1f}s)", file=sys.stderr, flush=True)
    text = summary(facts) + "\n\n" + table(facts) + "\n"
    print(text)
    if args.out:
        header = HEADER.format(version=transformers.__version__, seconds=time.perf_counter() - t0)
        args.out.write_text(header + text)
    return 0 if all(f.ok for f in facts) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
