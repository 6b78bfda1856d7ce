"""One CUDA graph memory pool for a runner's batched graphs, and when to stop capturing.

The batched target rounds (``graphs.py``) and the batched drafter (``draft_graphs.py``) used to keep
a graph pool each. They never run at once (a round drafts, then verifies, on one stream) and every
output they keep lives outside the pool (``graph_out.py``), so one pool can hold both families'
working memory: a later capture reuses what an earlier one freed, whichever family it belongs to.
On one H200 at the Qwen3.6-27B shape with 150 slots the two pools held 3.11 + 3.03 GiB when the
device ran out (docs/benchmarks/h200-2026-12-03/); vLLM likewise shares one pool among all its
captures.

Each new shape captured adds to the pool for as long as the server runs, and a capture that runs
out of memory fails mid-round (no cached memory can be released while a stream captures). The
eager rounds (shapes past the buckets, the prefill, the walk) need their working memory beside
the pool. So:

* ``reserve``: the working memory of the largest eager round, measured before the first capture
  (``reserve.py``: a drafter proposal for every slot and the target forward of the most rows a
  round may take, on the free slots);
* a capture's warm-up runs are measured (their peak beyond what was allocated before: what the
  capture will take at most);
* the shape is captured only when the device (driver-free memory plus the allocator's cached
  bytes, which the capture's start returns to the driver) keeps that, plus the reserve, plus
  ``headroom`` bytes; else it runs eagerly, and is tried again only once that much is free.
  ``DDTREE_GRAPH_HEADROOM_MIB`` sets the headroom (default 3,072 MiB, see below).

The allocator counts the pool's blocks as allocated (an out-of-memory report at 150 slots: 1.71
GiB "allocated in private pools" of 1.76 GiB of pool segments), so they are not counted as free.
``pool_bytes`` (the reserved growth while capturing: the pool's segments) is for /metrics. On one
H200 at the Qwen3.6-27B shape with 150 slots of 4k (docs/benchmarks/h200-2026-12-03-reserve/):
without the reserve the pool took 3.35 GiB at small batches and the eager rounds past 128
requests then ran out; with it (and the drafter's attention in passes) all 150 decoded, under a
rule that also subtracted the pool's bytes from the free memory and kept 1 GiB beside: it stopped
capturing with 2.6-2.8 GiB kept beside the reserve, which the default headroom now keeps without
counting the pool twice. The warm-up's measure resets the allocator's peak statistic;
``peak_allocated`` keeps the highest one seen.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager

import torch

log = logging.getLogger(__name__)
HEADROOM_ENV = "DDTREE_GRAPH_HEADROOM_MIB"
DEFAULT_HEADROOM_MIB = 3072


def headroom_bytes() -> int:
    raw = os.environ.get(HEADROOM_ENV, "").strip()
    try:
        mib = float(raw) if raw else DEFAULT_HEADROOM_MIB
    except ValueError:
        log.warning("%s=%r is not a number of MiB: using %d", HEADROOM_ENV, raw, DEFAULT_HEADROOM_MIB)
        mib = DEFAULT_HEADROOM_MIB
    return int(max(mib, 0) * 2 ** 20)


def may_capture(free: int, headroom: int) -> bool:
    """A new shape is captured only while ``free`` bytes keep ``headroom`` (pure rule)."""
    return free >= headroom


def device_free(device) -> int:
    """Bytes a new allocation can still get: free on the device and cached but unallocated."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


class GraphPool:
    """The pool handle shared by a runner's batched graphs and the capture rule."""

    def __init__(self, device, headroom: int | None = None):
        self.device = torch.device(device)
        self.headroom = headroom_bytes() if headroom is None else int(headroom)
        self.handle = None        # set by the first capture; every later capture passes it
        self.captured = 0
        self.refused = 0          # captures declined for memory (those shapes ran eagerly)
        self.need = 0             # bytes the last measured warm-up took at its peak
        self.reserve = 0          # working memory of the largest eager round (reserve.py)
        self.pool_bytes = 0       # bytes the captures took from the device: the pool's segments (/metrics)
        self.peak = 0             # the allocator's peak statistic before each measure reset it
        self.capture_s = 0.0      # seconds spent in captures (torch.cuda.graph's gc + empty_cache included)

    def room(self, need: int = 0) -> bool:
        """Whether a shape whose capture takes ``need`` bytes may be captured now (counts and logs
        a refusal); ``need`` 0 before its warm-up was measured."""
        if self.device.type != "cuda" or may_capture(device_free(self.device), need + self.reserve + self.headroom):
            return True
        if not self.refused:
            log.warning("CUDA graphs: fewer than %d MiB free on %s beside a capture's %d MiB and the largest "
                        "eager round's %d MiB, new shapes run eagerly", self.headroom >> 20, self.device,
                        need >> 20, self.reserve >> 20)
        self.refused += 1
        return False

    @contextmanager
    def measure(self):
        """Around a capture's warm-up runs: ``need`` = their peak beyond what was allocated before."""
        if self.device.type != "cuda":
            yield
            return
        torch.cuda.synchronize(self.device)
        self.peak = self.peak_allocated()
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        yield
        torch.cuda.synchronize(self.device)
        self.need = max(int(torch.cuda.max_memory_allocated(self.device) - base), 0)

    def warm_up(self, run, times: int = 2):
        """A capture's warm-up: ``run()`` ``times`` on a side stream, measured (``measure``); returns
        (its last output, whether the capture then fits: ``room(need)``)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with self.measure():
            with torch.cuda.stream(side):
                for _ in range(times):
                    out = run()
            torch.cuda.current_stream().wait_stream(side)
        return out, self.room(self.need)

    def peak_allocated(self) -> int:
        """The allocator's highest allocated bytes, across the resets of ``measure``."""
        return max(self.peak, torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda" else 0

    @contextmanager
    def capture(self, graph):
        """``torch.cuda.graph`` into the shared pool; counts the bytes the pool grew by (its start
        has returned the allocator's other cached bytes to the driver)."""
        t0 = time.perf_counter()
        with torch.cuda.graph(graph, pool=self.handle):
            before = torch.cuda.memory_reserved(self.device)
            yield
            self.pool_bytes += max(torch.cuda.memory_reserved(self.device) - before, 0)
        if self.handle is None:
            self.handle = graph.pool()
        self.captured += 1
        self.capture_s += time.perf_counter() - t0
