#!/usr/bin/env bash
# The main job, end to end on CPU with 4 local processes (gloo), nothing downloaded:
#   1. corpus from the Python standard library + a BPE tokenizer + megatron indexed dataset
#   2. a tiny Llama as a Hugging Face checkpoint (the "pretrained" starting point), converted
#      with `mbr convert` to megatron-core's dist_checkpointing format for tp2·pp2
#   3. `mbr check`: validate the tp2·pp2 layout and print its rank map
#   4. train tp2·pp2 under torchrun from the converted weights, with checkpoints, then
#      export the result back to a Hugging Face model
#   5. transformers loads the exported model and generates
#   6. supervised fine-tuning of the exported model on chat data made from the standard library's
#      docstrings (data=sft, packed, loss on the answers only), with validation loss
# Outputs under runs/demo/. Set STEPS=N to change the length (default 300).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_MODE=${WANDB_MODE:-offline} TOKENIZERS_PARALLELISM=false PYTHONWARNINGS=ignore
PY=.venv/bin/python
OUT=runs/demo
STEPS=${STEPS:-300}
rm -rf "$OUT/train" "$OUT/hf_out" "$OUT/ckpt" "$OUT/converted" "$OUT/chat" "$OUT/sft" "$OUT/vlm"
mkdir -p "$OUT"

echo "== 1. data: stdlib corpus -> tokenizer -> indexed dataset"
[ -f "$OUT/data/corpus.jsonl" ] || .venv/bin/mbr data demo=true output_dir="$OUT/data" vocab_size=512

echo "== 2. a tiny Llama as a Hugging Face checkpoint, converted to megatron dist_checkpointing (tp2·pp2)"
[ -f "$OUT/hf_init/config.json" ] || $PY -m megatron_bridge.demo init "$OUT/hf_init" "$OUT/data/tokenizer"

.venv/bin/mbr convert "src=$OUT/hf_init" "dst=$OUT/converted" parallel.tp=2 parallel.pp=2 format=torch_dist

ARGS=(recipe=tiny_llama "model.hf_path=$OUT/hf_init" "train.init_from=$OUT/converted" data=indexed "data.paths=[$OUT/data/stdlib_text_document]"
      "data.tokenizer=$OUT/data/tokenizer" train.seq_length=128 train.global_batch_size=16 train.micro_batch_size=2
      "train.steps=$STEPS" train.log_interval=20 optimizer.lr=3e-3 optimizer.min_lr=3e-4 optimizer.warmup_steps=20
      "checkpoint.dir=$OUT/ckpt" checkpoint.save_interval=100)

echo "== 3. mbr check: the layout and its rank map"
.venv/bin/mbr check "${ARGS[@]}"

echo "== 4. train tp2·pp2 on 4 CPU processes, then export to Hugging Face"
$PY -m torch.distributed.run --nproc-per-node 4 -m megatron_bridge.train "${ARGS[@]}" \
  "run_dir=$OUT/train" "export_to=$OUT/hf_out" 2>&1 | grep -v -E "Warning|warn\(|^\s*$"

first=$($PY -c "import json;r=[json.loads(l) for l in open('$OUT/train/metrics.jsonl')];print(f\"{r[0]['loss']:.3f} -> {r[-1]['loss']:.3f}\")")
echo "loss (first logged step -> last): $first"

echo "== 5. transformers generates from the exported model"
$PY -m megatron_bridge.demo generate "$OUT/hf_out" "def main():"

echo "== 6. supervised fine-tuning: docstring Q&A chat data -> SFT of the exported model (tp2·pp2, packed)"
.venv/bin/mbr data mode=chat demo=true "output_dir=$OUT/chat" "tokenizer=$OUT/data/tokenizer" max_examples=500
$PY -m torch.distributed.run --nproc-per-node 4 -m megatron_bridge.train recipe=sft_tiny_llama \
  "model.hf_path=$OUT/hf_out" "train.init_from=$OUT/hf_out" "data.paths=[$OUT/chat/stdlib_chat]" \
  "run_dir=$OUT/sft" 2>&1 | grep -v -E "Warning|warn\(|^\s*$"
val=$($PY -c "import json;r=[json.loads(l) for l in open('$OUT/sft/metrics.jsonl')];print(' -> '.join(f\"{x['val_loss']:.3f} (step {x['step']})\" for x in r if 'val_loss' in x))")
echo "SFT val_loss on held-out conversations: $val"

echo "== 7. a vision-language model: LoRA fine-tuning of a tiny Qwen2.5-VL on image chats (tp2, dp2), exported"
$PY -m megatron_bridge.demo_vlm "$OUT/vlm"
.venv/bin/mbr data mode=chat "input=$OUT/vlm/data/chats.jsonl" "output=$OUT/vlm/chat/img" "tokenizer=$OUT/vlm/model" max_length=65
$PY -m torch.distributed.run --nproc-per-node 4 -m megatron_bridge.train recipe=sft_tiny_vlm \
  "model.hf_path=$OUT/vlm/model" "data.tokenizer=$OUT/vlm/model" "data.paths=[$OUT/vlm/chat/img]" \
  "run_dir=$OUT/vlm/sft" "export_to=$OUT/vlm/hf_out" 2>&1 | grep -v -E "Warning|warn\(|^\s*$"
$PY -m megatron_bridge.demo_vlm answer "$OUT/vlm/hf_out" "$OUT/vlm/data/img/0.png"

echo "demo done: run dir $OUT/train (metrics.jsonl, tensorboard/, wandb/), checkpoints $OUT/ckpt, HF model $OUT/hf_out, SFT run $OUT/sft, VLM run $OUT/vlm/sft"
