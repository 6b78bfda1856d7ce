"""The batch-1 DDTree / DFlash round after the drafter, all on the device, on the paged KV layout (dense targets).

``solo_round.py`` for a lone greedy ``ddtree`` (or ``dflash``: the chain of the draft block's
argmax tokens) request on pages: the tree build, the verify
forward, the walk and the commit run with fixed shapes and no host synchronisation, so on CUDA
they are ONE CUDA graph per (tree width, rows) replayed every round, and the round ends with ONE
device-to-host copy. Before, such a round took the batched path: the trees copied back to build the
layout on the host, the forward, then the walk copied back, the GPU idle in between (the
batch-1 profile of docs/benchmarks/h200-2026-12-04-batch1/).

The verify forward is the batched one (``forward.dense_forward``) over a layout of one block
built on the device (``DeviceLayout``): the tree's n rows at cache rows ``s .. s+n-1``, their K/V
written through the slot's page table (a copy of its device row, ``PagedSlots.device_tables``).
Rows past the live nodes are dead: they see only themselves and are never accepted; their K/V go
to the request's own reserved rows past its tree or, past its pages, to the dummy page. The round
applies only while ``s + n`` rows fit the table's width (else the batched path runs). The commit
moves the rows in path order to ``s ..`` through the page table (gather, then scatter), and the
host sets the committed length to ``s + len(path)``.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from ddtree_server.engine.batch import settle
from ddtree_server.engine.batch.draft import address
from ddtree_server.engine.batch.forward import dense_forward
from ddtree_server.engine.batch.pages import PAGE_SIZE
from ddtree_server.engine.batch.solo_round import (SoloResult, Transfers, device_chain, device_tree, unpack,
                                                   walk_and_pack)

log = logging.getLogger(__name__)


class DeviceLayout:
    """A ``forward.Layout`` of one block of ``n`` tree rows whose fields are device buffers written
    on the device (duck-typed: the fields ``dense_forward`` and ``forward.attend`` read)."""

    def __init__(self, n: int, width: int, device):
        long = dict(dtype=torch.long, device=device)
        self.b, self.rmax, self.tree, self.n = 1, n, True, n
        self.ids, self.pos, self.req = torch.zeros(n, **long), torch.zeros(n, **long), torch.zeros(n, **long)
        self.row = torch.arange(n, **long)
        self.page_of_row, self.row_in_page = torch.zeros(n, **long), torch.zeros(n, **long)
        self.starts, self.qo = torch.zeros(1, dtype=torch.int32, device=device), \
            torch.tensor([0, n], dtype=torch.int32, device=device)
        self.slots = torch.zeros(1, **long)
        self.pages = torch.zeros((1, width), dtype=torch.int32, device=device)   # the slot's table row
        self.inner = torch.zeros((1, n, n), dtype=torch.bool, device=device)
        self.kv_max = 0   # host: the eager SDPA path's key count (s + n), set per round

    def fill(self, tree, s: Tensor, depth_max: int) -> None:
        """The round's rows from the device tree and the 0-d committed length ``s`` (cache rows
        ``s .. s+n-1``)."""
        page, row = address(0, self.row + s, self.pages)
        self.ids.copy_(tree.ids)
        self.pos.copy_(tree.dep + s)
        self.starts.copy_(s[None])
        self.page_of_row.copy_(page)
        self.row_in_page.copy_(row)
        self.inner.copy_(tree.mask(depth_max)[None])

    # the eager SDPA path (no Triton kernels: the CPU); s is known on the host there
    @property
    def lens(self) -> Tensor:
        return (self.starts + self.n).long()

    @property
    def valid(self) -> Tensor:
        return torch.arange(self.kv_max, device=self.ids.device)[None, :] < self.lens[:, None]

    def additive(self, rep: int, dtype) -> Tensor:
        s = self.kv_max - self.n
        see = torch.zeros((self.n, self.kv_max), dtype=torch.bool, device=self.ids.device)
        see[:, :s] = True
        see[:, s:] = self.inner[0]
        m = see[None, None, None].expand(1, 1, rep, self.n, self.kv_max).reshape(1, 1, rep * self.n, self.kv_max)
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))


class _Round:
    def __init__(self, mode: str, width: int, n: int, draft: Tensor, table_width: int):
        self.mode, self.width, self.n = mode, width, n
        self.lay = DeviceLayout(n, table_width, draft.device)
        self.draft = torch.zeros_like(draft)
        self.scal = torch.zeros(3, dtype=torch.long, device=draft.device)   # root token, s, cap
        self.graph = None
        self.out: Tensor | None = None
        self.ctx: Tensor | None = None


class PagedSoloRound:
    """The device round of a dense ``model`` whose K/V is the page pools ``kpool`` / ``vpool``
    (``[layers, pages, kv_heads, page_size, d]``) of ``slots`` (``paged.PagedSlots``); ``capture``:
    CUDA graphs (else eager, e.g. on the CPU)."""

    def __init__(self, model, slots, capture: bool):
        self.model, self.slots, self.capture = model, slots, capture
        self.enabled = True   # False after a capture error: the batched path from then on
        self._rounds: dict[tuple, _Round] = {}
        self._pool = None
        self.io = Transfers()

    def round(self, runner, req, draft: Tensor) -> list[int] | None:
        """The request's round on the device (its tokens, the request settled), or None where it
        does not apply (``run``): the caller's batched round then goes on with the same draft."""
        got = self.run(req, draft, min(req.budget, runner.room(req)))
        return None if got is None else settle.device_round(runner, req, got)

    def run(self, req, draft: Tensor, cap: int) -> SoloResult | None:
        """As ``SoloRound.run`` for the request in slot ``req.slot`` (draft logits ``[L, vocab]``);
        None, with nothing done, where the round does not apply (not a greedy ddtree request
        without a processor, cap < 1, or its rows past the table's width)."""
        if not self.enabled or req.mode not in ("ddtree", "dflash") or cap < 1 or not req.params.greedy \
                or req.processor is not None:
            return None
        width = req.budget if req.mode == "ddtree" else draft.shape[0]   # a chain: the block's drafts
        n = width + 1
        table = self.slots.device_tables(draft.device)
        if req.s + n > table.shape[1] * PAGE_SIZE:
            return None
        key = (req.mode, width, tuple(draft.shape), draft.dtype)
        rd = self._rounds.get(key)
        if rd is None:
            with torch.inference_mode(False):   # normal tensors: updatable in and out of inference mode
                rd = self._rounds[key] = _Round(req.mode, width, n, draft, table.shape[1])
        self.io.scalars(rd.scal, (req.bonus, req.s, cap), self.capture)
        rd.draft.copy_(draft)
        rd.lay.pages.copy_(table[req.slot:req.slot + 1])
        rd.lay.kv_max = req.s + n
        if not self.capture:
            host = self._body(rd).tolist()
        else:
            if rd.graph is None:
                try:
                    self._capture(rd)
                except RuntimeError as exc:   # warm-up and capture wrote the dummy page only
                    log.warning("paged device round disabled (CUDA graph capture failed): %s", exc)
                    self.enabled = False
                    return None
            host = self.io.replay(rd.graph, rd.out)
        result = unpack(host, n, rd.ctx)
        self.slots[req.slot].length = req.s + len(result.path)
        return result

    def _capture(self, rd: _Round) -> None:
        # warm-up and capture with an empty table: every write lands on the dummy page; the
        # request's table row is copied back before the replay
        real = rd.lay.pages.clone()
        rd.lay.pages.zero_()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._body(rd)
        torch.cuda.current_stream().wait_stream(side)
        rd.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(rd.graph, pool=self._pool):
            self._body(rd)
        self._pool = rd.graph.pool()
        rd.lay.pages.copy_(real)

    def _body(self, rd: _Round) -> Tensor:
        """Tree, verify inputs, forward, walk, commit: fixed shapes, no host synchronisation."""
        depth_max, s = rd.draft.shape[0], rd.scal[1]
        tree = device_tree(rd.draft, rd.width, rd.n, rd.scal[0:1], rd.scal[2]) if rd.mode == "ddtree" else \
            device_chain(rd.draft, rd.n, rd.scal[0:1], rd.scal[2])
        rd.lay.fill(tree, s, depth_max)
        logits, feats = dense_forward(self.model, self.slots.pool("k"), self.slots.pool("v"), rd.lay)
        order, rd.out = walk_and_pack(logits, tree, depth_max)
        # the rows in path order to s .. s+n-1 (the layout's rows) through the page table
        self.slots.kv.move(*address(0, order + s, rd.lay.pages), rd.lay.page_of_row, rd.lay.row_in_page)
        rd.ctx = None if feats is None else feats.index_select(0, order)
        return rd.out
