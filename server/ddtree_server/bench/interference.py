"""``bench --random-shape NAME --interference N``: what a long prompt arriving costs running streams.

Random weights at the shape (bench/shapes.py), the server's batch engine. For each prefill chunk
setting (``--prefill-chunk``, e.g. ``512,0``; 0 = the whole prompt in one step): ``--batch`` B
requests (default 4) with random prompts of ``--context-len`` tokens are prefilled and decode
(plain decoding, or DFlash chains with ``--modes dflash``); ``--iters`` steps are timed as the
baseline; then a prompt of N random tokens arrives and every step is timed until its first token.
Each of those steps gives every running request one round, so a step's time is the running
requests' time per output token (TPOT; one token per round at random weights). Reported per
setting: baseline step p50, the steps the long prefill took, the worst and p50 step during it
(the TPOT the running requests saw), and the long prompt's time to first token.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from ddtree_server.bench.batch_shape import NoText
from ddtree_server.bench.report import save_json_md
from ddtree_server.bench.random_shape import build_engine, resolve_device
from ddtree_server.bench.shapes import Shape


def _timed_step(engine, sync) -> float:
    sync()
    t0 = time.perf_counter()
    engine.batch.step()
    sync()
    return time.perf_counter() - t0


def _prompt(g: torch.Generator, vocab: int, n: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def measure_interference(shape: Shape, long_prompt: int, chunks: list[int], *, batch: int = 4, context: int = 1024,
                         iters: int = 20, mode: str = "ar", device: str = "auto", dtype: str | None = None,
                         log: Callable[[str], None] = print) -> dict:
    """The report document (meta + one row per chunk setting)."""
    from ddtree_server.engine.sampling import SamplingParams

    device, dtype = resolve_device(device, dtype)
    bs = (shape.drafter or {}).get("block_size") or 16
    max_len = max(context + 4 * (iters + 8) * bs, long_prompt + 8) + 2
    engine = build_engine(shape, device=device, dtype=dtype, max_len=max_len, max_running=batch + 1)
    engine.tokenizer = engine.tokenizer or NoText()
    dev = engine.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    vocab = int(engine.target.config.vocab_size)
    if mode != "ar" and not engine.spec_available:
        raise ValueError(f"mode {mode} needs a drafter; shape {shape.name} has none")
    rows = []
    for chunk in chunks:
        engine.batch.prefill_chunk = chunk or None
        g = torch.Generator().manual_seed(chunk)
        reqs = [engine.make_request(_prompt(g, vocab, context), SamplingParams(max_tokens=max_len, ignore_eos=True),
                                    mode=mode, rid=f"run{i}") for i in range(batch)]
        for r in reqs:
            engine.batch.add(r)
        while any(r.prefilling for r in reqs) or engine.batch.scheduler.waiting:
            engine.batch.step()
        for _ in range(3):   # warm-up rounds (graph capture, autotuning)
            _timed_step(engine, sync)
        base = [_timed_step(engine, sync) for _ in range(iters)]
        long = engine.make_request(_prompt(g, vocab, long_prompt), SamplingParams(max_tokens=1, ignore_eos=True),
                                   mode="ar", rid="long")
        t0 = time.perf_counter()
        engine.batch.add(long)
        during = []
        while not long.events:
            during.append(_timed_step(engine, sync))
        ttft = time.perf_counter() - t0
        for r in reqs:
            engine.batch.abort(r)
        engine.batch.abort(long)
        row = {"prefill_chunk": chunk, "base_step_ms": round(1e3 * statistics.median(base), 3),
               "prefill_steps": len(during), "worst_step_ms": round(1e3 * max(during), 3),
               "p50_step_ms": round(1e3 * statistics.median(during), 3), "long_ttft_s": round(ttft, 3)}
        row["worst_vs_base"] = round(row["worst_step_ms"] / row["base_step_ms"], 2)
        rows.append(row)
        log(f"chunk {chunk or 'whole'}: base {row['base_step_ms']} ms, {len(during)} steps during the prefill, "
            f"worst {row['worst_step_ms']} ms, TTFT {ttft:.2f} s")
    meta = {"shape": shape.name, "device": device, "dtype": dtype, "context": context, "batch": batch,
            "mode": mode, "long_prompt": long_prompt, "iters": iters, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None}
    return {"meta": meta, "rows": rows}


def write(doc: dict, out_dir: str | Path, stem: str) -> dict[str, Path]:
    """``<stem>.json`` and ``<stem>.md`` under out_dir."""
    m = doc["meta"]
    lines = [f"# A {m['long_prompt']}-token prompt arriving while {m['batch']} requests decode ({m['mode']}), "
             f"{m['shape']} (random weights), {m['device']} {m['dtype']}, context {m['context']}", "",
             "Running requests' time per output token = the step time (one round per step).", "",
             "| prefill chunk | base step ms (p50) | steps of the prefill | worst step ms | p50 step ms "
             "| worst / base | long prompt TTFT s |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in doc["rows"]:
        lines.append(f"| {r['prefill_chunk'] or 'whole'} | {r['base_step_ms']} | {r['prefill_steps']} | "
                     f"{r['worst_step_ms']} | {r['p50_step_ms']} | {r['worst_vs_base']} | {r['long_ttft_s']} |")
    return save_json_md(doc, lines, out_dir, stem)
