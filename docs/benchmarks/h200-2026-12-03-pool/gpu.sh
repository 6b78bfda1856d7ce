#!/usr/bin/env bash
# one GPU run: the batched graphs' one pool and capture headroom (CUDA tests), admission runs at 27B / 8B
set -uo pipefail
OUT=$1 COMMIT=$2 PART=$3
REPO=$(pwd)
export PYTHONPATH="$REPO/server:$REPO" DDTREE_CACHE=/tmp/ddc HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
LOG="$OUT/gpu-$PART.log"
step() { local name=$1 limit=$2; shift 2; echo "=== $name (limit ${limit}s) $(date -u +%T)" | tee -a "$LOG"; timeout "$limit" "$@" >>"$LOG" 2>&1; echo "=== $name exit $? $(date -u +%T)" | tee -a "$LOG"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$LOG" 2>&1
python3 -c "import torch, transformers, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >>"$LOG" 2>&1
RUN="python3 -m ddtree_server.bench.admission_run --context 4096 --prefill-chunk 512"
if [[ $PART == a ]]; then    # before the measured capture rule and the allocator default (f1f1791)
  step graph-tests 150 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/server/test_graph_out.py tests/server/test_drafter_graphs.py \
    tests/server/test_batch_hybrid_rounds.py tests/server/test_tree_gpu.py -k "cuda or graph or passes"
  step slots150-27b 400 $RUN --shape qwen3.6-27b --slots 150 --new-tokens 3072 --out "$OUT/slots150"
elif [[ $PART == f ]]; then  # the measured capture rule; admission_run sets expandable segments as serve does
  step slots150-27b 240 $RUN --shape qwen3.6-27b --slots 150 --new-tokens 3072 --out "$OUT/slots150"
  step graph-tests 100 python3 -m pytest -q -p no:xdist -p no:cacheprovider tests/server/test_graph_out.py tests/server/test_drafter_graphs.py \
    tests/server/test_batch_hybrid_rounds.py -k "cuda or graph"
elif [[ $PART == g ]]; then
  step f0.5-27b 200 $RUN --shape qwen3.6-27b --fraction 0.5 --new-tokens 3072 --out "$OUT/f0.5"
fi
cd "$OUT" && tar czf "../res-$PART.tgz" . && mv "../res-$PART.tgz" .
