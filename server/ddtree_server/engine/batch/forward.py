"""One target forward over the rows of several requests (dense Llama-family and Qwen3.5 hybrids).

Rows are flattened ``[N]`` (request after request; a request's rows are its block: 1 row for plain
decoding, a chain or a tree); GEMMs (projections, MLP, LM head) run once over all N rows.
Attention is per request in one padded SDPA: queries ``[b, heads, rows_max]`` against the
request's slot ``pool_k[slot, layer, :, :kv_max]``; a row sees its request's committed prefix
``[0, s)`` and its own ancestors in the block (causal for chains), rows past a request's live
length are zeroed before use (a freed slot may hold anything, NaN in the debug mode). K/V of row
i of a request go to slot row ``s + i`` (compaction to the accepted path is the cache's ``keep``).
GDN layers (hybrids) project all rows at once; the recurrent core runs with a request axis on the
pooled slot states (``models/hybrid/gdn_batch.py``: plain rows committed at once, chains and
trees pending until the cache's ``keep``), the ``node`` method per request on its slot's cache.

Attention takes the split-K Triton kernel with a request axis where the kernel path is on (CUDA;
``kernels/attention_batch.py``: each slot read in place up to its live length, a request's rows
bitwise those it gets alone), else a padded SDPA over the gathered slots (every device). CUDA
graphs of batched rounds replay these forwards in a padded layout (``graphs.py``; the hybrid ones
from the layout alone: ``hybrid_rounds.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ddtree_server.engine.batch.pages import PAGE_SIZE
from ddtree_server.kernels.attention_batch import batch_attention
from ddtree_server.models.hybrid import gdn_batch, gdn_fast, gdn_groups
from ddtree_server.models.hybrid.config import GDN
from ddtree_server.models.hybrid.tree import tree_meta
from ddtree_server.models.layers import apply_rope as _apply_rope
from ddtree_server.models.layers import attention_backends as _attention_backends
from ddtree_server.models.layers import kernels_usable
from ddtree_server.models.layers import linear_add as _linear_add


@dataclass
class Block:
    """One request's rows in a batched forward: token ids, depths (position = s + depth), the
    bool ancestor-or-self mask ``[n, n]`` (numpy, host; None: a causal chain)."""

    slot: int
    s: int
    ids: list[int]
    depths: list[int]
    mask: np.ndarray | None


class Layout:
    """Flattened rows of a batch of blocks and the attention geometry, built on the host and sent
    in two copies (row indices; per-request lengths / offsets / slots) plus the tree masks."""

    def __init__(self, blocks: list[Block], device, rmax: int = 0, tree: bool = False, pages: Tensor | None = None):
        """``rmax`` / ``tree``: at least this many rows per block and tree masks even for chains
        (the fixed shapes of a CUDA graph, engine/batch/graphs.py). ``pages``: int32 ``[b, width]``
        device page tables of the blocks (the paged KV layout, ``paged.py``), None for slots."""
        self.blocks, self.device = blocks, device
        sizes = np.fromiter((len(b.ids) for b in blocks), dtype=np.int64, count=len(blocks))
        starts = np.fromiter((b.s for b in blocks), dtype=np.int64, count=len(blocks))
        offsets = np.zeros(len(blocks) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        self.sizes, self.offsets = sizes.tolist(), offsets.tolist()
        self.b, self.rmax = len(blocks), max(int(sizes.max()), rmax)
        self.kv_max = int((starts + sizes).max())
        req = np.repeat(np.arange(self.b), sizes)
        row = np.arange(offsets[-1]) - offsets[req]
        rows = np.stack((req, row, np.fromiter((t for b in blocks for t in b.ids), dtype=np.int64, count=offsets[-1]),
                         np.fromiter((d for b in blocks for d in b.depths), dtype=np.int64, count=offsets[-1])
                         + starts[req], starts[req] + row))   # request, row in request, id, position, cache row
        self.req, self.row, self.ids, self.pos, self.dest = torch.from_numpy(rows).to(device)
        slots = np.fromiter((b.slot for b in blocks), dtype=np.int64, count=self.b)
        per = np.stack((np.append(slots, 0), np.append(starts, 0), np.append(starts + sizes, 0), offsets))
        per_dev = torch.from_numpy(per).to(device)   # slot, start, length, row offset
        self.slots, self.lens = per_dev[0, :-1], per_dev[2, :-1]
        self.starts, self.qo = per_dev[1, :-1].to(torch.int32), per_dev[3].to(torch.int32)
        self.slot_of_row = self.slots[self.req]
        self.pages = pages
        if pages is not None:   # where each row's K/V goes: (page, row in the page)
            size = PAGE_SIZE
            self.page_of_row = pages[self.req, self.dest // size].long()
            self.row_in_page = self.dest % size
        self.tree = tree or any(b.mask is not None for b in blocks)
        self.inner_np = self.inner_host if self.tree else None   # host copy (hybrid_rounds.layout_windows)
        self.inner = torch.from_numpy(self.inner_np).to(device) if self.tree else None

    @property
    def inner_host(self) -> np.ndarray:
        """Bool ``[b, rmax, rmax]``: each block's own mask (a tree's, else causal) in its corner."""
        inner = np.zeros((self.b, self.rmax, self.rmax), dtype=bool)
        tri = np.tri(self.rmax, dtype=bool)
        for i, (blk, n) in enumerate(zip(self.blocks, self.sizes)):
            inner[i, :n, :n] = blk.mask if blk.mask is not None else tri[:n, :n]
        return inner

    @property
    def valid(self) -> Tensor:
        """Bool ``[b, kv_max]``: the rows of each slot below its request's live length."""
        return torch.arange(self.kv_max, device=self.device)[None, :] < self.lens[:, None]

    def additive(self, rep: int, dtype) -> Tensor:
        """Additive mask ``[b, 1, rep*rmax, kv_max]`` of the padded SDPA (GQA rows: rep query heads
        per KV head): the committed prefix, the block's own mask; padding rows see column 0."""
        see = np.zeros((self.b, self.rmax, self.kv_max), dtype=bool)
        inner = self.inner_host
        for i, (blk, n) in enumerate(zip(self.blocks, self.sizes)):
            see[i, :n, : blk.s] = True
            see[i, :n, blk.s: blk.s + n] = inner[i, :n, :n]
            see[i, n:, 0] = True
        m = torch.from_numpy(see).to(self.device)[:, None, None].expand(self.b, 1, rep, self.rmax, self.kv_max)
        m = m.reshape(self.b, 1, rep * self.rmax, self.kv_max)
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))

    def split(self, x: Tensor) -> list[Tensor]:
        return [x[a:b] for a, b in zip(self.offsets, self.offsets[1:])]


def _paged_rows(pool: Tensor, lay: Layout) -> Tensor:
    """A layer's first ``kv_max`` rows of every request through its page table: ``[b, hkv, kv_max, d]``."""
    used = -(-lay.kv_max // PAGE_SIZE)
    got = pool[lay.pages[:, :used].long()]                               # [b, used, hkv, page, d]
    b, _, hkv, size, d = got.shape
    return got.permute(0, 2, 1, 3, 4).reshape(b, hkv, used * size, d)[:, :, : lay.kv_max]


def attend(lay: Layout, q: Tensor, k: Tensor, v: Tensor, kpool: Tensor, vpool: Tensor, li: int,
           mask: Tensor | None) -> Tensor:
    """Write K/V ``[N, hkv, d]`` to the slots (or pages) and attend: q ``[N, hq, d]`` -> ``[N, hq * d]``.
    The pools: ``[slots, layers, hkv, rows, d]``, or ``[layers, pages, hkv, page_size, d]`` when
    the layout has page tables."""
    paged = lay.pages is not None
    if paged:
        kl, vl = kpool[li], vpool[li]                                    # [pages, hkv, page_size, d]
        kl[lay.page_of_row, :, lay.row_in_page] = k
        vl[lay.page_of_row, :, lay.row_in_page] = v
    else:
        kl, vl = kpool[:, li], vpool[:, li]                              # [slots, hkv, rows, d]
        kl[lay.slot_of_row, :, lay.dest] = k
        vl[lay.slot_of_row, :, lay.dest] = v
    n, hq, d = q.shape
    if kernels_usable(d, kpool):  # split-K kernel with the request axis: reads each slot in place
        out = batch_attention(q, kl, vl, lay.starts, lay.qo, lay.slots, lay.rmax,
                              "tree" if lay.tree else "causal", lay.inner, pages=lay.pages)
        return out.reshape(n, hq * d)
    keep = lay.valid[:, None, :, None]
    keys = _paged_rows(kl, lay) if paged else kl[lay.slots, :, : lay.kv_max]
    vals = _paged_rows(vl, lay) if paged else vl[lay.slots, :, : lay.kv_max]
    keys, vals = keys.masked_fill_(~keep, 0.0), vals.masked_fill_(~keep, 0.0)
    hkv = k.shape[1]
    rep = hq // hkv
    qp = q.new_zeros((lay.b, lay.rmax, hq, d))
    qp[lay.req, lay.row] = q
    qp = qp.permute(0, 2, 1, 3).reshape(lay.b, hkv, rep * lay.rmax, d)
    out = F.scaled_dot_product_attention(qp, keys, vals, attn_mask=mask)
    out = out.reshape(lay.b, hq, lay.rmax, d).permute(0, 2, 1, 3)
    return out[lay.req, lay.row].reshape(n, hq * d)


def _features(x, i, want, captured):
    if i in want:
        captured[want[i]] = x


def dense_forward(model, kpool: Tensor, vpool: Tensor, lay: Layout, logit_rows: Tensor | None = None
                  ) -> tuple[Tensor, Tensor | None]:
    """TargetModel over the batch: logits ``[N, vocab]`` (only of ``logit_rows`` when given) and
    captured features ``[N, F]``."""
    x = model.embed_tokens(lay.ids)
    cos, sin = model._rope(lay.pos, x.dtype)
    a0 = model.layers[0].self_attn
    mask = None if kernels_usable(a0.head_dim, kpool) else lay.additive(a0.n_heads // a0.n_kv, x.dtype)
    want = {layer: i for i, layer in enumerate(model.capture_layers)}
    captured: list = [None] * len(want)
    n = x.shape[0]
    with _attention_backends(x.device):
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            hq, hkv = attn.n_heads, attn.n_kv
            qkv = attn.qkv_proj(layer.input_layernorm(x)).view(n, hq + 2 * hkv, attn.head_dim)
            qk, v = qkv[:, : hq + hkv], qkv[:, hq + hkv:]
            if attn.qk_norm:
                qk = torch.cat((attn.q_norm(qk[:, :hq]), attn.k_norm(qk[:, hq:])), dim=1)
            qk = _apply_rope(qk, cos, sin)
            out = attend(lay, qk[:, :hq], qk[:, hq:], v, kpool, vpool, i, mask)
            x = _linear_add(x, out, attn.o_proj)
            x = _linear_add(x, layer.mlp.hidden(layer.post_attention_layernorm(x)), layer.mlp.down_proj)
            _features(x, i, want, captured)
    logits = model.lm_head(model.norm(x if logit_rows is None else x.index_select(0, logit_rows)))
    return logits, (torch.cat(captured, dim=-1) if captured else None)


def _gated_attention(attn, x: Tensor, lay: Layout, kpool, vpool, li: int, cos, sin, mask) -> Tensor:
    n, hq, hkv, hd = x.shape[0], attn.n_heads, attn.n_kv, attn.head_dim
    qg, k, v = attn.qkv_proj(x).split((2 * hq * hd, hkv * hd, hkv * hd), dim=-1)
    qg = qg.view(n, hq, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(n, hq * hd)
    qk = torch.cat((attn.q_norm(q), attn.k_norm(k.view(n, hkv, hd))), dim=1)
    if attn.rot:
        qk = torch.cat((_apply_rope(qk[..., : attn.rot], cos, sin), qk[..., attn.rot:]), dim=-1)
    out = attend(lay, qk[:, :hq], qk[:, hq:], v.view(n, hkv, hd), kpool, vpool, li, mask)
    return out * torch.sigmoid(gate)


def hybrid_forward(model, caches: list, kpool: Tensor, vpool: Tensor, lay: Layout, gdn: dict | None = None
                   ) -> tuple[Tensor, Tensor | None]:
    """HybridTarget over the batch; ``caches``: the requests' slot caches (HybridCache views);
    ``gdn``: the pooled GDN tensors by name (``state``, ``conv``; the chunk method's round scratch
    ``win``, ``kk``, ``uu``, ``GG``, which the caches share), whose presence batches the GDN layers
    over the requests (``gdn_batch.py``), else each request's mixer runs on its cache. Blocks of
    one row are committed at once, longer ones stay pending until ``cache.keep`` (a batched
    pending block's scratch rows at its row offset in the round: at most the scratch's rows).
    Raises ValueError for a pending block past the caches' ``cap`` or a round past the scratch."""
    x = model.embed_tokens(lay.ids)
    head_dim = model.config.head_dim
    mask = None if kernels_usable(head_dim, kpool) else lay.additive(model.rep, x.dtype)
    kernel = model.config.linear_conv_kernel_dim
    batch_chunks = model.method == "chunk"
    ctxs, modes = [], []
    for i, (blk, n, cache) in enumerate(zip(lay.blocks, lay.sizes, caches)):
        cache.settle()
        commit = blk.mask is None and n == 1
        if not commit and n > cache.cap:
            raise ValueError(f"a pending block of {n} rows exceeds the slot's verify scratch ({cache.cap})")
        mode = "own" if gdn is None else "step" if commit else "chunk" if batch_chunks else "own"
        if mode == "chunk" and lay.offsets[-1] > gdn["kk"].shape[1]:
            raise ValueError(f"a round of {lay.offsets[-1]} rows exceeds the verify scratch ({gdn['kk'].shape[1]})")
        modes.append(mode)
        ctx = SimpleNamespace(meta=None, mode="commit" if commit else model.method, rows=None, kv_len=None,
                              start=None, block=None, cos=None, sin=None, mask=None)
        if mode == "own":   # the per-request mixer: its tree metadata (windows of a pending block to its cache)
            ctx.block = None if blk.mask is None else lay.inner[i, :n, :n].contiguous()
            ctx.meta = tree_meta(ctx.block, n, kernel, x.device)
            if not commit:
                cache.win[:n] = ctx.meta.win
        ctxs.append(ctx)
    groups = None
    if gdn is not None:
        groups = gdn_groups.RowGroups(lay.offsets, [b.slot for b in lay.blocks], modes,
                                      [b.mask for b in lay.blocks], kernel, x.device)
        if groups.chunks is not None:   # the pending blocks' conv windows, for the commit (HybridCache.keep)
            gdn["win"][groups.chunks.rows] = groups.chunks.win
    logits, feats = hybrid_layers(model, lay, x, kpool, vpool, mask, lambda mixer, proj, li: _gdn_rows(
        mixer, proj, lay, caches, ctxs, li, gdn, groups))
    for blk, n, cache, ctx, mode, base in zip(lay.blocks, lay.sizes, caches, ctxs, modes, lay.offsets):
        cache.begin(blk.s, n, blk.mask is not None, ctx.mode == "commit", base if mode == "chunk" else 0)
    return logits, feats


def hybrid_layers(model, lay, x: Tensor, kpool: Tensor, vpool: Tensor, mask, gdn_rows
                   ) -> tuple[Tensor, Tensor | None]:
    """The layer stack from the embeddings ``x``; ``gdn_rows(mixer, proj, li)``: a GDN layer's core output."""
    cos, sin = model.rope(lay.pos, x.dtype)
    want = {layer: i for i, layer in enumerate(model.capture_layers)}
    captured: list = [None] * len(want)
    with _attention_backends(x.device):
        for i, layer in enumerate(model.layers):
            h = layer.input_layernorm(x)
            if layer.kind == GDN:
                mixer = layer.linear_attn
                x = _linear_add(x, gdn_rows(mixer, mixer.in_proj(h), layer.index), mixer.out_proj)
            else:
                out = _gated_attention(layer.self_attn, h, lay, kpool, vpool, layer.index, cos, sin, mask)
                x = _linear_add(x, out, layer.self_attn.o_proj)
            x = _linear_add(x, layer.mlp.hidden(layer.post_attention_layernorm(x)), layer.mlp.down_proj)
            _features(x, i, want, captured)
    logits = model.lm_head(model.norm(x))
    return logits, (torch.cat(captured, dim=-1) if captured else None)


def _own(mixer, proj: Tensor, cache, li: int, ctx) -> Tensor:
    fast = gdn_fast.usable(proj, cache, ctx)
    return (gdn_fast.mix if fast else type(mixer).mix)(mixer, proj, cache, li, ctx)


def _gdn_rows(mixer, proj: Tensor, lay: Layout, caches: list, ctxs: list, li: int, gdn: dict | None,
              groups) -> Tensor:
    """The GDN core output ``[N, value_dim]`` of every row: the batched groups, then the rest per request."""
    if groups is None:
        return torch.cat([_own(mixer, p, c, li, ctx) for p, c, ctx in zip(lay.split(proj), caches, ctxs)])
    if groups.step_rows is not None and groups.step_all:
        return gdn_batch.step(mixer, proj, gdn, li, groups.step_slots)
    if groups.chunks is not None and groups.chunk_all:
        return gdn_batch.chunk(mixer, proj, gdn, li, groups.chunks)
    out = proj.new_empty((proj.shape[0], mixer.value_dim))
    if groups.step_rows is not None:
        out[groups.step_rows] = gdn_batch.step(mixer, proj[groups.step_rows], gdn, li, groups.step_slots)
    if groups.chunks is not None:
        out[groups.chunks.rows] = gdn_batch.chunk(mixer, proj[groups.chunks.rows], gdn, li, groups.chunks)
    for i in groups.own:
        a, b = lay.offsets[i], lay.offsets[i + 1]
        out[a:b] = _own(mixer, proj[a:b], caches[i], li, ctxs[i])
    return out
