"""PagedKV: the target's K/V in pages, read and written through page tables (device side).

The pool is ``k, v [layers, num_pages, kv_heads, page_size, head_dim]``: one layer ``k[l]`` is the
page pool the batched attention kernel reads (``kernels/attention_batch.py`` with ``pages``), and
request r's row j lives in page ``table[j // page_size]`` at row ``j % page_size`` (its page-table
row from ``engine/batch/pages.py``). The three operations a round needs, each the paged form of a
slot cache's (``models/kv_cache.py``):

* ``write``: a layer's new K/V rows at positions s .. s+n-1 (the forward, after RoPE);
* ``keep``: the compaction after verification, row ``start + rows[i]`` -> ``start + i`` in every
  layer (the accepted path of a tree; ``KVCache.keep``);
* ``gather``: a request's first ``length`` rows of a layer as ``[kv_heads, length, d]`` (the SDPA
  path, which needs contiguous keys).

Rows are addressed with index tensors (one gather / scatter per call, no host loop over pages).
The engine's paged layout holds one (``paged.PagedSlots``; docs/architecture.md, "Slot memory and
admission"); its batched forwards and commits address the pools directly (``forward.attend``,
``commit.commit_paths``), a single request's compaction goes through ``keep``.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from ddtree_server.engine.batch.pages import PAGE_SIZE


class PagedKV:
    """K/V pages of one model (``num_pages`` including the dummy page 0)."""

    def __init__(self, num_layers: int, num_pages: int, kv_heads: int, head_dim: int, dtype, device,
                 page_size: int = PAGE_SIZE):
        shape = (num_layers, num_pages, kv_heads, page_size, head_dim)
        # zeros: rows a request has not written yet are finite (see engine/batch/pools.py)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size

    def _where(self, table: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """(page ids, rows within the page) of ``positions`` of the request whose page-table row is
        ``table``; IndexError for a position past the table."""
        slot = positions // self.page_size
        if positions.numel() and int(slot.max()) >= table.shape[0]:
            raise IndexError(f"row {int(positions.max())} is past the {table.shape[0]} pages of the table")
        return table.to(positions.device).long()[slot], positions % self.page_size

    def write(self, layer: int, table: Tensor, start: int, k_new: Tensor, v_new: Tensor) -> None:
        """Rows ``start .. start + n - 1`` of layer ``layer`` from ``k_new, v_new [n, kv_heads, d]``."""
        pos = torch.arange(start, start + k_new.shape[0], device=self.k.device)
        page, row = self._where(table, pos)
        self.k[layer, page, :, row] = k_new.to(self.k.dtype)
        self.v[layer, page, :, row] = v_new.to(self.v.dtype)

    def keep(self, table: Tensor, start: int, rows: Sequence[int]) -> None:
        """Row ``start + rows[i]`` moves to ``start + i`` in every layer (nothing moves when rows is
        ``0 .. k-1``); the caller then sets the request's length to ``start + len(rows)``."""
        rows = list(rows)
        if not rows or rows == list(range(len(rows))):
            return
        if min(rows) < 0:
            raise ValueError(f"rows {rows} must be >= 0")
        dev = self.k.device
        src_page, src_row = self._where(table, torch.tensor(rows, device=dev) + start)
        dst_page, dst_row = self._where(table, torch.arange(start, start + len(rows), device=dev))
        self.move(src_page, src_row, dst_page, dst_row)

    def move(self, src_page: Tensor, src_row: Tensor, dst_page: Tensor, dst_row: Tensor) -> None:
        """Row ``src_row[i]`` of page ``src_page[i]`` to row ``dst_row[i]`` of page ``dst_page[i]``
        in every layer, all read before any is written (device indices: no host synchronisation)."""
        for pool in (self.k, self.v):
            pool[:, dst_page, :, dst_row] = pool[:, src_page, :, src_row]

    def gather(self, layer: int, table: Tensor, length: int) -> Tensor:
        """The first ``length`` rows of a request in layer ``layer``: ``(k, v)``, each
        ``[kv_heads, length, d]`` (fresh storage)."""
        page, row = self._where(table, torch.arange(length, device=self.k.device))
        return (self.k[layer, page, :, row].transpose(0, 1).contiguous(),
                self.v[layer, page, :, row].transpose(0, 1).contiguous())
