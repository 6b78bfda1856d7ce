"""KVCache: the target's static, pre-allocated key/value cache (batch 1) with in-place compaction."""

from __future__ import annotations

from typing import Sequence

import torch


class KVCache:
    """Static, pre-allocated KV cache for batch 1.

    ``k``/``v``: ``[num_layers, kv_heads, max_len + spare_rows, head_dim]``; rows ``[0, length)``
    are valid, ``length <= max_len``. ``spare_rows`` are scratch rows past the capacity that
    padded (CUDA-graph) forwards may write to.
    """

    def __init__(self, num_layers: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, spare_rows: int = 0):
        shape = (num_layers, kv_heads, max_len + spare_rows, head_dim)
        # zeros, not empty: padded (CUDA-graph) forwards read masked rows, and a NaN there would
        # leak through softmax (0 * NaN)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0

    def reset(self) -> None:
        """Forget every row (no memory is freed)."""
        self.length = 0

    def truncate(self, length: int) -> None:
        """Keep rows ``[0, length)``. Raises ValueError if ``length`` is outside ``[0, self.length]``."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def keep(self, start: int, rows: Sequence[int], rows_on_device: torch.Tensor | None = None) -> None:
        """Compact: row ``start + rows[i]`` moves to ``start + i``, then truncate to ``start + len(rows)``.

        Used after tree verification to keep the accepted path (docs/ddtree.md §2.5). When ``rows`` is
        ``0..k-1`` nothing moves. ``rows_on_device``: the same rows as a long tensor on the cache's
        device, if the caller has one (saves a host-to-device copy). Raises ValueError for rows
        outside ``[0, length - start)``.
        """
        rows = list(rows)
        count = len(rows)
        if count and (min(rows) < 0 or start + max(rows) >= self.length):
            raise ValueError(f"rows {rows} outside the cache window [{start}, {self.length})")
        if rows != list(range(count)):
            if rows_on_device is None:
                idx = torch.tensor(rows, dtype=torch.long).add_(start).to(self.k.device, non_blocking=True)
            else:
                idx = rows_on_device + start
            self.k[:, :, start:start + count] = self.k.index_select(2, idx)
            self.v[:, :, start:start + count] = self.v.index_select(2, idx)
        self.length = start + count
