"""Where a batched engine step's time goes: the device kernels of a few steps at a published shape.

Random weights at the shape (bench/shapes.py), the server's batch engine on one KV layout: ``--batch``
requests of ``--mode`` with random prompts of ``--context`` tokens are prefilled, a few steps run
to warm up (graph captures), then ``--steps`` steps are timed and profiled with ``torch.profiler``.
Reported: the step's wall time, the device time the kernels of a step take (their sum: less than
the wall time when the host, launches or copies keep the device waiting) and the kernels by
device time per step (name, calls and ms per step), so a slow round can be told host-bound from
kernel-bound and its costly kernels named. ``--host``: then the same steps again under ``cProfile``
(Python's profiler; its own overhead inflates the times), the host functions by their own time per
step, so a host-bound step's Python can be named too.

Usage: python -m ddtree_server.bench.round_profile --shape qwen3.6-27b --batch 1 --mode ddtree --kv-layout paged
"""

from __future__ import annotations

import cProfile
import pstats
import time
from pathlib import Path

import torch
import typer

from ddtree_server.bench.batch_shape import NoText, random_requests
from ddtree_server.bench.random_shape import build_engine, resolve_device
from ddtree_server.bench.report import save_json_md
from ddtree_server.bench.shapes import get_shape


def profile(shape: str, batch: int, mode: str, layout: str, *, context: int = 4096, steps: int = 5,
            warmup: int = 3, device: str = "auto", dtype: str | None = None, top: int = 25, host: bool = False) -> dict:
    """The report document (see the module docstring)."""
    device, dtype = resolve_device(device, dtype)
    spec = get_shape(shape)
    bs = (spec.drafter or {}).get("block_size") or 16
    engine = build_engine(spec, device=device, dtype=dtype, max_len=context + (2 * steps + warmup + 2) * bs + 2,
                          max_running=batch, kv_layout=layout)
    engine.tokenizer = engine.tokenizer or NoText()
    cuda = engine.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(engine.device)) if cuda else (lambda: None)
    reqs = random_requests(engine, batch, mode, context, (2 * steps + warmup + 2) * bs, seed=batch)
    for r in reqs:
        engine.batch.add(r)
    while any(r.prefilling for r in reqs):
        engine.batch.step()
    for _ in range(warmup):
        engine.batch.step()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    sync()
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.batch.step()
        sync()
        wall = (time.perf_counter() - t0) / steps
    kernels = _kernels(prof, cuda, steps)
    funcs = _host(engine, steps, sync, top) if host else []
    doc = {"shape": shape, "batch": batch, "mode": mode, "kv_layout": layout, "context": context, "steps": steps,
           "device": torch.cuda.get_device_name(engine.device) if cuda else str(engine.device), "dtype": dtype,
           "torch": torch.__version__, "step_ms": round(wall * 1e3, 3),
           "kernel_ms_per_step": round(sum(k["ms_per_step"] for k in kernels), 3),
           "kernels": kernels[:top], "kernel_kinds": len(kernels), "host_functions": funcs}
    for r in reqs:
        engine.batch.abort(r)
    return doc


def _kernels(prof, cuda: bool, steps: int) -> list[dict]:
    """Device kernels (CPU ops off CUDA) by their own time per step, most first."""
    out = []
    for ev in prof.key_averages():
        us = ev.self_device_time_total if cuda else ev.self_cpu_time_total
        if us <= 0 or (cuda and ev.device_type != torch.autograd.DeviceType.CUDA):
            continue
        out.append({"name": ev.key[:120], "calls_per_step": round(ev.count / steps, 2),
                    "ms_per_step": round(us / 1e3 / steps, 4)})
    return sorted(out, key=lambda k: -k["ms_per_step"])


def _host(engine, steps: int, sync, top: int) -> list[dict]:
    """``steps`` more steps under cProfile: the host functions by their own time per step, most first."""
    prof = cProfile.Profile()
    sync()
    prof.enable()
    for _ in range(steps):
        engine.batch.step()
    sync()
    prof.disable()
    stats = pstats.Stats(prof).stats   # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{Path(f).name}:{line}({name})", "calls_per_step": round(v[0] / steps, 2),
             "own_ms_per_step": round(v[2] * 1e3 / steps, 4), "cumulative_ms_per_step": round(v[3] * 1e3 / steps, 4)}
            for (f, line, name), v in rows]


def write(doc: dict, out: Path) -> dict[str, Path]:
    """``round-profile-<shape>-<layout>-b<batch>-<mode>.json`` and ``.md`` under ``out``."""
    d = doc
    lines = [f"# One engine step, {d['shape']} ({d['device']}, {d['dtype']}): batch {d['batch']}, {d['mode']}, "
             f"{d['kv_layout']} KV layout, context {d['context']}", "",
             f"Step {d['step_ms']} ms of wall time; the device kernels of a step take {d['kernel_ms_per_step']} ms "
             f"({d['kernel_kinds']} kinds; the top {len(d['kernels'])} below; per step: over {d['steps']} steps / {d['steps']}).",
             "", "| kernel | calls per step | ms per step |", "|---|---:|---:|"]
    lines += [f"| `{k['name']}` | {k['calls_per_step']} | {k['ms_per_step']} |" for k in d["kernels"]]
    if d.get("host_functions"):
        lines += ["", "Host functions under cProfile (its overhead included), by own time per step:", "",
                  "| function | calls per step | own ms per step | cumulative ms per step |", "|---|---:|---:|---:|"]
        lines += [f"| `{h['function']}` | {h['calls_per_step']} | {h['own_ms_per_step']} | {h['cumulative_ms_per_step']} |"
                  for h in d["host_functions"]]
    return save_json_md(doc, lines, out, f"round-profile-{d['shape']}-{d['kv_layout']}-b{d['batch']}-{d['mode']}")


def main(shape: str = typer.Option("qwen3.6-27b", help="bench.shapes name"),
         batch: int = typer.Option(1), mode: str = typer.Option("ddtree", help="ar | dflash | ddtree"),
         kv_layout: str = typer.Option("paged", help="slot | paged"),
         context: int = typer.Option(4096, help="prompt tokens of each request"),
         steps: int = typer.Option(5, help="steps profiled"), device: str = typer.Option("auto"),
         dtype: str = typer.Option(None), out: Path = typer.Option(Path("round-profile"), help="report folder"),
         host: bool = typer.Option(False, help="also the host functions under cProfile")) -> None:
    doc = profile(shape, batch, mode, kv_layout, context=context, steps=steps, device=device, dtype=dtype, host=host)
    paths = write(doc, out)
    print(f"step {doc['step_ms']} ms, kernels {doc['kernel_ms_per_step']} ms per step: {paths['md']}")


if __name__ == "__main__":
    typer.run(main)
