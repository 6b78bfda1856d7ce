"""CUDA-graph replay of HybridTarget forwards (decode steps, DFlash blocks, DDTree verification).

Same scheme as the dense ``GraphedTarget`` (models/dense/graphs.py), which this class extends: each
forward of n <= 80 rows is padded to a bucket of N rows and replays a graph captured for
(N, kv_len) with static inputs written in place before every replay (ids, positions, the cache
length and the ``[N, N]`` block mask; padding rows see only themselves, so for the GDN layers
they are extra roots whose scratch is never committed). Inside the graph the tree metadata
(parents, conv windows) is derived once from the block mask. The per-request state is static:
the attention KV rows, the committed conv / recurrent states and the verify scratch of
``HybridCache`` are allocated once (``new_cache``; scratch for ``max(buckets)`` nodes) and the
graphs are bound to their storage.

Prompts (``last_only`` forwards) run eagerly: the chunked prefill, committed at once.
Bookkeeping stays outside the graph: a pending chain is settled before the replay, the block is
recorded as pending afterwards, and ``cache.keep`` commits the accepted path eagerly (a handful
of batched kernels over all GDN layers). A 1-row bucket commits in place inside the graph (plain
decoding); its capture restores the committed states that the warm-up runs advanced.
``capture=False`` runs the identical static path eagerly (CPU tests); a failed capture switches
to it with a warning.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from ddtree_server.models.dense.graphs import GraphedTarget
from ddtree_server.models.hybrid import gdn_fast
from ddtree_server.models.hybrid.cache import HybridCache
from ddtree_server.models.hybrid.model import HybridTarget

log = logging.getLogger(__name__)
HYBRID_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80)
MIN_KV = 256


class GraphedHybrid(GraphedTarget):
    """HybridTarget with CUDA-graph replay for forwards of up to ``max(buckets)`` rows; longer
    ones run eagerly. Same ``forward`` contract; outputs are views of static buffers."""

    def __init__(self, model: HybridTarget, capture: bool = True, buckets=HYBRID_BUCKETS):
        super().__init__(model, capture=capture, buckets=buckets)

    def new_cache(self, max_len: int, scratch=None) -> HybridCache:
        """A HybridCache with spare KV rows for padded forwards and scratch for the largest bucket
        (its own, or views of a shared ``scratch``)."""
        return self.model.new_cache(max_len, spare_rows=self.spare_rows, tree_rows=self.buckets[-1], scratch=scratch)

    def _get(self, cache, n_pad: int, kv_len: int):
        # a new cache, grown scratch, or GDN kernels that turned themselves off: capture anew
        ptrs = (cache.state.data_ptr(), cache.conv.data_ptr(), cache.scratch.inputs.data_ptr(), bool(gdn_fast._failed))
        if ptrs != getattr(self, "_state_ptrs", None):
            self._static.clear()
            self._cache_ptr = None
            self._state_ptrs = ptrs
        return super()._get(cache, n_pad, kv_len)

    def _run(self, st, cache):
        n, kv = st.n, st.kv_len
        rows = self._arange[:n] + st.s
        rel = self._arange_kv[:kv] - st.s
        in_block = st.block.gather(1, rel.clamp(0, n - 1).expand(n, kv)) & (rel >= 0) & (rel < n)
        mask = (in_block | (rel < 0)).repeat(st.rep, 1)[None, None]
        return self.model.run(cache, st.ids, st.pos, mask, st.block, rows=rows, kv_len=kv, commit=n == 1,
                              start=st.s)

    def _capture(self, st, cache) -> None:
        k1 = cache.kernel - 1
        saved = (cache.state.clone(), cache.conv[:, :k1].clone())
        try:
            super()._capture(st, cache)
        except RuntimeError as exc:  # an op that cannot be captured: same static path, eagerly
            log.warning("hybrid target CUDA graphs disabled (capture failed: %s)", exc)
            self.capture, st.graph = False, None
            torch.cuda.synchronize()
        finally:
            cache.state.copy_(saved[0])
            cache.conv[:, :k1] = saved[1]

    def forward(self, cache: HybridCache, input_ids: Tensor, positions: Tensor,
                tree_mask: Tensor | None = None, last_only: bool = False) -> tuple[Tensor, Tensor | None]:
        """As ``HybridTarget.forward``. Raises ValueError (cache full, bad mask shape)."""
        n = input_ids.shape[0]
        if cache.length + n > cache.max_len:
            raise ValueError(f"KV cache full: {cache.length} + {n} rows > max_len {cache.max_len}")
        if tree_mask is not None and tuple(tree_mask.shape) != (n, n):
            raise ValueError(f"tree_mask has shape {tuple(tree_mask.shape)}, expected ({n}, {n})")
        n_pad = self._bucket(n)
        limit = cache.k.shape[2] // 16 * 16
        prefill = last_only and tree_mask is None and n > 1  # eager: chunked and committed at once
        if n_pad is None or n_pad > cache.cap or cache.length + n_pad > limit or prefill:
            return self.model.forward(cache, input_ids, positions, tree_mask, last_only)
        cache.settle()
        s = cache.length
        kv_len = min(max(MIN_KV, 1 << (s + n_pad - 1).bit_length()), limit)
        st = self._get(cache, n_pad, kv_len)
        logits, feats = self._launch(st, cache, input_ids, positions, tree_mask, s)
        cache.begin(s, n, tree_mask is not None, committed=n_pad == 1)
        return self._rows(logits, feats, n, last_only)

    __call__ = forward
