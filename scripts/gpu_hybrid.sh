#!/usr/bin/env bash
# Hybrid (Qwen3.5 / Qwen3.6) checks on the GPU machine: fp32 exactness with CUDA graphs on a small
# random hybrid (ar == dflash == ddtree, both GDN tree methods), then the GDN tree-verify
# microbenchmark at the Qwen3.6-27B shape (random weights, bf16, 1,024-token context).
#
# Usage: scripts/gpu_hybrid.sh OUT_DIR [--quick]
#   OUT_DIR  receives exactness.log, hybrid-verify.json (copy it to docs/benchmarks/)
#   --quick  benchmark only the first 8 layers with 20 calls per figure (a few minutes)
# Needs one H200 (the whole 27B model in bf16 is 55 GB; the per-node method's static verify
# scratch another 12.5 GB). Set DDTREE_COMMIT to the commit being measured.
set -euo pipefail

[[ $# -ge 1 ]] || { sed -n '2,10p' "$0" >&2; exit 2; }
OUT=$1 QUICK=${2:-}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$OUT"
export PYTHONPATH="$REPO/server:$REPO${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
cd "$REPO"

set +e  # the benchmark runs even when exactness fails; the exit status is exactness's
if python -c "import pytest" 2>/dev/null; then
  python -m pytest -q -m gpu tests/server/test_hybrid_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/exactness.log"
else
  python tests/server/test_hybrid_gpu.py 2>&1 | tee "$OUT/exactness.log"
fi
EXACT=${PIPESTATUS[0]}
set -e

ARGS=(--shape qwen3.6-27b --device cuda --dtype bf16 --context 1024 --sizes 17,33,65 --out "$OUT/hybrid-verify.json")
[[ $QUICK == --quick ]] && ARGS+=(--layers 8 --iters 20) || ARGS+=(--iters 50)
python -m ddtree_server.bench.hybrid_verify "${ARGS[@]}" | tail -n 40
echo "exactness exit status: $EXACT"
exit "$EXACT"
