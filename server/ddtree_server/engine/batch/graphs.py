"""CUDA graphs of the batched target forward, keyed by (batch bucket, row bucket, block bucket, mode).

Eager, a batched forward of a small target is bound by kernel launches and Python (~600 launches for
SmolLM2), as the batch-1 forward was before its graphs (``models/dense/graphs.py``). Here a round's
rows are padded to a fixed ragged layout and the forward replays a graph captured for it:

* the requests' blocks stay as they are (ragged: 1 row for plain decoding, a chain, a tree), one
  after the other; the total N rows is padded to a bucket ``N_pad`` and the request count b to a
  bucket ``B`` by padding blocks of 1 .. r rows on a scratch slot (the pool's last slot, never
  handed to a request), r = the largest block rounded up to a bucket (it sizes the attention grid);
* the graph reads the layout (token ids, positions, cache rows, slots, starts, row offsets, tree
  masks ``[B, r, r]``) from static buffers, written by a few device copies before each replay; the
  kernel path reads each request's live length and row offsets from them on the device, so one graph
  serves every length and every way of splitting N_pad rows among B blocks of at most r rows.

A request's rows are computed as unpadded: its attention sees only its own slot and block, and the
projections are row-wise. Graphs exist on the Triton-kernel path only (CUDA); ``capture=False`` runs
the same padded layout eagerly (the CPU tests of the padding).

Hybrid (Qwen3.5 / 3.6) targets (``hybrid_rounds.py``): a round of one row per request (plain
decoding) runs the GDN step with a request axis on the pooled slot states, committed at once; a
round with chains or trees (``chunk`` method, blocks up to the verify scratch) keeps every block
pending (one-row blocks too) and runs the batched tree-masked chunk rule over the padded blocks
(tree masks and conv windows from static buffers), committed after the walk by
``hybrid_rounds.commit_pending``. Padding rows write the scratch slot's state and conv rows and
their rows of the round's verify scratch, which no request reads. The verify scratch is the
round's (``runner.py``): a pending round needs ``N_pad`` rows of it, else it runs eagerly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree_server.engine.batch.forward import Block, Layout, dense_forward
from ddtree_server.engine.batch.graph_out import SharedOut
from ddtree_server.engine.batch.graph_pool import GraphPool
from ddtree_server.engine.batch.hybrid_rounds import layout_windows, pending_forward, plain_forward
from ddtree_server.engine.batch.pages import PAGE_SIZE
from ddtree_server.engine.batch.padding import (  # noqa: F401 - the buckets are part of this module's interface
    BATCH_BUCKETS,
    MAX_ROWS,
    ROW_BUCKETS,
    TOTAL_BUCKETS,
    bucket,
    padded_shape,
)


def pad_blocks(blocks: list[Block], b_pad: int, n_pad: int, scratch: int) -> list[Block]:
    """The blocks followed by ``b_pad - b`` padding blocks on the scratch slot holding the
    ``n_pad - N`` padding rows (see the module docstring)."""
    k, extra = b_pad - len(blocks), n_pad - sum(len(b.ids) for b in blocks)
    sizes = [extra // k + (i < extra % k) for i in range(k)] if k else []
    return [*blocks, *(Block(scratch, 0, [0] * m, list(range(m)), None) for m in sizes)]


class _Static:
    """Static layout buffers of one (B, N_pad, r, mode) and its graph; duck-types the ``Layout`` fields the
    kernel path of ``dense_forward`` reads."""

    FIELDS = ("ids", "pos", "dest", "slot_of_row", "starts", "qo", "slots")
    PENDING = ("req", "row", "win")   # a hybrid round of pending blocks (hybrid_rounds.pending_forward)
    PAGED = ("pages", "page_of_row", "row_in_page")   # the paged KV layout's page tables (paged.py)

    def __init__(self, lay: Layout):
        self.b, self.rmax, self.tree, self.pages = lay.b, lay.rmax, lay.tree, None
        self.fields = self.FIELDS + (self.PENDING if getattr(lay, "win", None) is not None else ()) \
            + (self.PAGED if lay.pages is not None else ())
        for name in self.fields:
            setattr(self, name, getattr(lay, name).clone())
        self.inner = lay.inner.clone() if lay.tree else None
        self.graph = None
        self.logits: Tensor | None = None
        self.feats: Tensor | None = None

    def load(self, lay: Layout) -> None:
        for name in self.fields:
            getattr(self, name).copy_(getattr(lay, name), non_blocking=True)
        if self.inner is not None:
            self.inner.copy_(lay.inner, non_blocking=True)


class BatchGraphs:
    """Padded, graph-replayed batched forwards of a dense ``TargetModel`` over a slot pool whose
    last slot is the scratch slot (see the module docstring)."""

    def __init__(self, model, kpool: Tensor, vpool: Tensor, *, capture: bool = True, gdn: dict | None = None,
                 cap: int | None = None, pool: GraphPool | None = None, scratch: int | None = None, tables=None):
        """``gdn``: the pooled GDN tensors of a hybrid target (``hybrid_rounds.py``): then rounds of
        one row per request, and of pending blocks up to ``cap`` rows (the slots' caches' ``cap``;
        None: the scratch's rows up to ``ROW_BUCKETS[-1]``; ``chunk`` method: ``gdn`` holds the
        round's verify scratch, whose rows bound the padded rows). ``pool``: the graph pool shared with
        the runner's drafter graphs (``graph_pool.py``). The paged KV layout (``paged.py``): the
        pools are page pools, ``tables(blocks)`` gives the padded blocks' page tables and
        ``scratch`` is a slot without pages (padding rows write the dummy page 0)."""
        self.model, self.kpool, self.vpool, self.capture, self.gdn = model, kpool, vpool, capture, gdn
        self.tables = tables
        self.rows = gdn["kk"].shape[1] if gdn is not None and "kk" in gdn else 0   # 0: no pending graphs
        self.cap = min(self.rows, ROW_BUCKETS[-1]) if cap is None else min(cap, self.rows)
        self.scratch = kpool.shape[0] - 1 if scratch is None else scratch
        self._static: dict[tuple, _Static] = {}
        self._refused: dict[tuple, int] = {}   # shapes not captured for memory: what their capture needs
        # every graph's logits / features in one buffer each (graph_out.py): at most the padded rows
        # of all slots' blocks (plain hybrid rounds: one row each; pending ones: the scratch's rows)
        most = min(MAX_ROWS, self.scratch * ROW_BUCKETS[-1] + BATCH_BUCKETS[-1])
        if gdn is not None:
            most = min(most, max(self.rows, BATCH_BUCKETS[-1]))
        self.out = SharedOut(bucket(most, TOTAL_BUCKETS) or MAX_ROWS)
        self.pool = pool if pool is not None else GraphPool(kpool.device)
        self.rounds = 0    # forwards through the padded layout (replayed or, without capture, eager)
        self.pending_rounds = 0   # of them, hybrid rounds of pending blocks (chains / trees)

    def shape(self, blocks: list[Block]) -> tuple[int, int, int, bool] | None:
        """(B, N_pad, r, tree) of the padded layout, or None when the round runs eagerly."""
        sizes = [len(b.ids) for b in blocks]
        got = padded_shape(sizes)
        if got is None or self.gdn is None:
            return None if got is None else (*got, any(b.mask is not None for b in blocks))
        if max(sizes) == 1:
            return (*got, False)
        return (*got, True) if got[2] <= self.cap and got[1] <= self.rows else None   # pending blocks

    def forward(self, blocks: list[Block], shape: tuple[int, int, int, bool], caches: list | None = None
                ) -> tuple[Tensor, Tensor | None, list[int]]:
        """Logits ``[N_pad, vocab]`` and features of the padded layout (views of static buffers,
        valid until the next forward), and each block's first row in them. ``caches``: the blocks'
        slot caches of a hybrid target (settled before; after, plain rows recorded as committed, the
        blocks of a pending round as pending: ``hybrid_rounds.commit_pending``)."""
        for c in caches if self.gdn is not None else ():
            c.settle()
        out = self._forward(blocks, shape)
        for c, blk, base in zip(caches, blocks, out[2]) if self.gdn is not None else ():
            c.begin(blk.s, len(blk.ids), blk.mask is not None, not shape[3], base)
        return out

    def _forward(self, blocks: list[Block], shape: tuple[int, int, int, bool]) -> tuple[Tensor, Tensor | None, list[int]]:
        b_pad, n_pad, r, tree = shape
        padded = pad_blocks(blocks, b_pad, n_pad, self.scratch)
        lay = Layout(padded, self.kpool.device, rmax=r, tree=tree,
                     pages=self.tables(padded) if self.tables is not None else None)
        if self.gdn is not None and tree:
            lay.win = layout_windows(lay, self.model.config.linear_conv_kernel_dim)
        starts = lay.offsets[: len(blocks)]
        self.rounds += 1
        self.pending_rounds += self.gdn is not None and tree
        key = (b_pad, n_pad, r, tree, tuple(self.model.capture_layers))
        st = self._static.get(key)
        if st is not None:
            st.load(lay)
        elif self.capture and self.pool.room(self._refused.get(key, 0)):
            st = self._capture(lay)   # built from this round's layout
            if st is None:            # its warm-up showed the capture would not leave the headroom free
                self._refused[key] = self.pool.need
            else:
                self._static[key] = st
        if st is None:                # eager: CPU, or memory is short (graph_pool.py)
            logits, feats = self._run(lay)
            return logits, feats, starts
        st.graph.replay()
        return st.logits, st.feats, starts

    def _run(self, lay) -> tuple[Tensor, Tensor | None]:
        if self.gdn is not None:
            run = pending_forward if lay.tree else plain_forward
            return run(self.model, self.kpool, self.vpool, lay, self.gdn)
        return dense_forward(self.model, self.kpool, self.vpool, lay)

    def _capture(self, lay: Layout) -> _Static | None:
        with torch.inference_mode(False):
            st = _Static(lay)
        saved = {}
        paged = st.pages is not None   # warm-up and capture write the scratch slot (the dummy page) only
        for name in ("dest", "slot_of_row", "slots") + (_Static.PAGED if paged else ()):
            saved[name] = getattr(st, name).clone()
            getattr(st, name).fill_(self.scratch if name in ("slot_of_row", "slots") else 0)
        st.dest.copy_(torch.arange(st.dest.numel(), device=st.dest.device) % st.rmax)   # rows [0, r) of scratch
        if paged:
            st.row_in_page.copy_(st.dest % PAGE_SIZE)
        (logits, feats), fits = self.pool.warm_up(lambda: self._run(st))
        if not fits:
            for name, value in saved.items():
                getattr(st, name).copy_(value)
            return None
        self.out.reserve("logits", logits)
        self.out.reserve("feats", feats)
        del logits, feats
        st.graph = torch.cuda.CUDAGraph()
        with self.pool.capture(st.graph):
            logits, feats = self._run(st)
            st.logits, st.feats = self.out.keep("logits", logits), self.out.keep("feats", feats)
            del logits, feats
        for name, value in saved.items():
            getattr(st, name).copy_(value)
        return st
