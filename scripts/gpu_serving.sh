#!/usr/bin/env bash
# Serving benchmarks on the GPU machine in one run (<= ~9.5 minutes): closed-loop concurrency through
# the batch engine (DDTREE_MODES, default ar,dflash,ddtree), batched random-shape steps (batch 1 is the
# regression check), a 16k-token prompt arriving during decoding (chunked vs whole prefill), and
# constrained json_schema decoding. Every step has its own time limit; a step that
# fails or runs out of time is reported in the log and the next one starts.
#
# Usage: scripts/gpu_serving.sh GGUF WHEELS OUT_DIR
#   GGUF     SmolLM2-135M-Instruct.Q4_1.gguf (sha256-checked by the loader)
#   WHEELS   folder with gguf-*.whl, the gsm8k / humaneval prompt-set wheels, and xgrammar with the
#            wheels it needs that the machine lacks (pydantic, pydantic-core, apache-tvm-ffi, ...);
#            for the http step also fastapi, starlette, uvicorn, h11, anyio, annotated-doc and
#            opentelemetry-api
#   OUT_DIR  reports land in OUT_DIR/<step>/ (JSON + markdown), the log in OUT_DIR/serving.log
# Set DDTREE_COMMIT to the commit being measured (the GPU copy has no .git); DDTREE_STEPS to a
# comma-separated subset of the steps (concurrency,batch-smol,batch-8b,batch-27b,interference-8b,
# constrained,http,http-switch5ms,gpu-tests,tree-batch,stages-8b,stages-27b,ctx-8b,ctx-27b,admission) to run
# only those; DDTREE_LEVELS the
# concurrency levels of the closed loop (default 1,8,32,64).
set -uo pipefail
[[ $# -eq 3 ]] || { sed -n '2,13p' "$0" >&2; exit 2; }
GGUF=$1 WHEELS=$2 OUT=$3
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${DDTREE_WORK:-/tmp/ddtree-serving}
mkdir -p "$WORK" "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$WHEELS"/*.whl || exit 1
export PYTHONPATH="$REPO/server:$WORK/site" DDTREE_CACHE="$WORK/cache" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
DRAFTER="$REPO/server/ddtree_server/assets/drafter"
COMMIT=${DDTREE_COMMIT:-unknown}
LOG="$OUT/serving.log"

step() {   # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  [[ -z ${DDTREE_STEPS:-} || ,$DDTREE_STEPS, == *,$name,* ]] || return 0
  echo "=== $name (limit ${limit}s) $(date -u +%T)" | tee -a "$LOG"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  echo "=== $name exit $? $(date -u +%T)" | tee -a "$LOG"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$LOG" 2>&1
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" >>"$LOG" 2>&1
B="python3 -m ddtree_server.bench --commit $COMMIT --no-download --data-dir $WHEELS --device cuda"
MODES=${DDTREE_MODES:-ar,dflash,ddtree}
step concurrency 200 $B --gguf "$GGUF" --drafter "$DRAFTER" --concurrency "${DDTREE_LEVELS:-1,8,32,64}" --datasets gsm8k,humaneval \
  --max-prompts 32 --max-new-tokens 256 --modes "$MODES" --budgets 16 --out "$OUT/concurrency"
step batch-smol 40 $B --random-shape smollm2-135m --batch 1,8,32,64 --context-len 512 --iters 20 --out "$OUT/batch"
step batch-8b 55 $B --random-shape qwen3-8b --batch 1,8,32 --context-len 1024 --iters 10 --out "$OUT/batch"
step batch-27b 150 $B --random-shape qwen3.6-27b --batch 1,8,32 --context-len 1024 --iters 5 --out "$OUT/batch"
# batch-1 round stages (plain step, DFlash, DDTree verify / round) and long contexts at the user shapes
step stages-8b 90 $B --random-shape qwen3-8b --context-len 1024 --iters 10 --budgets 16,64 --stem stages-qwen3-8b --out "$OUT/stages"
step stages-27b 150 $B --random-shape qwen3.6-27b --context-len 1024 --iters 5 --budgets 16,64 --stem stages-qwen3.6-27b --out "$OUT/stages"
for n in 4096 32768; do
  step ctx-8b 90 $B --random-shape qwen3-8b --context-len $n --iters 5 --budgets 16,64 --stem ctx-qwen3-8b-$n --out "$OUT/ctx"
  step ctx-27b 150 $B --random-shape qwen3.6-27b --context-len $n --iters 3 --budgets 16,64 --stem ctx-qwen3.6-27b-$n --out "$OUT/ctx"
done
for s in qwen3-8b qwen3.6-27b; do
  step admission 90 python3 -m ddtree_server.bench.admission --shape $s --contexts 4096,32768 --commit "$COMMIT" --out "$OUT/admission"
done
step gpu-tests 150 env PYTHONPATH="$REPO:$PYTHONPATH" python3 -m pytest -q -p no:xdist -p no:cacheprovider \
  tests/server/test_gdn_batch.py tests/server/test_kernels_gdn_batch.py tests/server/test_kernels_batch.py \
  tests/server/test_chunked_prefill.py -k "cuda or kernel or graph"
step interference-8b 60 $B --random-shape qwen3-8b --interference 16384 --batch 8 --prefill-chunk 512,0 \
  --context-len 1024 --iters 20 --out "$OUT/interference"
step constrained 50 python3 -m ddtree_server.bench.constrained --out "$OUT/constrained" --gguf "$GGUF" \
  --drafter "$DRAFTER" --device cuda --dtype bf16 --budgets 16 --prompts 4 --max-new-tokens 256
step tree-batch 90 python3 -m ddtree_server.bench.tree_batch --batch 1,8,32,64 --budgets 16,64 --vocab 49152 \
  --iters 30 --device cuda --out "$OUT/tree_batch/tree_batch.json"
http_load() {   # http_load STEM MODES LEVELS: the prompts through a real server over HTTP (bench/http_load.py)
  python3 -m ddtree_server serve --gguf "$GGUF" --drafter "$DRAFTER" --device cuda --port 8123 \
    --max-running 64 --max-queue 256 >"$OUT/$1-server.log" 2>&1 &
  local pid=$! i
  for i in $(seq 1 120); do python3 -c "import httpx; assert httpx.get('http://127.0.0.1:8123/ready').status_code == 200" 2>/dev/null && break; sleep 1; done
  python3 -m ddtree_server.bench.http_load --url http://127.0.0.1:8123 --out "$OUT/http" --concurrency "$3" \
    --modes "$2" --datasets gsm8k,humaneval --data-dir "$WHEELS" --no-download --max-prompts 32 \
    --max-tokens 256 --commit "$COMMIT" --stem "$1"
  local rc=$?
  kill -TERM $pid; wait $pid
  grep -E "spec gate|batching|default mode|switch interval" "$OUT/$1-server.log"
  return $rc
}
export -f http_load
export GGUF DRAFTER OUT WHEELS COMMIT
step http 300 bash -c 'http_load http_load ar,default,ddtree:16 1,8,32,64'
# the same server with the interpreter's default GIL switch interval (5 ms): the A/B of serve's 0.5 ms
step http-switch5ms 120 env DDTREE_SWITCH_INTERVAL=0.005 bash -c 'http_load http_load_switch5ms ar,ddtree:16 8,64'
echo "done $(date -u +%T)" | tee -a "$LOG"
