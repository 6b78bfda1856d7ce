#!/usr/bin/env bash
# The benchmark on a machine with two GPUs: scripts/gpu_bench.sh on each GPU with half of the
# prompt sets (GPU 0: gsm8k,humaneval; GPU 1: mt-bench,math500), in parallel, one archive back.
#
# Usage: scripts/gpu_bench_2gpu.sh GGUF DRAFTER_DIR OUT_DIR --wheels DIR [--max-minutes 9.3]
#                                  [--exactness] [extra bench options for both halves, e.g. --max-prompts 64]
#   --exactness  first run python -m ddtree_server.bench.exactness (fp32, CUDA graphs) on each GPU
#   OUT_DIR receives bench.tar.gz (bench-a.*, bench-b.* and both console logs); merge locally with
#   ddtree-server bench --merge bench-a.json --merge bench-b.json --out docs/benchmarks
# Set DDTREE_COMMIT to the commit being measured (the GPU copy has no .git).
set -euo pipefail

usage() { sed -n '2,10p' "$0" >&2; exit 2; }
[[ $# -ge 3 ]] || usage
GGUF=$1 DRAFTER=$2 OUT=$3
shift 3
MAX_MINUTES=9.3 WHEELS="" EXACT=0
EXTRA=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --max-minutes) MAX_MINUTES=$2; shift 2 ;;
    --exactness) EXACT=1; shift ;;
    --wheels) WHEELS=$2; shift 2 ;;
    -h|--help) usage ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
[[ -n $WHEELS ]] || usage
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RES="$OUT/res"
mkdir -p "$RES"

T0=$SECONDS
half() {  # GPU, datasets, stem
  export CUDA_VISIBLE_DEVICES=$1 DDTREE_WORK="/tmp/ddtree-bench-$1"
  if [[ $EXACT == 1 ]]; then
    (WORK=$DDTREE_WORK; source "$REPO/scripts/gpu_env.sh"
     python -m ddtree_server.bench.exactness --gguf "$GGUF" --drafter "$DRAFTER" --device cuda --dtype fp32 \
       --prompts 2 --budgets 16,64 --max-new-tokens 64 --out "$RES/exactness-$3.json") \
      >"$RES/exactness-$3.log" 2>&1 || echo "exactness $3: NOT all equal (see exactness-$3.log)"
  fi
  local left
  left=$(python3 -c "print(round(float('$MAX_MINUTES') - ($SECONDS - $T0) / 60, 2))")
  bash "$REPO/scripts/gpu_bench.sh" "$GGUF" "$DRAFTER" "$RES" --wheels "$WHEELS" --max-minutes "$left" \
    --datasets "$2" --stem "$3" "${EXTRA[@]}" >"$RES/$3.log" 2>&1 || echo "$3 FAILED (see $3.log)"
}

half 0 gsm8k,humaneval bench-a &
half 1 mt-bench,math500 bench-b &
wait
for f in "$RES"/*.log; do echo "== $f"; tail -n 12 "$f"; done
tar -czf "$OUT/bench.tar.gz" -C "$RES" .
rm -rf "$RES"
ls -la "$OUT"
