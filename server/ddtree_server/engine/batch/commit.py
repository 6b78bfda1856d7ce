"""The commit of a greedy decode round for all requests at once (dense targets on pooled slots):
the acceptance walk of every tree on the device (speculative/walk_gpu.py), then every request's
accepted path compacted in its slot (row ``s + path[j]`` moves to ``s + j``, as ``KVCache.keep``
does per request) by one ``index_select`` and one ``index_copy_`` per K / V pool, and the
captured features of all paths in one ``index_select``; the indices travel in ONE host-to-device
copy. Pure data movement: the rows are bitwise those of the per-request commit. On the paged
layout (``paged.PagedSlots``) the rows are located through the slots' page tables on the host
and move within the page pools the same way."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ddtree_server.speculative.walk_gpu import walk_all


def commit_greedy(kpool: Tensor, vpool: Tensor, caches: list, feats: Tensor | None, reqs: list, trees: list,
                  starts: list[int], choices: Tensor, bufs=(None, None), paged=None
                  ) -> list[tuple[list[int], int, Tensor | None]]:
    """Walk every request's tree over the target's choices ``[N]`` (on the device; request i's rows
    start at ``starts[i]``), compact its slot to the path and set its cache length to ``s + len(path)``.
    ``bufs``: staging buffers (decode.Staging) of the walk's and the commit's index copies, or Nones;
    ``paged``: the ``PagedSlots`` whose page pools ``kpool`` / ``vpool`` are (None: slot pools).
    Returns per request (path, bonus token, the path's feature rows or None)."""
    walks = walk_all(choices, trees, starts, bufs[0])
    ctxs = commit_paths(kpool, vpool, feats, [r.slot for r in reqs], [r.s for r in reqs], starts,
                        [p for p, _ in walks], choices.device, bufs[1], paged)
    for cache, r, (path, _) in zip(caches, reqs, walks):
        cache.length = r.s + len(path)
    return [(p, b, ctx) for (p, b), ctx in zip(walks, ctxs)]


def commit_paths(kpool: Tensor, vpool: Tensor, feats: Tensor | None, slots: list[int], starts: list[int],
                 offsets: list[int], paths: list[list[int]], device, staging=None, paged=None) -> list[Tensor | None]:
    """Compact every request's verified block to its accepted path.

    Args:
        kpool / vpool: ``[slots, layers, kv_heads, rows, head_dim]`` pooled K / V, or with ``paged``
            (a ``PagedSlots``) its page pools ``[layers, pages, kv_heads, page_size, head_dim]``.
        feats: ``[N, F]`` captured features of the round's rows (request after request) or None.
        slots / starts: request i's slot and first block row (its ``s``).
        offsets: request i's first row in ``feats``.
        paths: request i's accepted node indices, root first, strictly increasing.
        staging: a ``decode.Staging`` (pinned) for the copy of the indices, or None.
    Returns:
        per request its path's feature rows ``[len(path), F]`` (fresh storage), or None without feats.
    """
    lens = [len(p) for p in paths]
    flat = np.fromiter((j for p in paths for j in p), dtype=np.int64, count=sum(lens))
    req = np.repeat(np.arange(len(paths)), lens)
    pos = np.arange(len(flat)) - np.repeat(np.cumsum([0] + lens[:-1]), lens)   # j within the path
    moved = flat != pos
    base = np.asarray(starts, dtype=np.int64)[req]
    slot, src, dst = np.asarray(slots, dtype=np.int64)[req][moved], (base + flat)[moved], (base + pos)[moved]
    where = () if paged is None else (*paged.locate(slot, src), *paged.locate(slot, dst))
    host = np.concatenate((slot, src, dst, *where, np.asarray(offsets, dtype=np.int64)[req] + flat))
    dev = staging.send(host, device) if staging is not None else torch.from_numpy(host).to(device)
    m, parts = int(moved.sum()), 3 + len(where)
    if m:
        for pool in (kpool, vpool):
            if paged is None:
                _move(pool, dev[:m], dev[m:2 * m], dev[2 * m:3 * m])
            else:
                _move_paged(pool, *dev[3 * m: 7 * m].view(4, m))
    if feats is None:
        return [None] * len(paths)
    return list(feats.index_select(0, dev[parts * m:]).split(lens))


def _move(pool: Tensor, slot: Tensor, src: Tensor, dst: Tensor) -> None:
    """``pool[slot, :, :, dst] = pool[slot, :, :, src]`` as one ``index_select`` and one
    ``index_copy_`` over the pool's rows of ``head_dim`` values (contiguous chunks)."""
    slots, layers, heads, rows, dim = pool.shape
    planes = (slot[:, None] * (layers * heads) + torch.arange(layers * heads, device=pool.device)) * rows
    flat = pool.view(-1, dim)
    flat.index_copy_(0, (planes + dst[:, None]).reshape(-1), flat.index_select(0, (planes + src[:, None]).reshape(-1)))


def _move_paged(pool: Tensor, src_page: Tensor, src_row: Tensor, dst_page: Tensor, dst_row: Tensor) -> None:
    """``pool[:, dst_page, :, dst_row] = pool[:, src_page, :, src_row]`` for a page pool ``[layers,
    pages, heads, page_size, head_dim]``, as ``_move`` does (all sources read before any write)."""
    layers, pages, heads, size, dim = pool.shape
    lh = torch.arange(layers, device=pool.device)[:, None] * (pages * heads) + torch.arange(heads, device=pool.device)
    lh = lh.reshape(-1)[None, :]                                         # [1, layers * heads]

    def rows(page: Tensor, row: Tensor) -> Tensor:
        return ((lh + page[:, None] * heads) * size + row[:, None]).reshape(-1)

    flat = pool.view(-1, dim)
    flat.index_copy_(0, rows(dst_page, dst_row), flat.index_select(0, rows(src_page, src_row)))
