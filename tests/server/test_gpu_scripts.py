"""scripts/gpu_bench.sh and scripts/gpu_exactness.sh: options reach the bench exactly once.

The GPU machine cannot run here, so `python -m ...` is emulated: a `python` wrapper first on PATH
records the argv of every `python -m` call (and exits 0) and hands everything else (`python -c`,
heredocs) to the real interpreter; `nvidia-smi` is a no-op. The scripts themselves run in real bash.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, script: str, *args: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    bindir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bindir.mkdir(exist_ok=True)
    (bindir / "python").write_text(
        "#!/usr/bin/env bash\n"
        f'if [[ $1 == -m ]]; then "{sys.executable}" -c \'import json,sys; '
        f'open("{log}","a").write(json.dumps(sys.argv[1:])+"\\n")\' "$@"; exit 0; fi\n'
        f'exec "{sys.executable}" "$@"\n')
    (bindir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    for f in bindir.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", DDTREE_WORK=str(tmp_path / "work"))
    run = subprocess.run(["bash", str(REPO / "scripts" / script), *args], capture_output=True, text=True,
                         env=env, timeout=120)
    calls = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return run, calls


def test_gpu_bench_options_are_passed_once(tmp_path):
    (tmp_path / "wheels").mkdir()
    run, calls = _run(tmp_path, "gpu_bench.sh", "G.gguf", str(tmp_path), str(tmp_path / "out"),
                      "--wheels", str(tmp_path / "wheels"), "--budgets", "16,64", "--prompts", "4", "--no-t1",
                      "--max-new-tokens", "32", "--hf-prompts", "0", "--datasets", "gsm8k")
    assert run.returncode == 0, run.stderr
    argv = next(c for c in calls if c[:2] == ["-m", "ddtree_server.bench"])
    for opt, value in (("--budgets", "16,64"), ("--max-prompts", "4"), ("--t1-budget", "-1"),
                       ("--max-new-tokens", "32"), ("--hf-prompts", "0"), ("--datasets", "gsm8k")):
        assert argv.count(opt) == 1 and argv[argv.index(opt) + 1] == value, (opt, argv)


def test_gpu_bench_usage_names_the_options(tmp_path):
    run, _ = _run(tmp_path, "gpu_bench.sh", "--help")
    assert run.returncode == 2
    for opt in ("--budgets", "--prompts", "--t1-budget", "--no-t1", "--exactness", "--max-minutes"):
        assert opt in run.stderr


def test_gpu_exactness_runs_the_fp32_check(tmp_path):
    (tmp_path / "wheels").mkdir()
    run, calls = _run(tmp_path, "gpu_exactness.sh", "G.gguf", str(tmp_path), str(tmp_path / "out"),
                      "--wheels", str(tmp_path / "wheels"), "--budgets", "16", "--prompts", "2")
    assert run.returncode == 0, run.stderr
    argv = next(c for c in calls if c[:2] == ["-m", "ddtree_server.bench.exactness"])
    assert argv[argv.index("--dtype") + 1] == "fp32" and argv[argv.index("--device") + 1] == "cuda"
    assert argv[argv.index("--budgets") + 1] == "16" and argv[argv.index("--prompts") + 1] == "2"
    bad, _ = _run(tmp_path, "gpu_exactness.sh", "G", "D", "O", "--wheels", "w", "--bogus")
    assert bad.returncode == 2 and "unknown option --bogus" in bad.stderr
