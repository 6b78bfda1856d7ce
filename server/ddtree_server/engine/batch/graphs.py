"""CUDA graphs of the batched dense target forward, keyed by (batch bucket, rows per request, mode).

Eager, a batched forward of a small target is bound by kernel launches and Python (~600 launches for
SmolLM2), as the batch-1 forward was before its graphs (``models/dense/graphs.py``). Here a round's
blocks are padded to a fixed layout and the forward replays a graph captured for it:

* every request's block is padded to ``r`` rows (r = the largest block, rounded up to a bucket);
  padding rows follow the real ones in the request's own slot (rows ``s + n .. s + r - 1``, past
  its live length: the next round overwrites them) and see only themselves (tree mode) or the
  prefix (causal mode, after every real row), so a real row's attention is the one it gets
  unpadded;
* the batch is padded to a bucket of B requests with blocks on a scratch slot (the pool's last
  slot, never handed to a request);
* the graph reads the layout from static buffers (token ids, positions, cache rows, slots, starts,
  row offsets, tree masks), written by a few device copies before each replay; the kernel path
  reads each request's live length from them on the device, so one graph serves every length.

Padding costs rows, so a round takes a graph only while the padded rows stay within ``WASTE`` x its
real rows (a tree among plain requests runs eagerly). Graphs exist on the Triton-kernel path only
(CUDA); ``capture=False`` runs the same padded layout eagerly (the CPU tests of the padding).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ddtree_server.engine.batch.forward import Block, Layout, dense_forward

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
ROW_BUCKETS = (1, 2, 4, 8, 16, 17, 24, 32, 33, 48, 65, 80)
WASTE = 2.0
MAX_ROWS = 1024   # padded rows of one graph (its logits are [B * r, vocab])


def bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= n), None)


def pad_blocks(blocks: list[Block], b_pad: int, r: int, tree: bool, scratch: int) -> list[Block]:
    """The blocks padded to ``r`` rows each and to ``b_pad`` blocks (see the module docstring)."""
    out = []
    for blk in blocks:
        n = len(blk.ids)
        extra = r - n
        mask = None
        if tree:
            mask = np.eye(r, dtype=bool)
            mask[:n, :n] = blk.mask if blk.mask is not None else np.tri(n, dtype=bool)
        depth = max(blk.depths) + 1
        out.append(Block(blk.slot, blk.s, [*blk.ids, *([0] * extra)],
                         [*blk.depths, *range(depth, depth + extra)], mask))
    pad_mask = np.eye(r, dtype=bool) if tree else None
    out.extend(Block(scratch, 0, [0] * r, list(range(r)), pad_mask) for _ in range(b_pad - len(blocks)))
    return out


class _Static:
    """Static layout buffers of one (B, r, mode) and its graph; duck-types the ``Layout`` fields the
    kernel path of ``dense_forward`` reads."""

    FIELDS = ("ids", "pos", "dest", "slot_of_row", "starts", "qo", "slots")

    def __init__(self, lay: Layout):
        self.b, self.rmax, self.tree = lay.b, lay.rmax, lay.tree
        for name in self.FIELDS:
            setattr(self, name, getattr(lay, name).clone())
        self.inner = lay.inner.clone() if lay.tree else None
        self.graph = None
        self.logits: Tensor | None = None
        self.feats: Tensor | None = None

    def load(self, lay: Layout) -> None:
        for name in self.FIELDS:
            getattr(self, name).copy_(getattr(lay, name), non_blocking=True)
        if self.inner is not None:
            self.inner.copy_(lay.inner, non_blocking=True)


class BatchGraphs:
    """Padded, graph-replayed batched forwards of a dense ``TargetModel`` over a slot pool whose
    last slot is the scratch slot (see the module docstring)."""

    def __init__(self, model, kpool: Tensor, vpool: Tensor, *, capture: bool = True):
        self.model, self.kpool, self.vpool, self.capture = model, kpool, vpool, capture
        self.scratch = kpool.shape[0] - 1
        self._static: dict[tuple, _Static] = {}
        self._pool = None
        self.rounds = 0    # forwards through the padded layout (replayed or, without capture, eager)

    def shape(self, blocks: list[Block]) -> tuple[int, int, bool] | None:
        """(B, r, tree) of the padded layout, or None when the round should run eagerly."""
        sizes = [len(b.ids) for b in blocks]
        b_pad, r = bucket(len(blocks), BATCH_BUCKETS), bucket(max(sizes), ROW_BUCKETS)
        if b_pad is None or r is None or b_pad * r > min(WASTE * sum(sizes) + 8, MAX_ROWS):
            return None
        if max(b.s for b in blocks) + r > self.kpool.shape[3]:   # padding rows must fit the slot
            return None
        return b_pad, r, any(b.mask is not None for b in blocks)

    def forward(self, blocks: list[Block], shape: tuple[int, int, bool]) -> tuple[Tensor, Tensor | None, list[int]]:
        """Logits ``[B * r, vocab]`` and features of the padded layout (views of static buffers,
        valid until the next forward), and each block's first row in them."""
        b_pad, r, tree = shape
        lay = Layout(pad_blocks(blocks, b_pad, r, tree, self.scratch), self.kpool.device)
        starts = [i * r for i in range(len(blocks))]
        self.rounds += 1
        if not self.capture:
            logits, feats = dense_forward(self.model, self.kpool, self.vpool, lay)
            return logits, feats, starts
        key = (b_pad, r, tree, tuple(self.model.capture_layers))
        st = self._static.get(key)
        if st is None:
            st = self._static[key] = self._capture(lay)
        else:
            st.load(lay)
        st.graph.replay()
        return st.logits, st.feats, starts

    def _capture(self, lay: Layout) -> _Static:
        with torch.inference_mode(False):
            st = _Static(lay)
        saved = {}
        for name in ("dest", "slot_of_row", "slots"):   # warm-up and capture write the scratch slot only
            saved[name] = getattr(st, name).clone()
            getattr(st, name).fill_(self.scratch if name != "dest" else 0)
        st.dest.copy_(torch.arange(st.dest.numel(), device=st.dest.device) % st.rmax)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                dense_forward(self.model, self.kpool, self.vpool, st)
        torch.cuda.current_stream().wait_stream(side)
        st.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(st.graph, pool=self._pool):
            st.logits, st.feats = dense_forward(self.model, self.kpool, self.vpool, st)
        self._pool = st.graph.pool()
        for name, value in saved.items():
            getattr(st, name).copy_(value)
        return st
