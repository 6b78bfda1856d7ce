"""Batched attention over a page pool against the slot pool: the cost of reading K/V through page
tables at the real shapes (random K/V; one attention layer; CUDA graphs).

For each shape (its attention heads, KV heads, head dim), context length and batch size, every
request attends with n new rows (1: plain decoding; 16: a chain or a small tree) over ``context``
live rows, once from the slot pool ``[b, kv_heads, rows, d]`` (today's layout) and once from a page
pool ``[pages, kv_heads, 16, d]`` whose pages hold the same rows, either in a random order
(``shuffled``: the worst case for locality, a long-running server's free list after much churn) or
in ascending order (``ascending``: a fresh server's free list). Reported: the median time of each
launch replayed from a CUDA graph, the ratio paged / slot, whether the outputs are bitwise equal,
and the extra time per target forward (the difference times the shape's attention layers).

``--variants 0,2,4`` (with ``--stages 2,3``) instead times each address variant of the paged
launch (``DDTREE_PAGED_VARIANT``, kernels/attention_paged_kernels.py) at each pipeline depth
(``DDTREE_PAGED_STAGES``) against the slot pool (at its default depth), and checks each is bitwise
the slot pool's output.

Usage: python -m ddtree_server.bench.paged_attention --device cuda --out docs/benchmarks/<folder>
       python -m ddtree_server.bench.paged_attention --device cuda --variants 0,2,4 --stages 2,3 \
           --contexts 4096,16384 --batches 8,64 --layouts shuffled --iters 30 --out <folder>
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import typer

from ddtree_server.bench.random_report import env_meta
from ddtree_server.bench.report import save_json_md
from ddtree_server.bench.shapes import get_shape
from ddtree_server.bench.timing import empty_cache, median_ms
from ddtree_server.engine.batch.pages import PAGE_SIZE
from ddtree_server.kernels.attention_batch import batch_attention


def attention_shape(name: str) -> dict:
    """Heads, KV heads, head dim and attention layers of a named shape (hybrids: their full
    attention layers only)."""
    cfg = get_shape(name).target
    cfg = cfg.get("text_config", cfg)
    layers = cfg["num_hidden_layers"]
    kinds = cfg.get("layer_types")
    if kinds:
        layers = sum(1 for k in kinds if k == "full_attention")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return {"hq": cfg["num_attention_heads"], "hkv": cfg["num_key_value_heads"], "d": head_dim, "layers": layers}


def pools(b: int, hkv: int, rows: int, d: int, dtype, device, gen: torch.Generator, shuffled: bool = True):
    """A slot pool ``k, v [b, hkv, rows, d]`` and the same rows in a page pool (pages shuffled or in
    order; page 0 the dummy) with the requests' page tables ``[b, rows // 16]``."""
    k = torch.randn(b, hkv, rows, d, device=device, dtype=dtype, generator=gen)
    v = torch.randn(b, hkv, rows, d, device=device, dtype=dtype, generator=gen)
    per = rows // PAGE_SIZE
    perm = (torch.randperm(b * per, generator=gen, device=device) if shuffled
            else torch.arange(b * per, device=device)) + 1
    kp = torch.zeros(b * per + 1, hkv, PAGE_SIZE, d, device=device, dtype=dtype)
    vp = torch.zeros_like(kp)
    kp[perm] = k.view(b, hkv, per, PAGE_SIZE, d).transpose(1, 2).reshape(-1, hkv, PAGE_SIZE, d)
    vp[perm] = v.view(b, hkv, per, PAGE_SIZE, d).transpose(1, 2).reshape(-1, hkv, PAGE_SIZE, d)
    return k, v, kp, vp, perm.view(b, per).to(torch.int32)


def with_env(fn, **env: str):
    """``fn`` called with the environment ``env`` set (then restored); for the launch settings that
    batch_attention reads at each call (a CUDA graph keeps those of its capture)."""
    def call():
        old = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            return fn()
        finally:
            for key, val in old.items():
                if val is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = val
    return call


def measure(shape: str, context: int, b: int, n: int, dtype, device, iters: int, layout: str = "shuffled",
            configs: list[tuple[int, int]] | None = None) -> dict:
    a = attention_shape(shape)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = -(-(context + 64) // PAGE_SIZE) * PAGE_SIZE
    k, v, kp, vp, table = pools(b, a["hkv"], rows, a["d"], dtype, device, gen, layout == "shuffled")
    q = torch.randn(b * n, a["hq"], a["d"], device=device, dtype=dtype, generator=gen)
    start = torch.full((b,), context - n, dtype=torch.long, device=device)
    qo = torch.arange(0, b * n + 1, n, dtype=torch.long, device=device)
    slot = torch.arange(b, dtype=torch.long, device=device)
    slot_fn = lambda: batch_attention(q, k, v, start, qo, slot, n)   # noqa: E731
    paged_fn = lambda: batch_attention(q, kp, vp, start, qo, slot, n, pages=table)   # noqa: E731
    if configs:   # the paged launch's address variants and pipeline depths
        want = slot_fn()
        rec = {"shape": shape, "context": context, "batch": b, "rows": n, "pages": layout,
               "slot_ms": median_ms(slot_fn, iters, graph=True), "variants": {}}
        for variant, stages in configs:
            fn = with_env(paged_fn, DDTREE_PAGED_VARIANT=str(variant), DDTREE_PAGED_STAGES=str(stages))
            ms = median_ms(fn, iters, graph=True)
            rec["variants"][f"v{variant}s{stages}"] = {"ms": ms, "ratio": round(ms / rec["slot_ms"], 3),
                                                      "bitwise": bool(torch.equal(fn(), want))}
        return rec
    same = bool(torch.equal(slot_fn(), paged_fn()))
    slot_ms, paged_ms = median_ms(slot_fn, iters, graph=True), median_ms(paged_fn, iters, graph=True)
    return {"shape": shape, "context": context, "batch": b, "rows": n, "pages": layout, "slot_ms": slot_ms, "paged_ms": paged_ms,
            "ratio": round(paged_ms / slot_ms, 3), "bitwise": same, "attention_layers": a["layers"],
            "extra_ms_per_forward": round((paged_ms - slot_ms) * a["layers"], 3)}


def main(device: str = typer.Option("cuda"), dtype: str = typer.Option("bf16"),
         shapes: str = typer.Option("qwen3-8b,qwen3.6-27b"), contexts: str = typer.Option("4096,32768"),
         batches: str = typer.Option("1,8,64"), rows: str = typer.Option("1,16"),
         layouts: str = typer.Option("shuffled,ascending", help="page orders: shuffled, ascending"),
         iters: int = typer.Option(50), out: Path = typer.Option(Path("paged-attention"), help="report folder"),
         variants: str = typer.Option("", help="paged address variants to time, e.g. 0,2,4 (DDTREE_PAGED_VARIANT)"),
         stages: str = typer.Option("2,3", help="with --variants: pipeline stages of the paged launch")) -> None:
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    configs = [(int(v), int(st)) for v in variants.split(",") if v for st in stages.split(",")]
    recs = []
    for shape in shapes.split(","):
        for context in (int(c) for c in contexts.split(",")):
            for b in (int(x) for x in batches.split(",")):
                for n in (int(x) for x in rows.split(",")):
                    for layout in layouts.split(","):
                        rec = measure(shape, context, b, n, dt, device, iters, layout, configs)
                        empty_cache()   # the pools and graphs of this point
                        print(rec, flush=True)
                        recs.append(rec)
    meta = env_meta(device, dtype)
    if configs:
        return report_variants(recs, configs, meta, dtype, iters, out)
    lines = [f"# Batched attention: page pool (pages of {PAGE_SIZE}) vs slot pool", "",
             f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}, {dtype}, "
             f"commit {meta['commit'][:12]}, {meta['date']}. One attention layer per launch, replayed from a "
             "CUDA graph (median of "
             f"{iters}); `extra ms / forward` = (paged - slot) x the shape's attention layers.", "",
             "| shape | context | batch | rows / request | pages | slot ms | paged ms | paged / slot | bitwise | extra ms / forward |",
             "|---|---:|---:|---:|---|---:|---:|---:|---|---:|"]
    lines += [f"| {r['shape']} | {r['context']} | {r['batch']} | {r['rows']} | {r['pages']} | {r['slot_ms']:.4f} | {r['paged_ms']:.4f} "
              f"| {r['ratio']:.3f} | {'yes' if r['bitwise'] else 'NO'} | {r['extra_ms_per_forward']:.3f} |" for r in recs]
    paths = save_json_md({"meta": meta, "records": recs}, lines, out, "paged-attention")
    print("\n".join(lines))
    print(f"wrote {paths['json']} and {paths['md']}")


def report_variants(recs: list[dict], configs: list[tuple[int, int]], meta: dict, dtype: str, iters: int,
                    out: Path) -> None:
    """The ``--variants`` report: each paged variant / depth as paged ms / slot ms, bitwise checked."""
    names = [f"v{v}s{st}" for v, st in configs]
    lines = [f"# Paged attention address variants (pages of {PAGE_SIZE}) vs slot pool", "",
             f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}, {dtype}, "
             f"commit {meta['commit'][:12]}, {meta['date']}. One attention layer per launch from a CUDA graph "
             f"(median of {iters}). Cells: paged ms / slot ms of variant v (DDTREE_PAGED_VARIANT) at s pipeline "
             "stages (DDTREE_PAGED_STAGES; the slot pool at its default); `!` marks a result not bitwise the "
             "slot pool's.", "",
             "| shape | context | batch | rows | pages | slot ms | " + " | ".join(names) + " | best |",
             "|---|---:|---:|---:|---|---:|" + "---:|" * len(names) + "---|"]
    for r in recs:
        cells = [f"{r['variants'][k]['ratio']:.3f}" + ("" if r["variants"][k]["bitwise"] else " !") for k in names]
        best = min(names, key=lambda k: r["variants"][k]["ms"])
        lines.append(f"| {r['shape']} | {r['context']} | {r['batch']} | {r['rows']} | {r['pages']} | "
                     f"{r['slot_ms']:.4f} | " + " | ".join(cells) + f" | {best} |")
    bad = [(r["shape"], r["context"], r["batch"], r["rows"], k) for r in recs for k in names
           if not r["variants"][k]["bitwise"]]
    lines += ["", f"Bitwise equal to the slot pool: {'all' if not bad else 'NOT ' + str(bad)}."]
    mean = {k: sum(r["variants"][k]["ratio"] for r in recs) / len(recs) for k in names}
    lines += ["", "Mean paged / slot per config: " + ", ".join(f"{k} {m:.3f}" for k, m in mean.items())]
    paths = save_json_md({"meta": meta, "configs": names, "records": recs}, lines, out, "paged-variants")
    print("\n".join(lines))
    print(f"wrote {paths['json']} and {paths['md']}")


if __name__ == "__main__":
    typer.run(main)
