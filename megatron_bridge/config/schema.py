"""Typed schema of every config group (OmegaConf structured configs).

Each dataclass is the schema of one group under `conf/`. Composing a recipe merges the
group YAMLs into these types, so an unknown key or a wrong type is an error at compose time
instead of a silently ignored value. Field names are the CLI names (`parallel.tp=4`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class ModelConfig:
    """The recipe's model group: the input `backends.describe` turns into the one model
    description (`BridgeSpec`) every consumer takes; nothing else reads these fields.

    A group YAML (`model=llama3_8b`) sets the fields; with `hf_path` set, that directory's
    `config.json` describes the model instead (only `make_vocab_size_divisible_by` still
    applies, as config.json has no key for it).
    """

    name: str = "custom"
    hf_path: str | None = None
    # auto: the native family where one exists, else transformers' own modeling code
    # (transformers); native | transformers force one ("hf" is another spelling of transformers;
    # docs/bridge.md, "The transformers backend")
    backend: str = "auto"
    family: str = "llama"  # bridge family: llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, gpt
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 256
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # KV heads; None = multi-head attention
    kv_channels: int | None = None  # head dim; None = hidden / heads
    vocab_size: int = 1024
    max_position_embeddings: int = 2048
    make_vocab_size_divisible_by: int = 128
    tie_word_embeddings: bool = False
    gated_linear_unit: bool = True  # SwiGLU; false = a GELU MLP
    normalization: str = "RMSNorm"  # RMSNorm | LayerNorm
    add_bias_linear: bool = False  # biases on every linear layer (GPT-2/3)
    position_embedding_type: str = "rope"  # rope | learned_absolute (GPT-2/3)
    norm_epsilon: float = 1e-5
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    rotary_base: float = 10000.0
    num_moe_experts: int | None = None  # None = dense
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    # parts of a vision-language model kept as loaded (no gradient, not in the optimizer): any of
    # vision (the vision tower), projector (what maps its features into the language model), language
    freeze: list[str] = field(default_factory=list)

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads


@dataclass
class ParallelConfig:
    """Parallel degrees. dp=-1 infers DP from the world size."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel; None = tp
    dp: int = -1
    vpp: int | None = None  # virtual pipeline stages per rank (interleaved 1F1B)
    # None = auto: on exactly where megatron-core requires it (MoE with tp > 1; printed as a
    # note by `mbr check`). A pinned false there is refused by the moe-tp-sp rule.
    sequence_parallel: bool | None = None
    # Uneven pipeline split (megatron-core num_layers_in_{first,last}_pipeline_stage).
    layers_first_stage: int | None = None
    layers_last_stage: int | None = None
    # TP/CP groups spanning nodes is almost always a mistake; this turns the error into a warning.
    allow_cross_node_tp: bool = False


@dataclass
class ZeroConfig:
    """ZeRO stage and the DeepSpeed `zero_optimization` knobs it maps to."""

    stage: int = 0
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    offload_optimizer: str = "none"  # none | cpu
    offload_param: str = "none"  # none | cpu (stage 3 only)
    # Raw ds_config keys merged last (user override of the generated config).
    ds_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class ClusterConfig:
    """The machines: how many, how big, how connected. Bandwidths are per GPU, GB/s."""

    name: str = "custom"
    nodes: int = 1
    gpus_per_node: int = 1
    gpu_memory_gb: float = 80.0
    peak_tflops: float = 312.0  # dense bf16 per GPU
    achieved_efficiency: float | None = None  # fraction of peak for `mbr plan`; None = plan.comm's fitted default
    intra_node_bandwidth_gbps: float = 300.0  # NVLink, GB/s per GPU, one direction
    inter_node_bandwidth_gbps: float = 25.0  # InfiniBand, GB/s per GPU, one direction
    backend: str = "auto"  # auto (nccl on GPU, gloo on CPU) | nccl | gloo
    hostnames: list[str] = field(default_factory=list)
    hostfile: str | None = None
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    rdzv_backend: str = "c10d"


@dataclass
class OptimizerConfig:
    name: str = "adam"
    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 10
    decay_style: str = "cosine"


@dataclass
class DataConfig:
    # synthetic | indexed | sft (chat data from `mbr data mode=chat`) | preference (DPO pairs from
    # `mbr data mode=preference`)
    kind: str = "synthetic"
    paths: list[str] = field(default_factory=list)  # indexed dataset prefixes (no .bin/.idx)
    tokenizer: str | None = None  # local HF tokenizer directory
    split: str = "98,2,0"
    num_workers: int = 0
    cache_dir: str | None = None  # megatron's sample-index cache (default: cache/ next to the data)
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    create_attention_mask: bool = False
    # data=sft only (docs/finetune.md): several conversations per train.seq_length sequence, each
    # attending only to itself (block-diagonal causal) with position ids restarting; false pads
    # every conversation to seq_length instead. The loss is the same either way.
    packing: bool = True


@dataclass
class TrainConfig:
    engine: str = "megatron"  # megatron | deepspeed
    seq_length: int = 128
    micro_batch_size: int = 1
    global_batch_size: int = 8
    grad_accum: int | None = None  # None = global / (micro * dp)
    steps: int = 10
    seed: int = 1234
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16 | fp8 (auto + float8 GEMMs: runtime/fp8.py)
    # precision=fp8: torchao's scaling of the float8 GEMMs, tensorwise (one scale per tensor) | rowwise
    fp8_recipe: str = "tensorwise"
    recompute: str = "none"  # none | selective | full
    # recompute=selective: what megatron-core recomputes in backward (its recompute_modules):
    # core_attn (the attention scores), mlp, layernorm (both norms, output discarded), moe (an MoE
    # layer's experts), shared_experts, mla_up_proj (an MLA model's up projections)
    recompute_modules: list[str] = field(default_factory=lambda: ["core_attn"])
    log_interval: int = 1
    init_from: str | None = None  # HF dir or `mbr convert` output
    timeout_minutes: float = 10.0  # process-group timeout: a dead rank ends the job
    exit_after: int | None = None  # stop after this many steps of this run (schedule still spans `steps`)
    # Validation (docs/train.md "Validation"): every `eval_interval` steps and once at the end of
    # each launch, the mean token loss over the first `eval_iters` global batches of the valid
    # split (the same batches every time, so `val_loss` is comparable across steps and layouts).
    eval_interval: int = 0  # 0 = no periodic evaluation (still one at the end when eval_iters > 0)
    eval_iters: int = 0  # global batches per evaluation; 0 = no validation
    # Every N steps, `export_to/iter_NNNNNNN/`: the model as a complete Hugging Face directory
    # (LoRA merged in), published by rename; needs `export_to` (the end-of-run export). 0 = none.
    export_interval: int = 0
    # Interval exports are written behind the loop: each rank queues its gathered tensors (host
    # copies) for a writer thread, at most this many bytes at once (the step waits while the
    # queue is full); extra host memory <= this + the largest tensor. 0 = written in the step.
    export_buffer_bytes: int = 1 << 30
    # A non-finite loss or gradient norm (docs/train.md "Non-finite steps"): `stop` ends the job
    # naming the step, publishing nothing of that state (`latest` stays on the last good
    # checkpoint); `skip` drops the step's update (parameters, optimizer state and lr schedule
    # untouched, the step's data consumed), counts it, and stops after `max_skipped_steps` in a row.
    on_nonfinite: str = "stop"  # stop | skip
    max_skipped_steps: int = 5  # on_nonfinite=skip: consecutive skipped steps that end the job (>= 1)
    # Straggler detection (docs/reliability.md "Stragglers"): every N steps the ranks compare their
    # compute time per step (waits on peers excluded); a rank slower than `straggler_factor` times
    # the median of its peers is named with its host. 0 = off (it costs one small all-gather).
    straggler_interval: int = 0
    straggler_factor: float = 1.5  # > 1
    # torch.compile each transformer layer (both backends, both engines; runtime/compiled.py):
    # compiled at the first step, graph breaks counted and printed after it.
    compile: bool = False
    # The LM head and cross entropy N sequence positions at a time, each piece recomputed in
    # backward: a micro-batch's full [s, b, vocab/tp] logits are never held (runtime/chunked_loss.py;
    # both backends). 0 = the whole sequence at once.
    loss_chunk: int = 0
    # megatron-core's own fused kernels (torch.compile'd on GPU; runtime/fast_paths.py): SwiGLU with
    # its bias, bias-dropout-add, the vocab-parallel cross entropy (both backends' losses).
    fused: bool = False


@dataclass
class CheckpointConfig:
    dir: str | None = None
    save_interval: int = 0  # 0 = only at the end
    # false: start as configured; true / auto: continue from the latest complete checkpoint in
    # `dir` if there is one, else start as configured (train.init_from, model.hf_path) -- one
    # command line for a first launch and its restarts (`auto` is what `mbr launch` writes).
    resume: Any = False  # false | true | auto
    # One job writes a directory (train/lease.py): a lease another host has not refreshed for
    # this many seconds is taken over (the same host checks the holder's pid at once).
    lease_stale_s: float = 60.0
    # Write rank files in a background thread while the next steps train (the state is
    # serialised first, at the save's step); published at a later step boundary once every
    # rank's write is done, the last one before the job ends. Megatron engine only.
    async_save: bool = False


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning (docs/finetune.md). `peft=none` trains every weight;
    `peft=lora` freezes the base model and trains LoRA adapters on the named linears, with
    HF PEFT's math and file format (`export_adapter_to=DIR` writes one `peft` loads)."""

    method: str = "none"  # none | lora (set by the group: peft=lora)
    rank: int = 8  # LoRA rank r: A is r x in_features, B is out_features x r
    alpha: float = 16.0  # HF PEFT's lora_alpha: the update is scaled by alpha / rank
    dropout: float = 0.0  # HF PEFT's lora_dropout, on the adapter's input
    # Hugging Face module names (or dotted suffixes, as in HF PEFT), never megatron's: the
    # bridge's tables map them onto megatron's fused linears (q/k/v -> linear_qkv, ...).
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    init_from: str | None = None  # an HF PEFT adapter directory to start from (else B = 0)


@dataclass
class ObjectiveConfig:
    """What a training step minimises (docs/finetune.md "Preference optimisation" and
    "Distillation"). `objective=lm` is next-token cross entropy over the loss-masked tokens;
    `objective=dpo` trains on preference pairs (data=preference) against a frozen reference;
    `objective=distill` trains a student towards a frozen teacher's token distributions. The
    second model is built under the policy's own TP/PP/EP layout and never gets gradients."""

    kind: str = "lm"  # lm | dpo | distill (set by the group: objective=dpo)
    # dpo: the strength of the KL constraint (TRL's beta) and the pair loss: sigmoid (TRL's
    # default), ipo, hinge, or simpo (reference-free: length-normalised log-probabilities, gamma).
    beta: float = 0.1
    loss: str = "sigmoid"  # sigmoid | ipo | hinge | simpo
    label_smoothing: float = 0.0  # sigmoid only: conservative DPO's label noise (TRL's meaning)
    simpo_gamma: float = 0.5  # simpo only: the target reward margin (SimPO's gamma, TRL's simpo_gamma)
    # dpo: the frozen reference, an HF directory or a converted checkpoint; null = the initial
    # policy (with peft=lora: the base model without its adapters, no second copy held).
    reference: str | None = None
    # dpo: compute the reference log-probabilities of every training pair in one pass before
    # training instead of holding the reference model during it.
    precompute_reference: bool = False
    # distill: the frozen teacher (HF directory or converted checkpoint, same vocabulary as the
    # student); loss = alpha·T²·divergence + (1 − alpha)·cross entropy, both token means over the
    # labelled tokens of the global batch.
    teacher: str | None = None
    temperature: float = 1.0
    alpha: float = 0.5
    divergence: str = "forward_kl"  # forward_kl | reverse_kl | jsd


@dataclass
class WandbLoggerConfig:
    """Weights & Biases. Runs offline unless `mode` (or $WANDB_MODE) says otherwise, so it never
    asks for a login; `WANDB_MODE=disabled` in the environment never imports wandb."""

    enabled: bool = True
    project: str = "megatron_bridge"
    entity: str | None = None  # the team or user; null = wandb's default
    name: str | None = None  # the run's display name; null = wandb's random one
    group: str | None = None  # groups runs in the UI (e.g. one sweep)
    tags: list[str] = field(default_factory=list)
    mode: str | None = None  # offline | online | disabled; null = $WANDB_MODE, else offline


@dataclass
class TensorBoardLoggerConfig:
    enabled: bool = True
    dir: str | None = None  # null = <run dir>/tensorboard


@dataclass
class MlflowLoggerConfig:
    """MLflow tracking (the optional `mlflow` extra: `pip install mlflow-skinny`)."""

    enabled: bool = False
    tracking_uri: str | None = None  # file:DIR, http://host:5000, ...; null = $MLFLOW_TRACKING_URI or ./mlruns
    experiment: str = "megatron_bridge"  # created when missing
    run_name: str | None = None  # null = MLflow's generated name


@dataclass
class LoggerConfig:
    """Where per-step metrics go besides the console and `<run dir>/metrics.jsonl` (always
    written): wandb, TensorBoard, MLflow, each logged from rank 0 only (docs/train.md)."""

    wandb: WandbLoggerConfig = field(default_factory=WandbLoggerConfig)
    tensorboard: TensorBoardLoggerConfig = field(default_factory=TensorBoardLoggerConfig)
    mlflow: MlflowLoggerConfig = field(default_factory=MlflowLoggerConfig)


@dataclass
class Config:
    """The whole resolved recipe."""

    # Other spellings the command line accepts (docs/install.md, "One CLI vocabulary"): an HF
    # model directory a model is built from is `model.hf_path=`; `src=` means the same where
    # the command has no `src` field of its own. A subclass may replace the table.
    CLI_ALIASES: ClassVar[dict[str, str]] = {"src": "model.hf_path"}

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    debug: bool = False


@dataclass
class TrainRunConfig(Config):
    """A training job's command line: the recipe plus where this run writes (`mbr launch`
    accepts the same keys and hands them to every rank)."""

    run_dir: str | None = None  # default runs/<recipe>/<timestamp>, chosen by rank 0
    export_to: str | None = None  # write an HF model here after training (LoRA: merged into the base)
    export_adapter_to: str | None = None  # peft=lora: write the adapter here in HF PEFT's format
