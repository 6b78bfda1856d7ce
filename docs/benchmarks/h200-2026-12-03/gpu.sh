#!/usr/bin/env bash
# one GPU run: CUDA tests of the batched hybrid engine with the round scratch, admission, batched rounds
set -uo pipefail
OUT=$1 COMMIT=$2 PART=$3
REPO=$(pwd)
export PYTHONPATH="$REPO/server:$REPO" DDTREE_CACHE=/tmp/ddc HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
LOG="$OUT/gpu-$PART.log"
step() { local name=$1 limit=$2; shift 2; echo "=== $name (limit ${limit}s) $(date -u +%T)" | tee -a "$LOG"; timeout "$limit" "$@" >>"$LOG" 2>&1; echo "=== $name exit $? $(date -u +%T)" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$LOG" 2>&1
python3 -c "import torch, transformers, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >>"$LOG" 2>&1
B="python3 -m ddtree_server.bench --commit $COMMIT --no-download --device cuda"
if [[ $PART == a ]]; then
  step gpu-tests 330 python3 -m pytest -q -p no:xdist -p no:cacheprovider --durations=12 \
    tests/server/test_gdn_batch.py tests/server/test_kernels_gdn_batch.py tests/server/test_kernels_batch.py \
    tests/server/test_chunked_prefill.py tests/server/test_round_scratch.py tests/server/test_batch_hybrid_rounds.py \
    tests/server/test_graphs.py tests/server/test_hybrid_gpu.py tests/server/test_kernels_gpu.py \
    tests/server/test_drafter_graphs.py tests/server/test_solo_round.py tests/server/test_longctx_gpu.py \
    -k "cuda or kernel or graph or gpu"
  for s in qwen3-8b qwen3.6-27b; do
    step admission 90 python3 -m ddtree_server.bench.admission --shape $s --contexts 4096,32768 --commit "$COMMIT" --device cuda --out "$OUT/admission"
  done
elif [[ $PART == d ]]; then
  step graph-tests 200 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/server/test_graph_out.py tests/server/test_graphs.py tests/server/test_drafter_graphs.py \
    tests/server/test_gdn_batch.py tests/server/test_batch_hybrid_rounds.py tests/server/test_hybrid_gpu.py -k "cuda or graph"
  step admission-run-27b 290 python3 -m ddtree_server.bench.admission_run --shape qwen3.6-27b --context 4096 --slots 150 --prefill-chunk 512 --new-tokens 3072 --out "$OUT/admission"
elif [[ $PART == e ]]; then
  step admission-run-27b 300 python3 -m ddtree_server.bench.admission_run --shape qwen3.6-27b --context 4096 --fraction 0.5 --prefill-chunk 512 --new-tokens 3072 --out "$OUT/admission"
elif [[ $PART == c ]]; then
  step admission-run-27b 290 python3 -m ddtree_server.bench.admission_run --shape qwen3.6-27b --context 4096 --slots 150 --prefill-chunk 512 --new-tokens 3072 --out "$OUT/admission"
  step admission-run-8b 170 python3 -m ddtree_server.bench.admission_run --shape qwen3-8b --context 4096 --fraction 0.8 --prefill-chunk 512 --new-tokens 2048 --out "$OUT/admission"
else
  step batch-27b 200 $B --random-shape qwen3.6-27b --batch 1,8,32 --context-len 1024 --iters 5 --out "$OUT/batch"
  step batch-8b 80 $B --random-shape qwen3-8b --batch 1,8,32 --context-len 1024 --iters 10 --out "$OUT/batch"
fi
cd "$OUT" && tar czf "../res-$PART.tgz" . && mv "../res-$PART.tgz" .
