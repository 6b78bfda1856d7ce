#!/usr/bin/env bash
# One GPU run (part a | b | c): the paged layout for hybrid targets (attention K/V in pages, GDN
# states per slot). (a) the GPU tests of the paged layouts and the hybrid batch, the Qwen3.6-27B
# shape at 4k, batch 8 / 32, slot vs paged; (b) the 27B shape's admitted concurrency on pages at the
# model's maximum context (262,144) with 4k requests; (c) the paged GPU tests, the 27B shape on
# pages at 4k, batch 8 / 32; (d) the Qwen3-8B shape on pages with the drafter paged; (e) the 27B shape at batch 1; (f) its DDTree step profiled. Usage: bash gpu.sh OUT_DIR COMMIT PART
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
A="python3 -m ddtree_server.bench.admission_run --shape qwen3.6-27b --kv-layout paged --max-model-len 262144 --prefill-chunk 4096"
if [[ $PART == a ]]; then
  step gpu-tests 200 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/server/test_paged_gpu.py tests/server/test_batch_hybrid_rounds.py tests/server/test_gdn_batch.py
  step 27b-b8-32-4k 330 $B --random-shape qwen3.6-27b --batch 8,32 --context-len 4096 --kv-layout slot,paged --out "$OUT/27b-4k"
fi
if [[ $PART == b ]]; then   # part a's tests ran out of time: the paged hybrid one alone, then the admission run
  step paged-hybrid-test 150 python3 -m pytest -q -x -p no:xdist -p no:cacheprovider --durations=5 tests/server/test_paged_gpu.py -k hybrid
  step 27b-paged-150x4k 360 $A --context 4096 --slots 150 --fraction 0.9 --new-tokens 1024 --rounds 4 --out "$OUT/admission-4k"
fi
if [[ $PART == c ]]; then   # the paged GPU tests with a bounded page count; the 27B shape on pages (slot: part a)
  step paged-gpu-tests 200 python3 -m pytest -q -p no:xdist -p no:cacheprovider -o faulthandler_timeout=150 --durations=6 tests/server/test_paged_gpu.py
  step 27b-paged-b8-32-4k 300 $B --random-shape qwen3.6-27b --batch 8,32 --context-len 4096 --kv-layout paged --out "$OUT/27b-4k-paged"
fi
if [[ $PART == d ]]; then   # the Qwen3-8B shape with the drafter's K/V on pages (batch 1 / 64 at 4k, as h200-2026-12-04-draft-kernel part c)
  step 8b-paged-b1-64-4k 280 $B --random-shape qwen3-8b --batch 1,64 --context-len 4096 --kv-layout paged --out "$OUT/8b-4k-paged"
fi
if [[ $PART == e ]]; then   # the 27B shape at batch 1: slot (the per-request graphs) vs paged (the batched path)
  step 27b-b1-4k 230 $B --random-shape qwen3.6-27b --batch 1 --context-len 4096 --kv-layout slot,paged --out "$OUT/27b-4k-b1"
fi
if [[ $PART == f ]]; then   # where the 27B shape's batch-1 DDTree step goes: slot (per-request graphs) vs paged (batched path)
  P="python3 -m ddtree_server.bench.round_profile --shape qwen3.6-27b --batch 1 --mode ddtree --context 4096 --out $OUT/profile"
  step profile-slot 100 $P --kv-layout slot
  step profile-paged 100 $P --kv-layout paged
fi
cd "$OUT" && tar czf "../res-$PART.tgz" . && mv "../res-$PART.tgz" .
