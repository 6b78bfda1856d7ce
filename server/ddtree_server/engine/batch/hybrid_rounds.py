"""Hybrid (Qwen3.5 / 3.6) rounds in the padded layout of the batched-round CUDA graphs (``graphs.py``),
the commit of a hybrid round's pending blocks for all requests at once, and the rows of the round's
verify scratch (``round_rows``: ``chunk`` method, one scratch per engine, shared by the slots).

Forwards, from the layout's device tensors only (a ``forward.Layout`` or a graph's static buffers):

* ``plain_forward``: blocks of ONE row each (plain decoding), committed at once: the GDN step with
  a request axis on ``lay.slots`` (``gdn_batch.step``);
* ``pending_forward``: every block pending (DFlash chains, DDTree trees, and the one-row blocks of
  requests without a draft alike; ``chunk`` method, blocks of at most the verify scratch's rows):
  one tree-masked chunk rule over the padded blocks (``gdn_batch.chunk``, geometry ``[B, r, r]``
  from the layout's ``req`` / ``row`` / ``slot_of_row`` / ``slots`` / ``qo`` / ``inner`` and the
  conv windows ``win``); each row's conv window goes to the round's ``win`` for the commit. The
  verify scratch is the round's: block j's rows at its row offset ``qo[j]`` (so ``N_pad`` rows).
  Padding blocks are chains on the scratch slot: they write its conv rows and their scratch rows,
  read its state.

The caller settles the slots' caches before and records the rows after (``HybridCache.settle`` /
``begin``). ``commit_pending`` then folds every request's accepted path (``cache.keep`` for all
slots at once): K/V rows and path features by ``commit.commit_paths`` (one gather / scatter), the
GDN states by one ``delta.fold`` over the requests' left-padded paths (torch) or one fold kernel
launch per slot from one index copy (kernel path: in place, no state gather), the conv windows of
the paths' leaves by one gather / scatter.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ddtree_server.engine.batch.commit import commit_paths
from ddtree_server.engine.batch.forward_hybrid import hybrid_layers
from ddtree_server.engine.batch.padding import padded_shape
from ddtree_server.models.hybrid import delta, gdn_batch, gdn_fast
from ddtree_server.models.hybrid.gdn_groups import Chunks, block_windows
from ddtree_server.models.hybrid.model import TREE_ROWS
from ddtree_server.models.layers import kernels_usable

# default rows of a hybrid round's verify scratch (chunk method; one per engine, docs/architecture.md
# "Slot memory and admission"): 16 trees of 64 nodes; for a few slots what their trees take, padded
ROUND_ROWS = 1024


def round_rows(asked: int | None, slots: int) -> int:
    """Rows of the round scratch: ``asked``, else ROUND_ROWS (at most what ``slots`` trees of
    TREE_ROWS nodes take in the graphs' padded layout, so that every round of them replays a graph:
    80 rows for one slot, 160 for two, 256 for three). Raises ValueError below 1."""
    if asked is not None:
        rows = int(asked)
    else:
        padded = padded_shape([TREE_ROWS] * slots)
        rows = min(ROUND_ROWS, padded[1] if padded else slots * TREE_ROWS)
    if rows < 1:
        raise ValueError(f"round_rows must be >= 1, got {asked}")
    return rows


def _mask(model, lay, x: Tensor, kpool: Tensor):
    return None if kernels_usable(model.config.head_dim, kpool) else lay.additive(model.rep, x.dtype)


def plain_forward(model, kpool: Tensor, vpool: Tensor, lay, gdn: dict) -> tuple[Tensor, Tensor | None]:
    """HybridTarget over blocks of one row each, committed at once (see the module docstring)."""
    x = model.embed_tokens(lay.ids)
    return hybrid_layers(model, lay, x, kpool, vpool, _mask(model, lay, x, kpool),
                         lambda mixer, proj, li: gdn_batch.step(mixer, proj, gdn, li, lay.slots))


def layout_windows(lay, kernel: int) -> Tensor:
    """Long ``[N, K]``: every row's conv window in its slot's conv buffer (``gdn_groups.block_windows``
    over the layout's tree masks, one numpy pass for all blocks)."""
    req = np.repeat(np.arange(lay.b), lay.sizes)
    win = block_windows(lay.inner_np, kernel)[req, np.arange(len(req)) - np.asarray(lay.offsets)[req]]
    return torch.from_numpy(win).to(lay.device)


def pending_forward(model, kpool: Tensor, vpool: Tensor, lay, gdn: dict) -> tuple[Tensor, Tensor | None]:
    """HybridTarget over pending blocks (see the module docstring); ``lay.tree`` True (the masks
    ``inner [B, r, r]``, causal for chains) and ``lay.win`` the rows' conv windows."""
    x = model.embed_tokens(lay.ids)
    ch = Chunks(None, lay.req, lay.row, lay.slot_of_row, lay.slots, lay.qo, lay.win, lay.inner, lay.rmax, lay.qo)
    gdn["win"][: lay.win.shape[0]] = lay.win
    return hybrid_layers(model, lay, x, kpool, vpool, _mask(model, lay, x, kpool),
                         lambda mixer, proj, li: gdn_batch.chunk(mixer, proj, gdn, li, ch))


def commit_pending(kpool: Tensor, vpool: Tensor, gdn: dict, caches: list, feats: Tensor | None, slots: list[int],
                   starts: list[int], offsets: list[int], paths: list[list[int]], staging=None, paged=None
                   ) -> list[Tensor | None]:
    """``cache.keep(starts[i], paths[i])`` for every request's cache at once (``chunk`` method);
    ``offsets[i]``: block i's first row in the round (its rows of the round's verify scratch).

    Blocks committed by the forward itself (no pending block: one row of an eager round) keep
    their one row. ``paged``: the ``PagedSlots`` of page pools ``kpool`` / ``vpool``. Returns per
    request its path's feature rows (``commit_paths``)."""
    device = kpool.device
    ctxs = commit_paths(kpool, vpool, feats, slots, starts, offsets, paths, device, staging, paged)
    fold = [i for i, c in enumerate(caches) if c.pending is not None and paths[i]]
    if fold:
        _fold(gdn, [caches[i] for i in fold], [slots[i] for i in fold], [offsets[i] for i in fold],
              [paths[i] for i in fold], device)
    for cache, s, p in zip(caches, starts, paths):
        cache.pending = None
        cache.length = s + len(p)
    return ctxs


def _fold(gdn: dict, caches: list, slots: list[int], bases: list[int], paths: list[list[int]], device) -> None:
    """GDN states and conv windows of these slots after their accepted paths (rows ``bases[j] +
    path`` of the round's scratch; left-padded to the longest with node 0, whose term is zeroed:
    the leaf stays last, as ``delta.fold`` wants)."""
    b, width = len(paths), max(map(len, paths))
    idx = np.repeat(np.asarray(bases, dtype=np.int64)[:, None], width, axis=1)
    for j, p in enumerate(paths):
        idx[j, width - len(p):] += p
    host = np.concatenate((np.asarray(slots, dtype=np.int64), idx.reshape(-1), width - np.fromiter(map(len, paths), np.int64),
                           np.asarray(bases, dtype=np.int64)))
    dev = torch.from_numpy(host).to(device)
    slot, idx_d, lead, base = dev[:b], dev[b: b + b * width].view(b, width), dev[b + b * width: -b], dev[-b:]
    state, kk, uu, GG, conv, win, inputs = (gdn[n] for n in ("state", "kk", "uu", "GG", "conv", "win", "inputs"))
    if gdn_fast.fold_usable(caches[0]):   # the fold kernel: one launch per slot, in place
        for j, (cache, p) in enumerate(zip(caches, paths)):
            gdn_fast.fold(cache, idx_d[j, width - len(p):])
    else:
        live = (torch.arange(width, device=device)[None, :] >= lead[:, None]).float()   # [b, P]
        sel = slice(None), idx_d                                                   # -> [L, b, P, ...]
        k = (kk[sel] * live[None, :, :, None, None]).transpose(0, 1)
        state[slot] = delta.fold(state[slot], k, uu[sel].transpose(0, 1), GG[sel].transpose(0, 1))
    k1 = win.shape[1] - 1
    leaf = win[idx_d[:, -1], 1:]                                   # [b, K-1] rows: committed, or K-1+j block row j
    pending = inputs[:, base[:, None] + (leaf - k1).clamp(min=0)].permute(1, 2, 0, 3)       # [b, K-1, L, C]
    rows = torch.where((leaf < k1)[:, :, None, None], conv[slot[:, None], :, leaf.clamp(max=k1 - 1)], pending)
    conv[slot[:, None], :, torch.arange(k1, device=device)[None, :]] = rows
