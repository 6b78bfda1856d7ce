"""bench --random-shape: shapes table, random targets / drafters from configs, the stage report
(tiny shape on CPU, no timing assertions), and the GPU probe's import path and CPU run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ddtree_server.bench import random_report
from ddtree_server.bench.random_shape import StageOptions, parse_tau, run_random_shape
from ddtree_server.bench.shapes import SHAPE_NAMES, get_shape, shape_from_dicts
from ddtree_server.models.drafter.config import DrafterConfig
from ddtree_server.models.dense.load import as_config
from ddtree_server.models.random_init import target_from_config
from ddtree_server.models.dense.target import TargetModel


def _param_count(raw: dict) -> int:
    with torch.device("meta"):
        model = TargetModel(as_config(raw))
    return sum(p.numel() for p in model.parameters())


def test_published_shapes_have_the_published_sizes():
    # Qwen3-8B: 8.19 B parameters (model card), untied; Llama-3.1-8B: 8.03 B; SmolLM2-135M: 134.5 M (tied)
    assert abs(_param_count(get_shape("qwen3-8b").target) / 8.19e9 - 1) < 0.005
    assert abs(_param_count(get_shape("llama-3.1-8b").target) / 8.03e9 - 1) < 0.005
    assert abs(_param_count(get_shape("smollm2-135m").target) / 134.5e6 - 1) < 0.005
    for name in SHAPE_NAMES:
        s = get_shape(name)
        d = DrafterConfig.from_dict(s.drafter)
        assert d.hidden_size == s.target["hidden_size"] and d.vocab_size == s.target["vocab_size"]
        assert max(d.target_layer_ids) < s.target["num_hidden_layers"] and d.mask_token_id < d.vocab_size
    q = DrafterConfig.from_dict(get_shape("qwen3-8b").drafter)
    assert (q.num_hidden_layers, q.block_size, q.mask_token_id, q.target_layer_ids) == (5, 16, 151669, (1, 9, 17, 25, 33))
    with pytest.raises(KeyError, match="qwen3-8b"):
        get_shape("qwen9")


def test_target_from_config_builds_random_finite_models():
    model = target_from_config(get_shape("tiny").target, device="cpu", dtype="fp32")
    cache = model.new_cache(16)
    logits, _ = model.forward(cache, torch.tensor([1, 2, 3]), torch.arange(3))
    assert torch.isfinite(logits).all() and logits.std() > 0 and cache.length == 3
    tied = dict(get_shape("tiny").target, tie_word_embeddings=True)
    model = target_from_config(tied, device="cpu", dtype="bf16")
    assert model.lm_head.weight is model.embed_tokens.weight and model.lm_head.weight.dtype == torch.bfloat16
    assert model.embed_tokens.weight.device.type == "cpu"
    with pytest.raises(ValueError, match="no target for model_type"):
        target_from_config({"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 100})
    with pytest.raises(ValueError, match="model_type"):
        target_from_config({"hidden_size": 64})


def test_parse_tau():
    assert parse_tau("ddtree=3.3, dflash=2.1,ddtree-64=3.5") == {"ddtree": 3.3, "dflash": 2.1, "ddtree-64": 3.5}
    assert parse_tau(None) == {}
    for bad in ("eagle=2", "ddtree=x", "ddtree=0.5", "ddtree-x=2"):
        with pytest.raises(ValueError):
            parse_tau(bad)


def test_break_even_and_projection_from_stage_times():
    stages = {"round_ar": {"ms": 2.0, "kv_len": 100, "rows": 1}, "round_dflash": {"ms": 3.0, "kv_len": 100, "rows": 1},
              "round_ddtree_64": {"ms": 4.0, "kv_len": 100, "rows": 1},
              "verify_ddtree_64": {"ms": 2.5, "kv_len": 200, "rows": 65}, "tree_ddtree_64": {"ms": 0.5, "rows": 1}}
    sizes = {"target": 10**9, "lm_head": 10**8, "drafter": 2 * 10**8, "target_kv_row": 1000, "drafter_kv_row": 100}
    d = random_report.derive(stages, sizes, 4000.0, {"ddtree": 3.0, "dflash": 2.0})
    assert d["break_even_tau"] == {"dflash": 1.5, "ddtree-64": 2.0}
    assert d["projected_speedup"]["ddtree-64"] == {"tau": 3.0, "speedup": 1.5}
    v = stages["verify_ddtree_64"]
    assert (v["weight_bytes"], v["kv_bytes"]) == (10**9, 200_000) and v["gbps"] == round(1.0002e9 / 2.5e-3 / 1e9, 1)
    assert stages["tree_ddtree_64"]["gbps"] is None and stages["round_ddtree_64"]["weight_bytes"] == 13 * 10**8


def test_random_shape_report_on_cpu(tmp_path):
    opts = StageOptions(context=24, iters=2, warmup=1, budgets=(4, 8))
    doc = run_random_shape(get_shape("tiny"), opts, device="cpu", tau={"ddtree": 2.0}, log=lambda s: None)
    names = {"forward_1", "plain_step", "draft", "tree_dflash", "verify_dflash", "round_ar", "round_dflash"}
    for b in (4, 8):
        names |= {f"tree_ddtree_{b}", f"tree_inputs_{b}", f"verify_ddtree_{b}", f"commit_ddtree_{b}", f"round_ddtree_{b}"}
    assert set(doc["stages"]) == names and not doc["skipped"]
    assert all(r["n"] == 2 and r["ms"] > 0 for r in doc["stages"].values())
    assert doc["stages"]["verify_ddtree_8"]["rows"] == 9 and doc["stages"]["commit_ddtree_8"]["rows"] > 1
    assert set(doc["derived"]["break_even_tau"]) == {"dflash", "ddtree-4", "ddtree-8"}
    assert doc["derived"]["projected_speedup"]["ddtree-8"]["tau"] == 2.0
    for key in ("gpu", "torch", "cuda", "triton", "transformers", "commit", "context"):
        assert key in doc["meta"]
    paths = random_report.write(doc, tmp_path, "random-tiny")
    assert json.loads(paths["json"].read_text())["stages"]["round_ar"]["weight_bytes"] > 0
    assert "| verify_ddtree_8 | 9 |" in paths["md"].read_text()


def test_random_shape_accepts_a_raw_config_row():
    raw = dict(get_shape("tiny").target, model_type="llama", tie_word_embeddings=True)
    raw.pop("head_dim")
    doc = run_random_shape(shape_from_dicts("toy-llama", raw, None), StageOptions(context=8, iters=1, warmup=0),
                           device="cpu", log=lambda s: None)
    assert set(doc["stages"]) == {"forward_1", "plain_step", "round_ar"}


def test_random_shape_cli(tmp_path):
    out = tmp_path / "r"
    run = subprocess.run([sys.executable, "-m", "ddtree_server.bench", "--random-shape", "tiny", "--context-len", "16",
                          "--iters", "1", "--budgets", "4", "--tau", "ddtree=2", "--out", str(out)],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    doc = json.loads((out / "random-tiny.json").read_text())
    assert doc["derived"]["projected_speedup"]["ddtree-4"]["tau"] == 2.0
    from typer.testing import CliRunner

    from ddtree_server.cli import app

    bad = CliRunner().invoke(app, ["bench", "--random-shape", "nope", "--out", str(out)])  # no second start-up
    assert bad.exit_code == 2 and "qwen3-8b" in bad.stderr


_BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'fastapi', 'uvicorn', 'pydantic', 'starlette', 'openai', 'gguf'}:
            raise ImportError('absent on the GPU machine: ' + name)
sys.meta_path.insert(0, Block())
import ddtree_server.bench.probe, ddtree_server.bench.probe_kernels, ddtree_server.bench.probe_compile
import ddtree_server.bench.random_shape, ddtree_server.bench.random_report, ddtree_server.commands.bench
import ddtree_server.kernels.gemv, ddtree_server.speculative.tree_gpu, ddtree_server.engine.engine
import ddtree_server.bench.probe_phase2, ddtree_server.bench.probe_attention, ddtree_server.models.dense.fast
import ddtree_server.models.drafter.load, ddtree_server.models.load
import tempfile
ddtree_server.bench.probe.main(["--out", tempfile.mkdtemp(), "--parts", "copy", "--budget-s", "30"])  # env_meta too
print(sorted(m for m in sys.modules if m.split('.')[0] in {'fastapi', 'uvicorn', 'pydantic', 'starlette'}))
"""


def test_probe_import_path_needs_no_api_packages():
    run = subprocess.run([sys.executable, "-c", _BLOCKER], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"


def test_probe_runs_on_cpu(tmp_path):
    from ddtree_server.bench import probe

    rc = probe.main(["--out", str(tmp_path), "--shapes", "tiny", "--context", "16", "--iters", "1",
                     "--parts", "copy,stages,profile,tree", "--budget-s", "120"])
    doc = json.loads((tmp_path / "probe.json").read_text())
    assert rc == 0 and not doc["errors"], doc["errors"]
    assert set(doc["parts"]) == {"copy", "stages", "profile", "tree"}
    assert doc["parts"]["copy"]["gbps_read_write"] > 0 and "round_ar" in doc["parts"]["stages"]["tiny"]["stages"]
    assert set(doc["parts"]["profile"]["tiny"]) == {"plain_step/graphed", "plain_step/eager",
                                                     "verify_ddtree_64/graphed", "verify_ddtree_64/eager"}
    assert doc["parts"]["tree"]["v49152/b64"]["host"] > 0 and (tmp_path / "random-tiny.md").exists()


def test_probe_command_forwards_its_arguments(tmp_path):
    """`ddtree-server probe` is the probe's own parser: its errors and exit codes come through."""
    from typer.testing import CliRunner

    from ddtree_server.cli import app

    res = CliRunner().invoke(app, ["probe", "--out", str(tmp_path), "--parts", "nope"])
    assert res.exit_code == 2 and "--parts: unknown ['nope']" in res.output
    assert not (tmp_path / "probe.json").exists()


def test_random_shape_runs_a_hybrid_target(tmp_path):
    """A Qwen3.5-style hybrid at a named shape: every stage is timed (its cache cannot be truncated:
    pending blocks are dropped, committed rows stay) and the 27B row is in the table."""
    opts = StageOptions(context=24, iters=2, warmup=1, budgets=(4, 8))
    doc = run_random_shape(get_shape("tiny-hybrid"), opts, device="cpu", log=lambda s: None)
    assert {"plain_step", "draft", "verify_ddtree_8", "commit_ddtree_8", "round_ddtree_8"} <= set(doc["stages"])
    assert not doc["skipped"] and all(r["ms"] > 0 for r in doc["stages"].values())
    big = get_shape("qwen3.6-27b")
    assert big.target["hidden_size"] == 5120 and big.target["layer_types"].count("linear_attention") == 48
    assert big.drafter["dflash_config"]["target_layer_ids"] == [1, 16, 31, 46, 61]
