"""The GDN row groups of a batched round (host bookkeeping, built once per forward, used by every
GDN layer; ``gdn_batch.py`` runs them): which blocks take the batched step (one row committed at
once), the batched chunk rule (pending chains / trees of at most the slots' ``cap`` rows, each
block's scratch rows at its row offset in the round) or
each request's own mixer, and the chunk group's padded geometry. Conv windows (``tree.py``) and
ancestor masks are built on the host with numpy and sent in one copy each, so a round costs a
fixed number of small transfers instead of a few device ops per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


def windows(mask: np.ndarray | None, n: int, kernel: int) -> np.ndarray:
    """``tree_meta(...).win`` on the host: long ``[n, K]``, node i's K conv-window rows in the
    layer's conv buffer (rows 0..K-2 the committed conv state, K-1+j node j), following the node's
    ancestors (``mask`` bool ``[n, n]`` ancestor-or-self; None: a chain)."""
    return block_windows((np.tri(n, dtype=bool) if mask is None else mask)[None], kernel)[0]


def block_windows(anc: np.ndarray, kernel: int) -> np.ndarray:
    """``windows`` of B blocks at once from their ancestor-or-self masks ``anc`` bool ``[B, r, r]``
    (a block of n < r rows in the corner; its rows past n get the committed rows): ``[B, r, K]``."""
    b, r, _ = anc.shape
    k1 = kernel - 1
    strict = np.tril(anc, -1)
    parent = np.where(strict.any(axis=2), r - 1 - np.argmax(strict[:, :, ::-1], axis=2), -1)   # [B, r]
    up = np.concatenate((np.broadcast_to(np.maximum(np.arange(k1) - 1, 0), (b, k1)),
                         np.where(parent >= 0, parent + k1, k1 - 1)), axis=1)                  # [B, K-1+r]
    cols = [np.broadcast_to(np.arange(r) + k1, (b, r))]
    for _ in range(k1):
        cols.append(np.take_along_axis(up, cols[-1], axis=1))
    return np.stack(cols[::-1], axis=2)


@dataclass
class Chunks:
    """Padded geometry of the pending ``chunk`` blocks: ``rows`` long ``[m]`` (their rows in the
    round), ``req`` / ``local`` ``[m]`` (block index in the group, row in the block), ``slot_of_row``
    ``[m]``, ``slots`` ``[b]``, ``qo`` ``[b + 1]`` (block j's rows in the group: ``[qo[j], qo[j+1])``),
    ``win`` long ``[m, K]`` (conv-window rows in the slot's conv buffer), ``anc`` bool ``[b, r, r]``;
    r the longest block; ``base`` ``[b]`` (long or int32): block j's first row in the round, where
    its rows live in the round's verify scratch (``kk / uu / GG / win``: row ``base[j] + local``)."""

    rows: Tensor
    req: Tensor
    local: Tensor
    slot_of_row: Tensor
    slots: Tensor
    qo: Tensor
    win: Tensor
    anc: Tensor
    r: int
    base: Tensor


class RowGroups:
    """The GDN groups of a round (see the module docstring), from the layout's blocks.

    ``modes[i]``: ``"step"``, ``"chunk"`` or ``"own"`` (per-request mixer) for block i; ``masks[i]``:
    its ancestor mask (numpy bool ``[n, n]``; None: a chain); ``kernel``: the conv width K."""

    def __init__(self, offsets: list[int], slots: list[int], modes: list[str], masks: list, kernel: int, device):
        self.own = [i for i, m in enumerate(modes) if m == "own"]
        step = [i for i, m in enumerate(modes) if m == "step"]
        self.step_rows = self.step_slots = None
        if step:
            both = torch.tensor([[offsets[i] for i in step], [slots[i] for i in step]], dtype=torch.long)
            self.step_rows, self.step_slots = both.to(device)
            self.step_all = len(step) == offsets[-1]   # every row of the round: no gather / scatter
        chunk = [i for i, m in enumerate(modes) if m == "chunk"]
        self.chunks = _chunks(chunk, offsets, slots, masks, kernel, device) if chunk else None
        self.chunk_all = len(chunk) == len(modes)   # every block pending: the rows as they are


def _chunks(blocks: list[int], offsets: list[int], slots: list[int], masks: list, kernel: int, device) -> Chunks:
    sizes = [offsets[i + 1] - offsets[i] for i in blocks]
    r, b = max(sizes), len(blocks)
    req = np.repeat(np.arange(b), sizes)
    local = np.concatenate([np.arange(n) for n in sizes])
    rows = np.asarray([offsets[i] for i in blocks])[req] + local
    slot = np.asarray([slots[i] for i in blocks])
    qo = np.cumsum([0] + sizes)
    anc = np.zeros((b, r, r), dtype=bool)
    tri = np.tri(r, dtype=bool)
    for j, (i, n) in enumerate(zip(blocks, sizes)):
        anc[j, :n, :n] = masks[i] if masks[i] is not None else tri[:n, :n]
    win = block_windows(anc, kernel)[req, local]
    base = np.asarray([offsets[i] for i in blocks])
    host = np.concatenate((rows, req, local, slot[req], slot, qo, base, win.reshape(-1)))
    dev = torch.from_numpy(host).to(device)
    m = len(rows)
    rows_d, req_d, local_d, slot_d = dev[: 4 * m].view(4, m)
    at = 4 * m + 2 * b + 1
    return Chunks(rows_d, req_d, local_d, slot_d, dev[4 * m: 4 * m + b], dev[4 * m + b: at],
                  dev[at + b:].view(m, kernel), torch.from_numpy(anc).to(device), r, dev[at: at + b])
