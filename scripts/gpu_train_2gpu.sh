#!/usr/bin/env bash
# Train the default drafter on a machine with two GPUs, inside one wall-clock budget:
#   GPU 0: answers prompts 0, 2, 4, ... for GEN0 minutes, then trains (scripts/gpu_train_drafter.sh),
#          re-reading GPU 1's shard folder every minute (--extra-data);
#   GPU 1: first checks the engine with the drafter it is given (exactness in fp32 on CUDA with
#          CUDA graphs, then a short bf16 bench on GSM8K), then answers prompts 1, 3, 5, ... until
#          shortly before GPU 0 stops training.
#
# Usage: scripts/gpu_train_2gpu.sh GGUF WORK_DIR OUT_DIR --wheels DIR --prompts FILE
#                                  [--max-minutes 8.8] [--check-drafter DIR] [train-drafter options...]
#   OUT_DIR receives drafter/ (the returnable training state: export the z-lab folder with
#   python -m ddtree_server.train.resume export OUT_DIR/drafter DEST) and checks.tar.gz (logs,
#   exactness.json, mini bench). WORK_DIR/drafter keeps the z-lab drafter on the machine for a
#   following bench run.
set -euo pipefail

usage() { sed -n '2,13p' "$0" >&2; exit 2; }
[[ $# -ge 3 ]] || usage
GGUF=$1 WORK=$2 OUT=$3
shift 3
MAX_MINUTES=8.8 WHEELS="" PROMPTS="" CHECK_DRAFTER=""
EXTRA=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --max-minutes) MAX_MINUTES=$2; shift 2 ;;
    --wheels) WHEELS=$2; shift 2 ;;
    --prompts) PROMPTS=$2; shift 2 ;;
    --check-drafter) CHECK_DRAFTER=$2; shift 2 ;;
    -h|--help) usage ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
[[ -n $WHEELS && -n $PROMPTS ]] || usage
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CHECK_DRAFTER=${CHECK_DRAFTER:-$REPO/server/ddtree_server/assets/drafter}
LOGS="$WORK/logs"
mkdir -p "$WORK" "$OUT" "$LOGS"
source "$REPO/scripts/gpu_env.sh"
T0=$SECONDS

gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  python -m ddtree_server.bench.exactness --gguf "$GGUF" --drafter "$CHECK_DRAFTER" --device cuda \
    --dtype fp32 --out "$LOGS/exactness-fp32.json" >"$LOGS/exactness-fp32.log" 2>&1 || true
  python -m ddtree_server.bench.exactness --gguf "$GGUF" --drafter "$CHECK_DRAFTER" --device cuda \
    --dtype bf16 --out "$LOGS/exactness-bf16.json" >"$LOGS/exactness-bf16.log" 2>&1 || true
  python -m ddtree_server.bench --gguf "$GGUF" --drafter "$CHECK_DRAFTER" --data-dir "$WHEELS" --no-download \
    --out "$LOGS/minibench" --device cuda --dtype bf16 --datasets gsm8k --max-prompts 8 --max-new-tokens 256 \
    --budgets 32,64,128 --t1-budget -1 --hf-prompts 0 --time-budget-minutes 2 --stem mini \
    >"$LOGS/minibench.log" 2>&1 || true
  # generate until about 1.3 minutes before the trainer's budget ends
  local left
  left=$(python -c "print(round(float('$MAX_MINUTES') - ($SECONDS - $T0) / 60 - 1.3, 2))")
  if python -c "import sys; sys.exit(float('$left') < 0.8)"; then
    GEN_MINUTES=$left bash "$REPO/scripts/gpu_train_drafter.sh" "$GGUF" "$WORK/gen1" "$WORK/gen1-out" \
      --wheels "$WHEELS" --prompts "$PROMPTS" --max-minutes "$left" --prompt-shard 1/2 --generate-only \
      >"$LOGS/gen1.log" 2>&1 || true
  fi
}

gpu1 &
PID1=$!
mkdir -p "$WORK/gen1/train/data"
CUDA_VISIBLE_DEVICES=0 GEN_MINUTES=${GEN0:-2.5} bash "$REPO/scripts/gpu_train_drafter.sh" "$GGUF" "$WORK" \
  "$OUT/drafter" --wheels "$WHEELS" --prompts "$PROMPTS" --max-minutes "$MAX_MINUTES" \
  --prompt-shard 0/2 --extra-data "$WORK/gen1/train/data" "${EXTRA[@]}" 2>&1 | tee "$LOGS/train.log" \
  | tail -n 40 || echo "TRAINING FAILED (see logs/train.log)"
wait "$PID1" || true
for f in "$LOGS"/*.log; do echo "== $f"; tail -n 5 "$f"; done
# the device returns at most 8 files: drafter/ holds 6, the logs travel as one archive
tar -czf "$OUT/checks.tar.gz" -C "$WORK" logs
ls -la "$OUT" "$OUT/drafter"
