"""The working memory of the largest eager round, measured at start-up (``GraphPool.reserve``).

The batched CUDA graphs are captured lazily, at the batch sizes that come; rounds past the graph
buckets, and shapes declined for memory, run eagerly and need their working memory (activations,
logits ``[rows, vocab]``, the draft logits ``[b, block_size - 1, vocab]`` alive beside them) at the
moment they run. The capture rule (``graph_pool.py``) keeps that much free, so it is measured
before the first capture, the way vLLM profiles a maximal batch before it sizes its cache: on the
free slots, a drafter proposal for every slot (one context row each, at the end of the slot's
rows: the drafter's attention copies its keys up to there) and, while its logits are alive, the
eager target forward of the most rows a round may take (every slot a causal chain of up to
``ROW_BUCKETS[-1]`` rows at the end of its rows, at most ``MAX_ROWS`` in all; a hybrid's round at
most its verify scratch's rows); the peak beyond what was allocated before is the reserve. The
slots (fresh: zero K/V) are reset afterwards. The runner measures it on CUDA when it captures batched graphs.
"""

from __future__ import annotations

import torch

from ddtree_server.engine.batch.draft import blank_context, propose_batch
from ddtree_server.engine.batch.forward import Block, Layout
from ddtree_server.engine.batch.graphs import MAX_ROWS, ROW_BUCKETS
from ddtree_server.engine.batch.pages import PAGE_SIZE


def round_sizes(slots: int, per_block: int | None, most: int | None) -> list[int]:
    """Rows of each slot's block in the largest round: ``per_block`` (or ``ROW_BUCKETS[-1]``) rows
    each, cut so that the round keeps to ``most`` rows (or ``MAX_ROWS``), at least one each (pure)."""
    per = min(per_block or ROW_BUCKETS[-1], ROW_BUCKETS[-1])
    total = min(slots * per, most or MAX_ROWS)
    base, extra = divmod(max(total, slots), slots)
    return [min(per, base + (i < extra)) or 1 for i in range(slots)]


@torch.inference_mode()
def largest_round(runner) -> int:
    """Bytes the largest eager round takes beyond what is allocated (off CUDA it runs, measuring 0)."""
    pool = runner.graph_pool
    if runner.kind is None:
        return 0
    slots = runner.slots   # not the graphs' scratch slot
    per_block, most = runner.rows
    top = runner.caches[0].max_len - 1    # rows a request may hold (StepRunner.room)
    sizes = round_sizes(slots, min(per_block or top, top), most)
    blocks = [Block(i, top - n, [0] * n, list(range(n)), None) for i, n in enumerate(sizes)]
    caches = [runner.caches[i] for i in range(slots)]
    for c, blk in zip(caches, blocks):
        c.length = blk.s
    with pool.measure():
        draft = None
        if runner.dcaches is not None and runner.dcaches.pooled:
            dk, dv = runner.dcaches.pool("k"), runner.dcaches.pool("v")
            tables = getattr(runner.dcaches, "tables", None)   # pages: every row to the dummy page
            tables = None if tables is None else torch.zeros_like(tables)
            start = min(top, (dk.shape[3] if tables is None else tables.shape[1] * PAGE_SIZE) - runner.block_size)
            dcaches = [runner.dcaches[i] for i in range(slots)]
            for c in dcaches:
                c.length = start - 1
            ctx = blank_context(runner.model, runner.raw_drafter, runner.device)
            draft = propose_batch(runner.raw_drafter, dk, dv, dcaches, list(range(slots)), [ctx] * slots,
                                  [0] * slots, [start] * slots, tables)
        out = runner.eager_forward(caches, Layout(blocks, runner.device, pages=runner.tables(blocks, True)))
        del draft, out
    for i in range(slots):
        runner.reset(i)
    return pool.need
