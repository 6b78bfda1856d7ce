#!/usr/bin/env bash
# Train the default DFlash drafter on the GPU machine for one piece of at most --minutes of wall
# time, leaving in OUT_DIR everything the next piece needs on a fresh machine (the state folder of
# server/ddtree_server/train/resume.py: weights-NNNN.partKK, progress.json, train_log.jsonl, and
# run.log = this console; at most 8 files, each <= 15 MiB, ~24 MB in all).
#
# Usage: scripts/gpu_train_drafter.sh GGUF WORK_DIR OUT_DIR --inputs DIR [--resume STATE_DIR]
#                                     [--minutes 9.0] [--gen-minutes 3.5] [extra train-drafter options...]
#   GGUF      SmolLM2-135M-Instruct.Q4_1.gguf (sha256 b179c952...), joined on the machine
#   WORK_DIR  scratch folder outside the repository (data shards, train_state.pt); a machine still
#             warm from the previous piece keeps it, and the piece then also reuses its data and
#             (when the steps agree) its exact optimizer state
#   OUT_DIR   the returnable state (above); copy it back, carry it, pass it as --resume next time.
#             The z-lab drafter: python -m ddtree_server.train.resume export OUT_DIR DEST
#   --inputs  folder made by scripts/gpu_train_prepare.sh: gguf-*.whl (the machine lacks gguf), the
#             four evaluation wheels (contamination check) and train_prompts.jsonl.gz
#   --resume  a state folder returned by an earlier piece; without it the piece starts from the
#             shipped drafter (server/ddtree_server/assets/drafter)
#   --minutes wall budget of the whole piece, measured from this script's start (SIGTERM also ends
#             it with a save; a SIGKILL keeps the last save, at most --save-every-minutes old)
# Other helpers: scripts/gpu_train_2gpu.sh (two GPUs; passes --wheels/--prompts, still accepted).
set -euo pipefail
T0=$SECONDS

usage() { sed -n '2,23p' "$0" >&2; exit 2; }
[[ $# -ge 3 ]] || usage
GGUF=$1 WORK=$2 OUT=$3
shift 3
MINUTES=${MAX_MINUTES:-9.0} GEN_MINUTES=${GEN_MINUTES:-3.5} INPUTS="" RESUME="" PROMPTS=""
EXTRA=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --minutes|--max-minutes) MINUTES=$2; shift 2 ;;
    --gen-minutes) GEN_MINUTES=$2; shift 2 ;;
    --inputs|--wheels) INPUTS=$2; shift 2 ;;
    --prompts) PROMPTS=$2; shift 2 ;;
    --resume) RESUME=$2; shift 2 ;;
    -h|--help) usage ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
[[ -n $INPUTS ]] || usage
[[ -n $PROMPTS ]] || PROMPTS=$INPUTS/train_prompts.jsonl.gz
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$WORK" "$OUT"
WHEELS=$INPUTS
LOG=$OUT/run.log
exec > >(tee -a "$LOG") 2>&1
source "$REPO/scripts/gpu_env.sh"

START=(--init-from "$REPO/server/ddtree_server/assets/drafter")
if [[ -n $RESUME ]]; then
  START=(--resume-from "$RESUME")
  [[ -f $WORK/train_state.pt ]] && START+=(--resume)  # warm machine: exact optimizer if the steps agree
fi
SRC=(--data-dir "$INPUTS")
[[ -f $PROMPTS ]] && SRC+=(--prompts "$PROMPTS")

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
LEFT=$(python -c "print(round(float('$MINUTES') - ($SECONDS - $T0) / 60 - 0.15, 2))")
echo "piece budget ${MINUTES} min, python gets ${LEFT} min; resume: ${RESUME:-shipped drafter}"
# Choices (docs/benchmarks/drafter/README.md): answers from the batched static-cache generator,
# 4096 rows x (384 + 256) columns (~60 GB of KV cache; a decode step is bound by launches, so rows
# are nearly free); prompts up to 384 tokens (the long code prompts too); 2 passes over the ~50 K
# clean ShareGPT prompts (the 2nd samples new answers), until GEN_MINUTES after the start; the
# 3-layer drafter fed by layers 1,10,19,27; 32 sequences x 64 anchors per step, LM head on
# importance-sampled rows, length-bucketed batches; validation every minute on 160 held-out prompts
# (greedy answers); a save every 1.5 minutes.
python -m ddtree_server.train --gguf "$GGUF" --out "$WORK/drafter" --work-dir "$WORK/train" \
  --state-out "$OUT" --eval-data-dir "$INPUTS" "${SRC[@]}" "${START[@]}" \
  --max-minutes "$LEFT" --gen-minutes "$GEN_MINUTES" --num-prompts 50000 --passes 2 --val-prompts 160 \
  --gen-batch-size 4096 --max-new-tokens 256 --max-prompt-tokens 384 --sampled-fraction 0.25 --temperature 0.8 \
  --layers 3 --target-layer-ids 1,10,19,27 --block-size 16 \
  --batch-size 32 --anchors 64 --max-seq-len 640 --lr 6e-4 --warmup-steps 50 --gamma 7 --row-sample --bucket 8 \
  --save-every-minutes 1.5 --val-every-minutes 1 --device cuda "${EXTRA[@]}" &
PID=$!
trap 'kill -TERM $PID 2>/dev/null || true' TERM INT  # forwarded: python stops at the next step and saves
RC=0
while true; do  # a trapped signal interrupts `wait`; keep waiting until python itself has exited
  if wait "$PID"; then RC=0; break; else RC=$?; fi
  kill -0 "$PID" 2>/dev/null || break
done
trap - TERM INT
echo "train-drafter exit $RC after $((SECONDS - T0)) s"
[[ -f $OUT/progress.json ]] && python -m ddtree_server.train.resume show "$OUT" | head -c 3000
ls -la "$OUT"
exit "$RC"
