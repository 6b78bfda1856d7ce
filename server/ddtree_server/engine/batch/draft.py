"""The DFlash drafter over several requests in one forward (context append + draft block).

Per request r: its new context features (positions ``[dcache.length, s_r)``) are projected and
their K/V written to its slot of the pooled draft cache; then the blocks ``[bonus_r, MASK ...]``
at positions ``s_r .. s_r + bs - 1`` of all requests run as one ``[b, bs]`` batch, each block
attending to its own slot's rows ``[0, s_r + bs)`` (rows past that are zeroed: a freed slot may
hold anything). Draft outputs only shape the trees; exactness never depends on them.

On the kernel path (CUDA) the block's attention is the split-K Triton kernel with a request axis
(``kernels/attention_batch.py``, ``block`` mode and the sliding windows): each slot read in place
up to its request's live length, so a round's cost follows the requests' lengths, not the longest
one's. Elsewhere it gathers each request's key / value rows out of the pool (and repeats them
per query head beside a mask): at 150 requests of 4k context at the Qwen3.6-27B drafter's shape
one layer's copies took several GiB at once. So the requests attend in passes whose copies keep
to ``PASS_BYTES`` (``request_passes``); each request's attention is its own in any pass.

``tables`` (the paged layout, ``paged_draft.py``): the pools are page pools ``[pages, layers,
kv_heads, 16, d]`` on the target's page ids and ``tables`` the device page tables of every slot
``[slots + 1, width]``; position p of slot r is row ``p % 16`` of page ``tables[r, p // 16]``.
With rings (``paged_draft.LayerPool``) each layer names its own pool and tables (``layer_pool``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddtree_server.engine.batch.paged_draft import LayerPool
from ddtree_server.engine.batch.pages import PAGE_SIZE
from ddtree_server.kernels.attention_batch import batch_attention
from ddtree_server.models.drafter.attention import visibility
from ddtree_server.models.layers import attention_backends as sdpa_backends
from ddtree_server.models.layers import kernels_usable

PASS_BYTES = 512 << 20   # a pass's gathered (and per-head repeated) key / value rows, one layer


@torch.no_grad()
def propose_batch(drafter, kpool: Tensor, vpool: Tensor, caches: list, slots: list[int], ctxs: list[Tensor],
                  bonus: list[int], starts: list[int], tables: Tensor | None = None) -> Tensor:
    """Draft logits ``[b, block_size - 1, vocab]``; afterwards ``caches[r].length == starts[r]``."""
    dev, bs = kpool.device, drafter.config.block_size
    for c, ctx, s in zip(caches, ctxs, starts):
        if c.length + ctx.shape[0] != s:
            raise ValueError(f"context of {ctx.shape[0]} rows does not fill positions [{c.length}, {s})")
    append_rows(drafter, kpool, vpool, caches, slots, ctxs, tables)
    return draft_blocks(drafter, kpool, vpool, torch.tensor(slots, device=dev), torch.tensor(starts, device=dev),
                        torch.tensor(bonus, device=dev), max(starts) + bs, tables)


def fold_context(drafter, kpool: Tensor, vpool: Tensor, caches: list, slots: list[int], ctxs: list[Tensor],
                 tables: Tensor | None = None) -> list[Tensor]:
    """Requests that skipped the drafter for some rounds (plain rounds) gathered context rows; all
    but the newest of each go into its slot's draft cache now, in one batched append (the K/V
    ``propose_batch`` would write with them). Returns the kept rows: the newest of each request,
    so its next proposal brings 1 .. block_size rows (the drafter's graphs take it) and pending
    rows never grow with the length of a stretch of plain rounds."""
    append_rows(drafter, kpool, vpool, caches, slots, [ctx[:-1] for ctx in ctxs], tables)
    return [ctx[-1:].clone() for ctx in ctxs]


def fold_skipped(drafter, dcaches, reqs: list) -> None:
    """Requests that skipped the drafter (plain rounds) keep their new context rows ``req.ctx`` for
    its next proposal; from a block on they go into their slots of ``dcaches`` (``fold_context``)."""
    due = [r for r in reqs if r.mode != "ar" and r.ctx is not None and r.ctx.shape[0] >= drafter.config.block_size]
    if due:
        kept = fold_context(drafter, dcaches.pool("k"), dcaches.pool("v"), [dcaches[r.slot] for r in due],
                            [r.slot for r in due], [r.ctx for r in due], getattr(dcaches, "tables", None))
        for r, ctx in zip(due, kept):
            r.ctx = ctx


def append_rows(drafter, kpool: Tensor, vpool: Tensor, caches: list, slots: list[int], ctxs: list[Tensor],
                tables: Tensor | None = None) -> None:
    """Each request's context rows ``ctxs[r]`` at the positions after its draft cache's length
    in slot ``slots[r]`` (one batched ``append_context``); the lengths advance past them."""
    dev = kpool.device
    if any(ctx.shape[0] for ctx in ctxs):
        pos = torch.tensor([p for c, x in zip(caches, ctxs) for p in range(c.length, c.length + x.shape[0])],
                           device=dev)
        slot_c = torch.tensor([sl for sl, x in zip(slots, ctxs) for _ in range(x.shape[0])], device=dev)
        append_context(drafter, kpool, vpool, torch.cat([x for x in ctxs if x.shape[0]]), pos, slot_c, tables)
    for c, x in zip(caches, ctxs):
        c.length += x.shape[0]


def address(slot: Tensor, pos: Tensor, tables: Tensor | None) -> tuple[Tensor, Tensor]:
    """Pool indices (first axis, row axis) of positions ``pos`` of slots ``slot``: the slot and
    the position, or through the page tables the page and the row in it."""
    if tables is None:
        return slot, pos
    return tables[slot, pos // PAGE_SIZE].long(), pos % PAGE_SIZE


def layer_pool(pool, i: int, tables: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Layer i's cache (``[slots | pages, kv_heads, rows, d]``) and the tables that address it."""
    return pool.layer(i, tables) if isinstance(pool, LayerPool) else (pool[:, i], tables)


def last_rows(slot_c: Tensor, pos: Tensor, ring_rows: int, scratch: int) -> Tensor:
    """The slots to write context rows to in rings of ``ring_rows`` rows: rows a ring or more
    before their slot's newest row in this append go to the ``scratch`` slot instead, so that no
    two rows of one append land on the same ring row (graph-safe: no host sync)."""
    newest = torch.full((scratch + 1,), -1, dtype=pos.dtype, device=pos.device)
    newest = newest.scatter_reduce(0, slot_c, pos, "amax")
    return torch.where(pos > newest[slot_c] - ring_rows, slot_c, torch.full_like(slot_c, scratch))


def append_context(drafter, kpool: Tensor, vpool: Tensor, ctx: Tensor, pos: Tensor, slot_c: Tensor,
                   tables: Tensor | None = None) -> None:
    """Project context features ``[C, F]`` and write their K/V at positions ``pos`` of slots ``slot_c``."""
    h = drafter.project_context(ctx)[None]
    cos, sin = drafter.rope(pos[None], h.dtype)
    rows = {}
    for i, layer in enumerate(drafter.layers):
        k, v = layer.self_attn.kv(h, cos, sin)                       # [1, hkv, C, d]
        kl, tab = layer_pool(kpool, i, tables)
        vl = layer_pool(vpool, i, tables)[0]
        if id(tab) not in rows:
            ringed = isinstance(kpool, LayerPool) and tab is kpool.ring_tables
            at = last_rows(slot_c, pos, kpool.ring_rows, tab.shape[0] - 1) if ringed else slot_c
            rows[id(tab)] = address(at, pos, tab)
        at, row = rows[id(tab)]
        kl[at, :, row] = k[0].transpose(0, 1)
        vl[at, :, row] = v[0].transpose(0, 1)


def draft_blocks(drafter, kpool: Tensor, vpool: Tensor, slot_t: Tensor, starts: Tensor, bonus: Tensor,
                 kv_max: int, tables: Tensor | None = None) -> Tensor:
    """The blocks ``[bonus_r, MASK ...]`` at positions ``starts[r] ..`` of every request in one
    ``[b, bs]`` forward over key rows ``[0, kv_max)`` of their slots (rows at or past a request's
    ``starts[r] + bs`` are zeroed and hidden); shapes depend on ``b`` and ``kv_max`` only (graph-safe)."""
    dev, bs = kpool.device, drafter.config.block_size
    b = slot_t.shape[0]
    qpos = starts[:, None] + torch.arange(bs, device=dev)[None]                            # [b, bs]
    x = drafter.embed_tokens(drafter.block_ids(bonus)).to(drafter.dtype)
    cos, sin = drafter.rope(qpos, x.dtype)
    attn0 = drafter.layers[0].self_attn
    if kernels_usable(attn0.head_dim, kpool):
        attend = _kernel_attention(drafter, slot_t, starts, b, bs)
    else:
        attend = _gathered_attention(drafter, kpool, slot_t, qpos, kv_max)
    rows = {}   # per tables (the target's, the rings'): block rows' addresses, requests' table rows
    with sdpa_backends(dev):
        for i, layer in enumerate(drafter.layers):
            attn = layer.self_attn
            xn = layer.input_layernorm(x)
            k, v = attn.kv(xn, cos, sin)                                  # [b, hkv, bs, d]
            kl, tab = layer_pool(kpool, i, tables)
            vl = layer_pool(vpool, i, tables)[0]
            if id(tab) not in rows:
                rows[id(tab)] = (*address(slot_t[:, None].expand(b, bs), qpos, tab),
                                 None if tab is None else tab.index_select(0, slot_t))   # [b, width]
            at, row, pages = rows[id(tab)]
            kl[at, :, row] = k.transpose(1, 2)
            vl[at, :, row] = v.transpose(1, 2)
            x = layer.finish(x, attend(i, attn, attn.q(xn, cos, sin), kl, vl, pages))
    return drafter.lm_head(drafter.norm(x[:, 1:]))


def _kernel_attention(drafter, slot_t: Tensor, starts: Tensor, b: int, bs: int):
    """Layer i's block attention through ``batch_attention``: ``block`` mode for non-causal layers,
    ``causal`` for causal ones, the layer's window (``drafter/attention.py``: ``visibility``)."""
    dev = slot_t.device
    start32, slot32 = starts.to(torch.int32), slot_t.to(torch.int32)
    qo = torch.arange(0, (b + 1) * bs, bs, dtype=torch.int32, device=dev)

    def attend(i: int, attn, q: Tensor, kl: Tensor, vl: Tensor, pages: Tensor | None) -> Tensor:
        causal, window = drafter.kinds[i]
        flat = q.transpose(1, 2).reshape(b * bs, attn.n_heads, attn.head_dim)
        out = batch_attention(flat, kl, vl, start32, qo, slot32, bs, "causal" if causal else "block",
                              scale=attn.head_dim ** -0.5, window=window, pages=pages)
        return attn.o_proj(out.reshape(b, bs, -1))
    return attend


def _gathered_attention(drafter, kpool: Tensor, slot_t: Tensor, qpos: Tensor, kv_max: int):
    """Layer i's block attention as a masked SDPA over the slots' gathered rows ``[0, kv_max)``
    (rows at or past a request's ``starts[r] + bs`` zeroed and hidden), in passes (``request_passes``)."""
    b, dev = slot_t.shape[0], kpool.device
    kpos = torch.arange(kv_max, device=dev)
    valid = kpos[None, :] < (qpos[:, -1:] + 1)                                             # [b, kv_max]
    masks = {}
    for kind in set(drafter.kinds):
        see = visibility(qpos, kpos.expand(b, kv_max), kind)
        see = valid[:, None, :].expand(b, qpos.shape[1], kv_max) if see is None else see & valid[:, None, :]
        masks[kind] = see[:, None]
    hide = ~valid[:, None, :, None]

    def attend(i: int, attn, q: Tensor, kl: Tensor, vl: Tensor, pages: Tensor | None) -> Tensor:
        mask = masks[drafter.kinds[i]]
        at = slot_t if pages is None else pages
        outs = [attn.attend(q[a:e], _rows(kl, at[a:e], kv_max, hide[a:e]), _rows(vl, at[a:e], kv_max, hide[a:e]),
                            mask[a:e]) for a, e in request_passes(b, kv_max, attn, kpool.element_size())]
        return outs[0] if len(outs) == 1 else torch.cat(outs)
    return attend


def blank_context(target, drafter, device) -> Tensor:
    """One row of zero context features ``[1, hidden x tapped layers]`` (the start-up measures)."""
    width = target.config.hidden_size * len(drafter.config.target_layer_ids)
    return torch.zeros(1, width, dtype=target.embed_tokens.weight.dtype, device=device)


def _rows(pool: Tensor, at: Tensor, kv_max: int, hide: Tensor) -> Tensor:
    """Rows ``[0, kv_max)`` of one layer's caches (a copy), hidden rows zeroed: ``at`` the slots
    ``[b]`` of a slot pool, or the page-table rows ``[b, width]`` of a page pool."""
    if at.dim() == 1:
        return pool[at, :, :kv_max].masked_fill_(hide, 0.0)
    n = -(-kv_max // PAGE_SIZE)
    got = pool[at[:, :n].long()]                                   # [b, n, hkv, 16, d]
    b, _, hkv, size, d = got.shape
    rows = got.permute(0, 2, 1, 3, 4).reshape(b, hkv, n * size, d)[:, :, :kv_max]
    return rows.masked_fill_(hide, 0.0)   # a copy already (the permuted reshape)


def request_passes(b: int, kv_max: int, attn, elem: int, limit: int | None = None) -> list[tuple[int, int]]:
    """Spans ``[a, e)`` of the ``b`` requests whose key / value copies (gathered, and repeated per
    query head where heads share them) stay within ``limit`` bytes; at least one request each (pure)."""
    limit = PASS_BYTES if limit is None else limit
    rep = attn.n_heads // attn.n_kv
    per = 2 * kv_max * attn.n_kv * attn.head_dim * elem * (1 + (rep if rep > 1 else 0))
    step = max(1, limit // max(per, 1))
    return [(a, min(a + step, b)) for a in range(0, b, step)]
