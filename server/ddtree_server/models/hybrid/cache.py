"""HybridCache: the per-request state of a hybrid target (static, pre-allocated; batch 1).

* ``kv``: a ``KVCache`` over the full-attention layers only (compaction as for dense targets);
* ``conv``: ``[gdn_layers, K-1 + cap, conv_dim]`` (model dtype): rows 0..K-2 are the committed
  causal-conv state (the last K-1 inputs, oldest first), the next rows the current block's inputs;
* ``state``: ``[gdn_layers, Hv, Kd, Vd]`` fp32, the committed recurrent state;
* scratch of the pending block, per method: ``chunk`` keeps k ``kk``, u ``uu`` and path-cumsum
  gates ``GG`` of every node (``[gdn_layers, cap, Hv, *]`` fp32); ``node`` keeps every node's
  state ``nodes`` ``[gdn_layers, cap + 1, Hv, Kd, Vd]`` fp32 (slot 0 = the block's start state);
* ``win``: ``[cap, K]`` conv-window rows of the pending block (see ``tree.py``).

A forward of n <= cap rows that is not committed at once leaves a *pending* block: the attention
K/V are written, the recurrent and conv states are not. ``keep(start, path)`` commits the
accepted root path (attention: move its K/V rows; GDN: fold the path / copy the accepted node's
state, and the accepted node's conv window becomes the conv state), all GDN layers in one
batched op. ``settle()`` commits a pending CHAIN in full (a forward not followed by keep);
a pending TREE must be resolved by keep. Single tokens, prompts (``last_only`` forwards) and
chains longer than ``cap`` are committed by the forward itself (no rollback then).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ddtree_server.models.hybrid import delta, gdn_fast
from ddtree_server.models.kv_cache import KVCache


class HybridCache:
    """See the module docstring. ``length``: committed + pending rows; ``max_len``: capacity."""

    def __init__(self, cfg, method: str, max_len: int, cap: int, dtype, device, spare_rows: int = 0):
        if method not in ("chunk", "node"):
            raise ValueError(f"unknown GDN tree method {method!r}; use chunk or node")
        n_gdn, n_attn = len(cfg.gdn_layers), len(cfg.attn_layers)
        self.kv = KVCache(n_attn, cfg.num_key_value_heads, max_len, cfg.head_dim, dtype, device, spare_rows)
        self.method, self.kernel, self._cfg = method, cfg.linear_conv_kernel_dim, cfg
        self.state = torch.zeros((n_gdn, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                  cfg.linear_value_head_dim), dtype=torch.float32, device=device)
        self.conv = torch.zeros((n_gdn, self.kernel - 1, cfg.conv_dim), dtype=dtype, device=device)
        self.cap = 0
        self.grow(cap)
        self.max_len = max_len
        self.pending: tuple[int, int, bool] | None = None  # (start, rows, is_tree)

    def grow(self, rows: int) -> None:
        """(Re)allocate the verify scratch for ``rows`` nodes (keeps the committed conv state).
        Called once at creation; again only for a tree larger than the scratch (new storage:
        CUDA graphs bound to the old buffers are dropped by their wrapper)."""
        if rows <= self.cap:
            return
        cfg, dev, k1 = self._cfg, self.state.device, self.kernel - 1
        n_gdn, (hv, dk, dv) = self.state.shape[0], self.state.shape[1:]
        f32 = dict(dtype=torch.float32, device=dev)
        conv = torch.zeros((n_gdn, k1 + rows, cfg.conv_dim), dtype=self.conv.dtype, device=dev)
        conv[:, :k1] = self.conv[:, :k1]
        self.conv, self.cap = conv, rows
        self.win = torch.zeros((rows, self.kernel), dtype=torch.long, device=dev)
        if self.method == "chunk":
            self.kk = torch.zeros((n_gdn, rows, hv, dk), **f32)
            self.uu = torch.zeros((n_gdn, rows, hv, dv), **f32)
            self.GG = torch.zeros((n_gdn, rows, hv), **f32)
        else:
            self.nodes = torch.zeros((n_gdn, rows + 1, hv, dk, dv), **f32)

    # the attention KV tensors (CUDA-graph wrappers key on their storage and row count)
    k = property(lambda self: self.kv.k)
    v = property(lambda self: self.kv.v)

    @property
    def length(self) -> int:
        return self.kv.length

    @length.setter
    def length(self, value: int) -> None:
        self.kv.length = value

    def state_bytes(self) -> int:
        """Bytes of the recurrent + conv state and the verify scratch (attention KV excluded)."""
        bufs = [self.conv, self.state, self.win] + [getattr(self, n) for n in ("kk", "uu", "GG", "nodes")
                                                    if hasattr(self, n)]
        return sum(b.numel() * b.element_size() for b in bufs)

    def reset(self) -> None:
        """Empty cache: no rows, zero recurrent and conv states."""
        self.kv.reset()
        self.state.zero_()
        self.conv[:, : self.kernel - 1].zero_()
        self.pending = None

    def begin(self, start: int, n: int, tree: bool, committed: bool) -> None:
        """Record the forward of n rows at ``start`` (called by the target after running it)."""
        if start != self.length:
            raise ValueError(f"forward starts at {start}, cache holds {self.length} rows")
        self.pending = None if committed else (start, n, tree)
        self.length = start + n

    def settle(self) -> None:
        """Commit a pending chain in full; raises RuntimeError for a pending tree (needs keep)."""
        if self.pending is None:
            return
        start, n, tree = self.pending
        if tree:
            raise RuntimeError("a verified tree must be committed with keep(start, path) before the next forward")
        self._commit(start, list(range(n)), None)

    def truncate(self, length: int) -> None:
        """Only the no-op truncation is possible (recurrent states cannot be rolled back further)."""
        if length != self.length:
            raise ValueError(f"a hybrid cache of {self.length} rows cannot be truncated to {length}; use keep")

    def keep(self, start: int, rows: Sequence[int], rows_on_device: torch.Tensor | None = None) -> None:
        """Commit the accepted root path ``rows`` (node indices, root first, each a child of the
        previous) of the block at ``start``: attention K/V rows move as in ``KVCache.keep``, the
        GDN states become those after ``rows[-1]``. Raises ValueError for rows outside the block,
        a start that is not the block's, or a rollback of a block that was committed at once."""
        rows = list(rows)
        if self.pending is None:
            if rows == list(range(self.length - start)):
                return  # committed by the forward and kept in full
            raise ValueError(f"rows {rows} at {start}: the last forward was committed at once (no rollback)")
        p_start, n, _ = self.pending
        if start != p_start or (rows and (min(rows) < 0 or max(rows) >= n)):
            raise ValueError(f"rows {rows} at {start} outside the pending block [{p_start}, {p_start + n})")
        self._commit(start, rows, rows_on_device)

    def _commit(self, start: int, rows: list[int], rows_on_device: torch.Tensor | None) -> None:
        self.kv.keep(start, rows, rows_on_device)
        self.pending = None
        if not rows:
            return
        dev = self.state.device
        idx = rows_on_device if rows_on_device is not None else torch.tensor(rows, dtype=torch.long).to(dev)
        leaf = idx[-1:]
        if self.method == "chunk" and gdn_fast.fold_usable(self):
            gdn_fast.fold(self, idx)  # all GDN layers in one kernel, in place
        elif self.method == "chunk":
            self.state.copy_(delta.fold(self.state, self.kk.index_select(1, idx), self.uu.index_select(1, idx),
                                        self.GG.index_select(1, idx)))
        else:
            self.state.copy_(self.nodes.index_select(1, leaf + 1)[:, 0])
        k1 = self.kernel - 1
        window = self.win.index_select(0, leaf)[0, 1:]
        self.conv[:, :k1] = self.conv.index_select(1, window)
