"""The start-up time profile of the speculation policy (``policy.Profile``), measured on the runner.

Before any request runs, the runner's own batched forward (through its CUDA graphs where rounds
take them) is timed on its free slots: ``rows``
rows (split into blocks of at most ``BLOCK_ROWS`` rows, one slot each, causal chains) at a few row
counts, 16 one-row requests against one 16-row request (the extra cost of a request in the batch),
and one drafter proposal (one request's block), each the fastest of ``REPEATS`` calls after a
warm-up; the row curve is made non-decreasing. The slots are reset afterwards. A few forwards:
about a second on the CPU with the SmolLM2 default, well under on CUDA.
"""

from __future__ import annotations

import itertools
import math
import time

import torch

from ddtree_server.engine.batch.draft import blank_context
from ddtree_server.engine.batch.forward import Block, Layout
from ddtree_server.engine.batch.policy import Profile

CPU_ROWS = (1, 8, 32)
CUDA_ROWS = (1, 16, 64, 128, 256, 512, 1024)
BLOCK_ROWS = 64   # rows per slot in the measured forwards (a request's tree of budget 63)
REPEATS = 3


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device) -> float:
    fn()  # warm-up (kernels, allocator)
    times = []
    for _ in range(REPEATS):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return min(times)   # the least disturbed call (other work on the machine only adds time)


@torch.inference_mode()
def measure(runner, rows=None) -> Profile:
    """Time the runner's batched target forward (and the drafter) and return the profile."""
    dev, slots = runner.device, runner.slots   # not the graphs' scratch slot
    cuda = torch.device(dev).type == "cuda"
    per_block, most = runner.rows   # a hybrid's rows per tree and per round (None: no bound)
    per_block = min(BLOCK_ROWS, per_block or BLOCK_ROWS)
    rows = [r for r in (rows or (CUDA_ROWS if cuda else CPU_ROWS))
            if r <= slots * per_block and (most is None or r <= most)] or [1]

    def forward(sizes: list[int]) -> None:
        blocks = [Block(i, 0, [0] * n, list(range(n)), None) for i, n in enumerate(sizes)]
        caches = [runner.caches[i] for i in range(len(sizes))]
        shape = runner.graphs.shape(blocks) if runner.graphs is not None else None
        if shape is not None:   # the rounds' own path: the graph of this padded layout
            runner.graphs.forward(blocks, shape, caches)
        else:
            runner.eager_forward(caches, Layout(blocks, dev, pages=runner.tables(blocks, True)))
        for i in range(len(sizes)):
            runner.reset(i)

    def split(n: int) -> list[int]:
        parts = math.ceil(n / per_block)
        return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]

    seconds = list(itertools.accumulate((_time(lambda n=n: forward(split(n)), dev) for n in rows), max))
    many = min(slots, 16, per_block)
    per_request = 0.0
    if many > 1:
        per_request = max((_time(lambda: forward([1] * many), dev) - _time(lambda: forward([many]), dev))
                          / (many - 1), 0.0)
    draft, block = 0.0, 16
    if runner.drafter is not None:
        block = runner.block_size
        ctx = blank_context(runner.model, runner.raw_drafter, dev)
        # slot 0's draft cache; on pages a small cache of its own (the drafter's time alone)
        dcache = runner.drafter.new_cache(block + 1) if runner.paged else runner.dcaches[0]

        def propose() -> None:
            dcache.crop(0)
            runner.drafter.propose(dcache, ctx, 0, 1)
            dcache.crop(0)

        draft = _time(propose, dev)
    return Profile(list(rows), seconds, per_request, draft, block)
