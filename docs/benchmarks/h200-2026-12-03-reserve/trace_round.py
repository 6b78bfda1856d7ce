"""Probe (GPU, random weights): what an eager batched round holds at its peak, against the reserve
that ``engine/batch/reserve.py`` measures at start-up.

An Engine at a published shape with ``--slots`` slots and the batched graphs off (every round
eager), ``--slots`` requests of ``--prompt`` random tokens; once all decode, the working memory of
``--rounds`` rounds (the allocator's peak beyond what was allocated before the round) and, for the
last one, the allocations alive at its peak from the allocator's history, grouped by the first
frame in ``ddtree_server``. Writes ``trace-<shape>-<slots>.json`` to ``--out``.

    DDTREE_BATCH_GRAPHS=0 python docs/benchmarks/h200-2026-12-03-reserve/trace_round.py --slots 40 --out OUT
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

from ddtree_server.bench.batch_shape import NoText, random_requests
from ddtree_server.bench.random_shape import random_models
from ddtree_server.bench.shapes import get_shape
from ddtree_server.engine.batch.reserve import largest_round
from ddtree_server.engine.engine import Engine

MIB = 2 ** 20


def frame_of(ev) -> str:
    for f in ev.get("frames") or ():
        if "ddtree_server" in f["filename"]:
            return f"{f['filename'].split('ddtree_server/')[-1]}:{f['line']} {f['name']}"
    return "(outside ddtree_server)"


def live_at_peak(trace) -> tuple[int, dict[str, int]]:
    live, total, best, best_live = {}, 0, 0, {}
    for ev in trace:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
            if total > best:
                best, best_live = total, dict(live)
        elif ev["action"] == "free_requested" and ev["addr"] in live:
            total -= live.pop(ev["addr"])["size"]
    groups: dict[str, int] = defaultdict(int)
    for ev in best_live.values():
        groups[frame_of(ev)] += ev["size"]
    return best, dict(sorted(groups.items(), key=lambda kv: -kv[1])[:25])


def main(shape="qwen3.6-27b", slots=40, prompt=256, rounds=3, budget=16, out="."):
    dev = "cuda"
    target, drafter = random_models(get_shape(shape), device=dev, dtype="bf16")
    eng = Engine(target, NoText(), drafter, model_id=shape, max_model_len=prompt + 1024, eos_token_ids=[],
                 tree_budget=budget, max_running=slots, prefill_chunk=4096)
    runner = eng.batch.runner
    reserve = largest_round(runner)
    reqs = random_requests(eng, slots, "ddtree", prompt, 1024, seed=7)
    for r in reqs:
        eng.batch.add(r)
    while any(r.prefilling for r in reqs):
        eng.batch.step()
    works = []
    for i in range(rounds):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        if i == rounds - 1:
            torch.cuda.memory._record_memory_history(max_entries=200000)
        eng.batch.step()
        torch.cuda.synchronize()
        works.append(torch.cuda.max_memory_allocated() - base)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    peak, groups = live_at_peak(trace)
    doc = {"shape": shape, "slots": slots, "prompt": prompt, "budget": budget,
           "graphs_env": os.environ.get("DDTREE_BATCH_GRAPHS"), "reserve_mib": reserve / MIB,
           "round_work_mib": [w / MIB for w in works], "trace_peak_mib": peak / MIB,
           "live_at_peak_mib": {k: v / MIB for k, v in groups.items()},
           "nodes_last_round": runner.last.nodes}
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"trace-{shape}-{slots}.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    argv, kw = sys.argv[1:], {}
    while argv:
        key, val = argv.pop(0).lstrip("-"), argv.pop(0)
        kw[key] = val if key in ("shape", "out") else int(val)
    main(**kw)
