#!/usr/bin/env bash
# Hybrid (Qwen3.5 / Qwen3.6) checks on the GPU machine, in ~3 minutes:
#   1. fp32 exactness with CUDA graphs and the fused GDN kernels on (tests/server/test_hybrid_gpu.py:
#      ar == dflash == ddtree on a small random hybrid, both GDN tree methods; the kernels against
#      the torch path at the Qwen3.6-27B GDN shape in fp32 and bf16; tests/server/test_gdn_batch.py and
#      test_batch_hybrid_rounds.py: batched plain, chain and tree rounds replayed from CUDA graphs ==
#      eager rounds == each request alone);
#   2. the GDN tree-verify benchmark at the Qwen3.6-27B shape (random weights, bf16, 1,024-token
#      context), chunk method, kernels on and off: per-layer mixer / rule / decode step / GPU
#      kernels per call, whole-target verify, round, plain step, DFlash verify (JSON "kernels").
#
# Usage: scripts/gpu_hybrid.sh OUT_DIR [--quick] [--node]
#   OUT_DIR  receives exactness.log, hybrid-verify.json (copy both to docs/benchmarks/)
#   --quick  benchmark only the first 8 layers with 20 calls per figure
#   --node   also time the per-node-state method (torch only; several minutes more)
# Needs one H200 (the whole 27B model in bf16 is 55 GB). Set DDTREE_COMMIT to the commit measured.
set -euo pipefail

[[ $# -ge 1 ]] || { sed -n '2,16p' "$0" >&2; exit 2; }
OUT=$1
shift
QUICK="" METHODS=chunk
for arg in "$@"; do
  case $arg in
    --quick) QUICK=1 ;;
    --node) METHODS=chunk,node ;;
    *) echo "unknown option $arg" >&2; exit 2 ;;
  esac
done
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$OUT"
export PYTHONPATH="$REPO/server:$REPO${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
cd "$REPO"

set +e  # the benchmark runs even when exactness fails; the exit status is exactness's
START=$SECONDS
if python -c "import pytest" 2>/dev/null; then
  python -m pytest -q -m gpu tests/server/test_hybrid_gpu.py tests/server/test_gdn_batch.py \
    tests/server/test_batch_hybrid_rounds.py -p no:cacheprovider 2>&1 | tee "$OUT/exactness.log"
else
  python tests/server/test_hybrid_gpu.py 2>&1 | tee "$OUT/exactness.log"
fi
EXACT=${PIPESTATUS[0]}
echo "exactness: $((SECONDS - START)) s" | tee -a "$OUT/exactness.log"
set -e

ARGS=(--shape qwen3.6-27b --device cuda --dtype bf16 --context 1024 --sizes 17,33,65 --methods "$METHODS"
      --kernels on,off --out "$OUT/hybrid-verify.json")
[[ -n $QUICK ]] && ARGS+=(--layers 8 --iters 20) || ARGS+=(--iters 30)
python -m ddtree_server.bench.hybrid_verify "${ARGS[@]}" > "$OUT/hybrid-verify.stdout"
python - "$OUT/hybrid-verify.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
k = r.get("kernels", {})
print("kernels self-check failures:", k.get("failed"))
for st, s in k.get("summary", {}).items():
    print(f"kernels {st:3}: " + ", ".join(f"{a} {b}" for a, b in s.items()))
for st, rows in k.get("per_layer", {}).items():
    print(f"mixer {st:3}: " + "; ".join(f"n={n}: {v['mixer_ms']} ms, rule {v['rule_ms']} ms, {v.get('gpu_ops')} GPU ops"
                                        for n, v in rows.items()))
EOF
echo "total: $((SECONDS - START)) s; exactness exit status: $EXACT"
exit "$EXACT"
