#!/usr/bin/env bash
# one GPU run: the capture rule with the largest eager round's measured reserve (CUDA tests), 150 slots at 27B
set -uo pipefail
OUT=$1 COMMIT=$2 PART=$3
REPO=$(pwd)
export PYTHONPATH="$REPO/server:$REPO" DDTREE_CACHE=/tmp/ddc HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
LOG="$OUT/gpu-$PART.log"
step() { local name=$1 limit=$2; shift 2; echo "=== $name (limit ${limit}s) $(date -u +%T)" | tee -a "$LOG"; timeout "$limit" "$@" >>"$LOG" 2>&1; echo "=== $name exit $? $(date -u +%T)" | tee -a "$LOG"; }
echo "commit $COMMIT" >>"$LOG"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$LOG" 2>&1
python3 -c "import torch, transformers, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >>"$LOG" 2>&1
RUN="python3 -m ddtree_server.bench.admission_run --context 4096 --prefill-chunk 512"
if [[ $PART == r ]]; then    # the reserve: 150 requests of 4k at 27B with the batched graphs on (the default)
  step slots150-27b 300 $RUN --shape qwen3.6-27b --slots 150 --new-tokens 3072 --out "$OUT/slots150"
  step graph-tests 120 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/server/test_graph_out.py tests/server/test_drafter_graphs.py \
    tests/server/test_batch_hybrid_rounds.py -k "cuda or graph or largest or reserve"
elif [[ $PART == d ]]; then  # the server's default fraction at 27B (84 slots: graphed rounds before), 8B at fraction 0.8
  step default-f0.5-27b 200 $RUN --shape qwen3.6-27b --fraction 0.5 --new-tokens 3072 --out "$OUT/f0.5-27b"
  step f0.8-8b 160 $RUN --shape qwen3-8b --fraction 0.8 --new-tokens 3072 --out "$OUT/f0.8-8b"
elif [[ $PART == p ]]; then  # the drafter's attention passes against one pass: batched rounds at the Qwen3-8B shape
  mkdir -p "$OUT/passes"
  step passes-8b 420 python3 -c "
import json, torch
import ddtree_server.engine.batch.draft as d
from ddtree_server.bench.batch_shape import measure_batches
from ddtree_server.bench.shapes import get_shape
out = {}
for name, pb in (('passes_512MiB', 512 << 20), ('one_pass', 1 << 42)):
    d.PASS_BYTES = pb
    doc = measure_batches(get_shape('qwen3-8b'), [16, 64], context=4096, iters=6, device='cuda', dtype='bf16')
    out[name] = doc['rows']
    torch.cuda.empty_cache()
out['meta'] = doc['meta']
json.dump(out, open('$OUT/passes/passes-qwen3-8b-4096.json', 'w'), indent=1)
"
fi
cd "$OUT" && tar czf "../res-$PART.tgz" . && mv "../res-$PART.tgz" .
