#!/usr/bin/env bash
# The fp32 exactness check on one GPU: ar == dflash == ddtree token for token, target and drafter
# replayed from CUDA graphs as served (python -m ddtree_server.bench.exactness). Exit 0 when every
# output equals plain decoding's, 1 otherwise. Report: OUT_DIR/exactness-fp32.json (+ .log).
#
# Usage: scripts/gpu_exactness.sh GGUF DRAFTER_DIR OUT_DIR --wheels DIR [options]
#   GGUF               SmolLM2-135M-Instruct.Q4_1.gguf
#   DRAFTER_DIR        z-lab drafter folder (.partNN files are joined first, into a copy)
#   --wheels DIR       folder with gguf-*.whl (gguf is not installed on the GPU machine)
#   --budgets LIST     DDTree budgets to check (default 1,16,64,256)
#   --prompts N        how many of the built-in prompts, 1-4 (default 4)
#   --max-new-tokens N tokens per request (default 96)
#   --dtype fp32|bf16  (default fp32: bf16 may flip near-ties, see docs/benchmarks/RESULTS.md)
# Set DDTREE_COMMIT to the commit being checked (the GPU copy has no .git).
set -euo pipefail

usage() { sed -n '2,14p' "$0" >&2; exit 2; }
[[ $# -ge 3 ]] || usage
GGUF=$1 DRAFTER=$2 OUT=$3
shift 3
WHEELS="" BUDGETS=1,16,64,256 PROMPTS=4 NEW_TOKENS=96 DTYPE=fp32
while [[ $# -gt 0 ]]; do
  case $1 in
    --wheels) WHEELS=$2; shift 2 ;;
    --budgets) BUDGETS=$2; shift 2 ;;
    --prompts) PROMPTS=$2; shift 2 ;;
    --max-new-tokens) NEW_TOKENS=$2; shift 2 ;;
    --dtype) DTYPE=$2; shift 2 ;;
    -h|--help) usage ;;
    *) echo "unknown option $1" >&2; usage ;;
  esac
done
[[ -n $WHEELS ]] || usage

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${DDTREE_WORK:-/tmp/ddtree-bench}
mkdir -p "$WORK" "$OUT"
source "$REPO/scripts/gpu_env.sh"
if compgen -G "$DRAFTER/*.part00" >/dev/null; then
  rm -rf "$WORK/drafter-x" && mkdir -p "$WORK/drafter-x" && cp "$DRAFTER"/* "$WORK/drafter-x/"
  python -m ddtree_server.train.split --join "$WORK/drafter-x"
  DRAFTER="$WORK/drafter-x"
fi
rc=0
python -m ddtree_server.bench.exactness --gguf "$GGUF" --drafter "$DRAFTER" --device cuda --dtype "$DTYPE" \
  --budgets "$BUDGETS" --prompts "$PROMPTS" --max-new-tokens "$NEW_TOKENS" \
  --out "$OUT/exactness-$DTYPE.json" >"$OUT/exactness-$DTYPE.log" 2>&1 || rc=$?
tail -n 5 "$OUT/exactness-$DTYPE.log"
python - "$OUT/exactness-$DTYPE.json" <<'PYEOF' || true
import json, sys
d = json.load(open(sys.argv[1]))
print(f"all_equal={d['all_equal']} drafter_graphs_enabled={d['drafter_graphs_enabled']} "
      f"rows={len(d['rows'])} different={[r['method'] for r in d['rows'] if not r['same_as_ar']]}")
PYEOF
exit $rc
