# Sourced by the GPU scripts (bash): environment for running ddtree_server from this checkout on
# the offline GPU machine. Needs REPO, WORK and WHEELS set; unpacks the pure-Python gguf wheel
# (absent there) next to the work dir instead of touching the system site-packages.
export PYTHONPATH="$REPO/server${PYTHONPATH:+:$PYTHONPATH}"
export DDTREE_CACHE="$WORK/cache" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if ! python -c "import gguf" 2>/dev/null; then
  [[ -n $WHEELS ]] || { echo "gguf is not installed: pass --wheels DIR holding gguf-*.whl" >&2; exit 2; }
  python - "$WORK/pylib" "$WHEELS" <<'PYEOF'
import sys, zipfile, pathlib
dest, wheels = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
whl = sorted(wheels.glob("gguf-*.whl"))
if not whl:
    sys.exit(f"no gguf-*.whl in {wheels}")
zipfile.ZipFile(whl[-1]).extractall(dest)
print(f"unpacked {whl[-1].name} into {dest}")
PYEOF
  export PYTHONPATH="$PYTHONPATH:$WORK/pylib"
fi
