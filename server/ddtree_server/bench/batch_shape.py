"""``bench --random-shape NAME --batch B[,B2...]``: batched step and round times at a published shape.

Random weights at the shape (bench/shapes.py), the server's batch engine: for each batch size b,
b requests with random prompts of ``--context-len`` tokens are prefilled, then whole engine steps
are timed (median over ``--iters``): a plain-decoding step (every request ``ar``), a DFlash
round (every request a drafted chain) and a DDTree round (every request a tree of the engine's
default budget); random drafter weights, so drafts are rarely accepted: the round's time is what
counts. Reported per b: step / round ms, aggregate plain tokens/s (b / step), and the projected
DFlash tokens/s at each given tau (b * tau / round), with the ratio to batch 1. Batch 1 runs the
per-request path (CUDA graphs + Triton kernels on the GPU); larger batches the batched forward
(engine/batch/forward.py), graph-replayed (engine/batch/graphs.py) for dense rounds and for hybrid
plain, DFlash and DDTree rounds up to 2,560 rows (``DDTREE_BATCH_GRAPHS=0``: eager, to compare).
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from ddtree_server.bench.report import save_json_md
from ddtree_server.bench.random_shape import build_engine, resolve_device
from ddtree_server.bench.shapes import Shape


class NoText:
    """Random-weight shapes have no tokenizer: the stop rules then see empty text."""

    eos_token_id = None

    def decode(self, ids, **kw) -> str:
        return ""


def _time_steps(engine, reqs, iters: int, warmup: int, sync) -> float:
    """Median seconds of one decode step with every request of ``reqs`` running."""
    times = []
    for i in range(warmup + iters):
        sync()
        t0 = time.perf_counter()
        engine.batch.step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def random_requests(engine, b: int, mode: str, context: int, tokens: int, seed: int):
    """``b`` requests of ``engine`` with random prompts of ``context`` tokens and ``tokens`` new ones."""
    from ddtree_server.engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(seed)
    vocab = int(engine.target.config.vocab_size)
    out = []
    for i in range(b):
        ids = torch.randint(0, vocab, (context,), generator=g).tolist()
        out.append(engine.make_request(ids, SamplingParams(max_tokens=tokens, ignore_eos=True), mode=mode,
                                       rid=f"{mode}{i}"))
    return out


def measure_batches(shape: Shape, batches: list[int], *, context: int, iters: int, device: str = "auto",
                    dtype: str | None = None, tau: dict[str, float] | None = None, warmup: int = 3,
                    log: Callable[[str], None] = print, layouts: list[str] | tuple = ("slot",)) -> dict:
    """The report document (meta + one row per KV layout, batch size and mode). ``layouts``: the
    target's KV layouts to measure, one engine after the other (the paged one with pages for
    every slot at the engine's max_len: the same capacity, nothing preempted)."""
    device, dtype = resolve_device(device, dtype)
    bs = (shape.drafter or {}).get("block_size") or 16
    steps = warmup + iters + 2
    max_len = context + steps * bs + 2
    rows, engine = [], None
    for layout in layouts:
        engine = None
        gc.collect()   # the previous layout's engine (its graphs and pools) before the next one is built
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
        engine = build_engine(shape, device=device, dtype=dtype, max_len=max_len, max_running=max(batches),
                              kv_layout=layout)
        rows += _measure_layout(engine, layout, batches, context, iters, warmup, steps * bs, log)
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    for r in rows:
        first = next(x for x in rows if x["mode"] == r["mode"] and x["batch"] == batches[0] and x["layout"] == r["layout"])
        r["step_vs_first_batch"] = round(r["step_ms"] / first["step_ms"], 3)
        if r["mode"] == "dflash":
            r["projected_tokens_per_s"] = {k: round(r["batch"] * t / (r["step_ms"] / 1e3), 1)
                                           for k, t in (tau or {}).items() if k == "dflash"}
        if r["layout"] != "slot" and "slot" in layouts:
            slot = next(x for x in rows if x["layout"] == "slot" and x["mode"] == r["mode"] and x["batch"] == r["batch"])
            r["vs_slot"] = round(r["step_ms"] / slot["step_ms"], 3)
    dev = engine.device
    meta = {"shape": shape.name, "device": device, "dtype": dtype, "context": context, "iters": iters,
            "batches": batches, "layouts": list(layouts), "modes": modes, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None}
    return {"meta": meta, "rows": rows}


def _measure_layout(engine, layout: str, batches: list[int], context: int, iters: int, warmup: int, tokens: int,
                    log) -> list[dict]:
    dev = engine.device
    engine.tokenizer = engine.tokenizer or NoText()
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    modes = ["ar"] + (["dflash", "ddtree"] if engine.spec_available else [])
    rows = []
    for b in batches:
        for mode in modes:
            reqs = random_requests(engine, b, mode, context, tokens, seed=b)
            for r in reqs:
                engine.batch.add(r)
            while any(r.prefilling for r in reqs):   # the prefill steps of all b prompts (chunked)
                engine.batch.step()
            sec = _time_steps(engine, reqs, iters, warmup, sync)
            for r in reqs:
                engine.batch.abort(r)
            rows.append({"layout": layout, "batch": b, "mode": mode, "step_ms": round(sec * 1e3, 3),
                         "plain_tokens_per_s" if mode == "ar" else "round_tokens_per_s_at_tau1": round(b / sec, 1)})
            log(f"{layout} b={b} {mode}: {sec * 1e3:.2f} ms per step")
    return rows


def write(doc: dict, out_dir: str | Path, stem: str) -> dict[str, Path]:
    """``<stem>.json`` and ``<stem>.md`` under out_dir."""
    m = doc["meta"]
    lines = [f"# Batched steps, {m['shape']} (random weights), {m['device']} {m['dtype']}, context {m['context']}",
             "", "| KV layout | batch | mode | step ms | x batch-first step | x slot layout | tokens/s (plain; dflash at "
             "tau 1) | projected |", "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in doc["rows"]:
        tps = r.get("plain_tokens_per_s", r.get("round_tokens_per_s_at_tau1"))
        proj = ", ".join(f"{k}: {v}" for k, v in r.get("projected_tokens_per_s", {}).items())
        lines.append(f"| {r.get('layout', 'slot')} | {r['batch']} | {r['mode']} | {r['step_ms']} | "
                     f"{r['step_vs_first_batch']} | {r.get('vs_slot', '')} | {tps} | {proj} |")
    return save_json_md(doc, lines, out_dir, stem)
