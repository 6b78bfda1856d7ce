"""The batched target forward of a hybrid (Qwen3.5 / 3.6) target over the rows of several requests.

Rows and attention as in ``forward.py`` (the flattened ``Layout``; the gated full-attention layers
write and read the slots' or pages' K/V through ``forward.attend``). GDN layers project all rows at
once; the recurrent core runs with a request axis on the pooled slot states (``models/hybrid/
gdn_batch.py``: plain rows committed at once, chains and trees pending until the cache's ``keep``),
else per request on its slot's cache (the ``node`` method, and prompt chunks: ``prefill``, which
commit every causal block at once, as the per-request forward does with ``last_only``).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from ddtree_server.engine.batch.forward import Layout, attend, features
from ddtree_server.models.hybrid import gdn_batch, gdn_fast, gdn_groups
from ddtree_server.models.hybrid.config import GDN
from ddtree_server.models.hybrid.tree import tree_meta
from ddtree_server.models.layers import attention_backends as _attention_backends
from ddtree_server.models.layers import kernels_usable
from ddtree_server.models.layers import linear_add as _linear_add


def _gated_attention(attn, x: Tensor, lay: Layout, kpool, vpool, li: int, cos, sin, mask) -> Tensor:
    q, k, v, gate = attn.project(x, cos, sin)
    return attend(lay, q, k, v, kpool, vpool, li, mask) * torch.sigmoid(gate)


def hybrid_forward(model, caches: list, kpool: Tensor, vpool: Tensor, lay: Layout, gdn: dict | None = None,
                   prefill: bool = False, logit_rows: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """HybridTarget over the batch; ``caches``: the requests' slot caches (HybridCache views);
    ``gdn``: the pooled GDN tensors by name (``state``, ``conv``; the chunk method's round scratch
    ``win``, ``kk``, ``uu``, ``GG``, which the caches share), whose presence batches the GDN layers
    over the requests (``gdn_batch.py``), else each request's mixer runs on its cache. Blocks of
    one row are committed at once, longer ones stay pending until ``cache.keep`` (a batched
    pending block's scratch rows at its row offset in the round: at most the scratch's rows).
    ``prefill``: causal blocks are prompt chunks, committed at once by each request's mixer (no
    ``gdn``); ``logit_rows``: the rows whose logits are returned (all when None). Raises
    ValueError for a pending block past the caches' ``cap`` or a round past the scratch."""
    x = model.embed_tokens(lay.ids)
    head_dim = model.config.head_dim
    mask = None if kernels_usable(head_dim, kpool) else lay.additive(model.rep, x.dtype)
    kernel = model.config.linear_conv_kernel_dim
    batch_chunks = model.method == "chunk"
    ctxs, modes = [], []
    for i, (blk, n, cache) in enumerate(zip(lay.blocks, lay.sizes, caches)):
        cache.settle()
        commit = blk.mask is None and (n == 1 or prefill)
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
        mixer, proj, lay, caches, ctxs, li, gdn, groups), logit_rows)
    for blk, n, cache, ctx, mode, base in zip(lay.blocks, lay.sizes, caches, ctxs, modes, lay.offsets):
        cache.begin(blk.s, n, blk.mask is not None, ctx.mode == "commit", base if mode == "chunk" else 0)
    return logits, feats


def hybrid_layers(model, lay, x: Tensor, kpool: Tensor, vpool: Tensor, mask, gdn_rows,
                  logit_rows: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """The layer stack from the embeddings ``x``; ``gdn_rows(mixer, proj, li)``: a GDN layer's core
    output; the logits of ``logit_rows`` (all rows when None)."""
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
            features(x, i, want, captured)
    logits = model.lm_head(model.norm(x if logit_rows is None else x.index_select(0, logit_rows)))
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
