"""GPU probe parts about kernels: the per-kernel breakdown of one forward (torch.profiler) and the
bandwidth of the 8B layer GEMVs / skinny GEMMs, cuBLAS (``F.linear``) against the Triton kernel of
``kernels/gemv.py``.

Bandwidth = weight bytes / time per call. Calls are replayed from a CUDA graph (no launch gaps)
and rotate over enough copies of the weight (>= 512 MB in all) that the 50-60 MB L2 cache cannot
serve them.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.nn.functional as F

from ddtree_server.bench.timing import graph_time_us

# (out features N, in features K) of one Qwen3-8B decoder layer's fused projections and its LM head
GEMV_SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
                  "lm_head": (151936, 4096)}


def kernel_breakdown(fn: Callable[[], object], device: torch.device, reps: int = 3, top: int = 15) -> dict:
    """Profile ``reps`` calls of ``fn`` (after one untimed call): device kernels per call, their
    summed time per call (us), wall time per call (us) and the ``top`` kernels by total time.
    ``kernels_seen`` False means the profiler showed no device kernels (e.g. hidden in a graph)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        sync()
    wall = (time.perf_counter() - t0) * 1e6 / reps
    agg: dict[str, list] = {}
    for e in prof.events():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        row = agg.setdefault(e.name, [0, 0.0])
        row[0] += 1
        row[1] += e.time_range.elapsed_us()
    total = sum(r[1] for r in agg.values())
    rows = sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels_seen": bool(agg), "kernels_per_call": sum(r[0] for r in agg.values()) / reps,
            "kernel_us_per_call": round(total / reps, 1), "wall_us_per_call": round(wall, 1),
            "distinct_kernels": len(agg),
            "top": [{"name": n[:140], "calls_per_call": c / reps, "us_per_call": round(t / reps, 2),
                     "share": round(t / total, 3) if total else None} for n, (c, t) in rows]}


def gemv_bandwidth(deadline: float, rows: tuple[int, ...] = (1, 16, 80), shapes: dict | None = None,
                   dtype: torch.dtype = torch.bfloat16, log: Callable[[str], None] = print) -> list[dict]:
    """For each weight shape and row count M: cuBLAS and every Triton config of the probe's small
    search space; us per call and GB/s of the weight read. Stops at ``deadline`` (monotonic)."""
    from ddtree_server.kernels import gemv

    dev = torch.device("cuda")
    out = []
    for name, (n, k) in (shapes or GEMV_SHAPES_8B).items():
        nbytes = n * k * torch.finfo(dtype).bits // 8
        copies = max(2, math.ceil(512e6 / nbytes))
        ws = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for _ in range(copies)]
        reps = max(1, 16 // copies)
        for m in rows:
            if time.monotonic() > deadline:
                out.append({"shape": name, "m": m, "skipped": "time budget"})
                continue
            x = torch.randn(m, k, device=dev, dtype=dtype)
            row = {"shape": name, "n": n, "k": k, "m": m, "weight_mb": round(nbytes / 1e6, 1)}
            us = graph_time_us([lambda w=w: F.linear(x, w) for w in ws] * reps)
            row["cublas_us"], row["cublas_gbps"] = round(us, 2), round(nbytes / us / 1e3, 1)
            if gemv.HAVE_TRITON:
                best = None
                ref = F.linear(x, ws[0]).float()
                for cfg in (gemv.CONFIGS_M1 if m == 1 else gemv.CONFIGS_MN):
                    if time.monotonic() > deadline:
                        break
                    try:
                        err = (gemv.skinny_matmul(x, ws[0], cfg).float() - ref).abs().max().item()
                        t = graph_time_us([lambda w=w, cfg=cfg: gemv.skinny_matmul(x, w, cfg) for w in ws] * reps)
                    except Exception as exc:  # noqa: BLE001 - a config that fails is recorded, not fatal
                        row.setdefault("triton_errors", {})[cfg.name] = str(exc)[:200]
                        continue
                    if best is None or t < best[0]:
                        best = (t, cfg.name, err)
                if best:
                    row["triton_us"], row["triton_config"] = round(best[0], 2), best[1]
                    row["triton_gbps"], row["triton_max_abs_err"] = round(nbytes / best[0] / 1e3, 1), best[2]
            log(f"gemv {name} M={m}: cuBLAS {row['cublas_gbps']} GB/s, Triton {row.get('triton_gbps')} GB/s")
            out.append(row)
        del ws
        torch.cuda.empty_cache()
    return out
