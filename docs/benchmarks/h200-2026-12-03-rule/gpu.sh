#!/usr/bin/env bash
# one GPU run: the committed capture rule (pool counted once, 3 GiB headroom) at 150 slots and at the
# default fraction (with the Engine's start-up and the captures' seconds apart), and the CUDA tests
set -uo pipefail
OUT=$1 COMMIT=$2 PART=$3
REPO=$(pwd)
export PYTHONPATH="$REPO/server:$REPO" DDTREE_CACHE=/tmp/ddc HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
LOG="$OUT/gpu-$PART.log"
step() { local name=$1 limit=$2; shift 2; echo "=== $name (limit ${limit}s) $(date -u +%T)" | tee -a "$LOG"; timeout "$limit" "$@" >>"$LOG" 2>&1; echo "=== $name exit $? $(date -u +%T)" | tee -a "$LOG"; }
echo "commit $COMMIT" >>"$LOG"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$LOG" 2>&1
python3 -c "import torch, transformers, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >>"$LOG" 2>&1
RUN="python3 -m ddtree_server.bench.admission_run --context 4096 --prefill-chunk 512 --new-tokens 3072"
if [[ $PART == r ]]; then    # 150 requests of 4k at 27B (graphs on, the default), then the default fraction
  step slots150-27b 300 $RUN --shape qwen3.6-27b --slots 150 --out "$OUT/slots150"
  step default-f0.5-27b 250 $RUN --shape qwen3.6-27b --fraction 0.5 --out "$OUT/f0.5-27b"
elif [[ $PART == t ]]; then  # every test that skips without CUDA
  step gpu-tests 560 python3 -m pytest -q -p no:xdist -p no:cacheprovider --durations=12 \
    tests/server/test_gdn_batch.py tests/server/test_kernels_gdn_batch.py tests/server/test_kernels_batch.py \
    tests/server/test_chunked_prefill.py tests/server/test_round_scratch.py tests/server/test_batch_hybrid_rounds.py \
    tests/server/test_graphs.py tests/server/test_graph_out.py tests/server/test_hybrid_gpu.py tests/server/test_kernels_gpu.py \
    tests/server/test_drafter_graphs.py tests/server/test_solo_round.py tests/server/test_longctx_gpu.py \
    -k "cuda or kernel or graph or gpu or reserve or largest"
fi
cd "$OUT" && tar czf "../res-$PART.tgz" . && mv "../res-$PART.tgz" .
