"""CUDA graphs of the batched DFlash drafter forward (``draft.py``), keyed by (batch bucket, key window).

Eager, ``propose_batch`` launches a few hundred small kernels per round (context append and the
``[b, bs]`` block through every draft layer), as the batch-1 drafter did before its graphs
(``models/drafter/graphs.py``). Here a round's inputs are padded to a fixed layout and a graph
captured for it is replayed:

* every request's new context rows (its last round's accepted tokens: 1 .. block_size) are padded
  to ``block_size`` rows; padding rows carry zero features at positions ``s_r, s_r + 1, ...``, the
  rows its block writes next in the same graph, so they are overwritten before anything reads them;
* the batch is padded to a bucket of B requests on the drafter pool's scratch slot (its last);
* the block attends to key rows ``[0, W)`` of its slot with rows at or past ``s_r + block_size``
  hidden, W = the power of two >= max(s_r) + block_size (at least 256; at most the slot's rows), so a graph serves every
  length below W; on the kernel path (``draft.py``: lengths read on the device) W is the slot's rows,
  one graph per batch bucket.

A round takes a graph when every request brings 1 .. block_size context rows (the first proposal
after a prefill brings the whole prompt and runs eagerly). The first replay of each graph is
compared with the eager forward; a difference beyond rounding (or a capture error) turns the
graphs off for good, with a warning. ``capture=False`` runs the padded layout eagerly (CPU tests).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from ddtree_server.engine.batch.draft import append_context, draft_blocks, propose_batch
from ddtree_server.engine.batch.graph_out import SharedOut
from ddtree_server.engine.batch.graph_pool import GraphPool
from ddtree_server.engine.batch.graphs import BATCH_BUCKETS, bucket
from ddtree_server.engine.batch.pages import PAGE_SIZE
from ddtree_server.models.drafter.graphs import replay_differs
from ddtree_server.models.layers import kernels_usable

log = logging.getLogger(__name__)
MIN_KV = 256


class _Static:
    def __init__(self, b: int, bs: int, width: int, dtype, device):
        self.ctx = torch.zeros((b * bs, width), dtype=dtype, device=device)
        self.pos = torch.zeros(b * bs, dtype=torch.long, device=device)
        self.slot_c = torch.zeros(b * bs, dtype=torch.long, device=device)
        self.slots = torch.zeros(b, dtype=torch.long, device=device)
        self.starts = torch.zeros(b, dtype=torch.long, device=device)
        self.bonus = torch.zeros(b, dtype=torch.long, device=device)
        self.graph = None
        self.logits: Tensor | None = None
        self.checked = False
        self.need = 0   # bytes its capture takes, once a warm-up showed memory was short for it


class DraftGraphs:
    """Padded, graph-replayed ``propose_batch`` over a drafter slot pool whose last slot is scratch."""

    def __init__(self, drafter, kpool: Tensor, vpool: Tensor, *, capture: bool = True, pool: GraphPool | None = None,
                 tables: Tensor | None = None):
        """``pool``: the graph pool shared with the runner's target graphs (``graph_pool.py``).
        ``tables``: page pools on the target's pages (``paged_draft.py``) and the persistent device
        page tables, a static input of the graphs; padding requests take its last row (no pages)."""
        self.drafter, self.kpool, self.vpool, self.capture, self.tables = drafter, kpool, vpool, capture, tables
        self.bs = int(drafter.config.block_size)
        self.scratch = kpool.shape[0] - 1 if tables is None else tables.shape[0] - 1
        self.rows = kpool.shape[3] if tables is None else tables.shape[1] * PAGE_SIZE
        self.kernel = kernels_usable(drafter.layers[0].self_attn.head_dim, kpool)
        self.enabled = True
        self.rounds = 0
        self._static: dict[tuple, _Static] = {}
        self.pool = pool if pool is not None else GraphPool(kpool.device)
        self.out = SharedOut(bucket(self.scratch, BATCH_BUCKETS) or BATCH_BUCKETS[-1])   # graph_out.py

    def propose(self, caches: list, slots: list[int], ctxs: list[Tensor], bonus: list[int], starts: list[int]) -> Tensor:
        """As ``propose_batch``: draft logits ``[b, block_size - 1, vocab]`` (a view of a static
        buffer when replayed, valid until the next call)."""
        b, bs = len(slots), self.bs
        b_pad = bucket(b, BATCH_BUCKETS)
        need = max(starts) + bs
        width = self.rows if self.kernel else min(1 << max(MIN_KV - 1, need - 1).bit_length(), self.rows)
        if (not self.enabled or b_pad is None or need > self.rows or self.scratch < 0
                or any(not 0 < c.shape[0] <= bs for c in ctxs)
                or any(c.length + x.shape[0] != s for c, x, s in zip(caches, ctxs, starts))):
            return propose_batch(self.drafter, self.kpool, self.vpool, caches, slots, ctxs, bonus, starts, self.tables)
        st = self._static.get((b_pad, width))
        if st is None:
            st = self._static[(b_pad, width)] = _Static(b_pad, bs, ctxs[0].shape[1], ctxs[0].dtype,
                                                        self.kpool.device)
        self._load(st, caches, slots, ctxs, bonus, starts)
        self.rounds += 1
        # eager: on the CPU, or when memory is short for a capture (graph_pool.py)
        eager = not self.capture or (st.graph is None and not self.pool.room(st.need))
        try:
            if not eager and st.graph is None and not self._capture(st, width):
                st.need, eager = self.pool.need, True   # its warm-up showed memory is short
            if eager:
                logits = self._run(st, width)
            else:
                st.graph.replay()
                logits = st.logits
        except RuntimeError as exc:   # capture problems: eager from now on
            log.warning("batched drafter CUDA graphs disabled: %s", exc)
            self.enabled = False
            return propose_batch(self.drafter, self.kpool, self.vpool, caches, slots, ctxs, bonus, starts, self.tables)
        for c, s in zip(caches, starts):
            c.length = s
        if not eager and not st.checked:
            logits = self._self_check(st, caches, slots, ctxs, bonus, starts, logits)
        return logits[:b]

    def _load(self, st: _Static, caches, slots, ctxs, bonus, starts) -> None:
        b, bs = len(slots), self.bs
        pad = st.slots.shape[0] - b
        rows, pos, slot_c = [], [], []
        for i, (c, x, sl) in enumerate(zip(caches, ctxs, slots)):
            rows.extend(range(i * bs, i * bs + x.shape[0]))
            pos.extend(range(c.length, c.length + bs))   # rows past s: the block's own rows (overwritten)
            slot_c.extend([sl] * bs)
        pos.extend(list(range(bs)) * pad)
        slot_c.extend([self.scratch] * (bs * pad))
        host = torch.tensor([pos, slot_c], dtype=torch.long)
        per = torch.tensor([[*slots, *[self.scratch] * pad], [*starts, *[0] * pad], [*bonus, *[0] * pad]],
                           dtype=torch.long)
        # padding rows keep stale (finite) features: their K/V land in block rows, rewritten
        st.ctx.index_copy_(0, torch.tensor(rows, device=st.ctx.device), torch.cat(ctxs))
        st.pos.copy_(host[0], non_blocking=True)
        st.slot_c.copy_(host[1], non_blocking=True)
        st.slots.copy_(per[0], non_blocking=True)
        st.starts.copy_(per[1], non_blocking=True)
        st.bonus.copy_(per[2], non_blocking=True)

    def _run(self, st: _Static, width: int) -> Tensor:
        append_context(self.drafter, self.kpool, self.vpool, st.ctx, st.pos, st.slot_c, self.tables)
        return draft_blocks(self.drafter, self.kpool, self.vpool, st.slots, st.starts, st.bonus, width, self.tables)

    def _capture(self, st: _Static, width: int) -> bool:
        """Capture ``st``'s graph; False when its warm-up shows memory is short (nothing captured)."""
        # warm-up with the real inputs: writes the K/V the graph writes
        logits, fits = self.pool.warm_up(lambda: self._run(st, width))
        if not fits:
            return False
        self.out.reserve("logits", logits)
        del logits
        graph = torch.cuda.CUDAGraph()
        with self.pool.capture(graph):
            logits = self._run(st, width)
            st.logits = self.out.keep("logits", logits)
            del logits
        st.graph = graph
        return True

    def _self_check(self, st: _Static, caches, slots, ctxs, bonus, starts, logits: Tensor) -> Tensor:
        """The first replay of a graph against the eager forward (same K/V writes); on a difference
        beyond rounding the graphs are turned off and the eager result returned."""
        st.checked = True
        for c, x, s in zip(caches, ctxs, starts):
            c.length = s - x.shape[0]
        ref = propose_batch(self.drafter, self.kpool, self.vpool, caches, slots, ctxs, bonus, starts, self.tables)
        differs = replay_differs(logits[: len(slots)], ref)
        if differs:
            log.warning("batched drafter CUDA graphs disabled: graph differs from eager (%s)", differs)
            self.enabled = False
            return ref
        return logits
