"""Per-GPU memory of one layout: model states, activations, logits, margin.

Model states (bytes per parameter held by the rank):

  engine=megatron, bf16   weights 2 · grads 2 · optimizer 12 (fp32 main params, Adam m, v)
                          megatron-core's defaults: bf16 grad buffers (grad_reduce_in_fp32
                          False). ZeRO-1 = DistributedOptimizer: the 12 bytes are sharded
                          over the dp·cp group (expert params over expert-dp). Unsharded,
                          this is the framework's "16 bytes per parameter" (1T → 16 TB).
  engine=deepspeed, bf16  weights 2 · grads 2 · optimizer 16 (fp32 master, m, v and the fp32
                          gradient partition), DeepSpeed's own accounting, so the numbers
                          equal its estimators: ZeRO-1 shards the 16, ZeRO-2 also the 16-bit
                          grads (2P + 18P/N), ZeRO-3 everything (18P/N + 4·largest layer: the
                          gathered 16-bit weights and grads of the layer in flight).
  fp32 (CPU)              weights 4 · grads 4 · optimizer 8 (m, v) / 16 (deepspeed)

Activations (bytes per layer per microbatch, Korthikanti et al. 2022, §4 and Table 2; 2-byte
activations, 1-byte dropout masks): `layer_activation_terms` derives them term by term, so
for a GPT layer (ffn = 4h, multi-head attention) they are exactly

  no parallelism   sbh(34 + 5as/h)          TP  sbh(10 + 24/t + 5as/(ht))
  TP + SP          sbh/t·(34 + 5as/h)        selective recompute: drop the 5as/h term
  full recompute   2sbh per layer (2sbh/t with SP: the checkpointed input is sequence-sharded)

and for GQA / SwiGLU / MoE layers the same terms with the real widths (K/V are g·d wide,
SwiGLU stores a 2·ffn-wide fc1 output, MoE experts see top-k copies of each token).
Context parallelism replaces s by s/cp. Pipeline stage i holds min(m, p−i) microbatches in
flight under 1F1B (the first stage p of them: L layers' worth however large p is, which is
why PP does not reduce activation memory); interleaving with v chunks holds
(2(p−i−1) + (v−1)p + 1) chunk-microbatches, i.e. ×(1 + (p−1)/(p·v)) on the first stage.

A VLM's vision tower and projector run whole on the first stage: their activations there are
`vision_activations` per microbatch in flight (images × patches, the tower's width × depth).

Logits (last stage, Korthikanti §4.3): 4·s·b·V/t for the fp32 cross-entropy input plus the
2sbh/t output-layer input.

A frozen second model (`objective=distill`'s teacher, `objective=dpo`'s reference) adds its
weights in training precision, split over TP/PP/EP exactly as the policy's are (its own layer
count over the same stages), with no gradients or optimizer states and no ZeRO partitioning;
its forward runs without grad, so it stores no activations. A teacher's logits for one
microbatch (s·b·V/t in activation precision) are held on the last stage until the loss. A DPO
microbatch is 2·micro_batch_size rows (chosen and rejected): `b` is the rows. Fragmentation margin: 10% of everything allocated (PyTorch's
caching allocator, CUDA/NCCL context), a planning allowance rather than a measurement.
Capacity: `cluster.gpu_memory_gb` read as GiB (an "80 GB" H100 has 80 GiB of HBM).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache

from megatron_bridge.backends.registry import backend_of
from megatron_bridge.plan import params as P

GIB = 1024**3
FRAGMENTATION = 0.10

# (weights, grads, optimizer) bytes per parameter, by (engine, precision).
STATE_BYTES = {
    ("megatron", "bf16"): (2, 2, 12),
    ("megatron", "fp32"): (4, 4, 8),
    ("deepspeed", "bf16"): (2, 2, 16),
    ("deepspeed", "fp32"): (4, 4, 16),
}

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class States:
    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def model_states(
    dense: float,
    expert: float,
    *,
    engine: str,
    precision: str,
    zero: int,
    dp_shard: int,
    edp_shard: int,
    largest_layer: float = 0.0,
) -> States:
    """Bytes of weights, gradients and optimizer states of `dense` + `expert` parameters
    on one rank at ZeRO `zero`. ZeRO shards over `dp_shard` ranks (dp·cp) for dense and
    `edp_shard` (expert data-parallel) for expert parameters."""
    wb, gb, ob = STATE_BYTES[(engine, precision)]
    total = dense + expert
    sharded = dense / dp_shard + expert / edp_shard
    weights = wb * (sharded + largest_layer if zero >= 3 else total)
    if zero >= 3:
        grads = gb * largest_layer
    elif zero == 2:
        grads = gb * sharded
    else:
        grads = gb * total
    optimizer = ob * (sharded if zero >= 1 else total)
    return States(weights, grads, optimizer)


def _with_adapters(frozen: States, m, peft, ids, first, tp, etp, ep, engine, precision, zero, dp_shard, edp) -> States:
    """States of a LoRA run: the base's weights plus the adapters' weights, gradients and
    optimizer states (the backend's adapter shapes, split as the adapters are)."""
    dense, expert = backend_of(m).adapter_params(m, peft, tp=tp, etp=etp, ep=ep, layers=ids, first=first)
    ad = model_states(
        dense,
        expert,
        engine=engine,
        precision=precision,
        zero=zero,
        dp_shard=dp_shard,
        edp_shard=edp,
    )
    return States(frozen.weights + ad.weights, ad.grads, ad.optimizer)


def layer_activation_terms(
    m,
    *,
    s: float,
    b: int,
    t: int = 1,
    sp: bool = False,
    cp: int = 1,
    moe: bool = False,
    etp: int = 1,
    act_bytes: int = 2,
) -> dict[str, float]:
    """One layer's stored activations for one microbatch, bytes, split into
    `base` (kept under selective recompute) and `scores` (the a·s² attention terms that
    selective recompute drops). Korthikanti's terms with the model's real widths."""
    h, a = m.hidden_size, m.num_attention_heads
    s = s / cp
    sbh = s * b * h
    ab, mask = act_bytes, 1
    rep_div = t if sp else 1  # SP shards the replicated (norm/dropout) regions over TP too
    # Attention: QKV input, attention-dropout mask (replicated without SP);
    # Q, K, V, projection input (TP-sharded: heads split).
    rep = ab * sbh + mask * sbh
    q, k, v = P.attention_widths(m)
    proj_in = a * (m.v_head_dim if m.multi_latent_attention else m.head_dim)  # every head's value
    shard = ab * s * b * (q + k + v + proj_in)
    if m.multi_latent_attention:
        # The latents: q_down / kv_down outputs, each stored as its norm's and its up
        # projection's input (sequence-sharded under SP, like the other replicated terms).
        rep += ab * s * b * (2 * (m.q_lora_rank or 0) + 2 * m.kv_lora_rank + m.qk_pos_emb_head_dim)
    scores = (2 * ab + mask) * a * s * s * b / t  # softmax out, its dropout mask and output
    rep += 2 * ab * sbh  # the two norms' inputs
    if not moe:
        f, k = m.ffn_hidden_size, 2 if m.gated_linear_unit else 1
        rep += ab * sbh + mask * sbh  # fc1 input, MLP dropout mask
        shard += ab * s * b * f * (k + 1)  # activation-function input (k·f wide), fc2 input
    else:
        E, topk = m.num_moe_experts, min(m.moe_router_topk, m.num_moe_experts)
        fm, k = m.moe_ffn_hidden_size or m.ffn_hidden_size, 2 if m.gated_linear_unit else 1
        rep += mask * sbh + 4 * s * b * E  # MoE dropout mask, fp32 router logits
        # Expert side: s·b·topk/t token copies per rank (SP is required with TP), each with
        # its full-width input and an etp-sharded k·fm + fm wide hidden; see module doc.
        tokens = s * b * topk / t
        rep_expert = ab * tokens * (etp * h + fm * (k + 1))
        fs = m.moe_shared_expert_intermediate_size or 0
        shard += ab * s * b * fs * (k + 1)
        return {"base": rep / rep_div + shard / t + rep_expert, "scores": scores}
    return {"base": rep / rep_div + shard / t, "scores": scores}


@lru_cache(maxsize=65536)
def _layer_activations(m, recompute, s, b, t, sp, cp, moe, etp, act_bytes) -> float:
    if recompute == "full":
        return act_bytes * (s / cp) * b * m.hidden_size / (t if sp else 1)
    terms = layer_activation_terms(m, s=s, b=b, t=t, sp=sp, cp=cp, moe=moe, etp=etp, act_bytes=act_bytes)
    return terms["base"] + (terms["scores"] if recompute == "none" else 0.0)


def layer_activations(
    m,
    *,
    recompute: str,
    s: int,
    b: int,
    t: int = 1,
    sp: bool = False,
    cp: int = 1,
    moe: bool = False,
    etp: int = 1,
    act_bytes: int = 2,
) -> float:
    """Stored bytes of one layer (`moe`: a MoE layer) for one microbatch under a recompute
    policy."""
    return _layer_activations(m, recompute, s, b, t, sp, cp, moe, etp, act_bytes)


def in_flight(stage: int, p: int, m: int, v: int = 1) -> float:
    """Microbatches (in whole-stage units) whose activations stage `stage` holds at the peak
    of the 1F1B schedule; with v>1 interleaved chunks, in chunk units divided by v."""
    if p == 1:
        return 1.0
    if v <= 1:
        return float(min(m, p - stage))
    chunks = min(m * v, 2 * (p - stage - 1) + (v - 1) * p + 1)
    return chunks / v


@dataclass
class StageMemory:
    stage: int
    layers: int
    params: float
    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    fragmentation: float
    total: float
    alone: float = 0.0  # the same stage's total with ZeRO-0 (model states unsharded)
    frozen_weights: float = 0.0  # the teacher's / reference's weights (module doc)
    frozen_logits: float = 0.0  # the teacher's held logits (last stage): one microbatch's, all with pp > 1

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def logits_bytes(m, *, s: float, b: int, t: int, cp: int, vocab: int, sp: bool) -> float:
    """Korthikanti §4.3: fp32 logits for the cross-entropy (4sbV/t) + output-layer input."""
    s = s / cp
    return 4 * s * b * vocab / t + 2 * s * b * m.hidden_size / (t if sp else 1)


def frozen_weights(
    f, *, layers: Sequence[int], first: bool, last: bool, tp: int, ep: int, etp: int, engine: str, precision: str
) -> float:
    """Bytes of the frozen model `f`'s weights on one rank of the stage holding its `layers`."""
    rp = (
        backend_of(f)
        .shards(f)
        .rank_params(tp=tp, ep=ep, etp=etp, layers=P.stage_ids(f, layers, first), first=first, last=last)
    )
    return STATE_BYTES[(engine, precision)][0] * (rp["dense"] + rp["expert"])


def vision_activations(m, *, b: int, images: int, patches: int, act_bytes: int = 2) -> float:
    """Stored bytes of a VLM's vision tower for one microbatch (first stage; whole on every TP
    rank, so no TP, SP or CP split): Korthikanti's 34·s·h per layer at 2-byte activations with
    s = the microbatch's patches and h·layers the tower's `vision_width`; its attention scores
    are left out (the towers run fused or windowed attention), and so is the projector."""
    return 17 * act_bytes * b * images * patches * m.vision_width


def stage_memory(
    m,
    *,
    stage: int,
    p: int,
    layers: int | Sequence[int],
    first: bool,
    last: bool,
    tp: int,
    cp: int,
    ep: int,
    etp: int,
    dp: int,
    edp: int,
    zero: int,
    engine: str,
    precision: str,
    recompute: str,
    sp: bool,
    s: int,
    b: int,
    num_micro: int,
    vpp: int = 1,
    vocab: int = 0,
    peft: object = None,
    images: int = 1,
    patches: int = 0,
    frozen: object = None,
    frozen_layers: Sequence[int] = (),
    frozen_logits: bool = False,
) -> StageMemory:
    """Peak bytes on one rank of pipeline stage `stage`, whose transformer layers are
    `layers` (global indices, `ParallelDims.stage_layer_ids`; or a count, as `params.rank_params`
    reads it). Each layer is counted as its kind (MoE or dense, `moe_layer_pattern`). With
    `peft.method == "lora"` only the adapters have gradients and optimizer states (the
    frozen base has weights only). The first stage also holds a VLM's vision tower's
    activations for `images` per sample of `patches` patches (`vision_activations`). `frozen`:
    the description of a frozen second model whose `frozen_layers` this stage holds, and with
    `frozen_logits` its logits on the last stage (module doc)."""
    ids = P.stage_ids(m, layers, first)
    shards = backend_of(m).shards(m)
    rp = shards.rank_params(tp=tp, ep=ep, etp=etp, layers=ids, first=first, last=last)
    ll = shards.largest(tp=tp, ep=ep, etp=etp) if zero >= 3 else 0.0
    st = model_states(
        rp["dense"],
        rp["expert"],
        engine=engine,
        precision=precision,
        zero=zero,
        dp_shard=dp * cp,
        edp_shard=edp,
        largest_layer=ll,
    )
    if peft is not None and getattr(peft, "method", "none") == "lora":
        st = _with_adapters(st, m, peft, ids, first, tp, etp, ep, engine, precision, zero, dp * cp, edp)
    ab = 4 if precision == "fp32" else 2
    n_moe = shards.moe_layers(ids)
    kinds = [(moe, n) for moe, n in ((True, n_moe), (False, len(ids) - n_moe)) if n]
    n_flight = in_flight(stage, p, num_micro, vpp)

    def per_layer(policy: str, moe: bool) -> float:
        return layer_activations(m, recompute=policy, s=s, b=b, t=tp, sp=sp, cp=cp, moe=moe, etp=etp, act_bytes=ab)

    acts = n_flight * sum(n * per_layer(recompute, moe) for moe, n in kinds)
    if recompute == "full" and kinds:
        # Backward recomputes one layer at a time: its full (selective-level) activations live.
        acts += max(per_layer("selective", moe) for moe, _ in kinds)
    if first:
        acts += n_flight * (s / cp) * b * m.hidden_size / (tp if sp else 1)  # embedding dropout mask
        if m.vision_params:
            acts += n_flight * vision_activations(m, b=b, images=images, patches=patches, act_bytes=ab)
    lg = logits_bytes(m, s=s, b=b, t=tp, cp=cp, vocab=vocab, sp=sp) if last else 0.0
    fw = fl = 0.0
    if frozen is not None:
        fw = frozen_weights(
            frozen,
            layers=frozen_layers,
            first=first,
            last=last,
            tp=tp,
            ep=ep,
            etp=etp,
            engine=engine,
            precision=precision,
        )
        held = 1 if first and last else num_micro  # pp > 1: the teacher ran over the step's microbatches first
        fl = held * ab * (s / cp) * b * vocab / tp if frozen_logits and last else 0.0
    allocated = st.total + acts + lg + fw + fl
    frag = FRAGMENTATION * allocated
    alone = allocated + frag
    if zero:
        s0 = model_states(
            rp["dense"], rp["expert"], engine=engine, precision=precision, zero=0, dp_shard=1, edp_shard=1
        )
        alone = (s0.total + acts + lg + fw + fl) * (1 + FRAGMENTATION)
    return StageMemory(
        stage=stage,
        layers=len(ids),
        params=rp["dense"] + rp["expert"],
        weights=st.weights,
        grads=st.grads,
        optimizer=st.optimizer,
        activations=acts,
        logits=lg,
        fragmentation=frag,
        total=allocated + frag,
        alone=alone,
        frozen_weights=fw,
        frozen_logits=fl,
    )
