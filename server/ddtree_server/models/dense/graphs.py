"""CUDA-graph replay of TargetModel forwards (decode, DFlash blocks, DDTree verification).

At batch 1 the eager forward is bound by kernel launches and Python, not by the GPU (~600 launches
for SmolLM2, ~10 ms CPU against ~1.5 ms of GPU work; docs/benchmarks/README.md, "Measurements behind
the engine's design"). ``GraphedTarget`` keeps the TargetModel calling convention but pads each
forward of n <= 512 tokens to a bucket of N tokens and replays a graph captured for (N, kv_len) with
static inputs:

* ids / positions ``[N]`` (padding rows reuse stale values: they are never read back),
* the cache length s (a 0-d tensor) and the ``[N, N]`` block mask (tree/causal block for the n
  real rows, padding rows see only themselves);
* inside the graph: cache rows ``[N]`` = s + 0..N-1 (padding rows land in spare rows past the real
  ones) and the attention mask ``[1, 1, rep*N, kv_len]`` (prefix ``[0, s)`` visible, the block at
  ``[s, s+N)``, everything past s+N hidden), so a replay needs only 5 small copies before it;
* kv_len = the power of two >= s+N (at least 256), so attention reads a bounded key window.

On the kernel path (models/dense/fast.py: CUDA with Triton unless ``DDTREE_KERNELS=0``) the attention
kernel reads the live rows ``[0, s+N)`` with s taken from the static buffer on the device and the
``[N, N]`` block mask as is: no window mask is built and graphs are keyed by N alone (kv_len 0),
so one graph per bucket serves every context length.

Positions are written into the static buffer before every replay (docs/ddtree.md §3.2: a graph that
kept its captured positions would silently verify with sequential positions). Graphs are bound to
one KVCache's storage; a new cache drops them. ``capture=False`` runs the identical static path
eagerly (tests on CPU).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree_server.models.dense import fast
from ddtree_server.models.dense.target import TargetModel
from ddtree_server.models.kv_cache import KVCache
from ddtree_server.models.layers import kernels_usable

# powers of two plus the sizes DDTree trees take (budget B -> B + 1 nodes: 17, 33, 65, 129, 257),
# so a 65-node tree pads to 80 rows, not 128
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 128, 160, 256, 320, 512)
MIN_KV = 256


class _Static:
    """Input / output buffers of one (N, kv_len) shape, and its graph."""

    def __init__(self, n: int, kv_len: int, rep: int, device):
        self.n, self.kv_len = n, kv_len
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.pos = torch.zeros(n, dtype=torch.long, device=device)
        self.s = torch.zeros((), dtype=torch.long, device=device)  # cache length before the forward
        self.block = torch.eye(n, dtype=torch.bool, device=device)
        self.rep = rep
        self.graph = None
        self.logits: Tensor | None = None
        self.feats: Tensor | None = None


class GraphedTarget:
    """TargetModel with CUDA-graph replay for forwards of up to ``max(buckets)`` tokens.

    Longer forwards (long prompts) run eagerly. Same ``forward`` contract as TargetModel; the
    returned logits / features are views of static buffers, valid until the next forward.
    """

    def __init__(self, model: TargetModel, capture: bool = True, buckets=BUCKETS):
        self.model = model
        self.config = model.config
        self.capture = capture
        self.buckets = tuple(sorted(buckets))
        self.spare_rows = self.buckets[-1] + 16
        self._rep = model.config.num_attention_heads // model.config.num_key_value_heads
        self._static: dict[tuple, _Static] = {}
        self._cache_ptr = None
        self._pool = None
        dev = model.embed_tokens.weight.device
        self._arange = torch.arange(self.buckets[-1], device=dev)
        self._arange_kv = self._arange  # grown to the cache's row count in _get
        self._tril = torch.ones((self.buckets[-1],) * 2, dtype=torch.bool, device=dev).tril_()
        self._eye = torch.eye(self.buckets[-1], dtype=torch.bool, device=dev)

    embed_tokens = property(lambda self: self.model.embed_tokens)
    lm_head = property(lambda self: self.model.lm_head)

    @property
    def capture_layers(self) -> list[int]:
        return self.model.capture_layers

    @capture_layers.setter
    def capture_layers(self, layers: list[int]) -> None:
        self.model.capture_layers = list(layers)

    def new_cache(self, max_len: int) -> KVCache:
        """A KVCache of ``max_len`` rows plus the spare rows padded forwards write to."""
        return self.model.new_cache(max_len, spare_rows=self.spare_rows)

    def _bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _fast(self) -> bool:
        """TargetModel layers on the kernel path (subclasses over other models keep their window)."""
        return isinstance(self.model, TargetModel) and kernels_usable(self.model.head_dim, self.model.embed_tokens.weight)

    def kv_rows(self, cache: KVCache, s: int, n: int) -> int | None:
        """Key rows attention reads for n new tokens after s cached ones on the graphed path:
        s + the bucket on the kernel path, else the power-of-two window; None = eager forward."""
        n_pad = self._bucket(n)
        limit = cache.k.shape[2] // 16 * 16
        if n_pad is None or s + n_pad > limit:
            return None
        return s + n_pad if self._fast() else min(max(MIN_KV, 1 << (s + n_pad - 1).bit_length()), limit)

    def static_inputs(self, cache: KVCache, n: int) -> _Static | None:
        """The static buffers of the bucket that a forward of n rows after ``cache.length`` takes
        (``ids`` / ``pos`` ``[N]``, the cache length ``s``, the ``[N, N]`` ``block``: padding rows
        see only themselves), for a caller that writes them on the device itself (inside its own
        CUDA graph) and then runs ``run_static``; None where that forward runs eagerly."""
        kv_len = self.kv_rows(cache, cache.length, n)
        if kv_len is None:
            return None
        return self._get(cache, self._bucket(n), 0 if self._fast() else kv_len)

    def run_static(self, st: _Static, cache: KVCache) -> tuple[Tensor, Tensor | None]:
        """The layer stack over ``st``'s buffers as they are, without replaying the bucket's own
        graph (so a caller's capture records it): logits ``[N, vocab]``, features ``[N, F]``. The
        cache length is the caller's to set."""
        return self._run(st, cache)

    def _get(self, cache: KVCache, n_pad: int, kv_len: int) -> _Static:
        ptr = cache.k.data_ptr()
        if ptr != self._cache_ptr:  # graphs captured the old cache's addresses
            self._static.clear()
            self._pool = None   # the pool died with its graphs: reusing its handle fails in capture
            self._cache_ptr = ptr
            if self._arange_kv.numel() < cache.k.shape[2]:
                self._arange_kv = torch.arange(cache.k.shape[2], device=cache.k.device)
        key = (n_pad, kv_len, tuple(self.model.capture_layers))
        st = self._static.get(key)
        if st is None:
            with torch.inference_mode(False):  # normal tensors: updatable in and out of inference mode
                st = _Static(n_pad, kv_len, self._rep, cache.k.device)
            if self.capture:
                self._capture(st, cache)
            self._static[key] = st
        return st

    def _run(self, st: _Static, cache: KVCache):
        n, kv = st.n, st.kv_len
        if kv == 0:  # kernel path: padding rows see only themselves through st.block
            return self.model.run(cache, st.ids, st.pos, fast.FastBlock(st.s, "tree", st.block))
        rows = self._arange[:n] + st.s
        rel = self._arange_kv[:kv] - st.s  # key column relative to the block start
        in_block = st.block.gather(1, rel.clamp(0, n - 1).expand(n, kv)) & (rel >= 0) & (rel < n)
        mask = (in_block | (rel < 0)).repeat(st.rep, 1)[None, None]  # [1, 1, rep*N, kv]
        return self.model.run(cache, st.ids, st.pos, mask, rows=rows, kv_len=kv)

    def _capture(self, st: _Static, cache: KVCache) -> None:
        # warm-up and capture write K/V only into spare rows past the real capacity
        st.s.fill_(cache.k.shape[2] - st.n)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run(st, cache)
        torch.cuda.current_stream().wait_stream(side)
        st.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(st.graph, pool=self._pool):
            st.logits, st.feats = self._run(st, cache)
        self._pool = st.graph.pool()

    def forward(self, cache: KVCache, input_ids: Tensor, positions: Tensor,
                tree_mask: Tensor | None = None, last_only: bool = False
                ) -> tuple[Tensor, Tensor | None]:
        """As ``TargetModel.forward`` (logits ``[n, vocab]`` or ``[1, vocab]``, features
        ``[n, L*H]`` or None). Raises ValueError when the cache has fewer than n free rows."""
        n, s = input_ids.shape[0], cache.length
        if s + n > cache.max_len:
            raise ValueError(f"KV cache full: {s} + {n} rows > max_len {cache.max_len}")
        if tree_mask is not None and tuple(tree_mask.shape) != (n, n):
            raise ValueError(f"tree_mask has shape {tuple(tree_mask.shape)}, expected ({n}, {n})")
        kv_len = self.kv_rows(cache, s, n)
        if kv_len is None:
            return self.model.forward(cache, input_ids, positions, tree_mask, last_only)
        n_pad = self._bucket(n)
        st = self._get(cache, n_pad, 0 if self._fast() else kv_len)
        logits, feats = self._launch(st, cache, input_ids, positions, tree_mask, s)
        cache.length = s + n
        return self._rows(logits, feats, n, last_only)

    def _launch(self, st: _Static, cache, input_ids: Tensor, positions: Tensor, tree_mask: Tensor | None,
                s: int) -> tuple[Tensor, Tensor | None]:
        """Write n real rows' inputs (ids, positions, cache length s, their block mask; padding rows
        see only themselves) into the bucket's static buffers and replay its graph (or run its static
        path); returns the bucket's logits ``[N, vocab]`` and features (views of static buffers)."""
        n, n_pad = input_ids.shape[0], st.n
        st.ids[:n].copy_(input_ids)
        st.pos[:n].copy_(positions)
        st.s.fill_(s)
        if n < n_pad:
            st.block.copy_(self._eye[:n_pad, :n_pad])
        st.block[:n, :n].copy_(self._tril[:n, :n] if tree_mask is None else tree_mask)
        if st.graph is not None:
            st.graph.replay()
            return st.logits, st.feats
        return self._run(st, cache)

    @staticmethod
    def _rows(logits: Tensor, feats: Tensor | None, n: int, last_only: bool) -> tuple[Tensor, Tensor | None]:
        """The n real rows of a bucket's outputs (the last one only with ``last_only``)."""
        return (logits[n - 1:n] if last_only else logits[:n]), (feats[:n] if feats is not None else None)

    __call__ = forward
