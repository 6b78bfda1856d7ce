"""HybridCache: the per-request state of a hybrid target (static, pre-allocated; batch 1).

* ``kv``: a ``KVCache`` over the full-attention layers only (compaction as for dense targets);
* ``conv``: ``[gdn_layers, K-1, conv_dim]`` (model dtype): the committed causal-conv state (the
  last K-1 inputs, oldest first); a conv window's row w < K-1 is conv row w, a row K-1+j the
  pending block's row j (its inputs in the scratch's ``inputs``);
* ``state``: ``[gdn_layers, Hv, Kd, Vd]`` fp32, the committed recurrent state;
* scratch of the pending block, per method: ``chunk`` keeps k ``kk``, u ``uu`` and path-cumsum
  gates ``GG`` of every node (``[gdn_layers, cap, Hv, *]`` fp32); ``node`` keeps every node's
  state ``nodes`` ``[gdn_layers, cap + 1, Hv, Kd, Vd]`` fp32 (slot 0 = the block's start state);
* ``win``: ``[cap, K]`` conv-window rows of the pending block (see ``tree.py``); ``inputs``:
  ``[gdn_layers, cap, conv_dim]`` (model dtype) its rows' conv inputs, for the commit's conv state.

The scratch (``kk / uu / GG / win / inputs`` or ``nodes / win / inputs``) is a ``VerifyScratch``: the cache's own,
or one SHARED by the batch engine's slots (``chunk`` method: one per round, ``engine/batch/
runner.py``), whose rows a batched round indexes by each pending block's row offset in the round
(``base``, set by ``begin``); a per-request forward writes rows ``[0, n)`` (base 0). A shared
scratch is not part of a slot's cache: ``engine/batch/pools.py`` does not pool it.

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


class VerifyScratch:
    """The pending block's GDN buffers for ``rows`` rows (see the module docstring): ``win``
    long ``[rows, K]``, ``inputs [L, rows, C]`` (``dtype``: the model's); ``chunk``: ``kk [L, rows, Hv, Dk]``, ``uu [L, rows, Hv, Dv]``, ``GG [L,
    rows, Hv]`` fp32; ``node``: ``nodes [L, rows + 1, Hv, Dk, Dv]`` fp32. ``shared``: one scratch
    for many caches (the batch engine's round scratch; ``SlotPool`` leaves it out of the slots)."""

    NAMES = {"chunk": ("win", "inputs", "kk", "uu", "GG"), "node": ("win", "inputs", "nodes")}

    def __init__(self, cfg, method: str, rows: int, device, shared: bool = False, dtype=torch.float32):
        n_gdn, hv = len(cfg.gdn_layers), cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        f32 = dict(dtype=torch.float32, device=device)
        self.method, self.rows, self.shared = method, rows, shared
        self.win = torch.zeros((rows, cfg.linear_conv_kernel_dim), dtype=torch.long, device=device)
        self.inputs = torch.zeros((n_gdn, rows, cfg.conv_dim), dtype=dtype, device=device)
        if method == "chunk":
            self.kk = torch.zeros((n_gdn, rows, hv, dk), **f32)
            self.uu = torch.zeros((n_gdn, rows, hv, dv), **f32)
            self.GG = torch.zeros((n_gdn, rows, hv), **f32)
        else:
            self.nodes = torch.zeros((n_gdn, rows + 1, hv, dk, dv), **f32)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in self.NAMES[self.method]}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


class HybridCache:
    """See the module docstring. ``length``: committed + pending rows; ``max_len``: capacity;
    ``scratch``: a shared ``VerifyScratch`` (None: the cache's own of ``cap`` rows); ``cap``: the
    rows of a pending block (at most the scratch's)."""

    def __init__(self, cfg, method: str, max_len: int, cap: int, dtype, device, spare_rows: int = 0,
                 scratch: VerifyScratch | None = None):
        if method not in ("chunk", "node"):
            raise ValueError(f"unknown GDN tree method {method!r}; use chunk or node")
        if scratch is not None and scratch.method != method:
            raise ValueError(f"a {scratch.method} scratch for a {method} cache")
        n_gdn, n_attn = len(cfg.gdn_layers), len(cfg.attn_layers)
        self.kv = KVCache(n_attn, cfg.num_key_value_heads, max_len, cfg.head_dim, dtype, device, spare_rows)
        self.method, self.kernel, self._cfg = method, cfg.linear_conv_kernel_dim, cfg
        self.state = torch.zeros((n_gdn, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                  cfg.linear_value_head_dim), dtype=torch.float32, device=device)
        self.conv = torch.zeros((n_gdn, self.kernel - 1, cfg.conv_dim), dtype=dtype, device=device)
        self.cap, self.scratch = 0, scratch
        self.grow(cap if scratch is None else min(cap, scratch.rows), own=scratch is None)
        self.max_len = max_len
        self.pending: tuple[int, int, bool] | None = None  # (start, rows, is_tree)
        self.base = 0   # the pending block's first row in the scratch

    def grow(self, rows: int, own: bool = True) -> None:
        """Pending blocks of up to ``rows`` nodes and, ``own``, a verify scratch of the cache's own
        for them. Called once at creation; again only for a tree larger than the scratch (new
        storage, the cache's own: CUDA graphs bound to the old buffers are dropped by their wrapper)."""
        if rows <= self.cap:
            return
        self.cap = rows
        if own:
            self.scratch = VerifyScratch(self._cfg, self.method, rows, self.state.device, dtype=self.conv.dtype)

    # the attention KV tensors (CUDA-graph wrappers key on their storage and row count)
    k = property(lambda self: self.kv.k)
    v = property(lambda self: self.kv.v)
    # the verify scratch (the cache's own or the shared one)
    win = property(lambda self: self.scratch.win)
    kk = property(lambda self: self.scratch.kk)
    uu = property(lambda self: self.scratch.uu)
    GG = property(lambda self: self.scratch.GG)
    nodes = property(lambda self: self.scratch.nodes)
    inputs = property(lambda self: self.scratch.inputs)

    @property
    def length(self) -> int:
        return self.kv.length

    @length.setter
    def length(self, value: int) -> None:
        self.kv.length = value

    def state_bytes(self) -> int:
        """Bytes of the recurrent + conv state and the verify scratch (attention KV excluded)."""
        return sum(b.numel() * b.element_size() for b in (self.conv, self.state)) + self.scratch.nbytes

    def reset(self) -> None:
        """Empty cache: no rows, zero recurrent and conv states."""
        self.kv.reset()
        self.state.zero_()
        self.conv[:, : self.kernel - 1].zero_()
        self.pending = None

    def begin(self, start: int, n: int, tree: bool, committed: bool, base: int = 0) -> None:
        """Record the forward of n rows at ``start`` (called by the target after running it);
        ``base``: the pending block's first row in the scratch (a batched round's row offset)."""
        if start != self.length:
            raise ValueError(f"forward starts at {start}, cache holds {self.length} rows")
        self.pending = None if committed else (start, n, tree)
        self.length, self.base = start + n, base

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
        if self.base:   # the block's rows in a shared scratch
            idx = idx + self.base
        leaf = idx[-1:]
        if self.method == "chunk" and gdn_fast.fold_usable(self):
            gdn_fast.fold(self, idx)  # all GDN layers in one kernel, in place
        elif self.method == "chunk":
            self.state.copy_(delta.fold(self.state, self.kk.index_select(1, idx), self.uu.index_select(1, idx),
                                        self.GG.index_select(1, idx)))
        else:
            self.state.copy_(self.nodes.index_select(1, leaf + 1)[:, 0])
        window = self.win.index_select(0, leaf)[0, 1:]
        self.conv.copy_(window_rows(self.conv, self.inputs, window, self.base))


def window_rows(conv, inputs, window, base):
    """The conv rows of a pending block's window: ``window`` long ``[K-1]`` (entries < K-1: rows of
    the committed ``conv [L, K-1, C]``; K-1+j: the block's row j, row ``base + j`` of ``inputs
    [L, rows, C]``) -> ``[L, K-1, C]``."""
    k1 = conv.shape[1]
    committed = conv.index_select(1, window.clamp(max=k1 - 1))
    pending = inputs.index_select(1, (window - k1).clamp(min=0) + base)
    return torch.where((window < k1)[None, :, None], committed, pending)
