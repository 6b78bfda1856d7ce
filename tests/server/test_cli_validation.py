"""Bad command lines of bench / exactness / train-drafter: a clear message and exit 2 (usage) or 1
(bad files), never a traceback. Runs on a CPU-only machine (CUDA is then 'not available')."""

from __future__ import annotations

import json

import pytest
import torch
import typer
from typer.testing import CliRunner

from ddtree_server.bench.exactness import main as exactness_main
from ddtree_server.cli import app

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")


def _exactness_app() -> typer.Typer:
    one = typer.Typer(rich_markup_mode=None)
    one.command()(exactness_main)
    return one


def _run(application, args):
    res = CliRunner().invoke(application, args)
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    return res.exit_code, " ".join(res.output.split())  # rich wraps long lines


@pytest.mark.parametrize("args,code,text", [
    (["--device", "gpu"], 2, "use auto, cpu, cuda or cuda:N"),
    (["--device", "cuda:x"], 2, "use auto, cpu, cuda or cuda:N"),
    (["--budgets", "0"], 2, "budgets >= 1"),
    (["--budgets", ","], 2, "budgets >= 1"),
    (["--budgets", "x"], 2, "--budgets"),
    (["--prompts", "0"], 2, "--prompts"),
    (["--dtype", "fp16"], 2, "use fp32 or bf16"),
])
def test_exactness_usage_errors(args, code, text):
    got, out = _run(_exactness_app(), ["--device", "cpu", *args] if "--device" not in args else args)
    assert got == code and text in out, out


@NO_CUDA
def test_cuda_requested_without_cuda_is_a_usage_error(tmp_path):
    assert _run(_exactness_app(), ["--device", "cuda"])[0] == 2
    code, out = _run(app, ["bench", "--device", "cuda", "--out", str(tmp_path)])
    assert code == 2 and "CUDA is not available" in out
    code, out = _run(app, ["train-drafter", "--out", str(tmp_path / "d"), "--steps", "1", "--device", "cuda"])
    assert code == 2 and "CUDA is not available" in out


def test_exactness_missing_drafter_is_a_clean_failure(tmp_path):
    code, out = _run(_exactness_app(), ["--device", "cpu", "--drafter", str(tmp_path / "nope")])
    assert code == 1 and "exactness failed" in out


@pytest.mark.parametrize("args,text", [
    (["--datasets", ","], "--datasets"),
    (["--modes", "foo"], "--modes"),
    (["--budgets", "0"], "budgets >= 1"),
    (["--max-prompts", "-1"], "--max-prompts"),
    (["--random-shape", "tiny", "--interference", "64", "--prefill-chunk", "-8"], "--prefill-chunk"),
])
def test_bench_usage_errors(tmp_path, args, text):
    code, out = _run(app, ["bench", "--device", "cpu", "--out", str(tmp_path), *args])
    assert code == 2 and text in out, out


def test_bench_merge_refuses_bad_inputs(tmp_path):
    code, out = _run(app, ["bench", "--merge", str(tmp_path / "missing.json"), "--out", str(tmp_path)])
    assert code == 1 and "merge failed" in out
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"meta": {"settings": {"max_new_tokens": 8}}, "records": [], "stages": []}))
    code, out = _run(app, ["bench", "--merge", str(a), "--merge", str(a), "--out", str(tmp_path)])
    assert code == 1 and "given twice" in out
    b = tmp_path / "b.json"
    b.write_text(json.dumps({"meta": {"settings": {"max_new_tokens": 4}}, "records": [], "stages": []}))
    code, out = _run(app, ["bench", "--merge", str(a), "--merge", str(b), "--out", str(tmp_path)])
    assert code == 1 and "max_new_tokens" in out


@pytest.mark.parametrize("args,text", [
    (["--drain-timeout", "-1"], "error: --drain-timeout: "),
    (["--drain-timeout", "nan"], "error: --drain-timeout: "),
    (["--kv-memory-fraction", "0"], "error: --kv-memory-fraction: "),
    (["--kv-memory-fraction", "1.5"], "error: --kv-memory-fraction: "),
    (["--prefill-chunk", "-1"], "error: --prefill-chunk: "),
])
def test_serve_usage_errors_name_the_flag_as_typed(args, text):
    """The message names the flag the operator typed (was `--drain-timeout-s`, the config field)."""
    code, out = _run(app, ["serve", "--device", "cpu", *args])
    assert code == 2 and text in out and "--drain-timeout-s" not in out, out


@pytest.mark.parametrize("args,text", [
    (["--seed", str(2**63)], "--seed"),
    (["--seed", str(-(2**63) - 1)], "--seed"),
    (["--top-p", "0"], "--top-p"),
    (["--gguf", "/nonexistent.gguf"], "--gguf /nonexistent.gguf: no such file"),
])
def test_generate_usage_errors_before_loading(args, text):
    """Options generate cannot use are exit 2 with the flag named, before any model loads (a seed
    beyond 64 bits was a traceback after loading; --top-p 0 exit 1; pydantic's "Value error, "
    prefix leaked)."""
    code, out = _run(app, ["generate", "hi", "--device", "cpu", *args])
    assert code == 2 and text in out and "Value error" not in out and "Traceback" not in out, out


def test_bench_never_writes_to_the_working_directorys_docs_benchmarks_by_default(tmp_path, monkeypatch):
    """Without --out the report goes to a new folder under $XDG_STATE_HOME/ddtree-server/bench/, so
    running `bench` from a checkout never overwrites the committed results in docs/benchmarks."""
    from ddtree_server.commands.bench import default_out_dir

    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs" / "benchmarks").mkdir(parents=True)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert default_out_dir().parent == tmp_path / "state" / "ddtree-server" / "bench"
    code, out = _run(app, ["bench", "--merge", str(tmp_path / "missing.json")])
    assert code == 1 and "report folder:" in out                        # rich may wrap the long path
    assert f"{tmp_path / 'state' / 'ddtree-server' / 'bench'}/" in out.replace(" ", "")
    assert list((tmp_path / "docs" / "benchmarks").iterdir()) == []
