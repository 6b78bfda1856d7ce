"""The benchmarks' timers, one set: device synchronisation, wall-clock medians of repeated calls
(eager or replayed from a CUDA graph), device time of a captured graph, and freeing cached memory.

Wall-clock timers synchronise the device before and after every timed call, so a figure is the
call's full latency. torch is imported on first use (the benchmark commands' ``--help`` stays fast).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable


def sync(device=None) -> None:
    """Wait for ``device``'s queued work (a CUDA device; others: nothing to wait for). None: the
    current CUDA device when there is one."""
    import torch

    if device is None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    elif torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def empty_cache() -> None:
    """Return the CUDA caching allocator's free blocks (between benchmark parts)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def time_calls(fn: Callable[[], object], iters: int, warmup: int, device,
               setup: Callable[[], None] | None = None) -> dict:
    """Wall time of ``fn`` per call (device synchronised around each call), after ``warmup`` calls.
    Returns {ms, p10, p90, n} in milliseconds; ``setup`` runs untimed before every call."""
    times = []
    for i in range(warmup + iters):
        if setup is not None:
            setup()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return {"ms": statistics.median(times), "p10": q(0.1), "p90": q(0.9), "n": len(times)}


def median_ms(fn: Callable[[], object], iters: int, graph: bool) -> float:
    """Median wall time of ``fn`` in ms after 3 warm-up calls; ``graph``: replay it from a CUDA graph
    (CUDA only)."""
    import torch

    for _ in range(3):
        fn()
    sync()
    if graph and torch.cuda.is_available():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
        fn()
    times = []
    for _ in range(iters):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(times), 4)


def graph_time_us(calls: list[Callable[[], object]], replays: int = 10) -> float:
    """Mean device time (us) per call of ``calls`` captured back to back in one CUDA graph."""
    import torch

    for f in calls:  # warm-up: Triton compiles, cuBLAS picks its kernels
        f()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in calls:
            f()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1000 / replays / len(calls)
    del graph
    return us
