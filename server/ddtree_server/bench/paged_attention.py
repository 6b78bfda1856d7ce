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

Usage: python -m ddtree_server.bench.paged_attention --device cuda --out docs/benchmarks/<folder>
"""

from __future__ import annotations

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


def measure(shape: str, context: int, b: int, n: int, dtype, device, iters: int, layout: str = "shuffled") -> dict:
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
    same = bool(torch.equal(slot_fn(), paged_fn()))
    slot_ms, paged_ms = median_ms(slot_fn, iters, graph=True), median_ms(paged_fn, iters, graph=True)
    return {"shape": shape, "context": context, "batch": b, "rows": n, "pages": layout, "slot_ms": slot_ms, "paged_ms": paged_ms,
            "ratio": round(paged_ms / slot_ms, 3), "bitwise": same, "attention_layers": a["layers"],
            "extra_ms_per_forward": round((paged_ms - slot_ms) * a["layers"], 3)}


def main(device: str = typer.Option("cuda"), dtype: str = typer.Option("bf16"),
         shapes: str = typer.Option("qwen3-8b,qwen3.6-27b"), contexts: str = typer.Option("4096,32768"),
         batches: str = typer.Option("1,8,64"), rows: str = typer.Option("1,16"),
         layouts: str = typer.Option("shuffled,ascending", help="page orders: shuffled, ascending"),
         iters: int = typer.Option(50), out: Path = typer.Option(Path("paged-attention"), help="report folder")) -> None:
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    recs = []
    for shape in shapes.split(","):
        for context in (int(c) for c in contexts.split(",")):
            for b in (int(x) for x in batches.split(",")):
                for n in (int(x) for x in rows.split(",")):
                    for layout in layouts.split(","):
                        rec = measure(shape, context, b, n, dt, device, iters, layout)
                        empty_cache()   # the pools and graphs of this point
                        print(rec, flush=True)
                        recs.append(rec)
    meta = env_meta(device, dtype)
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


if __name__ == "__main__":
    typer.run(main)
