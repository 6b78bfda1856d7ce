"""One target forward over the rows of several requests (dense Llama-family and Qwen3.5 hybrids).

Rows are flattened ``[N]`` (request after request; a request's rows are its block: 1 row for plain
decoding, a chain or a tree); GEMMs (projections, MLP, LM head) run once over all N rows.
Attention is per request in one padded SDPA: queries ``[b, heads, rows_max]`` against the
request's slot ``pool_k[slot, layer, :, :kv_max]``; a row sees its request's committed prefix
``[0, s)`` and its own ancestors in the block (causal for chains), rows past a request's live
length are zeroed before use (a freed slot may hold anything, NaN in the debug mode). K/V of row
i of a request go to slot row ``s + i`` (compaction to the accepted path is the cache's ``keep``).
On the paged layout the K/V rows go to and come from pages through the blocks' page tables
(``Layout(pages=...)``). Hybrid targets' GDN layers: ``forward_hybrid.py``, over this layout.

Attention takes the split-K Triton kernel with a request axis where the kernel path is on (CUDA;
``kernels/attention_batch.py``: each slot read in place up to its live length, a request's rows
bitwise those it gets alone) and, as in the per-request forward (``models/dense/fast.py``), a
layer's q/k-norm + RoPE + K/V writes in one launch (``kernels/fused.py`` ``qkv_prep_rows``, each
row to its slot row or page row) and the MLP's ``silu(gate) * up`` in another; elsewhere a padded
SDPA over the gathered slots (every device), the K/V written by indexing. CUDA
graphs of batched rounds replay these forwards in a padded layout (``graphs.py``; the hybrid ones
from the layout alone: ``hybrid_rounds.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ddtree_server.engine.batch.pages import PAGE_SIZE
from ddtree_server.kernels.attention_batch import batch_attention
from ddtree_server.kernels.fused import qkv_prep_rows
from ddtree_server.models.dense.fast import mlp_hidden
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
    kl, vl = _layer(lay, kpool, vpool, li)
    if paged:
        kl[lay.page_of_row, :, lay.row_in_page] = k
        vl[lay.page_of_row, :, lay.row_in_page] = v
    else:
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


def _layer(lay: Layout, kpool: Tensor, vpool: Tensor, li: int) -> tuple[Tensor, Tensor]:
    """Layer ``li`` of the pools: ``[pages, hkv, page_size, d]`` (paged) or ``[slots, hkv, rows, d]``."""
    return (kpool[li], vpool[li]) if lay.pages is not None else (kpool[:, li], vpool[:, li])


def kv_offsets(lay: Layout, pool: Tensor) -> Tensor:
    """Element offset of each row's K/V (head 0) in a pool layer (``_layer``): page and row in the
    page, or slot and cache row (``kernels/fused.py`` ``qkv_prep_rows``)."""
    if lay.pages is not None:
        return lay.page_of_row * pool.stride(0) + lay.row_in_page * pool.stride(2)
    return lay.slot_of_row * pool.stride(0) + lay.dest * pool.stride(2)


def _fused_attention(attn, h: Tensor, cos: Tensor, sin: Tensor, lay: Layout, kpool: Tensor, vpool: Tensor, li: int,
                     off: Tensor) -> Tensor:
    """The kernel path's attention of one layer: q/k-norm + RoPE + the K/V writes in one launch
    (as the per-request forward, ``models/dense/fast.py``), then the batched split-K kernel."""
    n, hq, hkv, d = h.shape[0], attn.n_heads, attn.n_kv, attn.head_dim
    qkv = attn.qkv_proj(h).view(n, hq + 2 * hkv, d)
    qw, kw, eps = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps) if attn.qk_norm else (None, None, 0.0)
    kl, vl = _layer(lay, kpool, vpool, li)
    q = qkv_prep_rows(qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], qw, kw, eps, cos, sin, kl, vl, off)
    out = batch_attention(q, kl, vl, lay.starts, lay.qo, lay.slots, lay.rmax, "tree" if lay.tree else "causal",
                          lay.inner, pages=lay.pages)
    return out.reshape(n, hq * d)


def features(x, i, want, captured):
    if i in want:
        captured[want[i]] = x


def dense_forward(model, kpool: Tensor, vpool: Tensor, lay: Layout, logit_rows: Tensor | None = None
                  ) -> tuple[Tensor, Tensor | None]:
    """TargetModel over the batch: logits ``[N, vocab]`` (only of ``logit_rows`` when given) and
    captured features ``[N, F]``."""
    x = model.embed_tokens(lay.ids)
    cos, sin = model._rope(lay.pos, x.dtype)
    a0 = model.layers[0].self_attn
    fused = kernels_usable(a0.head_dim, kpool)   # the per-request forward's fused kernels
    mask = None if fused else lay.additive(a0.n_heads // a0.n_kv, x.dtype)
    off = kv_offsets(lay, _layer(lay, kpool, vpool, 0)[0]) if fused else None   # the same in every layer
    want = {layer: i for i, layer in enumerate(model.capture_layers)}
    captured: list = [None] * len(want)
    n = x.shape[0]
    with _attention_backends(x.device):
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            if fused:
                out = _fused_attention(attn, h, cos, sin, lay, kpool, vpool, i, off)
            else:
                hq, hkv = attn.n_heads, attn.n_kv
                qkv = attn.qkv_proj(h).view(n, hq + 2 * hkv, attn.head_dim)
                qk, v = qkv[:, : hq + hkv], qkv[:, hq + hkv:]
                if attn.qk_norm:
                    qk = torch.cat((attn.q_norm(qk[:, :hq]), attn.k_norm(qk[:, hq:])), dim=1)
                qk = _apply_rope(qk, cos, sin)
                out = attend(lay, qk[:, :hq], qk[:, hq:], v, kpool, vpool, i, mask)
            x = _linear_add(x, out, attn.o_proj)
            h = layer.post_attention_layernorm(x)
            x = _linear_add(x, mlp_hidden(layer.mlp, h) if fused else layer.mlp.hidden(h), layer.mlp.down_proj)
            features(x, i, want, captured)
    logits = model.lm_head(model.norm(x if logit_rows is None else x.index_select(0, logit_rows)))
    return logits, (torch.cat(captured, dim=-1) if captured else None)
