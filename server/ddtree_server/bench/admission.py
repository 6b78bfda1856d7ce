"""Admitted concurrency: how many requests fit in the device's memory at given context lengths.

The batch engine allocates one slot per running request, each sized for ``max_model_len`` tokens
(the target's KV and, for hybrids, its GDN recurrent / conv state; the drafter's context K/V; a
hybrid's verify scratch is one per round, allocated once: ``round_scratch_bytes``): the server
takes as many slots as ``--kv-memory-fraction`` of the free memory after loading (less the round
scratch) holds (engine.Engine, capped at ``CUDA_MAX_RUNNING`` unless ``--max-running`` says more).
This command measures a slot's bytes at each context length on random weights of a named shape
(the caches are built on the device and freed) and reports:

* ``slots``: the slot-static engine's admitted requests when ``--max-model-len`` is that length
  (what an operator gets by capping the context);
* ``per_token`` / ``fixed``: a slot's bytes per context token and its length-independent part
  (GDN state, conv rows), fitted from two lengths;
* ``paged``: the requests of that length a paged cache (memory per live token) would admit with a
  ``max_model_len`` at the model's maximum, i.e. the figure slot-static caches give up.

Usage: python -m ddtree_server.bench.admission --shape qwen3.6-27b --contexts 4096,32768 --device cuda
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import typer

from ddtree_server.bench.random_shape import random_models
from ddtree_server.bench.shapes import get_shape
from ddtree_server.engine.batch.hybrid_rounds import round_rows
from ddtree_server.engine.batch.pools import cache_bytes, slot_cache_bytes
from ddtree_server.engine.engine import CUDA_MAX_RUNNING


def round_scratch_bytes(target) -> int:
    """Bytes of a hybrid target's round verify scratch at the default rows (``chunk``; else 0)."""
    if getattr(target, "method", None) != "chunk":
        return 0
    return target.new_scratch(round_rows(None, CUDA_MAX_RUNNING), "meta").nbytes


def free_after_load(device: str, free_gib: float = 0.0) -> int:
    """Bytes to size the slots from: ``free_gib`` when given, else the device's free memory now
    (after loading; 0 off CUDA)."""
    if free_gib > 0:
        return int(free_gib * 2 ** 30)
    return torch.cuda.mem_get_info(device)[0] if device.startswith("cuda") else 0


def slot_bytes(target, drafter, n: int) -> int:
    """Bytes of one slot's caches for ``n`` tokens (as ``Engine._slot_bytes`` sizes them)."""
    per = slot_cache_bytes(target.new_cache(n + 1))
    if drafter is not None:
        per += cache_bytes(drafter.new_cache(n + 1 + int(drafter.config.block_size)))
    return per


def admitted(budget: int, contexts: list[int], max_len: int, measure) -> list[dict]:
    """Rows per context length: slot bytes, slot-static slots, paged estimate (pure arithmetic over
    ``measure(n) -> bytes``)."""
    a, b = measure(1024), measure(2048)
    per_token = (b - a) / 1024
    fixed = a - per_token * 1024
    top = measure(max_len)
    rows = []
    for n in contexts:
        per = measure(n)
        rows.append({"context": n, "slot_bytes": per, "slots": budget // per,
                     "per_token": per_token, "fixed": fixed,
                     "slots_at_model_max": budget // top,
                     "paged": int(budget // (fixed + per_token * n))})
    return rows


def main(shape: str = typer.Option("qwen3.6-27b", help="bench.shapes name"),
         contexts: str = typer.Option("4096,32768", help="context lengths (tokens)"),
         fraction: float = typer.Option(0.5, help="--kv-memory-fraction of the free memory"),
         device: str = typer.Option("cuda"), dtype: str = typer.Option("bf16"),
         out: Path = typer.Option(Path("admission"), help="report folder"),
         commit: str = typer.Option("unknown"),
         free_gib: float = typer.Option(0.0, help="free memory to assume (GiB; 0: the device's, after loading)")) -> None:
    sh = get_shape(shape)
    target, drafter = random_models(sh, device=device, dtype=dtype)
    max_len = int(sh.target.get("max_position_embeddings") or sh.target.get("text_config", {}).get(
        "max_position_embeddings", 32768))
    free = free_after_load(device, free_gib)
    seen: dict[int, int] = {}

    def measure(n: int) -> int:
        if n not in seen:
            seen[n] = slot_bytes(target, drafter, n)
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        return seen[n]

    scratch = round_scratch_bytes(target)
    budget = int(fraction * free) - scratch
    rows = admitted(budget, [int(c) for c in contexts.split(",")], max_len, measure)
    doc = {"shape": shape, "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else device,
           "dtype": dtype, "free_bytes_after_load": free, "fraction": fraction, "model_max_len": max_len,
           "round_scratch_bytes": scratch,
           "torch": torch.__version__, "commit": commit, "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"admission-{shape}.json").write_text(json.dumps(doc, indent=2))
    gib = 2 ** 30
    lines = [f"# Admitted requests, {shape} ({doc['device']}, {dtype}, commit {commit})", "",
             f"Free after loading: {free / gib:.1f} GiB; KV budget {fraction} of it less the round scratch "
             f"({scratch / gib:.2f} GiB) = {budget / gib:.1f} GiB; "
             f"model maximum {max_len} tokens; a slot at the maximum: {rows[0]['slots_at_model_max']} slots.", "",
             "| context | slot MiB | slot-static slots (max-model-len = context) | paged estimate |",
             "|---:|---:|---:|---:|"]
    lines += [f"| {r['context']} | {r['slot_bytes'] / 2 ** 20:.1f} | {r['slots']} | {r['paged']} |" for r in rows]
    (out / f"admission-{shape}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    typer.run(main)
