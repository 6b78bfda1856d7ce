#!/usr/bin/env bash
# One GPU run (part a | b ...): a lone request on the paged layout. (a) the Qwen3-8B shape's batch-1
# step profiled (device kernels and host functions) on both layouts in plain / DFlash / DDTree mode,
# and the Qwen3.6-27B shape at batch 1 re-measured after the round scratch's padding fix; (b) the GPU
# tests of the kernels and the batched / paged paths after the fused batched forward, and the 8B
# batch-1 paged profiles again; (c) the 8B shape at batch 1 / 8 / 64 on both layouts; (d) with the
# device round of a lone request on pages: its GPU tests, batch 1 of both shapes on both layouts;
# (e) with DFlash rounds on it too: the GPU tests, the 8B shape at batch 1 on both layouts, the
# 27B shape's admitted 32k requests on pages; (f) after the fix of the DFlash capture: the lone
# paged GPU tests and the 8B shape at batch 1.
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
B="python3 -m ddtree_server.bench --device cuda --iters 5"
if [[ $PART == a ]]; then
  for layout in slot paged; do
    for mode in ar dflash ddtree; do
      step "8b-$layout-$mode" 90 python3 -m ddtree_server.bench.round_profile --shape qwen3-8b --batch 1 --mode $mode \
        --context 4096 --kv-layout $layout --host --out "$OUT/profile-8b"
    done
  done
  step 27b-b1-4k 200 $B --random-shape qwen3.6-27b --batch 1 --context-len 4096 --kv-layout slot,paged --out "$OUT/27b-4k-b1"
fi
if [[ $PART == b ]]; then
  step gpu-tests 240 python3 -m pytest -q -p no:xdist -p no:cacheprovider --durations=8 tests/server/test_kernels_gpu.py \
    tests/server/test_paged_gpu.py tests/server/test_draft_kernel_gpu.py tests/server/test_tree_gpu.py tests/server/test_walk_gpu.py
  for mode in ar ddtree; do
    step "8b-paged-$mode" 90 python3 -m ddtree_server.bench.round_profile --shape qwen3-8b --batch 1 --mode $mode \
      --context 4096 --kv-layout paged --host --out "$OUT/profile-8b-fused"
  done
fi
if [[ $PART == c ]]; then
  step 8b-b1-8-64-4k 560 $B --random-shape qwen3-8b --batch 1,8,64 --context-len 4096 --kv-layout slot,paged --out "$OUT/8b-4k"
fi
if [[ $PART == d ]]; then
  step gpu-tests 200 python3 -m pytest -q -p no:xdist -p no:cacheprovider --durations=5 tests/server/test_paged_gpu.py \
    tests/server/test_solo_round.py -k cuda
  step 8b-b1-4k 150 $B --random-shape qwen3-8b --batch 1 --context-len 4096 --kv-layout slot,paged --out "$OUT/8b-4k-b1-solo"
  step 27b-b1-4k 150 $B --random-shape qwen3.6-27b --batch 1 --context-len 4096 --kv-layout slot,paged --out "$OUT/27b-4k-b1-solo"
  step 8b-paged-ddtree 60 python3 -m ddtree_server.bench.round_profile --shape qwen3-8b --batch 1 --mode ddtree \
    --context 4096 --kv-layout paged --host --out "$OUT/profile-8b-solo"
fi
if [[ $PART == e ]]; then
  step gpu-tests 120 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/server/test_paged_gpu.py
  step 8b-b1-4k 90 $B --random-shape qwen3-8b --batch 1 --context-len 4096 --kv-layout slot,paged --out "$OUT/8b-4k-b1-e"
  step 27b-paged-32k 330 python3 -m ddtree_server.bench.admission_run --shape qwen3.6-27b --kv-layout paged \
    --max-model-len 262144 --prefill-chunk 4096 --context 32768 --slots 30 --fraction 0.9 --new-tokens 1024 --rounds 3 \
    --out "$OUT/admission-27b-32k"
fi
if [[ $PART == f ]]; then
  step gpu-tests 100 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/server/test_paged_gpu.py -k lone
  step 8b-b1-4k 80 $B --random-shape qwen3-8b --batch 1 --context-len 4096 --kv-layout slot,paged --out "$OUT/8b-4k-b1-f"
fi
cd "$OUT" && tar czf "../res-$PART.tgz" . && mv "../res-$PART.tgz" .
