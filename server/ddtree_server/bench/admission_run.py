"""Admitted concurrency, run: as many requests as a memory fraction admits, all at once, through the
batch engine at a published shape (random weights).

``bench.admission`` computes the slots from one slot's bytes; this command allocates them and fills
them: an Engine with ``max_model_len`` = ``--context`` and ``max_running`` = the slots that
``--fraction`` of the free memory after loading holds after the round scratch (as the server sizes
them with ``--kv-memory-fraction``, without the server's cap of 64), then that many requests with
random prompts of ``context - new_tokens`` tokens, added at once, prefilled ``--prefill-chunk``
tokens a step while the requests already prefilled decode, then ``--rounds`` rounds with every
request decoding. Reported: the slots, the most requests decoding in one step, the peak of the
device memory, the Engine's start-up seconds (policy profile, eager reserve, graph captures), the
prefill phase's seconds (from before the start-up), the median round with all of them decoding; or the
out-of-memory error and the step it came at. An operator gets the same engine with
``serve --max-model-len C --max-running N``.

``--kv-layout paged`` runs the paged layout instead: ``--slots`` requests (default 150) on an
engine of ``--max-model-len`` (default: the context; e.g. the model's maximum, which the slot
layout cannot give many requests) whose pages take ``--fraction`` of the free memory after the
slots' own bytes (a hybrid's GDN states); admission holds back what the pages do not hold, so
``most_decoding`` is the concurrency the pages admit (``serve --kv-layout paged --max-running N
--kv-memory-fraction F``). Rounds are timed with every running request decoding.

Usage: python -m ddtree_server.bench.admission_run --shape qwen3.6-27b --context 4096 --fraction 0.9
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
import typer

from ddtree_server.bench.admission import free_after_load, round_scratch_bytes, slot_bytes
from ddtree_server.bench.batch_shape import NoText, random_requests
from ddtree_server.bench.random_shape import random_models
from ddtree_server.bench.report import save_json_md
from ddtree_server.bench.shapes import get_shape
from ddtree_server.engine.engine import Engine, slots_for

GIB = 2 ** 30
PAGED_REQUESTS = 150   # requests of a paged run without --slots


def run(shape: str, context: int, fraction: float, *, new_tokens: int = 512, rounds: int = 8,
        mode: str = "ddtree", budget: int = 16, prefill_chunk: int = 4096, device: str = "cuda",
        dtype: str = "bf16", free_gib: float = 0.0, slots: int | None = None, kv_layout: str = "slot",
        max_model_len: int | None = None, log=print) -> dict:
    """The report document: what was allocated, how far the requests got, memory and times.
    ``slots``: that many instead of what ``fraction`` holds. ``new_tokens`` must outlast the
    prefill phase (steps of ``prefill_chunk`` over all prompts), or the first requests finish before
    the last one decodes and the round with all of them decoding is never timed."""
    target, drafter = random_models(get_shape(shape), device=device, dtype=dtype)
    cuda = device.startswith("cuda")
    free = free_after_load(device, free_gib)
    paged = kv_layout == "paged"
    per, once = (0 if paged else slot_bytes(target, drafter, context)), round_scratch_bytes(target)
    if cuda:
        torch.cuda.empty_cache()   # the slot measured above: its blocks back to the device
    slots = slots or (PAGED_REQUESTS if paged else slots_for(free, per, fraction, cap=1 << 20, once=once))
    doc = {"shape": shape, "context": context, "fraction": fraction, "free_bytes_after_load": free,
           "slot_bytes": per, "round_scratch_bytes": once, "slots": slots, "mode": mode, "budget": budget,
           "new_tokens": new_tokens, "prefill_chunk": prefill_chunk, "dtype": dtype, "torch": torch.__version__,
           "kv_layout": kv_layout, "max_model_len": max_model_len or context,
           "device": torch.cuda.get_device_name(device) if cuda else device}
    log(f"{shape}: free {free / GIB:.1f} GiB, slot {per / 2 ** 20:.1f} MiB, scratch {once / 2 ** 20:.0f} MiB "
        f"-> {slots} slots at fraction {fraction}")
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    step, most, times, t0, prefill_s, engine = 0, 0, [], time.perf_counter(), None, None
    try:
        engine = Engine(target, NoText(), drafter, model_id=shape, max_model_len=max_model_len or context,
                        eos_token_ids=[], tree_budget=budget, max_running=slots, prefill_chunk=prefill_chunk,
                        kv_layout=kv_layout, kv_memory_fraction=fraction)
        doc["engine_start_s"] = round(time.perf_counter() - t0, 2)   # profile, reserve, captures
        mem = engine.batch.memory
        doc.update(kv_pages=mem.kv_pages_free, page_bytes=mem.page_bytes)
        if paged:
            doc["slot_bytes"] = engine.batch.slot_bytes
            log(f"paged: {mem.kv_pages_free} pages of {mem.page_bytes / 2 ** 20:.2f} MiB "
                f"({mem.kv_rows_capacity} tokens), {engine.batch.slot_bytes / 2 ** 20:.1f} MiB per slot")
        reqs = random_requests(engine, slots, mode, context - new_tokens, new_tokens, seed=7)
        for r in reqs:
            engine.batch.add(r)
        while len(times) < rounds and not all(r.finished for r in reqs):
            sync()
            t = time.perf_counter()
            engine.batch.step()
            sync()
            step += 1
            decoding = sum(1 for r in reqs if not r.prefilling and not r.finished)
            settled = decoding == engine.batch.running   # every running request decodes
            most = max(most, decoding)
            if step % 100 == 0:
                mem = f", {torch.cuda.memory_allocated(device) / GIB:.1f} GiB allocated" if cuda else ""
                log(f"step {step}: {decoding} decoding, {time.perf_counter() - t0:.0f} s{mem}")
            if prefill_s is None and settled and (paged or decoding == slots):
                prefill_s = time.perf_counter() - t0
            elif prefill_s is not None and settled and decoding == most:
                times.append(time.perf_counter() - t)
        doc.update(ok=True, error=None)
    except torch.OutOfMemoryError as exc:
        doc.update(ok=False, error=f"out of memory at step {step}: {str(exc).splitlines()[0]}")
    doc.update(steps=step, most_decoding=most, prefill_s=None if prefill_s is None else round(prefill_s, 2),
               round_ms=round(statistics.median(times) * 1e3, 2) if times else None, rounds_timed=len(times))
    if cuda:
        doc["graph_pool_bytes"] = graph_pools(engine) if engine is not None else {}
        gp = getattr(getattr(getattr(engine, "batch", None), "runner", None), "graph_pool", None)
        doc.update(graphs_captured=getattr(gp, "captured", None), graphs_refused=getattr(gp, "refused", None),
                   eager_reserve_bytes=getattr(gp, "reserve", None), graph_pool_taken_bytes=getattr(gp, "pool_bytes", None),
                   graph_capture_s=round(getattr(gp, "capture_s", 0.0), 2))
        log(f"graph pools: { {k: f'{v / GIB:.2f} GiB' for k, v in doc['graph_pool_bytes'].items()} }; "
            f"eager reserve {(doc['eager_reserve_bytes'] or 0) / GIB:.2f} GiB")
        gp_peak = gp.peak_allocated() if gp is not None else 0   # captures' warm-ups reset the statistic
        doc.update(peak_allocated_bytes=max(gp_peak, torch.cuda.max_memory_allocated(device)),
                   peak_reserved_bytes=torch.cuda.max_memory_reserved(device),
                   total_bytes=torch.cuda.get_device_properties(device).total_memory)
    log(f"ok={doc['ok']} most decoding {most} of {slots}; {doc['error'] or ''}")
    return doc


def graph_pools(engine) -> dict[str, int]:
    """Bytes of the allocator's segments in CUDA graph pools, by the graphs that own the pool (the
    batched rounds' one pool, target and drafter: ``graph_pool.py``; the per-request target /
    drafter graphs, the solo round); a pool no longer held by any of them by its id."""
    runner = getattr(getattr(engine, "batch", None), "runner", None)
    owners = {}
    shared = getattr(getattr(runner, "graph_pool", None), "handle", None)
    if shared is not None:
        owners[tuple(shared)] = "batched rounds (target + drafter)"
    for name, obj in (("solo round", getattr(runner, "solo", None)),
                      ("target alone", getattr(engine, "target", None)), ("drafter alone", getattr(engine, "drafter", None))):
        pool = getattr(obj, "_pool", None)
        if pool is not None:
            owners[tuple(pool)] = name
    out: dict[str, int] = {}
    for seg in torch.cuda.memory_snapshot():
        pid = tuple(seg.get("segment_pool_id") or (0, 0))
        if pid != (0, 0):
            key = owners.get(pid, f"pool {pid}")
            out[key] = out.get(key, 0) + int(seg["total_size"])
    return out


def write(doc: dict, out: Path) -> dict[str, Path]:
    """``admission-run-<shape>-<context>.json`` and ``.md`` under ``out``."""
    d = doc
    peak = f"{d['peak_allocated_bytes'] / GIB:.1f}" if "peak_allocated_bytes" in d else "-"
    lines = [f"# Admission run, {d['shape']} at context {d['context']} ({d['device']}, {d['dtype']})", "",
             f"Fraction {d['fraction']} of {d['free_bytes_after_load'] / GIB:.1f} GiB free after loading, less the "
             f"round scratch ({d['round_scratch_bytes'] / 2 ** 20:.0f} MiB), over {d['slot_bytes'] / 2 ** 20:.1f} MiB "
             f"a slot: **{d['slots']} slots**; {d['slots']} requests of {d['context'] - d['new_tokens']} prompt "
             f"tokens + {d['new_tokens']} new ({d['mode']}, budget {d['budget']}), prefill chunk {d['prefill_chunk']}.",
             "", "| result | most decoding at once | steps | engine start s | prefill phase s (start incl.) "
             "| round ms (all decoding) | peak allocated GiB |",
             "|---|---:|---:|---:|---:|---:|---:|",
             f"| {'ran' if d['ok'] else d['error']} | {d['most_decoding']} | {d['steps']} | {d.get('engine_start_s')} | "
             f"{d['prefill_s']} | "
             f"{d['round_ms']} | {peak} |"]
    return save_json_md(doc, lines, out, f"admission-run-{d['shape']}-{d['context']}")


def main(shape: str = typer.Option("qwen3.6-27b", help="bench.shapes name"),
         context: int = typer.Option(4096, help="max-model-len and each request's prompt + new tokens"),
         fraction: float = typer.Option(0.9, help="share of the free memory after loading for the slots"),
         new_tokens: int = typer.Option(512), rounds: int = typer.Option(8, help="rounds timed with all decoding"),
         mode: str = typer.Option("ddtree"), budget: int = typer.Option(16, help="tree budget"),
         prefill_chunk: int = typer.Option(4096, help="prompt tokens per engine step"),
         device: str = typer.Option("cuda"), dtype: str = typer.Option("bf16"),
         free_gib: float = typer.Option(0.0, help="free memory to assume (GiB; 0: the device's, after loading)"),
         slots: int = typer.Option(0, help="run this many requests instead of what --fraction holds (0: those; "
                                   "paged: 150)"),
         kv_layout: str = typer.Option("slot", help="slot | paged (see the module docstring)"),
         max_model_len: int = typer.Option(0, help="the engine's max-model-len (0: --context)"),
         out: Path = typer.Option(Path("admission"), help="report folder")) -> None:
    from ddtree_server.commands.serve import ALLOC_CONF_DEFAULT, ALLOC_CONF_ENV

    os.environ.setdefault(ALLOC_CONF_ENV, ALLOC_CONF_DEFAULT)   # as the server (before CUDA starts)
    doc = run(shape, context, fraction, new_tokens=new_tokens, rounds=rounds, mode=mode, budget=budget,
              prefill_chunk=prefill_chunk, device=device, dtype=dtype, free_gib=free_gib, slots=slots or None,
              kv_layout=kv_layout, max_model_len=max_model_len or None)
    doc["alloc_conf"] = os.environ[ALLOC_CONF_ENV]
    write(doc, out)
    if not doc["ok"]:
        raise typer.Exit(1)


if __name__ == "__main__":
    typer.run(main)
