"""CUDA-graph replay of DFlashDrafter.propose (one graph per context bucket and key window).

An eager propose launches ~250 small kernels (3 layers: norms, projections, RoPE, attention, MLP,
plus the context K/V append), so at batch 1 it is bound by launches and Python like the target
(docs/benchmarks/README.md, "Measurements behind the engine's design"). `GraphedDrafter` keeps the
drafter contract (`config`, `new_cache`, `propose`, `embed_tokens`, `lm_head`) and replays one graph
per (N, kv_len):

* N = the new context rows n (1..16) padded to a power of two; padding rows are written to cache
  rows [start_pos, start_pos + N - n), which the block then overwrites in the same graph;
* the block's positions (start_pos + 0..bs-1) and the cache rows are computed inside the graph from
  a static `start` buffer, and RoPE comes from the drafter's table by index, so no position is
  frozen at capture time (docs/ddtree.md §3.2);
* attention reads a key window kv_len = the power of two >= start_pos + bs (at least 256) with a
  mask hiding rows >= start_pos + bs; on the kernel path (models/drafter/fast.py, CUDA unless
  ``DDTREE_KERNELS=0``) the attention kernel reads the live rows ``[0, start_pos + bs)`` instead,
  the K/V writes are fused with norm and RoPE, and graphs are keyed by N alone (kv_len 0).

Other calls (the prompt's first propose, n > 16 or n = 0) run eagerly. The first replay is checked
against the eager path; a mismatch or a capture error turns the graphs off (eager from then on,
with a warning). `capture=False` runs the identical static path eagerly (CPU tests).
The returned logits are a view of a static buffer, valid until the next propose.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from ddtree_server.models.drafter import fast
from ddtree_server.models.drafter.attention import visibility
from ddtree_server.models.drafter.model import DFlashDrafter, DraftCache

log = logging.getLogger(__name__)
CTX_BUCKETS = (1, 2, 4, 8, 16)
MIN_KV = 256


def replay_differs(logits: Tensor, ref: Tensor) -> str | None:
    """Why a graph's draft logits differ from the eager ones beyond rounding (mean relative
    difference > 0.05 or argmax agreement < 0.8), or None when they agree."""
    a, r = logits.float(), ref.float()
    rel = float((a - r).abs().mean() / r.abs().mean().clamp(min=1e-6))
    agree = float((a.argmax(-1) == r.argmax(-1)).float().mean())
    if rel > 0.05 or agree < 0.8:
        return f"mean rel. diff {rel:.3f}, argmax agreement {agree:.2f}"
    return None


class _Static:
    """Input / output buffers of one (N, kv_len) shape, and its graph."""

    def __init__(self, d: DFlashDrafter, n: int, kv_len: int, cache: DraftCache):
        dev, cfg = cache.k.device, d.config
        self.n, self.kv_len = n, kv_len
        self.ctx = torch.zeros((n, cfg.context_width), dtype=d.dtype, device=dev)
        self.c0 = torch.zeros((), dtype=torch.long, device=dev)     # first new context row
        self.start = torch.zeros((), dtype=torch.long, device=dev)  # position of the bonus token
        self.ids = torch.full((cfg.block_size,), cfg.mask_token_id, dtype=torch.long, device=dev)
        cos, sin = d.rope_range(0, cache.max_len, dev, d.dtype)
        self.cos, self.sin = cos[0], sin[0]  # [max_len, head_dim]; held so the storage stays alive
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None


class GraphedDrafter:
    """See the module docstring. `drafter`: a DFlashDrafter on CUDA (or CPU with capture=False)."""

    def __init__(self, drafter: DFlashDrafter, capture: bool = True, buckets=CTX_BUCKETS):
        self.drafter = drafter
        self.config = drafter.config
        self.capture = capture
        self.buckets = tuple(sorted(buckets))
        self.enabled = True
        self._checked = False
        self._static: dict[tuple[int, int], _Static] = {}
        self._cache_ptr = None
        self._pool = None
        self._fused: list | None = None  # fast.fuse_drafter weights, made on the kernel path's first use
        dev = drafter.fc.weight.device
        self._arange = torch.arange(max(self.buckets[-1], drafter.config.block_size), device=dev)

    embed_tokens = property(lambda self: self.drafter.embed_tokens)
    lm_head = property(lambda self: self.drafter.lm_head)
    dtype = property(lambda self: self.drafter.dtype)

    def new_cache(self, max_len: int) -> DraftCache:
        """As DFlashDrafter.new_cache."""
        return self.drafter.new_cache(max_len)

    def _run(self, st: _Static, cache: DraftCache) -> Tensor:
        d, bs, kv = self.drafter, self.config.block_size, st.kv_len
        rows = st.c0 + self._arange[: st.n]  # real rows [c0, start), then padding rows
        pos = st.start + self._arange[:bs]
        if kv == 0:
            return self._run_kernels(st, cache, rows, pos)
        h = d.project_context(st.ctx)[None]
        cos_c, sin_c = st.cos.index_select(0, rows)[None], st.sin.index_select(0, rows)[None]
        for i, layer in enumerate(d.layers):
            k, v = layer.self_attn.kv(h, cos_c, sin_c)
            cache.k[i].index_copy_(1, rows, k[0])
            cache.v[i].index_copy_(1, rows, v[0])
        x = d.embed_tokens(st.ids[None]).to(d.dtype)
        cos_b, sin_b = st.cos.index_select(0, pos)[None], st.sin.index_select(0, pos)[None]
        k_pos = torch.arange(kv, device=x.device)
        mask = (k_pos < st.start + bs).view(1, 1, 1, kv)
        masks = {kind: mask if see is None else (see & mask[0, 0])[None, None]
                 for kind in set(d.kinds) for see in [visibility(pos, k_pos, kind)]}
        for i, layer in enumerate(d.layers):
            mask = masks[d.kinds[i]]
            attn = layer.self_attn
            xn = layer.input_layernorm(x)
            k, v = attn.kv(xn, cos_b, sin_b)
            cache.k[i].index_copy_(1, pos, k[0])
            cache.v[i].index_copy_(1, pos, v[0])
            out = attn.attend(attn.q(xn, cos_b, sin_b), cache.k[i, None, :, :kv], cache.v[i, None, :, :kv], mask)
            x = layer.finish(x, out)
        return d.lm_head(d.norm(x[0, 1:]))

    def _run_kernels(self, st: _Static, cache: DraftCache, rows: Tensor, pos: Tensor) -> Tensor:
        d, fused = self.drafter, self._fused
        h = d.project_context(st.ctx)
        cos, sin = st.cos.index_select(0, rows), st.sin.index_select(0, rows)
        for i, layer in enumerate(d.layers):
            fast.drafter_context_kv(layer.self_attn, h, cos, sin, cache.k[i], cache.v[i], st.c0, fused[i])
        x = d.embed_tokens(st.ids).to(d.dtype)
        cos, sin = st.cos.index_select(0, pos), st.sin.index_select(0, pos)
        for i, layer in enumerate(d.layers):
            x = fast.drafter_layer(layer, x, cos, sin, cache.k[i], cache.v[i], st.start, fused[i], d.kinds[i])
        return d.lm_head(d.norm(x[1:]))

    def _get(self, cache: DraftCache, n_pad: int, kv_len: int) -> _Static:
        if cache.k.data_ptr() != self._cache_ptr:  # graphs captured another cache's addresses
            self._static.clear()
            self._pool = None   # the pool died with its graphs: reusing its handle fails in capture
            self._cache_ptr = cache.k.data_ptr()
        st = self._static.get((n_pad, kv_len))
        if st is None:
            st = _Static(self.drafter, n_pad, kv_len, cache)
            self._static[(n_pad, kv_len)] = st
        return st

    def _capture(self, st: _Static, cache: DraftCache) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up with the real inputs: writes the same K/V the graph will
                self._run(st, cache)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            st.logits = self._run(st, cache)
        self._pool = graph.pool()
        st.graph = graph

    @torch.no_grad()
    def propose(self, cache: DraftCache, ctx: Tensor, bonus_token: int | Tensor, start_pos: int) -> Tensor:
        """As DFlashDrafter.propose: logits [block_size-1, vocab] (a static buffer on the graphed path)."""
        n, bs = ctx.shape[0], self.config.block_size
        n_pad = next((b for b in self.buckets if b >= n), None)
        if (not self.enabled or n == 0 or n_pad is None or n_pad - n > bs or cache.length + n != start_pos
                or start_pos + bs > cache.max_len):
            return self.drafter.propose(cache, ctx, bonus_token, start_pos)
        kv_len = min(max(MIN_KV, 1 << (start_pos + bs - 1).bit_length()), cache.max_len)
        if fast.drafter_usable(self.drafter):
            kv_len = 0
            if self._fused is None:  # q|k|v and gate|up as one weight each (same storage as the layers')
                self._fused = fast.fuse_drafter(self.drafter)
        st = self._get(cache, n_pad, kv_len)
        st.ctx[:n].copy_(ctx)  # rows n.. keep stale features: their K/V land in block rows, rewritten
        st.c0.fill_(start_pos - n)
        st.start.fill_(start_pos)
        st.ids[0] = bonus_token
        try:
            if self.capture and st.graph is None:
                self._capture(st, cache)
            if st.graph is not None:
                st.graph.replay()
                logits = st.logits
            else:
                logits = self._run(st, cache)
        except RuntimeError as exc:  # capture problems: fall back to eager for good
            log.warning("drafter CUDA graphs disabled: %s", exc)
            self.enabled = False
            return self.drafter.propose(cache, ctx, bonus_token, start_pos)
        cache.length = start_pos
        if not self._checked:
            logits = self._self_check(cache, ctx, bonus_token, start_pos, logits)
        return logits

    def _self_check(self, cache: DraftCache, ctx: Tensor, bonus_token, start_pos: int, logits: Tensor) -> Tensor:
        """Redo the first static call eagerly (context rows included) and compare; on a mismatch
        the graphs are disabled and the eager result, whose K/V are now in the cache, is returned."""
        self._checked = True
        cache.crop(start_pos - ctx.shape[0])
        ref = self.drafter.propose(cache, ctx, bonus_token, start_pos)
        differs = replay_differs(logits, ref)
        if differs:
            log.warning("drafter CUDA graphs disabled: static path differs from eager (%s)", differs)
            self.enabled = False
            return ref
        return logits
