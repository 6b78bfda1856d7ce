#!/usr/bin/env bash
# One GPU run (part a | b ...): the DFlash drafter's sliding-window layers in rings on the paged
# layout. (a) the GPU tests of the batched drafter (slot pool and rings) and of the paged engine,
# then the Qwen3.6-27B shape's requests of 32k admitted and decoding together on pages (before the
# rings: 27 of 30, docs/benchmarks/h200-2026-12-04-batch1/admission-27b-32k/); (b) variants of the
# paged split-K kernel's page-table read against the slot pool (one attention layer, CUDA graphs),
# and the 27B shape's 4k requests on pages with the rings; (c) with the sweep's best variants the
# default: the GPU tests of the kernels, the batched drafter and the paged engine, and the 8B shape
# at batch 8 / 64 on both layouts; (d) variants at tree-sized row counts (DDTree got slower with
# (c)'s default), and the 8B shape at batch 64 with variant 0 for launches of several row blocks.
# Usage: bash gpu.sh OUT_DIR COMMIT PART
set -uo pipefail
OUT=$1 COMMIT=$2 PART=$3
REPO=$(pwd)
export PYTHONPATH="$REPO/server:$REPO" DDTREE_CACHE=/tmp/ddc HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
LOG="$OUT/gpu-$PART.log"
step() { local name=$1 limit=$2; shift 2; echo "=== $name (limit ${limit}s) $(date -u +%T)" | tee -a "$LOG"; timeout "$limit" "$@" >>"$LOG" 2>&1; echo "=== $name exit $? $(date -u +%T)" | tee -a "$LOG"; }
echo "commit $COMMIT" >>"$LOG"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$LOG" 2>&1
python3 -c "import torch, transformers, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >>"$LOG" 2>&1
A="python3 -m ddtree_server.bench.admission_run --shape qwen3.6-27b --kv-layout paged --max-model-len 262144 --prefill-chunk 4096"
if [[ $PART == a ]]; then
  step gpu-tests 150 python3 -m pytest -q -p no:xdist -p no:cacheprovider --durations=5 tests/server/test_draft_kernel_gpu.py \
    tests/server/test_paged_gpu.py
  step 27b-paged-32k 400 $A --context 32768 --slots 34 --fraction 0.9 --new-tokens 1024 --rounds 3 --out "$OUT/admission-27b-32k"
fi
if [[ $PART == b ]]; then
  step gpu-test-auto 90 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/server/test_paged_gpu.py -k auto
  step paged-variants 280 python3 -m ddtree_server.bench.paged_attention --device cuda --variants 0,1,2,3,4 --stages 2,3 \
    --shapes qwen3-8b,qwen3.6-27b --contexts 4096,16384 --batches 8,64 --rows 1,16 --layouts shuffled --iters 30 \
    --out "$OUT/paged-variants"
  step 27b-paged-4k 300 $A --context 4096 --slots 150 --fraction 0.9 --new-tokens 1024 --rounds 4 --out "$OUT/admission-27b-4k"
fi
if [[ $PART == c ]]; then
  step gpu-tests 200 python3 -m pytest -q -p no:xdist -p no:cacheprovider --durations=5 tests/server/test_kernels_gpu.py \
    tests/server/test_draft_kernel_gpu.py tests/server/test_paged_gpu.py
  step 8b-b8-64-4k 330 python3 -m ddtree_server.bench --device cuda --iters 5 --random-shape qwen3-8b --batch 8,64 \
    --context-len 4096 --kv-layout slot,paged --out "$OUT/8b-4k"
fi
if [[ $PART == d ]]; then
  step paged-variants-rows 150 python3 -m ddtree_server.bench.paged_attention --device cuda --variants 0,2,4 --stages 2,3 \
    --shapes qwen3-8b --contexts 4096 --batches 64 --rows 33,65 --layouts shuffled --iters 30 --out "$OUT/paged-variants-rows"
  step 8b-b64-4k 300 python3 -m ddtree_server.bench --device cuda --iters 5 --random-shape qwen3-8b --batch 64 \
    --context-len 4096 --kv-layout slot,paged --out "$OUT/8b-4k-b64"
fi
