"""One benchmark session: load prompts and models, run, profile stages, write the report.

Kept apart from the Typer command so that `python -m ddtree_server.bench` and `ddtree-server bench`
share it. Output under `out_dir`: `<stem>.records.jsonl` (written as results arrive),
`<stem>.json`, `<stem>.md`, `<stem>.png` (see bench/report.py).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from ddtree_server.data.datasets import load_datasets
from ddtree_server.bench.report import write_report
from ddtree_server.bench.runner import BenchRun, BenchSettings


@dataclass
class SessionOptions:
    """Paths and choices of a benchmark session."""

    out_dir: Path
    datasets: list[str]
    settings: BenchSettings
    max_prompts: int | None = 32
    target: Path | None = None
    gguf: Path | None = None
    drafter: Path | None = None
    target_layer_ids: list[int] | None = None
    data_dir: Path | None = None
    download: bool = True
    device: str = "auto"
    dtype: str | None = None
    commit: str | None = None
    stem: str = "bench"
    stage_budget: int = 64
    drafter_graphs: bool = False  # wrap the drafter in GraphedDrafter on CUDA if the engine did not


def commit_id(given: str | None = None) -> str:
    """The commit a benchmark ran at: ``given``, else ``$DDTREE_COMMIT``, else ``git rev-parse HEAD``
    of this checkout, else "unknown"."""
    if given:
        return given
    if os.environ.get("DDTREE_COMMIT"):
        return os.environ["DDTREE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _meta(opts: SessionOptions, engine, device: str, dtype: str) -> dict:
    import torch
    import transformers

    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": commit_id(opts.commit),
            "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() or "cpu",
            "device": device, "dtype": dtype, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "target": str(opts.target or opts.gguf or "embedded SmolLM2 GGUF"),
            "drafter": str(opts.drafter or "shipped default"), "max_prompts_per_dataset": opts.max_prompts,
            "settings": asdict(opts.settings), "engine": list(getattr(engine, "messages", []))}
    if engine.drafter is not None:
        cfg = engine.drafter.config
        meta["drafter_config"] = {"layers": cfg.num_hidden_layers, "block_size": cfg.block_size,
                                  "target_layer_ids": list(cfg.target_layer_ids), "mask_token_id": cfg.mask_token_id}
    return meta


def _drafter_graphs(engine, wanted: bool) -> str:
    """Wrap the engine's drafter in GraphedDrafter (CUDA only); returns who graphs it."""
    from ddtree_server.models.drafter.model import DFlashDrafter
    from ddtree_server.models.drafter.graphs import GraphedDrafter

    d = engine.drafter
    if d is None or engine.device.type != "cuda":
        return "off"
    if isinstance(d, GraphedDrafter):
        return "engine"
    if wanted and isinstance(d, DFlashDrafter):
        engine.drafter = GraphedDrafter(d)
        return "bench"
    return "off"


def run_session(opts: SessionOptions, log: Callable[[str], None] = print) -> dict[str, Path]:
    """Run the whole session; returns the written report paths. Raises DataFileError / model load errors."""
    import torch

    from ddtree_server.bench.hf_baseline import HFBaseline
    from ddtree_server.bench.stages import stage_split
    from ddtree_server.engine.factory import load_engine
    from ddtree_server.models import default
    from ddtree_server.models.common import resolve_dtype
    from ddtree_server.models.load import gguf_to_folder

    t_start = time.monotonic()  # the time budget counts model loading and warm-up too
    prompts = load_datasets(opts.datasets, opts.data_dir, opts.max_prompts, download=opts.download)
    log("prompts: " + ", ".join(f"{k} {len(v)}" for k, v in prompts.items()))
    device = opts.device if opts.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = opts.dtype or ("bf16" if device.startswith("cuda") else "fp32")
    engine = load_engine(target=opts.target, gguf=opts.gguf, drafter=opts.drafter,
                         target_layer_ids=opts.target_layer_ids, device=device, dtype=dtype,
                         max_running=1)  # the per-request table runs one request at a time
    for line in engine.messages:
        log(line)
    graphs = _drafter_graphs(engine, opts.drafter_graphs)
    log(f"drafter CUDA graphs: {graphs}")
    hf = None
    if opts.settings.hf_prompts > 0:
        gguf, sha = opts.gguf, None
        if opts.target is None and gguf is None:
            gguf, sha = default.default_gguf_path(verify=False), default.DEFAULT_GGUF_SHA256
        folder = opts.target if opts.target is not None else gguf_to_folder(Path(gguf), sha)
        hf = HFBaseline.load(target=folder, gguf=None, device=device, dtype=resolve_dtype(dtype),
                             eos_token_ids=list(engine.eos_token_ids))
    out = Path(opts.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sink_path = out / f"{opts.stem}.records.jsonl"
    with open(sink_path, "w", encoding="utf-8") as sink:
        def emit(rec: dict) -> None:
            sink.write(json.dumps(rec) + "\n")
            sink.flush()

        run = BenchRun(engine, opts.settings, emit, hf=hf, log=log, t_start=t_start)
        records = run.run(prompts)
    stages = []
    if engine.drafter is not None:
        for ds, ps in prompts.items():
            ids = engine.encode(ps[0].text)
            for mode, budget in (("dflash", None), ("ddtree", opts.stage_budget)):
                st = stage_split(engine, ids, mode, budget, opts.settings.max_new_tokens)
                st.update(dataset=ds, prompt_id=ps[0].id)
                stages.append(st)
    meta = _meta(opts, engine, device, dtype)
    meta["drafter_cuda_graphs"] = graphs if getattr(engine.drafter, "enabled", True) else graphs + " (disabled itself)"
    paths = write_report(records, meta, stages, out, opts.stem)
    paths["records"] = sink_path
    return paths


def merge_reports(inputs: list[Path], out_dir: Path, stem: str = "bench") -> dict[str, Path]:
    """Combine earlier `<stem>.json` (or `.records.jsonl`) files of split runs into one report;
    meta is taken from the first json, stages and records are concatenated.

    Raises ValueError for a file given twice or reports whose settings (new tokens, budgets,
    T=1 budget, modes, seed), commit or drafter differ; OSError / JSONDecodeError for unreadable
    files."""
    records, stages, meta = [], [], {}
    seen: set[Path] = set()
    for p in inputs:
        p = Path(p)
        if p.resolve() in seen:
            raise ValueError(f"{p} is given twice")
        seen.add(p.resolve())
        if p.suffix == ".jsonl":
            records += [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
            continue
        doc = json.loads(p.read_text())
        records += doc["records"]
        stages += doc.get("stages", [])
        other = dict(doc.get("meta", {}))
        if meta:
            _check_same_run(meta, other, p)
        meta = meta or other
    meta["merged_from"] = [str(p) for p in inputs]
    return write_report(records, meta, stages, out_dir, stem)


def _check_same_run(first: dict, other: dict, path: Path) -> None:
    """ValueError when two reports were not made with the same settings, commit and drafter."""
    keys = ("max_new_tokens", "budgets", "t1_budget", "modes", "seed")
    a, b = first.get("settings", {}), other.get("settings", {})
    for key in keys:
        if a.get(key) != b.get(key):
            raise ValueError(f"{path}: setting {key} = {b.get(key)!r} differs from the first report's {a.get(key)!r}")
    for key in ("commit", "drafter", "dtype"):
        if first.get(key) != other.get(key):
            raise ValueError(f"{path}: {key} = {other.get(key)!r} differs from the first report's {first.get(key)!r}")
