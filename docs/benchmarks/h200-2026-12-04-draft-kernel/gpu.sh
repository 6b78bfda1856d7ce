#!/usr/bin/env bash
# One GPU run (part a | b | c | d): the batched drafter on the split-K kernel, slot vs paged KV at the Qwen3-8B
# shape, batch 1 / 8 at 4k and 32k (a), batch 64 at 4k (b); the GPU tests of the drafter kernel and
# the paged layout; (c) the paged layout with its page tables kept on the device; (d) the 27B hybrid shape at 1k. Usage: bash gpu.sh OUT_DIR COMMIT PART
set -uo pipefail
OUT=$1 COMMIT=$2 PART=$3
REPO=$(pwd)
export PYTHONPATH="$REPO/server:$REPO" DDTREE_CACHE=/tmp/ddc HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
LOG="$OUT/gpu-$PART.log"
step() { local name=$1 limit=$2; shift 2; echo "=== $name (limit ${limit}s) $(date -u +%T)" | tee -a "$LOG"; timeout "$limit" "$@" >>"$LOG" 2>&1; echo "=== $name exit $? $(date -u +%T)" | tee -a "$LOG"; }
echo "commit $COMMIT" >>"$LOG"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$LOG" 2>&1
python3 -c "import torch, transformers, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >>"$LOG" 2>&1
B="python3 -m ddtree_server.bench --device cuda --random-shape qwen3-8b --iters 5"
if [[ $PART == a ]]; then
  step gpu-tests 150 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/server/test_draft_kernel_gpu.py tests/server/test_paged_gpu.py
  step b1-8-4k 170 $B --batch 1,8 --context-len 4096 --kv-layout slot,paged --out "$OUT/4k"
  step b1-8-32k 230 $B --batch 1,8 --context-len 32768 --kv-layout slot,paged --out "$OUT/32k"
fi
if [[ $PART == b ]]; then
  step gpu-tests 120 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/server/test_draft_kernel_gpu.py tests/server/test_paged_gpu.py
  step b64-4k 420 $B --batch 64 --context-len 4096 --kv-layout slot,paged --out "$OUT/4k-b64"
fi
if [[ $PART == c ]]; then   # the page tables kept on the device
  step paged-gpu-tests 150 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/server/test_paged_gpu.py
  step paged-b1-64-4k 240 $B --batch 1,64 --context-len 4096 --kv-layout paged --out "$OUT/4k-paged-tables"
fi
if [[ $PART == d ]]; then   # the hybrid 27B shape (its drafter: 4 sliding-window layers + 1 full)
  step 27b-b8-32-1k 290 python3 -m ddtree_server.bench --device cuda --random-shape qwen3.6-27b --iters 5 --batch 8,32 --context-len 1024 --out "$OUT/27b-1k"
fi
cd "$OUT" && tar czf "../res-$PART.tgz" . && mv "../res-$PART.tgz" .
